#!/usr/bin/env bash
# Fifteenth session, device call 1 (issue 22): bf16 q, k, v chunk-input cotangents (the
# relayout back to tokens in 16 bits), q and v cast before the relayout to the grid, and
# the merged reverse step ([qf; -w]^T [dO; dD]). The xla engine beside fully tuned FLA in
# one process at the four benchmark shapes; A/B of the two switches at (8, 4096, 16, 1);
# an n = 1 backward trace.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
mkdir -p /tmp/tr
timeout 330 python -m benchmarks.run fwdbwd --impl xla,fla --shapes main --out /tmp/b_main \
  --deadline 310 > $OUT/main.log 2>&1; grep '^| [0-9]' $OUT/main.log | cut -c1-200
cp /tmp/b_main/*.md $OUT/main.md 2>/dev/null
grep check $OUT/main.log
for sw in "engine.NARROW_COTANGENTS=False" "recurrence.MERGED_REVERSE_STEP=False"; do
  timeout 70 python -m benchmarks.run fwdbwd --impl xla --shapes "8,4096,16,1" --out /tmp/b_ab \
    --deadline 60 --set $sw > /tmp/tr/ab_$sw.log 2>&1
  echo "== $sw"; grep -E '^\| [0-9]|check' /tmp/tr/ab_$sw.log | cut -c1-200
done
timeout 60 python -m benchmarks.trace --shape 8,4096,16,1 --impl xla --mode bwd --top 80 \
  --out /tmp/t_bwd --hlo /tmp/tr/xla1_bwd.hlo.gz > /tmp/tr/trace1_bwd.log 2>&1
python -m benchmarks.hlo_lines /tmp/tr/trace1_bwd.log /tmp/tr/xla1_bwd.hlo.gz --by line --top 40 \
  > /tmp/tr/lines1_bwd.log 2>&1
echo "== n=1 bwd"; head -2 /tmp/tr/trace1_bwd.log; head -12 /tmp/tr/lines1_bwd.log | cut -c1-120
cp /tmp/tr/*.log $OUT/; ls -la $OUT
