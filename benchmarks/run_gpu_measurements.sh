#!/usr/bin/env bash
# The measurements still owed on the H200, as device calls of < 600 s each (carry
# [".gpu-deps"]); what the twenty-second session ran is in
# benchmarks/results/history/2026-12-04/s22_gpu*.sh:
#   bash benchmarks/run_gpu_measurements.sh 1   # the recursion kernels with their chunk scalars loaded first (s22, not measured):
#                                               # kernels alone and the op beside tuned FLA vs s20-4 / s21-1 / s22's numbers
#   bash benchmarks/run_gpu_measurements.sh 2   # issue 20's long rows (1, 131072, 8, 2), (1, 262144, 16, 1) beside tuned FLA
#   bash benchmarks/run_gpu_measurements.sh 3   # the kernel GPU tests in full (> 270 s: two files per call)
# Logs and raw files under $OUT/m; a summary is printed last. Each step has its own
# timeout so one slow step cannot take the others' results.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
# FLA's H = 8 winners (tuned in s22-3), beside the H = 4, 16 ones install.sh unpacked
tar -C "$TRITON_CACHE_DIR" -xJf benchmarks/fla-autotune-h200-extra.tar.xz
M=$OUT/m; mkdir -p $M
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
left() { echo $(( 580 - ($(date +%s) - T0) )); }
step() { local t=$1 name=$2; shift 2; local l; l=$(left); [ "$l" -lt 20 ] && { el "skip $name"; return; }
         [ "$t" -gt "$l" ] && t=$l; el "$name ($t s)"; timeout "$t" "$@" > $M/$name.log 2>&1; el "$name rc=$?"; }
rows() { grep -hE '^\| [0-9(]' "$@" | cut -c1-200; }
P="python -m pytest -m gpu -q -rA -p no:cacheprovider"
n=$(ls ffi/build/kernels 2>/dev/null | wc -l)
[ "$n" -lt 200 ] && step 100 build python ffi/build.py --jobs 14
case "${1:-1}" in
1)
  step 60 alone_main python -m benchmarks.prep_probe --shape 8,4096,16,2 --bv 64 --skip-prep-probe
  step 60 alone_long python -m benchmarks.prep_probe --shape 1,65536,16,2 --bv 32 --skip-prep-probe
  step 320 op python -m benchmarks.run fwdbwd --impl cutedsl,fla \
    --shapes "8,4096,16,1;8,4096,16,2;2,16384,16,2;1,65536,16,2" --deadline 260 --out $M/op
  grep -hE "ms" $M/alone_*.log | head -20; rows $M/op.log ;;
2)
  step 200 long8 python -m benchmarks.run fwdbwd --impl cutedsl,fla \
    --shapes "1,131072,8,2" --no-check --deadline 150 --out $M/long8
  step 250 long16 python -m benchmarks.run fwdbwd --impl cutedsl,fla \
    --shapes "1,262144,16,1" --no-check --deadline 150 --out $M/long16
  (cd $TRITON_CACHE_DIR && find . -name '*.autotune.json' -newer .fla-autotune | tar -cJf $M/fla-autotune-new.tar.xz -T -)
  rows $M/long*.log; grep -h NOTE $M/long*.log ;;
3)
  step 280 kernels $P tests/test_cutedsl_gpu.py
  step 200 prep $P tests/test_chunk_prep_gpu.py
  grep -hE "^(FAILED|ERROR)|passed|failed" $M/kernels.log $M/prep.log | tail -12 ;;
esac
