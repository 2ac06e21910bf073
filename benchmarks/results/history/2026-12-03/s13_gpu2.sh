#!/usr/bin/env bash
# Thirteenth session, device call 2 (issue 22): the xla engine at the session's final code
# (folded readout and reverse steps, 16-bit backward intermediates) beside fully tuned FLA
# in one process at the benchmark shapes; T = 256K fwd+bwd fit; the NARROW_WY A/B; the
# backward's kernel trace with its optimized HLO (one tarball).
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
mkdir -p /tmp/tr
timeout 260 python -m benchmarks.run fwdbwd --impl xla,fla --shapes main --out /tmp/b_main \
  --deadline 235 > $OUT/main.log 2>&1; grep '^| [0-9]' $OUT/main.log | cut -c1-150
cp /tmp/b_main/*.md $OUT/main.md
timeout 90 python benchmarks/results/history/2026-12-01/long_xla_256k_s4.py 1,262144,16,2 \
  > $OUT/long256k.log 2>&1; echo "== 256K rc=$?"; tail -3 $OUT/long256k.log
timeout 60 python -m benchmarks.run fwdbwd --impl xla --shapes "8,4096,16,2" --out /tmp/b_wy \
  --deadline 45 --set chunked.NARROW_WY=True > /tmp/tr/narrow_wy.log 2>&1
echo "== narrow_wy"; grep -E '^\| [0-9]|check' /tmp/tr/narrow_wy.log | cut -c1-150
m=bwd
timeout 70 python -m benchmarks.trace --shape 8,4096,16,2 --impl xla --mode $m --top 80 \
  --out /tmp/t_$m --hlo /tmp/tr/xla_$m.hlo.gz > /tmp/tr/trace_$m.log 2>&1
python -m benchmarks.hlo_lines /tmp/tr/trace_$m.log /tmp/tr/xla_$m.hlo.gz --top 80 \
  > /tmp/tr/kernels_$m.log 2>&1
echo "== $m"; head -2 /tmp/tr/trace_$m.log; head -24 /tmp/tr/kernels_$m.log | cut -c1-160
tar -C /tmp -czf $OUT/tr.tar.gz tr; ls -la $OUT
