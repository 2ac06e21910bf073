#!/usr/bin/env bash
# Twentieth session, device call 1: the local-gradient kernel at 16 warps (4 x 4,
# local_grad.WARPS_N = 4; 128 registers, 32 B of spills on CPU) vs 8 (4 x 2): the kernel
# alone with its phase probe and the token-major variant's results compared; then the op's
# fwd+bwd with WARPS_N and pipeline.FUSED_DDO (prepared in s19, never measured) A/B.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
( timeout 80 python ffi/build.py --jobs 14 > $OUT/build.log 2>&1 ); tail -1 $OUT/build.log
timeout 150 python -m benchmarks.prep_probe --shape 8,4096,16,2 --bv 64 --local-grad \
  --skip-prep-probe --warps-n 2,4 --json $OUT/probe.json > $OUT/probe.log 2>&1
echo "== probe rc=$?"; grep -E "local grad|rev|vs the first" $OUT/probe.log | grep -v "prebuilt" | cut -c1-150
ab() {
  tag=$1; shift
  timeout 100 python -m benchmarks.run fwdbwd --impl cutedsl --shapes "8,4096,16,2;8,4096,16,3" \
    --no-check --deadline 80 --out /tmp/b_$tag "$@" > $OUT/ab_$tag.log 2>&1
  echo "== $tag rc=$?"; grep -E '^\| [0-9(]' $OUT/ab_$tag.log | cut -c1-120
}
ab base
ab wn4 --set kernels.local_grad.WARPS_N=4
ab ddo --set kernels.pipeline.FUSED_DDO=True
ab wn4ddo --set kernels.local_grad.WARPS_N=4 --set kernels.pipeline.FUSED_DDO=True
