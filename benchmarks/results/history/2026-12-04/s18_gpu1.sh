#!/usr/bin/env bash
# Eighteenth session, device call 1 (issue 14/15): the software L2 prefetch switches
# measured, each kernel alone at (8,4096,16,2) with and without its prefetch
# (benchmarks/prep_probe.py --l2-prefetch both), operands, recursion and local-gradient kernels.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
( timeout 70 python ffi/build.py --jobs 14 > $OUT/build.log 2>&1 ); tail -1 $OUT/build.log
timeout 300 python -m benchmarks.prep_probe --shape 8,4096,16,2 --bv 64 --local-grad \
  --skip-prep-probe --l2-prefetch both --json $OUT/prefetch.json > $OUT/prefetch.log 2>&1
echo "== rc=$?"; grep -v Warning $OUT/prefetch.log | cut -c1-160 | tail -30
