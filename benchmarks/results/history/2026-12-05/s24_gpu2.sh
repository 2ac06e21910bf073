#!/usr/bin/env bash
# s24-1 (cold machine): the split / CP GPU tests and the opt-in tests (s22, s23: never run),
# then one long sequence, every variant beside tuned FLA in one process, then a trace of cp4.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
tar -C "$TRITON_CACHE_DIR" -xJf benchmarks/fla-autotune-h200-extra.tar.xz
M=$OUT/m; mkdir -p $M
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
left() { echo $(( ${BUDGET:-575} - ($(date +%s) - T0) )); }
step() { local t=$1 name=$2; shift 2; local l; l=$(left); [ "$l" -lt 20 ] && { el "skip $name"; return; }
         [ "$t" -gt "$l" ] && t=$l; el "$name ($t s)"; timeout "$t" "$@" > $M/$name.log 2>&1; el "$name rc=$?"; }
rows() { grep -hE '^\| [0-9(]' "$@" | cut -c1-220; }
P="python -m pytest -m gpu -q -rA -p no:cacheprovider"
git log -1 --format='commit %h %s' 2>/dev/null | cut -c1-100; nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
n=$(ls ffi/build/kernels 2>/dev/null | wc -l)
[ "$n" -lt 200 ] && step 110 build python ffi/build.py --jobs 14

step 420 long python -m benchmarks.run fwdbwd --no-check --deadline 400 --out $M/long \
  --impl cutedsl-cp4,cutedsl-cpauto,cutedsl-cp4+narrow,cutedsl+narrow,fla \
  --shapes "1,65536,16,2;1,131072,8,2"
step 60 trace_cp4 python -m benchmarks.trace --shape 1,65536,16,2 --impl cutedsl-cp4 --mode fwd --top 20 --out /tmp/t_cp4
echo "== tests"; grep -hE "^(FAILED|ERROR|PASSED)|passed|failed" $M/tests.log | tail -30 | cut -c1-250
grep -hE "Error|error|assert" $M/tests.log | head -20 | cut -c1-250
echo "== long"; rows $M/long.log; grep -hE "NOTE|Error|Traceback" $M/long.log | head; tail -5 $M/long.log | cut -c1-200
echo "== trace"; tail -28 $M/trace_cp4.log | cut -c1-200
tar -cJf $OUT/s24_gpu2_out.tar.xz -C $M . && rm -rf $M
