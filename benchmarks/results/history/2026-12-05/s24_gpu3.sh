#!/usr/bin/env bash
# The measurements still owed on the H200, as device calls of < 600 s each (carry
# [".gpu-deps"]); what the twenty-second session ran is in
# benchmarks/results/history/2026-12-04/s22_gpu*.sh:
#   bash benchmarks/run_gpu_measurements.sh 1   # s22's opt-ins for few walks (not measured): NARROW_TILES and WALK_READOUT -
#                                               # their GPU tests, an A/B of each and both beside tuned FLA, the recursions alone
#   bash benchmarks/run_gpu_measurements.sh 2   # the main-shape table beside tuned FLA (the recursions' chunk scalars loaded
#                                               # first: compare with s20-4 / s22's 9.06 ms)
#   bash benchmarks/run_gpu_measurements.sh 3   # issue 20's long rows (1, 131072, 8, 2), (1, 262144, 16, 1) beside tuned FLA;
#                                               # a trace of intra_cp = 4's forward
#   bash benchmarks/run_gpu_measurements.sh 4   # the kernel GPU tests in full: five pytest processes at once
#   bash benchmarks/run_gpu_measurements.sh 5   # s23's CP / intra_cp pass changes (not measured): the split GPU test,
#                                               # the split forward and fwd+bwd beside unsplit and tuned FLA, a trace
# Logs and raw files under $OUT/m; a summary is printed last. Each step has its own
# timeout so one slow step cannot take the others' results.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
# FLA's H = 8 winners (tuned in s22-3), beside the H = 4, 16 ones install.sh unpacked
tar -C "$TRITON_CACHE_DIR" -xJf benchmarks/fla-autotune-h200-extra.tar.xz
M=$OUT/m; mkdir -p $M
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
left() { echo $(( 580 - ($(date +%s) - T0) )); }
step() { local t=$1 name=$2; shift 2; local l; l=$(left); [ "$l" -lt 20 ] && { el "skip $name"; return; }
         [ "$t" -gt "$l" ] && t=$l; el "$name ($t s)"; timeout "$t" "$@" > $M/$name.log 2>&1; el "$name rc=$?"; }
rows() { grep -hE '^\| [0-9(]' "$@" | cut -c1-200; }
P="python -m pytest -m gpu -q -rA -p no:cacheprovider"
n=$(ls ffi/build/kernels 2>/dev/null | wc -l)
[ "$n" -lt 200 ] && step 100 build python ffi/build.py --jobs 14
  # five pytest processes at once (one GPU, no preallocation; s20-3's split), one 420 s limit
  F=tests/test_cutedsl_gpu.py
  job() { local name=$1; shift; ( timeout 400 "$@" > $M/$name.log 2>&1; echo "rc=$?" >> $M/$name.log ) & }
  job grad1 $P $F -k "fused_ddo or token_major_gradients or local_grad_kernel_matches or packed_gradients"
  job grad2 $P $F -k "gradients_match and not token_major and not packed"
  job fwd $P $F -k "forward_matches or token_major_operands or packed_matches or inverse_kernel or long_sequence_state"
  job rest $P $F -k "not forward_matches and not packed_matches and not gradients_match and not long_sequence_state and not token_major and not fused_ddo and not local_grad_kernel and not inverse_kernel"
  job prep $P tests/test_chunk_prep_gpu.py tests/test_robust_gpu.py
  wait
  for f in grad1 grad2 fwd rest prep; do echo "== $f"; grep -hE "^(FAILED|ERROR)|passed|failed|^rc=" $M/$f.log | tail -6 | cut -c1-250; done 
tar -cJf $OUT/s24_gpu3_out.tar.xz -C $M . && rm -rf $M
