#!/usr/bin/env bash
# Eighteenth session, device call 5 (issue 14): s18-4's kernel change was slower (the
# one-reduction norm: token-major operands kernel 1.45 -> 1.87 ms) and is reverted; the
# cutedsl backend on the s18-3-verified kernels (token-major operands kernel, split off)
# beside fully tuned FLA at the main shapes, as far as the device time left allows.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
( timeout 60 python ffi/build.py --jobs 14 > $OUT/build.log 2>&1 ); tail -1 $OUT/build.log
timeout 215 python -m benchmarks.run fwdbwd --impl cutedsl,fla --shapes main --out $OUT/bench \
  --deadline 170 > $OUT/main.log 2>&1
echo "== main"; grep -E '^\| [0-9]|check' $OUT/main.log | cut -c1-220
