#!/usr/bin/env bash
# Nineteenth session, device call 2: the local-gradient kernel writing dq, dk, dv
# token-major in 16 bits (local_grad.TOKEN_GRADS): cutedsl alone at the main shapes with
# and without it (fwd+bwd), the fwd+bwd trace, then the GPU suites.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
( timeout 80 python ffi/build.py --jobs 14 > $OUT/build.log 2>&1 ); tail -1 $OUT/build.log
for tg in True False; do
  timeout 130 python -m benchmarks.run fwdbwd --impl cutedsl --shapes main --no-check \
    --deadline 110 --out /tmp/b_$tg --set kernels.local_grad.TOKEN_GRADS=$tg > $OUT/bench_$tg.log 2>&1
  echo "== TOKEN_GRADS=$tg rc=$?"; grep -E '^\| [0-9(]' $OUT/bench_$tg.log | cut -c1-200
done
mkdir -p /tmp/tr
timeout 80 python -m benchmarks.trace --shape 8,4096,16,2 --impl cutedsl --mode fwdbwd --top 40 \
  --out /tmp/t_fb --hlo /tmp/tr/fb.hlo.gz > $OUT/trace_fwdbwd.log 2>&1
python -m benchmarks.hlo_lines $OUT/trace_fwdbwd.log /tmp/tr/fb.hlo.gz --top 30 > $OUT/lines_fwdbwd.log 2>&1
echo "== trace"; head -30 $OUT/lines_fwdbwd.log | cut -c1-180
mkdir -p $OUT/tests
P="python -m pytest -m gpu -q -rA -s -p no:cacheprovider --durations=5"
run() { name=$1; shift; ( timeout 250 "$@" > $OUT/tests/$name.log 2>&1; echo "rc=$?" >> $OUT/tests/$name.log ) & }
run cutedsl_fwd $P tests/test_cutedsl_gpu.py -k "forward_matches or packed_matches or long_sequence_state or token_major_operands"
run cutedsl_grad $P tests/test_cutedsl_gpu.py -k "gradients_match or token_major_gradients"
run cutedsl_rest $P tests/test_cutedsl_gpu.py -k "not forward_matches and not packed_matches and not gradients_match and not long_sequence_state and not token_major"
run robust $P tests/test_robust_gpu.py
wait
for f in $OUT/tests/*.log; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed|rc=" $f | tail -8 | cut -c1-300; done
grep -h "^\[tokens" $OUT/tests/cutedsl_grad.log | cut -c1-250
