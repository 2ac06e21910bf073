#!/usr/bin/env bash
# The measurements owed on the H200 (the twenty-first session prepared them; the device was
# not lent again after its second call), as three device calls of < 600 s each:
#   bash benchmarks/run_gpu_measurements.sh 1   # TOKEN_BACKWARD and batch_invariant: GPU tests, then A/B beside tuned FLA
#   bash benchmarks/run_gpu_measurements.sh 2   # issue 20's long rows (1, 131072, 8, 2), (1, 262144, 16, 1) beside tuned FLA
#   bash benchmarks/run_gpu_measurements.sh 3   # the AOT GPU test alone, then the kernel GPU tests in full
# (device run: carry [".gpu-deps"]). Logs and raw files under $OUT/m; a summary is printed last.
# Each step has its own timeout so one slow step cannot take the others' results.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
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
  step 150 tests $P tests/test_cutedsl_gpu.py -k "token_backward or sequence_alone or deterministic"
  for s in False True; do
    step 120 "ab_token_backward_$s" python -m benchmarks.run fwdbwd --impl cutedsl,cutedsl-inv,fla \
      --shapes "8,4096,16,2;2,16384,16,2" --set "kernels.pipeline.TOKEN_BACKWARD=$s" \
      --deadline 100 --out $M/ab
  done
  grep -hE "^(FAILED|ERROR)|passed|failed" $M/tests.log | tail -8; rows $M/ab_*.log ;;
2)
  step 330 long python -m benchmarks.run fwdbwd --impl cutedsl,fla \
    --shapes "1,131072,8,2;1,262144,16,1" --no-check --deadline 300 --out $M/long
  (cd /tmp/tcache 2>/dev/null && find . -name '*.autotune.json' | tar -cJf $M/fla-autotune.tar.xz -T -)
  rows $M/long.log; grep -h NOTE $M/long.log ;;
3)
  step 300 aot $P -s tests/test_aot_gpu.py
  step 250 kernels $P tests/test_cutedsl_gpu.py tests/test_chunk_prep_gpu.py
  grep -hE "^(FAILED|ERROR)|passed|failed" $M/aot.log $M/kernels.log | tail -12 ;;
esac
