#!/usr/bin/env bash
# Twelfth session, device call 3 (issue 22): the xla engine with the s12-2 defaults
# (optimistic factors, q and k in bf16, unroll 8 below 64 problems per step) beside fully
# tuned FLA in one process at the benchmark shapes (what the device time left allows).
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 230 python -m benchmarks.run fwdbwd --impl xla,fla --shapes main \
  --out /tmp/bench --deadline 170 > $OUT/bench.log 2>&1; grep "^| " $OUT/bench.log | tail -10
cp /tmp/bench/*.md $OUT/ 2>/dev/null
