#!/usr/bin/env bash
# Fourteenth session, device call 1 (issue 22): whole-token chunks (n = 3 reads out 21 rows
# of 64). The xla engine beside fully tuned FLA in one process at the benchmark shapes; the
# cutedsl backend's n = 3 GPU tests on the new grid (prebuilt kernels) and its n = 3 row;
# kernel traces of the xla engine at n = 1 (forward, backward) for the next lever.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
mkdir -p /tmp/tr
timeout 250 python -m benchmarks.run fwdbwd --impl xla,fla --shapes main --out /tmp/b_main \
  --deadline 225 > $OUT/main.log 2>&1; grep '^| [0-9]' $OUT/main.log | cut -c1-160
cp /tmp/b_main/*.md $OUT/main.md 2>/dev/null
( timeout 60 python ffi/build.py --jobs 14 > /tmp/tr/build.log 2>&1; echo "build rc=$?" >> /tmp/tr/build.log )
tail -2 /tmp/tr/build.log
P="python -m pytest -m gpu -q -rA -p no:cacheprovider"
( timeout 130 $P tests/test_cutedsl_gpu.py -k "forward_matches and (128-128-3 or 64-64-3 or 128-64-3)" > /tmp/tr/t_fwd.log 2>&1; echo "rc=$?" >> /tmp/tr/t_fwd.log ) &
( timeout 130 $P tests/test_cutedsl_gpu.py -k "gradients_match and (128-128-3 or 64-64-3 or 128-64-3)" > /tmp/tr/t_grad.log 2>&1; echo "rc=$?" >> /tmp/tr/t_grad.log ) &
( timeout 130 $P tests/test_cutedsl_gpu.py -k "packed and 16-3" > /tmp/tr/t_packed.log 2>&1; echo "rc=$?" >> /tmp/tr/t_packed.log ) &
wait
for f in /tmp/tr/t_*.log; do echo "== $f"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed|rc=" $f | tail -8; done
timeout 70 python -m benchmarks.run fwdbwd --impl cutedsl --shapes "8,4096,16,3" --out /tmp/b_cd \
  --deadline 50 > /tmp/tr/cutedsl_n3.log 2>&1; echo "== cutedsl n3"; grep -E '^\| [0-9]' /tmp/tr/cutedsl_n3.log | cut -c1-160
for m in fwd bwd; do
  timeout 55 python -m benchmarks.trace --shape 8,4096,16,1 --impl xla --mode $m --top 80 \
    --out /tmp/t_$m --hlo /tmp/tr/xla1_$m.hlo.gz > /tmp/tr/trace1_$m.log 2>&1
  python -m benchmarks.hlo_lines /tmp/tr/trace1_$m.log /tmp/tr/xla1_$m.hlo.gz --by line --top 40 \
    > /tmp/tr/lines1_$m.log 2>&1
  echo "== n=1 $m"; head -2 /tmp/tr/trace1_$m.log; head -16 /tmp/tr/lines1_$m.log | cut -c1-120
done
tar -C /tmp -czf $OUT/tr.tar.gz tr; ls -la $OUT
