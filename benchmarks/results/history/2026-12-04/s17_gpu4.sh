#!/usr/bin/env bash
# Seventeenth session, device call 4 (issue 14): the cutedsl backend beside fully tuned FLA
# at the four main shapes (operands kernel at 3 CTAs an SM, BV = 64); precision of o and
# the final state vs float64 with the hi + lo split on and off beside FLA; where the
# forward's time goes (trace + source lines).
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
( timeout 70 python ffi/build.py --jobs 14 > $OUT/build.log 2>&1 ); tail -1 $OUT/build.log
timeout 250 python -m benchmarks.run fwdbwd --impl cutedsl,fla --shapes main --out /tmp/b_main \
  --deadline 225 > $OUT/main.log 2>&1
cp /tmp/b_main/*.md $OUT/main.md 2>/dev/null; cp /tmp/b_main/*.json $OUT/main.json 2>/dev/null
echo "== main"; grep -E '^\| [0-9]|check' $OUT/main.log | cut -c1-220
timeout 130 python -m benchmarks.peer_precision --impl cutedsl,cutedsl-nosplit,fla \
  --cases bf16-K64-n2-nogate,bf16-K128-V64-n3-nogate,bf16-K128-n2-gate > $OUT/precision.log 2>&1
echo "== precision"; grep -v Warn $OUT/precision.log | tail -12
mkdir -p /tmp/tr
timeout 60 python -m benchmarks.trace --shape 8,4096,16,2 --impl cutedsl --mode fwd --top 30 \
  --out /tmp/t_fwd --hlo /tmp/tr/fwd.hlo.gz > $OUT/trace_fwd.log 2>&1
python -m benchmarks.hlo_lines $OUT/trace_fwd.log /tmp/tr/fwd.hlo.gz --top 25 > $OUT/lines_fwd.log 2>&1
echo "== fwd trace"; head -3 $OUT/trace_fwd.log; head -30 $OUT/lines_fwd.log | cut -c1-160
