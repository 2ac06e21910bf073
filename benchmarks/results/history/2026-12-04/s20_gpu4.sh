#!/usr/bin/env bash
# Twentieth session, device call 4: today's defaults (s20-3's code) beside fully tuned FLA
# at the main shapes, with the check vs float64; then the step and AOT GPU tests.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
n=$(ls ffi/build/kernels 2>/dev/null | wc -l); echo "prebuilt objects here: $n"
if [ "$n" -lt 129 ]; then ( timeout 90 python ffi/build.py --jobs 14 > $OUT/build.log 2>&1 ); tail -1 $OUT/build.log; fi
timeout 330 python -m benchmarks.run fwdbwd --impl cutedsl,fla --shapes main --deadline 300 \
  --out $OUT/bench > $OUT/bench.log 2>&1
echo "== bench rc=$?"; grep -E '^\| [0-9(]' $OUT/bench.log | cut -c1-220
P="python -m pytest -m gpu -q -rA -s -p no:cacheprovider"
( timeout 110 $P tests/test_step_gpu.py > $OUT/step.log 2>&1; echo "rc=$?" >> $OUT/step.log ) &
( timeout 110 $P tests/test_aot_gpu.py tests/test_chunk_prep_gpu.py > $OUT/aot.log 2>&1; echo "rc=$?" >> $OUT/aot.log ) &
wait
for f in step aot; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed|^rc=" $OUT/$f.log | tail -5 | cut -c1-250; done
