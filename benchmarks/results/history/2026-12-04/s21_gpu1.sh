#!/usr/bin/env bash
# Twenty-first session, device call 1: issue 20's starting point with today's kernels -
# one long sequence, intra_cp = none / 4 / 8 beside fully tuned FLA (fwd, fwd+bwd), a trace
# of the forward split and unsplit; the batch-invariance GPU test (first run); COMPACT A/B.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
date -u
n=$(ls ffi/build/kernels 2>/dev/null | wc -l); echo "prebuilt objects here: $n"
if [ "$n" -lt 197 ]; then ( timeout 100 python ffi/build.py --jobs 14 > $OUT/build.log 2>&1 ); tail -1 $OUT/build.log; fi
date -u
timeout 200 python -m benchmarks.run fwdbwd --impl cutedsl,cutedsl-cp4,cutedsl-cp8,fla \
  --shapes "1,65536,16,2;1,262144,16,1" --no-check --deadline 150 --out $OUT/bench > $OUT/long.log 2>&1
echo "== long rc=$?"; grep -E '^\| [0-9(]' $OUT/long.log | cut -c1-200
date -u
for impl in cutedsl cutedsl-cp8; do
  echo "== trace fwd $impl"
  timeout 60 python -m benchmarks.trace --shape 1,65536,16,2 --impl $impl --mode fwd --top 12 2>&1 | grep -E "ms" | cut -c1-150
done
date -u
timeout 150 python -m pytest -m gpu -q -rA -s -p no:cacheprovider tests/test_cutedsl_gpu.py -k "sequence_alone" > $OUT/inv.log 2>&1
echo "== invariance rc=$?"; grep -E "^(FAILED|ERROR|PASSED)|passed|failed|differ|max" $OUT/inv.log | tail -12 | cut -c1-250
date -u
for c in False True; do
  timeout 120 python -m benchmarks.run fwd --impl cutedsl --shapes main --no-check --set kernels.chunk_prep.COMPACT=$c --out $OUT/c$c > $OUT/compact_$c.log 2>&1
  echo "== COMPACT=$c rc=$?"; grep -E '^\| [0-9(]' $OUT/compact_$c.log | cut -c1-120
done
date -u
