#!/usr/bin/env bash
# s24-5 (cold machine, the session's last ~80 s after four refused starts): the split's
# GPU test on the final tree (NARROW_TILES on, the value tile for B x S rows, apply's
# response products on bf16 hi + lo).
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
M=$OUT/m; mkdir -p $M
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
el start
n=$(ls ffi/build/kernels 2>/dev/null | wc -l)
# only the variants the split test runs (bf16 K = V = 128); the rest compile on first use
[ "$n" -lt 200 ] && timeout 25 python ffi/build.py --jobs 15 --only "bfloat16 K=128 V=128" --only "bfloat16 K=128 V=256" > $M/build.log 2>&1; el "build rc=$?"
timeout $(( 74 - ($(date +%s) - T0) )) python -m pytest -m gpu -q -rA -p no:cacheprovider \
  tests/test_cutedsl_gpu.py -k "intra_cp_split and batched" > $M/tests.log 2>&1; el "tests rc=$?"
grep -hE "^(FAILED|ERROR|PASSED)|passed|failed|intra_cp=4" $M/tests.log | tail -30 | cut -c1-250
grep -hE "Error|assert" $M/tests.log | head -10 | cut -c1-250; tail -3 $M/build.log
tar -cJf $OUT/s24_gpu5_out.tar.xz -C $M . && rm -rf $M
