#!/usr/bin/env bash
# Eleventh session, device call 1 (issue 22): the xla engine with 16-bit storage (lean10
# patch, e03c176) beside fully tuned FLA at the benchmark shapes; its fwd+bwd time and
# compiled temp memory per segment size; the xla fwd+bwd trace. No kernels are built.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 330 python -m benchmarks.run fwdbwd --impl xla,fla --shapes main \
  --out /tmp/bench --deadline 280 > $OUT/bench.log 2>&1; grep "^| " $OUT/bench.log | tail -10
cp /tmp/bench/*.md $OUT/ 2>/dev/null
timeout 110 python -m benchmarks.segments --shape 8,4096,16,2 --sizes none,16384,8192 \
  > $OUT/seg.log 2>&1; tail -5 $OUT/seg.log
timeout 80 python -m benchmarks.trace --shape 8,4096,16,2 --impl xla --top 45 \
  --out /tmp/t1 > $OUT/trace_xla.log 2>&1; head -50 $OUT/trace_xla.log
