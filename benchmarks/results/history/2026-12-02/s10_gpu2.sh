#!/usr/bin/env bash
# Tenth session, device call 2: after the operands kernel's unrolled gate sums / row rules:
# GPU tests of the forward, gradients, non-finite rules, operands kernel and AOT path (5
# jobs in parallel, one log back); the benchmark shapes for cutedsl, cutedsl-save (the
# forward's operands kept) beside fully tuned FLA; the fwd+bwd trace.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false
python ffi/build.py --jobs 14 --out /tmp/kern > $OUT/build.log 2>&1; tail -1 $OUT/build.log
export GDP_JAX_KERNEL_DIR=/tmp/kern
T=/tmp/tests; mkdir -p $T
P="python -m pytest -m gpu -q -rA -p no:cacheprovider --durations=0"
run() { name=$1; shift; ( timeout 200 "$@" > $T/$name.log 2>&1; echo "rc=$?" >> $T/$name.log ) & }
run fwd $P tests/test_cutedsl_gpu.py -k "forward_matches or packed_matches"
run grad $P tests/test_cutedsl_gpu.py -k "gradients_match"
run robust $P tests/test_robust_gpu.py
run prep $P tests/test_chunk_prep_gpu.py
run aot $P tests/test_aot_gpu.py
wait
for f in $T/*.log; do echo "== $f"; cat $f; done > $OUT/tests.log
for f in $T/*.log; do echo "== $f"; grep -E "^FAILED|^ERROR|passed|failed|rc=" $f | tail -4; done
timeout 290 python -m benchmarks.run fwdbwd --impl cutedsl,cutedsl-save,fla --shapes main \
  --out /tmp/bench --deadline 250 > $OUT/bench.log 2>&1; grep "^| " $OUT/bench.log | tail -13
cp /tmp/bench/*.md /tmp/bench/*.json $OUT/ 2>/dev/null
timeout 70 python -m benchmarks.trace --shape 8,4096,16,2 --impl cutedsl --top 30 \
  --out /tmp/t1 > $OUT/trace_fb.log 2>&1; head -10 $OUT/trace_fb.log
