#!/usr/bin/env bash
# Twentieth session, device call 3: local_grad.SPLIT off by default (prebuilt), the gate
# loops of the local-gradient kernel without branches and both kernels' gate exps as
# ex2.approx; "kloop" (the ldmatrix products as dynamic k-loops) timed beside. Forward and
# gradient GPU tests (three jobs), the kernels alone with their probes, the op's fwd+bwd.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
( timeout 90 python ffi/build.py --jobs 14 > $OUT/build.log 2>&1 ); tail -1 $OUT/build.log
T="python -m pytest -m gpu -q -rA -s -p no:cacheprovider tests/test_cutedsl_gpu.py"
timeout 260 $T -k "fused_ddo or token_major_gradients or local_grad_kernel_matches or packed_gradients" > $OUT/tests1.log 2>&1 &
timeout 260 $T -k "gradients_match and not token_major and not packed" > $OUT/tests2.log 2>&1 &
timeout 260 $T -k "forward_matches or token_major_operands or packed_matches or inverse_kernel" > $OUT/tests3.log 2>&1 &
wait
for f in tests1 tests2 tests3; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/$f.log | cut -c1-250; done
grep -h "^precision" $OUT/tests1.log | cut -c1-400
timeout 150 python -m benchmarks.prep_probe --shape 8,4096,16,2 --bv "" --local-grad --tokens \
  --warps-n 2 --lg-variants kloop --json $OUT/probe.json > $OUT/probe.log 2>&1
echo "== probe rc=$?"; grep -E "ms$|cycles|latency" $OUT/probe.log | grep -v "prebuilt" | cut -c12-150
ab() {
  tag=$1; shift
  timeout 100 python -m benchmarks.run fwdbwd --impl cutedsl --shapes "8,4096,16,2;8,4096,16,3" \
    --no-check --deadline 80 --out /tmp/b_$tag "$@" > $OUT/ab_$tag.log 2>&1
  echo "== $tag rc=$?"; grep -E '^\| [0-9(]' $OUT/ab_$tag.log | cut -c1-120
}
ab base
