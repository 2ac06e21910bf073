#!/usr/bin/env bash
# Nineteenth session, device call 3: the token-major local-gradient kernel was 36% slower
# than the chunk-major one in s19-2 (32-bit stores straight from the accumulators, CTAs in
# (chunk, head, row) order). A/B of its store path (local_grad.TOKEN_STAGED: through smem,
# 128-bit row pieces) and CTA order (TOKEN_HEAD_MAJOR) against the chunk-major kernel
# (TOKEN_GRADS=False), fwd+bwd at two shapes; trace of the default; the gradient GPU tests.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
( timeout 80 python ffi/build.py --jobs 14 > $OUT/build.log 2>&1 ); tail -1 $OUT/build.log
ab() {
  tag=$1; shift
  timeout 100 python -m benchmarks.run fwdbwd --impl cutedsl --shapes "8,4096,16,2;8,4096,16,3" \
    --no-check --deadline 80 --out /tmp/b_$tag "$@" > $OUT/ab_$tag.log 2>&1
  echo "== $tag rc=$?"; grep -E '^\| [0-9(]' $OUT/ab_$tag.log | cut -c1-120
}
ab chunk --set kernels.local_grad.TOKEN_GRADS=False
ab staged_head
ab staged_chunkorder --set kernels.local_grad.TOKEN_HEAD_MAJOR=False
ab direct_head --set kernels.local_grad.TOKEN_STAGED=False
mkdir -p /tmp/tr
timeout 80 python -m benchmarks.trace --shape 8,4096,16,2 --impl cutedsl --mode fwdbwd --top 40 \
  --out /tmp/t_fb --hlo /tmp/tr/fb.hlo.gz > $OUT/trace_fwdbwd.log 2>&1
python -m benchmarks.hlo_lines $OUT/trace_fwdbwd.log /tmp/tr/fb.hlo.gz --top 30 > $OUT/lines_fwdbwd.log 2>&1
echo "== trace"; head -24 $OUT/lines_fwdbwd.log | cut -c1-150
timeout 200 python -m pytest -m gpu -q -rA -s -p no:cacheprovider tests/test_cutedsl_gpu.py \
  -k "token_major_gradients or packed_gradients" > $OUT/tests.log 2>&1
echo "== tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|^\[tokens" $OUT/tests.log | cut -c1-250
