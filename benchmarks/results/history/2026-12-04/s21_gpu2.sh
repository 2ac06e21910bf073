#!/usr/bin/env bash
# Twenty-first session, device call 2: the recursion kernels with their operands loaded one
# chunk ahead (two cp.async groups). Kernels alone, the op at the main shapes with the
# check vs float64 and at one long sequence; the GPU tests of the kernels; batch-invariance
# diagnosis.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
date -u
( timeout 100 python ffi/build.py --jobs 14 > $OUT/build.log 2>&1 ); tail -1 $OUT/build.log
date -u
for sb in 8,4096,16,2:64 1,65536,16,2:32; do
  echo "== recursion kernels alone ${sb%:*} BV=${sb#*:}"
  timeout 80 python -m benchmarks.prep_probe --shape ${sb%:*} --bv ${sb#*:} --skip-prep-probe 2>&1 | grep -E "(fwd|rev).*BV.*ms" | cut -c1-160
done
date -u
timeout 200 python -m benchmarks.run fwdbwd --impl cutedsl --shapes "8,4096,16,1;8,4096,16,2;2,16384,16,2;1,65536,16,2" --deadline 140 --out $OUT/bench > $OUT/bench.log 2>&1
echo "== bench rc=$?"; grep -E '^\| [0-9(]' $OUT/bench.log | cut -c1-200
date -u
timeout 170 python -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_cutedsl_gpu.py > $OUT/tests.log 2>&1
echo "== tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/tests.log | tail -8 | cut -c1-250
date -u
timeout 50 python benchmarks/results/history/2026-12-04/s21_inv_diag.py 2>&1 | grep norm=
date -u
