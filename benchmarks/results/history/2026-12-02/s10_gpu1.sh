#!/usr/bin/env bash
# Tenth session, device call 1: the local-gradient kernel with register-resident dk, dq
# partials; GPU tests of the backward not re-run since the ninth session's change (4 jobs in
# parallel, then timings alone); kernel A/B (roundtrip, nosplit, nomma) with precision; op
# A/B (default, saved operands, no split, XLA factors, all XLA); fwd+bwd trace.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false
python ffi/build.py --jobs 14 --out /tmp/kern > $OUT/build.log 2>&1; tail -1 $OUT/build.log
export GDP_JAX_KERNEL_DIR=/tmp/kern
mkdir -p $OUT/tests
P="python -m pytest -m gpu -q -rA -p no:cacheprovider --durations=0"
run() { name=$1; shift; ( timeout 215 "$@" > $OUT/tests/$name.log 2>&1; echo "rc=$?" >> $OUT/tests/$name.log ) & }
run grad $P tests/test_cutedsl_gpu.py -k "gradients_match and not packed"
run rest $P tests/test_cutedsl_gpu.py -k "not forward_matches and not gradients_match and not packed_matches or packed_gradients"
run robust $P tests/test_robust_gpu.py
run prep_aot $P tests/test_chunk_prep_gpu.py tests/test_aot_gpu.py
wait
for f in $OUT/tests/*.log; do echo "== $f"; grep -cE " PASSED" $f; grep -E "^FAILED|^ERROR|passed|failed|rc=" $f | tail -4; done
timeout 200 python -m benchmarks.local_grad --variants "roundtrip;nosplit;nomma" \
  --json $OUT/local_grad.json > $OUT/local_grad.log 2>&1; grep -E "^\||^op|alone" $OUT/local_grad.log
timeout 75 python -m benchmarks.trace --shape 8,4096,16,2 --impl cutedsl --top 60 \
  --hlo $OUT/fb.hlo.gz --out /tmp/t1 > $OUT/trace_fb.log 2>&1; head -22 $OUT/trace_fb.log
python -m benchmarks.hlo_lines $OUT/trace_fb.log $OUT/fb.hlo.gz --top 50 > $OUT/lines_fb.log 2>&1
