#!/usr/bin/env bash
# Fourteenth session, device call 3 (issue 22): the final defaults (whole-token grid,
# engine.NARROW_INPUTS = (v, q)) beside fully tuned FLA in one process at the benchmark
# shapes; the cutedsl backend at n = 2, 3 (from_chunks on the strided slice) and its
# n = 3 GPU tests.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
mkdir -p /tmp/tr
timeout 200 python -m benchmarks.run fwdbwd --impl xla,fla --shapes main --out /tmp/b_main \
  --deadline 170 > $OUT/main.log 2>&1; grep '^| [0-9]' $OUT/main.log | cut -c1-160
cp /tmp/b_main/*.md $OUT/main.md 2>/dev/null
( timeout 40 python ffi/build.py --jobs 14 > /tmp/tr/build.log 2>&1 ); tail -1 /tmp/tr/build.log
timeout 70 python -m benchmarks.run fwdbwd --impl cutedsl --shapes "8,4096,16,2;8,4096,16,3" \
  --out /tmp/b_cd --deadline 45 > $OUT/cutedsl.log 2>&1; echo "== cutedsl"; grep -E '^\| [0-9]' $OUT/cutedsl.log | cut -c1-150
P="python -m pytest -m gpu -q -rA -p no:cacheprovider"
( timeout 60 $P tests/test_cutedsl_gpu.py -k "(forward_matches or gradients_match) and (128-128-3 or 64-64-3 or 128-64-3)" > /tmp/tr/t_n3.log 2>&1; echo "rc=$?" >> /tmp/tr/t_n3.log ) &
( timeout 60 $P tests/test_cutedsl_gpu.py -k "packed and 16-3" > /tmp/tr/t_packed.log 2>&1; echo "rc=$?" >> /tmp/tr/t_packed.log ) &
wait
for f in /tmp/tr/t_*.log; do echo "== $f"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed|rc=" $f | tail -9; done
tar -C /tmp -czf $OUT/tr.tar.gz tr; ls -la $OUT
