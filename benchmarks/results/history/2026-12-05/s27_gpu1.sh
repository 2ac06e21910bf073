#!/usr/bin/env bash
# The measurements still owed on the H200, as device calls of < 600 s each (carry
# [".gpu-deps"]); what the twenty-fourth session ran is in
# benchmarks/results/history/2026-12-05/s24_gpu*.sh:
#   bash benchmarks/run_gpu_measurements.sh 2   # the main-shape table beside tuned FLA (s22's chunk scalars loaded first,
#                                               # measured only at the long shape in s24: compare with s20-4 / s22's 9.06 ms)
#   bash benchmarks/run_gpu_measurements.sh 3   # issue 20's long rows (1, 131072, 8, 2), (1, 262144, 16, 1) beside tuned FLA;
#                                               # a trace of intra_cp = 4's forward
#   bash benchmarks/run_gpu_measurements.sh 4   # the kernel GPU tests in full: five pytest processes at once
#   bash benchmarks/run_gpu_measurements.sh 5   # s24 / s25's split changes (not measured): the opt-ins RESPONSE_HI_LO (the
#                                               # response products on bf16 hi + lo) and CP_REWALK (summary walks, then
#                                               # plain walks), the value tile counting the segments, "auto" counting CTAs:
#                                               # the split GPU tests, the split A/B beside unsplit and tuned FLA, a trace
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
[ "$n" -lt 200 ] && step 150 build python ffi/build.py --jobs 15
case "${1:-2}" in
2)
  step 420 op python -m benchmarks.run fwdbwd --impl cutedsl,fla --shapes main --deadline 360 --out $M/op
  rows $M/op.log ;;
3)
  step 200 long8 python -m benchmarks.run fwdbwd --impl cutedsl,fla \
    --shapes "1,131072,8,2" --no-check --deadline 150 --out $M/long8
  step 210 long16 python -m benchmarks.run fwdbwd --impl cutedsl,fla \
    --shapes "1,262144,16,1" --no-check --deadline 130 --out $M/long16
  # where intra_cp = 4's forward spends its 11.6 ms (s21-1; unsplit 9.0): no trace yet
  step 70 trace_cp4 python -m benchmarks.trace --shape 1,65536,16,2 --impl cutedsl-cp4 \
    --mode fwd --top 25 --out /tmp/t_cp4
  (cd $TRITON_CACHE_DIR && find . -name '*.autotune.json' -newer .fla-autotune | tar -cJf $M/fla-autotune-new.tar.xz -T -)
  rows $M/long*.log; grep -h NOTE $M/long*.log; tail -30 $M/trace_cp4.log ;;
4)
  # five pytest processes at once (one GPU, no preallocation; s20-3's split), one 420 s limit
  F=tests/test_cutedsl_gpu.py
  job() { local name=$1; shift; ( timeout 420 "$@" > $M/$name.log 2>&1; echo "rc=$?" >> $M/$name.log ) & }
  job grad1 $P $F -k "fused_ddo or token_major_gradients or local_grad_kernel_matches or packed_gradients"
  job grad2 $P $F -k "gradients_match and not token_major and not packed"
  job fwd $P $F -k "forward_matches or token_major_operands or packed_matches or inverse_kernel or long_sequence_state"
  job rest $P $F -k "not forward_matches and not packed_matches and not gradients_match and not long_sequence_state and not token_major and not fused_ddo and not local_grad_kernel and not inverse_kernel"
  job prep $P tests/test_chunk_prep_gpu.py tests/test_robust_gpu.py
  wait
  for f in grad1 grad2 fwd rest prep; do echo "== $f"; grep -hE "^(FAILED|ERROR)|passed|failed|^rc=" $M/$f.log | tail -6 | cut -c1-250; done ;;
5)
  # s24 / s25 (NOT measured): engine.RESPONSE_HI_LO (+hilo: apply's response products on
  # bf16 hi + lo instead of a float32 GEMM, 1.55 ms of 8.8 in s24-1's trace, and its
  # float32 copies); chunk_forward.CP_REWALK (+rewalk: prepare's V + K walks write only
  # the summary, apply walks again on V columns: no response products at all); the
  # split's value tile for B x S rows; "auto" (s25: counts CTAs, splits only the forward
  # nothing differentiates: S = 4 at 8 heads, none at 16). Before (s24-2): intra_cp = 4
  # forward 8.91 / 8.93 ms at the two shapes, fwd+bwd 35.48 / 35.80. Turn on what pays
  # (and passes its test); remove the loser of respond vs rewalk.
  step 150 split_test $P tests/test_cutedsl_gpu.py -k "intra_cp_split or cp_cutedsl_equals or response_hi_lo"
  L="1,65536,16,2;1,131072,8,2"
  step 300 split_ab python -m benchmarks.run fwdbwd --impl cutedsl,cutedsl-cp4,cutedsl-cp4+hilo,cutedsl-cp4+rewalk,cutedsl-cpauto+rewalk,fla \
    --no-check --shapes "$L" --deadline 280 --out $M/split
  step 70 trace_cp4 python -m benchmarks.trace --shape 1,65536,16,2 --impl cutedsl-cp4+rewalk \
    --mode fwd --top 25 --out /tmp/t_cp4
  grep -hE "^(FAILED|ERROR|PASSED)|passed|failed" $M/split_test.log | tail -8
  rows $M/split_ab.log; tail -30 $M/trace_cp4.log ;;
esac
