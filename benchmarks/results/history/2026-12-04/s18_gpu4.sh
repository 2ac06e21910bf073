#!/usr/bin/env bash
# Eighteenth session, device call 4 (issue 14): the token-major operands kernel with one
# reduction a row for the L2 norm and head-major CTA order - its GPU tests (and the robust
# suite: non-finite rows through the norm); if they fail, the s18-3-verified kernel
# (1bddde8) is restored and rebuilt before timing. Then the kernels alone and the cutedsl
# backend beside fully tuned FLA at the main shapes.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
( timeout 80 python ffi/build.py --jobs 14 > $OUT/build.log 2>&1 ); tail -1 $OUT/build.log
mkdir -p $OUT/tests
P="python -m pytest -m gpu -q -rA -s -p no:cacheprovider --durations=5"
run() { name=$1; shift; ( timeout 230 "$@" > $OUT/tests/$name.log 2>&1; echo "rc=$?" >> $OUT/tests/$name.log ) & }
run cutedsl_fwd $P tests/test_cutedsl_gpu.py -k "token_major or forward_matches or packed_matches or long_sequence_state"
run robust $P tests/test_robust_gpu.py
wait
for f in $OUT/tests/*.log; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed|rc=" $f | tail -8 | cut -c1-300; done
if ! grep -q "rc=0" $OUT/tests/cutedsl_fwd.log || ! grep -q "rc=0" $OUT/tests/robust.log; then
  echo "== tests failed: restoring the s18-3 kernel"
  cp s18_verified_chunk_prep_sm90.py.txt gdp_jax/kernels/chunk_prep_sm90.py
  ( timeout 80 python ffi/build.py --jobs 14 > $OUT/build2.log 2>&1 ); tail -1 $OUT/build2.log
else
  timeout 60 python -m benchmarks.prep_probe --shape 8,4096,16,2 --bv "" --tokens \
    --skip-prep-probe --json $OUT/probe.json > $OUT/probe.log 2>&1
  echo "== probe rc=$?"; grep -v Warning $OUT/probe.log | cut -c1-150 | tail -6
fi
timeout 250 python -m benchmarks.run fwdbwd --impl cutedsl,fla --shapes main --out /tmp/b_main \
  --deadline 225 > $OUT/main.log 2>&1
cp /tmp/b_main/*.md $OUT/main.md 2>/dev/null; cp /tmp/b_main/*.json $OUT/main.json 2>/dev/null
echo "== main"; grep -E '^\| [0-9]|check' $OUT/main.log | cut -c1-220
