#!/usr/bin/env bash
# Seventeenth session, device call 5 (issue 14, evidence for the next session): the cutedsl
# GPU tests with the recursion kernels' hi + lo split OFF (chunk_forward.BF16_SPLIT = False,
# not the default): which bounds hold with plain 16-bit state operands; and FLA's error on
# the n = 3 ungated case beside ours (the first run, with WITH_PRECISION=1; its tests did not
# start: a shell function under `timeout`; the second run: the tests only).
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
[ -d ffi/build/kernels ] || ( timeout 70 python ffi/build.py --jobs 14 > $OUT/build.log 2>&1 )
mkdir -p $OUT/tests
NOSPLIT=(python -c "import sys, pytest; import gdp_jax.kernels.chunk_forward as m; m.BF16_SPLIT = False; sys.exit(pytest.main(sys.argv[1:]))" -m gpu -q -rA -p no:cacheprovider)
run() { name=$1; shift; ( timeout 260 "$@" > $OUT/tests/$name.log 2>&1; echo "rc=$?" >> $OUT/tests/$name.log ) & }
run nosplit_fwd "${NOSPLIT[@]}" tests/test_cutedsl_gpu.py -k "forward_matches or packed_matches or long_sequence_state"
run nosplit_grad "${NOSPLIT[@]}" tests/test_cutedsl_gpu.py -k "gradients_match"
wait
for f in $OUT/tests/*.log; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed|rc=" $f | tail -8 | cut -c1-400; done
[ -n "$WITH_PRECISION" ] && timeout 150 python -m benchmarks.peer_precision --impl cutedsl,cutedsl-nosplit,fla \
  --cases bf16-K128-V64-n3-nogate > $OUT/precision_n3.log 2>&1
echo "== precision n3"; grep -v Warn $OUT/precision_n3.log | tail -5
