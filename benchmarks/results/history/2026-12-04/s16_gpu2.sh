#!/usr/bin/env bash
# Sixteenth session, device call 2 (issue 22): the new default, 4 x 4 substitution blocks
# in the WY inverse (chunked.SUBSTITUTION_BLOCK = 4), beside fully tuned FLA in one process
# at the four benchmark shapes; the xla engine alone with blocks of 2 and 1 (merges only).
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
timeout 250 python -m benchmarks.run fwdbwd --impl xla,fla --shapes main --out /tmp/b_main \
  --deadline 230 > $OUT/main.log 2>&1
cp /tmp/b_main/*.md $OUT/main.md 2>/dev/null
echo "== block 4 (default)"; grep -E '^\| [0-9]|check' $OUT/main.log | cut -c1-200
timeout 130 python -m benchmarks.run fwdbwd --impl xla --shapes main --out /tmp/b_2 \
  --deadline 120 --set chunked.SUBSTITUTION_BLOCK=2 > $OUT/main2.log 2>&1
echo "== block 2"; grep -E '^\| [0-9]' $OUT/main2.log | cut -c1-200
timeout 80 python -m benchmarks.run fwdbwd --impl xla --shapes "8,4096,16,1;8,4096,16,3" \
  --out /tmp/b_1 --deadline 70 --set chunked.SUBSTITUTION_BLOCK=1 > $OUT/main1.log 2>&1
echo "== block 1"; grep -E '^\| [0-9]' $OUT/main1.log | cut -c1-200
