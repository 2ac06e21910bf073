#!/usr/bin/env bash
# s24-4 (cold machine, the session's last ~250 s): NARROW_TILES on by default, the value
# tile counting the split's segments, the split's response products on bf16 hi + lo
# (tensor cores), the gather fold inside a device; tests, then issue 20's long rows.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
tar -C "$TRITON_CACHE_DIR" -xJf benchmarks/fla-autotune-h200-extra.tar.xz
M=$OUT/m; mkdir -p $M
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
left() { echo $(( ${BUDGET:-248} - ($(date +%s) - T0) )); }
step() { local t=$1 name=$2; shift 2; local l; l=$(left); [ "$l" -lt 20 ] && { el "skip $name"; return; }
         [ "$t" -gt "$l" ] && t=$l; el "$name ($t s)"; timeout "$t" "$@" > $M/$name.log 2>&1; el "$name rc=$?"; }
rows() { grep -hE '^\| [0-9(]' "$@" | cut -c1-220; }
P="python -m pytest -m gpu -q -rA -p no:cacheprovider"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
n=$(ls ffi/build/kernels 2>/dev/null | wc -l)
[ "$n" -lt 200 ] && step 120 build python ffi/build.py --jobs 14
step 75 tests timeout 70 $P tests/test_cutedsl_gpu.py -k "intra_cp_split"
step 200 long python -m benchmarks.run fwdbwd --no-check --deadline 45 --out $M/long \
  --impl fla,cutedsl --shapes "1,262144,16,1"
echo "== tests"; grep -hE "^(FAILED|ERROR)|passed|failed|intra_cp=4" $M/tests.log | tail -40 | cut -c1-250
grep -hE "Error|assert" $M/tests.log | head -10 | cut -c1-250
echo "== long"; rows $M/long.log; grep -hE "NOTE|ERROR|Traceback" $M/long.log | head; tail -3 $M/long.log | cut -c1-200
(cd $TRITON_CACHE_DIR && find . -name '*.autotune.json' -newer .fla-autotune | tar -cJf $M/fla-autotune-new.tar.xz -T -) 2>/dev/null
tar -cJf $OUT/s24_gpu4_out.tar.xz -C $M . && rm -rf $M
