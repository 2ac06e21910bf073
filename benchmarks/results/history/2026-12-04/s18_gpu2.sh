#!/usr/bin/env bash
# Eighteenth session, device call 2 (issue 14): the operands kernel reading q, k, v from
# the op's token-major tensors (L2 norm in the kernel): GPU tests of the new path and the
# forward paths it feeds, then cutedsl alone at the main shapes with and without it
# (chunk_prep.TOKEN_LAYOUT), fwd and fwd+bwd.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
( timeout 80 python ffi/build.py --jobs 14 > $OUT/build.log 2>&1 ); tail -1 $OUT/build.log
timeout 200 python -m pytest -q -m gpu -x tests/test_cutedsl_gpu.py -k \
  "token_major or forward_matches or packed_matches or long_sequence_state" -s \
  > $OUT/tests.log 2>&1
echo "== tests rc=$?"; grep -E "^\[|passed|failed|Error|error" $OUT/tests.log | cut -c1-220 | tail -40
for tl in True False; do
  timeout 150 python -m benchmarks.run fwdbwd --impl cutedsl --shapes main --no-check \
    --deadline 120 --out /tmp/b_$tl --set kernels.chunk_prep.TOKEN_LAYOUT=$tl > $OUT/bench_$tl.log 2>&1
  echo "== TOKEN_LAYOUT=$tl rc=$?"; grep -E '^\| [0-9(]' $OUT/bench_$tl.log | cut -c1-200
done
