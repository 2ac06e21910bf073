#!/usr/bin/env bash
# Twenty-first session, device call 3: the fixed-order L2 norm (gdp_jax.norm) - the
# batch-invariance GPU test, determinism, the op at two main shapes beside fully tuned FLA
# (check vs float64); then issue 20's (1, 262144, 16, 1) row beside tuned FLA.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
date -u
( timeout 100 python ffi/build.py --jobs 14 > $OUT/build.log 2>&1 ); tail -1 $OUT/build.log
date -u
timeout 120 python -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_cutedsl_gpu.py \
  -k "sequence_alone or deterministic or packed_gradients_match" > $OUT/tests.log 2>&1
echo "== tests rc=$?"; grep -E "^(FAILED|ERROR|PASSED)|passed|failed|^E " $OUT/tests.log | tail -14 | cut -c1-250
date -u
timeout 150 python -m benchmarks.run fwdbwd --impl cutedsl,fla --shapes "8,4096,16,2;2,16384,16,2" \
  --deadline 130 --out $OUT/bench > $OUT/main.log 2>&1
echo "== main rc=$?"; grep -E '^\| [0-9(]' $OUT/main.log | cut -c1-200
date -u
timeout 120 python -m benchmarks.run fwdbwd --impl cutedsl,fla --shapes "1,262144,16,1" \
  --no-check --deadline 100 --out $OUT/bench > $OUT/long.log 2>&1
echo "== long rc=$?"; grep -E '^\| [0-9(]' $OUT/long.log | cut -c1-200; grep -E "NOTE|rror" $OUT/long.log | head -5
date -u
