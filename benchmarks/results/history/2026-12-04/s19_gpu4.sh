#!/usr/bin/env bash
# Nineteenth session, device call 4: A/B of the token-major operands kernel's CTA order
# (chunk_prep.TOKEN_HEAD_MAJOR, forward); today's defaults beside fully tuned FLA at the
# main shapes; the GPU suites.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
( timeout 80 python ffi/build.py --jobs 14 > $OUT/build.log 2>&1 ); tail -1 $OUT/build.log
for hm in False True; do
  timeout 45 python -m benchmarks.run fwd --impl cutedsl --shapes "8,4096,16,2;2,16384,16,2" \
    --no-check --deadline 30 --out /tmp/f_$hm --set kernels.chunk_prep.TOKEN_HEAD_MAJOR=$hm \
    > $OUT/ab_prep_head_major_$hm.log 2>&1
  echo "== TOKEN_HEAD_MAJOR=$hm rc=$?"; grep -E '^\| [0-9(]' $OUT/ab_prep_head_major_$hm.log | cut -c1-120
done
timeout 200 python -m benchmarks.run fwdbwd --impl cutedsl,fla --shapes main --deadline 170 \
  --out $OUT/bench > $OUT/bench.log 2>&1
echo "== bench rc=$?"; grep -E '^\| [0-9(]' $OUT/bench.log | cut -c1-200
mkdir -p $OUT/tests
P="python -m pytest -m gpu -q -rA -s -p no:cacheprovider --durations=5"
run() { name=$1; shift; ( timeout 215 "$@" > $OUT/tests/$name.log 2>&1; echo "rc=$?" >> $OUT/tests/$name.log ) & }
run cutedsl_fwd $P tests/test_cutedsl_gpu.py -k "forward_matches or packed_matches or long_sequence_state or token_major_operands"
run cutedsl_grad $P tests/test_cutedsl_gpu.py -k "gradients_match or token_major_gradients"
run cutedsl_rest $P tests/test_cutedsl_gpu.py -k "not forward_matches and not packed_matches and not gradients_match and not long_sequence_state and not token_major"
run robust $P tests/test_robust_gpu.py
wait
for f in $OUT/tests/*.log; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed|rc=" $f | tail -6 | cut -c1-300; done
