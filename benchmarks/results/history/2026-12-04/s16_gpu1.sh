#!/usr/bin/env bash
# Sixteenth session, device call 1 (issue 22): the WY inverse's diagonal blocks by forward
# substitution on 8 x 8 (and 4 x 4) blocks instead of 16 x 16 (chunked.SUBSTITUTION_BLOCK):
# the xla engine beside fully tuned FLA in one process at the four benchmark shapes with
# 8, the xla engine alone with 4; the T = 256K fwd+bwd fit; an n = 1 backward trace.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
mkdir -p /tmp/tr
timeout 250 python -m benchmarks.run fwdbwd --impl xla,fla --shapes main --out /tmp/b_main \
  --deadline 230 --set chunked.SUBSTITUTION_BLOCK=8 > $OUT/main8.log 2>&1
cp /tmp/b_main/*.md $OUT/main8.md 2>/dev/null
echo "== block 8"; grep -E '^\| [0-9]|check' $OUT/main8.log | cut -c1-200
timeout 130 python -m benchmarks.run fwdbwd --impl xla --shapes main --out /tmp/b_4 \
  --deadline 115 --set chunked.SUBSTITUTION_BLOCK=4 > $OUT/main4.log 2>&1
echo "== block 4"; grep -E '^\| [0-9]|check' $OUT/main4.log | cut -c1-200
timeout 90 python -m benchmarks.fit --shape 1,262144,16,2 --impl xla > $OUT/fit256k.log 2>&1
echo "== fit"; tail -3 $OUT/fit256k.log
timeout 60 python -m benchmarks.trace --shape 8,4096,16,1 --impl xla --mode bwd --top 80 \
  --out /tmp/t_bwd --hlo /tmp/tr/xla1_bwd.hlo.gz --set chunked.SUBSTITUTION_BLOCK=8 \
  > $OUT/trace1_bwd.log 2>&1
python -m benchmarks.hlo_lines $OUT/trace1_bwd.log /tmp/tr/xla1_bwd.hlo.gz --by line --top 40 \
  > $OUT/lines1_bwd.log 2>&1
echo "== n=1 bwd"; head -2 $OUT/trace1_bwd.log; head -14 $OUT/lines1_bwd.log | cut -c1-120
ls -la $OUT
