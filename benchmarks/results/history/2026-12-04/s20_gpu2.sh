#!/usr/bin/env bash
# Twentieth session, device call 2: the local-gradient kernel with its loads in two
# cp.async groups (q, k first: QG starts while w, doc, S0 and a 16-bit dS_end land, the
# latter straight into shared memory) and u's load issued a phase earlier; FUSED_DDO on
# (prebuilt). GPU tests of the gradients (two jobs), the kernel alone + probe, and the
# op's fwd+bwd with LOCAL_GRAD_SPLIT on / off.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
( timeout 90 python ffi/build.py --jobs 14 > $OUT/build.log 2>&1 ); tail -1 $OUT/build.log
T="python -m pytest -m gpu -q -rA -s -p no:cacheprovider tests/test_cutedsl_gpu.py"
timeout 250 $T -k "fused_ddo or token_major_gradients or local_grad_kernel_matches or packed_gradients" > $OUT/tests1.log 2>&1 &
timeout 250 $T -k "gradients_match and not token_major and not packed" > $OUT/tests2.log 2>&1 &
wait
for f in tests1 tests2; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/$f.log | cut -c1-250; done
timeout 100 python -m benchmarks.prep_probe --shape 8,4096,16,2 --bv "" --local-grad \
  --skip-prep-probe --warps-n 2 --json $OUT/probe.json > $OUT/probe.log 2>&1
echo "== probe rc=$?"; grep -E "local grad" $OUT/probe.log | grep -v "prebuilt" | cut -c1-150
ab() {
  tag=$1; shift
  timeout 100 python -m benchmarks.run fwdbwd --impl cutedsl --shapes "8,4096,16,2;8,4096,16,3" \
    --no-check --deadline 80 --out /tmp/b_$tag "$@" > $OUT/ab_$tag.log 2>&1
  echo "== $tag rc=$?"; grep -E '^\| [0-9(]' $OUT/ab_$tag.log | cut -c1-120
}
ab base
ab nosplit --set kernels.pipeline.LOCAL_GRAD_SPLIT=False
