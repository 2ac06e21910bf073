#!/usr/bin/env bash
# The GPU measurements, as device calls of < 600 s each (carry [".gpu-deps"]); what the
# twenty-seventh session ran (on an H100) is in benchmarks/results/history/2026-12-05/s27_*:
#   bash benchmarks/run_gpu_measurements.sh 2   # the main-shape table beside tuned FLA (owed since s20-4 / s22's 9.06 ms)
#   bash benchmarks/run_gpu_measurements.sh 3   # the split's GPU tests; issue 20's long rows (1, 131072, 8, 2),
#                                               # (1, 262144, 16, 1) fwd + fwd+bwd beside tuned FLA
#   bash benchmarks/run_gpu_measurements.sh 4   # the kernel GPU tests in full: five pytest processes at once
#                                               # (SUITE_S: their time limit, default 420 s)
#   bash benchmarks/run_gpu_measurements.sh 6   # the recursion walks' operands a chunk ahead (PIPELINE): tests, A/B
#   bash benchmarks/run_gpu_measurements.sh 7   # head groups: GPU test; T = 2**20, n = 2, 16 heads fwd+bwd vs FLA
#   bash benchmarks/run_gpu_measurements.sh 8   # the forward on the read-out rows only (READOUT_ONLY): GPU test,
#                                               # forward A/B at the main shapes and one long row, beside FLA
#   bash benchmarks/run_gpu_measurements.sh 9   # mode 8 cut to ~200 s (bf16 test cases, one A/B shape, no FLA)
#   bash benchmarks/run_gpu_measurements.sh 10  # modes 8 and 6 in one call: the opt-ins' GPU tests, read-out rows
#                                               # A/B beside FLA at the main shapes, one long row with them and PIPELINE
#   bash benchmarks/run_gpu_measurements.sh 11  # PAIR_TILES: GPU test, fwd and fwd+bwd A/B beside FLA, one long row
#   bash benchmarks/run_gpu_measurements.sh 12  # READOUT_ONLY_GRAD: GPU test, fwd+bwd A/B beside FLA at the main shapes
#   bash benchmarks/run_gpu_measurements.sh 13  # mode 11 cut to ~300 s: PAIR_TILES A/B at one shape, its bf16 GPU test cases
#   bash benchmarks/run_gpu_measurements.sh 14  # modes 11 and 12 in one call (PAIR_TILES, READOUT_ONLY_GRAD): tests, A/B, long row
#   bash benchmarks/run_gpu_measurements.sh 15  # the three opt-ins not yet run (PAIR_TILES, READOUT_ONLY_GRAD,
#                                               # READOUT_ONLY_BWD): bf16 GPU tests, fwd+bwd A/B beside tuned FLA
#   bash benchmarks/run_gpu_measurements.sh 16  # the L2 norm's backward in the local-gradient kernel
#                                               # (FUSED_NORM_BWD): GPU test, fwd+bwd A/B beside tuned FLA
#   bash benchmarks/run_gpu_measurements.sh 17  # dO read token-major by the local-gradient kernel
#                                               # (DO_TOKENS): GPU test, fwd+bwd A/B at one shape, no FLA
#   bash benchmarks/run_gpu_measurements.sh 18  # DO_TOKENS (test, A/B), TOKEN_BACKWARD A/B, a trace of the
#                                               # default fwd+bwd, one long row beside tuned FLA
#   bash benchmarks/run_gpu_measurements.sh 19  # TOKEN_BACKWARD (read-out rows) and NORM_IN_KERNELS: GPU tests,
#                                               # fwd+bwd A/B beside tuned FLA at the main shapes, a trace
#   bash benchmarks/run_gpu_measurements.sh 20  # the in-kernel norm a step over 4 pieces: its GPU tests, forward
#                                               # and fwd+bwd beside tuned FLA at the main shapes, one long row
#   bash benchmarks/run_gpu_measurements.sh 22  # the local-gradient kernel alone (chunk tiles / tokens / norm
#                                               # inside) and its probe; a trace of the default fwd+bwd
#   bash benchmarks/run_gpu_measurements.sh 23  # the GPU tests s33's defaults had not run, then mode 22
#   (modes 24, 25 - s34's load-order, stagger and L2-prefetch A/B - ran on fb199f0 and were
#    removed with those ablations: benchmarks/results/CURRENT.md, s34)
#   NO_BUILD=1 bash benchmarks/run_gpu_measurements.sh 26  # a trace of fwd+bwd on per-shape kernels
#   NO_BUILD=1 bash benchmarks/run_gpu_measurements.sh 27  # one SM's load rate: cp.async vs bulk copies; mode 26
#   BUILD_ONLY=bfloat16 bash benchmarks/run_gpu_measurements.sh 28  # 32-bit strides in the generic kernels (OFFSETS32)
#   BUILD_ONLY=bfloat16 bash benchmarks/run_gpu_measurements.sh 29  # u in bfloat16 (chunk_prep.U16): A/B beside FLA, its GPU tests
#   TOTAL=200 BUILD_ONLY=bfloat16 bash benchmarks/run_gpu_measurements.sh 30  # mode 29 cut to ~200 s
#   BUILD_ONLY=bfloat16 bash benchmarks/run_gpu_measurements.sh 31  # SAVE_OPERANDS (token path): GPU test, fwd+bwd A/B beside FLA
#   TOTAL=420 BUILD_ONLY=bfloat16 bash benchmarks/run_gpu_measurements.sh 32  # kept operands in a 4-layer stack (+/- jax.checkpoint); a trace
#   NO_BUILD=1 bash benchmarks/run_gpu_measurements.sh 33  # one product's SM cycles: mma.sync vs wgmma (SS, RS)
#   TOTAL=570 BUILD_ONLY=bfloat16 bash benchmarks/run_gpu_measurements.sh 34  # mma_rate, local_grad.GMMA (tests, A/B), mode 32
#   BUILD_ONLY=bfloat16 bash benchmarks/run_gpu_measurements.sh 35  # local_grad.GMMA only
#   TOTAL=450 BUILD_ONLY=bfloat16 bash benchmarks/run_gpu_measurements.sh 36  # mode 35 cut short: A/B, then tests
#   TOTAL=200 NO_BUILD=1 bash benchmarks/run_gpu_measurements.sh 37  # the default beside GMMA "all", fwd+bwd only
#   TOTAL=570 BUILD_ONLY=bfloat16 bash benchmarks/run_gpu_measurements.sh 38  # GMMA "all" the default: gradient
#                                               # GPU tests (4 processes), fwd+bwd at the main shapes vs +mma and FLA
#   TOTAL=250 BUILD_ONLY=bfloat16 bash benchmarks/run_gpu_measurements.sh 39  # mode 38's benchmark alone
#   TOTAL=400 BUILD_ONLY=bfloat16 bash benchmarks/run_gpu_measurements.sh 40  # s38's fixes: float16 wgmma tests,
#                                               # "all" without overlap (kernel alone), mma_rate's RS mode
#   TOTAL=500 BUILD_ONLY=bfloat16 bash benchmarks/run_gpu_measurements.sh 41  # the walks on wgmma (+wg, +wgb):
#                                               # fwd+bwd A/B beside tuned FLA, walks alone, GPU test, one long row
#   TOTAL=540 BUILD_ONLY=bfloat16 bash benchmarks/run_gpu_measurements.sh 43  # s39's defaults (walks on wgmma):
#                                               # main table vs +mmaf+mmab and tuned FLA, then mode 4's tests
#   TOTAL=500 BUILD_ONLY=bfloat16 bash benchmarks/run_gpu_measurements.sh 45  # chunk_prep.GMMA (+wgp),
#                                               # chunk_forward.GMMA="all" (+wga): A/B beside tuned
#                                               # FLA, their GPU tests and the walks'
#   TOTAL=560 BUILD_ONLY=bfloat16 bash benchmarks/run_gpu_measurements.sh 46  # the inverse's 16-byte loads:
#                                               # operands kernel + probe vs s39's source (carry
#                                               # ".ab"), main table vs +mmap+wg and tuned FLA, tests
#   TOTAL=590 BUILD_ONLY=bfloat16 bash benchmarks/run_gpu_measurements.sh 47  # +gram A/B beside tuned FLA,
#                                               # its GPU test beside mode 4's groups
#   (mode 48 - s40's +u16 A/B and a long row, never run - is mode 49's since s41)
#   TOTAL=480 BUILD_ONLY=bfloat16 bash benchmarks/run_gpu_measurements.sh 49  # the operands kernel and
#                                               # walk alone +/- u16 (bytes or latency?), +u16
#                                               # A/B beside tuned FLA, a forward trace, a long row
#   (modes 50, 51 - s41's K_ROWS A/B, run as s42-1 - were removed with K_ROWS in s42)
#   (mode 52 - s42's LOAD_AHEAD and O_TOKENS A/B - ran as s43-1; LOAD_AHEAD was removed in s43)
#   TOTAL=340 BUILD_ONLY=bfloat16 bash benchmarks/run_gpu_measurements.sh 54  # STAGED_STORES (+stg),
#                                               # LATE_V (+latev): fwd A/B +/- u16f beside
#                                               # tuned FLA, GPU tests, Nsight Compute
#   TOTAL=570 BUILD_ONLY=bfloat16 bash benchmarks/run_gpu_measurements.sh 56  # mode 54 (with +prep2,
#                                               # +pipe2), then mode 4's rest group
#   TOTAL=150 NO_BUILD=1 bash benchmarks/run_gpu_measurements.sh 55  # Nsight Compute on fwd+bwd's
#                                               # kernels (operands with X, reverse walk,
#                                               # local gradients)
#   TOTAL=540 BUILD_ONLY=bfloat16 bash benchmarks/run_gpu_measurements.sh 58  # modes 56, 57 in one call:
#                                               # fwd A/B, same-bits tests, fwd+bwd, long row
#   TOTAL=220 NO_BUILD=1 bash benchmarks/run_gpu_measurements.sh 59  # mode 58 cut: +pipe2 fwd A/B, its test
#   TOTAL=570 BUILD_ONLY=bfloat16 bash benchmarks/run_gpu_measurements.sh 57  # +pipe2 in fwd+bwd and
#                                               # a long row beside tuned FLA; the operands
#                                               # kernel's phase probe: default, +prep2,
#                                               # +pipe2; then mode 55 (ncu of fwd+bwd)
#   TOTAL=560 NO_BUILD=1 bash benchmarks/run_gpu_measurements.sh 53  # where the forward's cycles go: the
#                                               # operands kernel's phase probe, Nsight Compute
#                                               # on both forward kernels, a forward trace,
#                                               # then mode 4's rest group
#   TOTAL=420 BUILD_ONLY=bfloat16 bash benchmarks/run_gpu_measurements.sh 44  # every kernel alone + probes,
#                                               # traces of the forward and fwd+bwd (s39's defaults),
#                                               # one long row's forward traced
#   bash benchmarks/run_gpu_measurements.sh 5   # intra_cp's forward at S = 2, 4, 8 beside unsplit and tuned FLA at
#                                               # two long shapes, for "auto"'s rule (SWEEP_S: its limit, default 300 s)
# Logs and raw files under $OUT/m; a summary is printed last. Each step has its own
# timeout so one slow step cannot take the others' results.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
# FLA's H = 8 winners (tuned in s22-3), beside the H = 4, 16 ones install.sh unpacked
tar -C "$TRITON_CACHE_DIR" -xJf benchmarks/fla-autotune-h200-extra.tar.xz
M=$OUT/m; mkdir -p $M
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
# TOTAL: the seconds this call may take (a device call with less budget left gets less)
left() { echo $(( ${TOTAL:-580} - ($(date +%s) - T0) )); }
step() { local t=$1 name=$2; shift 2; local l; l=$(left); [ "$l" -lt 20 ] && { el "skip $name"; return; }
         [ "$t" -gt "$l" ] && t=$l; el "$name ($t s)"; timeout "$t" "$@" > $M/$name.log 2>&1; el "$name rc=$?"; }
rows() { grep -hE '^\| [0-9(]' "$@" | cut -c1-200; }
P="python -m pytest -m gpu -q -rA -p no:cacheprovider"
n=$(ls ffi/build/kernels 2>/dev/null | wc -l)
# BUILD_ONLY=bfloat16: prebuild only the variants naming it (the rest compile when traced)
# NO_BUILD=1: no prebuild (each variant compiles when first traced: a few seconds each)
[ "$n" -lt 200 ] && [ -z "$NO_BUILD" ] && step 150 build python ffi/build.py --jobs 15 ${BUILD_ONLY:+--only $BUILD_ONLY}
# a pytest process in the background, its log $M/NAME.log ending with its exit status; each
# stops after JOB_S seconds (set by the caller)
job() { local name=$1; shift; ( timeout $JOB_S "$@" > $M/$name.log 2>&1; echo "rc=$?" >> $M/$name.log ) & }
# each named log's failures and summary lines
results() { for f in "$@"; do echo "== $f"; grep -hE "^(FAILED|ERROR)|passed|failed|^rc=" $M/$f.log | tail -6 | cut -c1-250; done; }
# mode 4's five test groups (s20-3's split: one GPU, no preallocation); $1: more of
# rest's -k expression (" and not NAME" for a test another job runs)
# mode 4's rest group: the tests the other four groups do not run
REST_K="not forward_matches and not packed_matches and not gradients_match and not long_sequence_state and not token_major and not fused_ddo and not local_grad_kernel and not inverse_kernel"
suite_jobs() {
  local F=tests/test_cutedsl_gpu.py
  job grad1 $P $F -k "fused_ddo or token_major_gradients or local_grad_kernel_matches or packed_gradients"
  job grad2 $P $F -k "gradients_match and not token_major and not packed"
  job fwd $P $F -k "forward_matches or token_major_operands or packed_matches or inverse_kernel or long_sequence_state"
  job rest $P $F -k "$REST_K$1"
  job prep $P tests/test_chunk_prep_gpu.py tests/test_robust_gpu.py
}
# mode 4's GPU tests: the five groups at once, one time limit (SUITE_S, default 420 s)
suite() {
  el "suite (${SUITE_S:-420} s)"; JOB_S=${SUITE_S:-420}
  suite_jobs; wait; results grad1 grad2 fwd rest prep
}
# modes 29, 30: the GPU tests that read or write u, three pytest processes at once for $1 s
u_tests() {
  local t=$1 F=tests/test_cutedsl_gpu.py; el "tests ($t s)"
  JOB_S=$t
  job t_grad $P $F -k "local_grad_kernel_matches or token_major_gradients or norm_in_kernels or gradients_match"
  job t_fwd $P $F -k "forward_matches or token_major_operands or packed_matches or long_sequence"
  job t_prep $P tests/test_chunk_prep_gpu.py tests/test_robust_gpu.py
  wait
  results t_grad t_fwd t_prep
}
# s37: what warpgroup MMA buys the local-gradient kernel's products (benchmarks/mma_rate.py):
# [64, Kd] x [Kd, N] on one CTA of 8 warps an SM, mma.sync + ldmatrix vs wgmma SS / RS
mma_probe() {
  step 90 mma64 python -m benchmarks.mma_rate --kd 64 --n 128 --reps 1,4,8 --ctas 132
  step 90 mma128 python -m benchmarks.mma_rate --kd 128 --n 128 --reps 1,4 --ctas 132
  step 60 mma_full python -m benchmarks.mma_rate --kd 64 --n 128 --reps 4 --ctas 16896
  grep -hE "cycles|Error|error:" $M/mma64.log $M/mma128.log $M/mma_full.log | cut -c1-200
}
gmma_ab() {
  step 200 t_gmma $P tests/test_cutedsl_gpu.py -k "gmma_gradients_match or local_grad_kernel_matches_float64"
  grep -hE "^(FAILED|ERROR)|passed|failed|vs float64|vs warp|Error" $M/t_gmma.log | tail -30 | cut -c1-250
  step 200 gm python -m benchmarks.run fwdbwd --impl cutedsl,cutedsl+gmma,cutedsl+gmmao,cutedsl+gmmaa,fla \
    --shapes "8,4096,16,2" --deadline 170 --out $M/gm
  rows $M/gm.log
  step 150 lg python -m benchmarks.prep_probe --local-grad --skip-prep-probe --bv "" \
    --shape 8,4096,16,2 --lg-variants "gmma;gmmao;gmmaa" --json $M/lg.json
  grep -hE "local grad|probe" $M/lg.log | cut -c1-200
}
layers_and_trace() {
  # s36: what keeping the operands does in a model - a 4-layer stack under jax.grad,
  # recomputed / kept x plain / jax.checkpoint per layer (time, XLA temp, same bits);
  # then a trace of one fwd+bwd with them kept
  step 240 layers python -m benchmarks.layers --shape 8,4096,16,2 --layers 4 --reps 7
  step 90 trace python -m benchmarks.trace --shape 8,4096,16,2 --impl cutedsl \
    --set kernels.pipeline.SAVE_OPERANDS=True
  tail -8 $M/layers.log; head -12 $M/trace.log | cut -c1-160
}
# the same-bits GPU tests' log (t_stg): failures, summaries, the compared bits
same_bits_summary() { grep -hE "^(FAILED|ERROR)|passed|failed|the same bits|Error" $M/t_stg.log \
  | tail -14 | cut -c1-230; }
stg_ab() {
  # s43: the operands kernel's P, w (and a 16-bit u) through shared memory in 16-byte row
  # pieces (chunk_prep.STAGED_STORES, +stg); s44: its v tile waited for only before the
  # w, u products (chunk_prep.LATE_V, +latev), its registers for 2 CTAs an SM
  # (chunk_prep.CTAS_PER_SM, +prep2): the op's forward A/B with and without u in
  # bfloat16 beside tuned FLA (O_TOKENS "auto", s43's default), their GPU tests (the same
  # bits), the pipelined kernel under Nsight Compute
  # (+prep2: the operands kernel's registers capped for 2 CTAs an SM instead of 3; +pipe2:
  # it persistent and pipelined, 2 CTAs an SM - chunk_prep.PIPELINED)
  step 190 fwd python -m benchmarks.run fwd \
    --impl cutedsl,cutedsl+pipe2,cutedsl+latev,cutedsl+stg+latev,cutedsl+prep2,cutedsl+pipe2+stg,cutedsl+stg+u16f+latev,cutedsl+pipe2+stg+u16f,fla \
    --shapes "8,4096,16,2;8,4096,16,1;2,16384,16,2;8,4096,16,3" --deadline 175 --out $M/fwd
  rows $M/fwd.log
  step 160 t_stg $P tests/test_cutedsl_gpu.py -k "staged_stores or late_v or pipelined_same"
  same_bits_summary
  # (the pipelined kernel: where a 2-CTA kernel's issue slots and bandwidth stand)
  step 60 ncu ncu --clock-control none --target-processes all -k regex:"ChunkPrep" \
    --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section SchedulerStats --section Occupancy --section SourceCounters \
    python -m benchmarks.run fwd --impl cutedsl+pipe2+stg --shapes 8,4096,16,2 \
    --no-check --iters 1 --reps 1 --out /tmp/ncub
  grep -vE "^==PROF==|^\[" $M/ncu.log | grep -E "ChunkPrep|Duration|Throughput|excessive|Issued|Achieved Occ|ERR|rror" \
    | cut -c1-180 | head -30
}
# mode 4's rest group for the call's time left (when that is worth a pytest start)
rest_in_what_is_left() {
  [ "$(left)" -gt 100 ] || return 0
  JOB_S=$(( $(left) - 15 )); el "rest ($JOB_S s)"
  job rest $P tests/test_cutedsl_gpu.py -k "$REST_K and not staged_stores and not late_v and not pipelined_same"
  wait; results rest
}
ncu_backward() {
  # s43: where fwd+bwd's kernels stand (Nsight Compute, one launch each at (8, 4096, 16,
  # 2)): the operands kernel with X, the reverse walk, the local-gradient kernel - DRAM
  # and issue-slot use, occupancy and its limit, stall reasons, excess sectors
  step 120 ncu_fb ncu --clock-control none --target-processes all \
    -k regex:"ChunkPrep|ChunkBwdDh|ChunkGrad" --launch-count 3 --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
    python -m benchmarks.run fwdbwd --impl cutedsl --shapes 8,4096,16,2 --no-check \
    --iters 1 --reps 1 --out /tmp/ncub
  grep -vE "^==PROF==|^\[" $M/ncu_fb.log | grep -E "^  [a-z_]*kernel|Duration|DRAM Throughput|Registers Per|Dynamic Shared|Achieved Occupancy|Block Limit (Reg|Shared)|Issued Warp|excessive|stalled|ERR|rror" | cut -c1-170 | head -60
}
case "${1:-2}" in
2)
  step 420 op python -m benchmarks.run fwdbwd --impl cutedsl,fla --shapes main --deadline 360 --out $M/op
  rows $M/op.log ;;
3)
  # the split's GPU tests (the two-vmap split of s27, not run on the GPU before s28-1),
  # then issue 20's long rows fwd + fwd+bwd beside tuned FLA ("auto": split forward,
  # unsplit training)
  step 120 split_test $P tests/test_cutedsl_gpu.py -k "intra_cp_split or cp_cutedsl_equals"
  step 170 long8 python -m benchmarks.run fwdbwd --impl cutedsl-cpauto,fla \
    --shapes "1,131072,8,2" --no-check --deadline 140 --out $M/long8
  step 210 long16 python -m benchmarks.run fwdbwd --impl cutedsl-cpauto,fla \
    --shapes "1,262144,16,1" --no-check --deadline 180 --out $M/long16
  grep -hE "^(FAILED|ERROR|PASSED)|passed|failed" $M/split_test.log | tail -8
  rows $M/long*.log; grep -h NOTE $M/long*.log ;;
4)
  suite ;;
5)
  # s27-2/3 (H100): "auto" picked S within 1% of the best at both shapes (S = 4 at 16
  # heads, 8 at 8); rerun after a kernel or rule change
  step ${SWEEP_S:-300} sweep python -m benchmarks.run fwd \
    --impl cutedsl,cutedsl-cp2,cutedsl-cp4,cutedsl-cp8,fla --no-check \
    --shapes "1,65536,16,2;1,131072,8,2" --deadline $(( ${SWEEP_S:-300} - 20 )) --out $M/sweep
  rows $M/sweep.log ;;
6)
  # s28 (NOT run: no device after s28-2): the recursion walks' operands one chunk ahead
  # (opt-in chunk_forward.PIPELINE; +pipe = "auto": on for launches of <= one CTA an SM):
  # its GPU tests, then the long rows with it (cutedsl+pipe, and cutedsl-cp2+pipe, whose
  # V-column walks have 128 CTAs at 8 heads) and without, beside "auto" and tuned FLA,
  # forward and fwd+bwd. BUILD_ONLY=bfloat16 halves the build (the stage-2 variants
  # compile when traced). Turn "auto" on by default if it pays and its test passes.
  step 170 pipe_test $P tests/test_cutedsl_gpu.py -k "pipelined_walk or intra_cp_split"
  L="1,65536,16,2;1,131072,8,2"
  step 200 pipe_fwd python -m benchmarks.run fwd \
    --impl cutedsl,cutedsl+pipe,cutedsl-cpauto,cutedsl-cp2+pipe,fla --no-check \
    --shapes "$L" --deadline 180 --out $M/pipe_fwd
  step 200 pipe_fwdbwd python -m benchmarks.run fwdbwd --impl cutedsl,cutedsl+pipe,fla --no-check \
    --shapes "$L" --deadline 180 --out $M/pipe_fwdbwd
  grep -hE "^(FAILED|ERROR|PASSED)|passed|failed" $M/pipe_test.log | tail -14
  rows $M/pipe_fwd.log $M/pipe_fwdbwd.log ;;
7)
  # s28 (NOT run): head groups (gdp_jax.heads) - their GPU test, then issue 20's memory
  # goal: one row of 2**20 tokens, n = 2, 16 heads fwd + fwd+bwd (8 head groups of 2;
  # recompute_chunk_num 0 and 3) beside tuned FLA, on the H200 (141 GB)
  step 150 groups_test $P tests/test_cutedsl_gpu.py -k "head_groups"
  step 400 million python -m benchmarks.run fwdbwd --impl cutedsl,cutedsl-n3,fla --no-check \
    --shapes "1,1048576,16,2" --deadline 380 --out $M/million
  grep -hE "^(FAILED|ERROR|PASSED)|passed|failed" $M/groups_test.log | tail -6
  rows $M/million.log; grep -h "NOTE\|rror" $M/million.log | tail -5 ;;
8)
  # s29 (written without a device): pipeline.READOUT_ONLY - qg, P, o on the read-out rows
  # only for n >= 2 (+ro; +allrows: all C rows, today's default). Its GPU test (same bits
  # as all rows, vs float64) with the head-groups test, then the forward beside tuned FLA
  # at the main shapes (with the float64 check) and at one long row under "auto" (the
  # split's summary and apply walks). Turn it on if it pays and the bits match.
  step 230 ro_test $P tests/test_cutedsl_gpu.py -k "readout_only or head_groups"
  step 170 ro_fwd python -m benchmarks.run fwd --impl cutedsl+allrows,cutedsl+ro,fla \
    --shapes main --deadline 150 --out $M/ro_fwd
  step 120 ro_long python -m benchmarks.run fwd \
    --impl cutedsl-cpauto+allrows,cutedsl-cpauto+ro,fla --no-check \
    --shapes "1,65536,16,2" --deadline 100 --out $M/ro_long
  grep -hE "^(FAILED|ERROR|PASSED)|passed|failed|readout only" $M/ro_test.log | tail -16
  rows $M/ro_fwd.log $M/ro_long.log ;;
9)
  # mode 8 cut to what ~200 s of device time after a cold start holds: the bf16 cases of
  # READOUT_ONLY's GPU test, then ours with / without it at one main shape (no FLA)
  step 150 ro_test $P tests/test_cutedsl_gpu.py -k "readout_only and bfloat16"
  step 90 ro_ab python -m benchmarks.run fwd --impl cutedsl+allrows,cutedsl+ro --no-check \
    --shapes "8,4096,16,2" --deadline 80 --out $M/ro_ab
  grep -hE "^(FAILED|ERROR|PASSED)|passed|failed|readout only" $M/ro_test.log | tail -12
  rows $M/ro_ab.log ;;
10)
  # s30: modes 8 and 6 in one call (what a session whose device starts are mostly refused
  # can afford): the GPU tests of READOUT_ONLY, PIPELINE, head groups and the split in one
  # process, then the forward with / without the read-out rows beside tuned FLA at the
  # main shapes (float64 check on), then one long row with the read-out rows and the
  # pipelined walks ("auto"'s split; the unsplit pipelined walk)
  step 190 opt_test $P tests/test_cutedsl_gpu.py \
    -k "readout_only or pipelined_walk or head_groups or intra_cp_split"
  step 150 ro_fwd python -m benchmarks.run fwd --impl cutedsl+allrows,cutedsl+ro,fla \
    --shapes main --deadline 130 --out $M/ro_fwd
  step 130 long python -m benchmarks.run fwd \
    --impl cutedsl-cpauto+allrows,cutedsl-cpauto+ro,cutedsl-cpauto+ro+pipe,cutedsl+pipe,fla \
    --no-check --shapes "1,65536,16,2" --deadline 110 --out $M/long
  grep -hE "^(FAILED|ERROR|PASSED)|passed|failed" $M/opt_test.log | tail -16 | cut -c1-200
  rows $M/ro_fwd.log $M/long.log; grep -h NOTE $M/long.log ;;
11)
  # s30: PAIR_TILES (a walk CTA of two 4-warp groups on two value tiles, one copy of the
  # shared operands; forward and reverse walks): its GPU test with the default forward
  # tests (READOUT_ONLY on since s30), then fwd and fwd+bwd with / without it beside
  # tuned FLA at three main shapes, then one long row ("auto"'s split with / without
  # it; the unsplit walk with / without PIPELINE)
  step 200 pair_test $P tests/test_cutedsl_gpu.py -k "pair_tiles or forward_matches or packed_matches"
  step 230 pair_ab python -m benchmarks.run fwdbwd --impl cutedsl,cutedsl+pair,fla \
    --shapes "8,4096,16,2;8,4096,16,1;2,16384,16,2" --deadline 210 --out $M/pair_ab
  step 120 long python -m benchmarks.run fwd \
    --impl cutedsl-cpauto,cutedsl-cpauto+pair,cutedsl,cutedsl+pipe --no-check \
    --shapes "1,65536,16,2" --deadline 100 --out $M/long
  grep -hE "^(FAILED|ERROR|PASSED)|passed|failed" $M/pair_test.log | tail -20 | cut -c1-200
  grep -h "pair tiles" $M/pair_test.log | cut -c1-250
  rows $M/pair_ab.log $M/long.log; grep -h NOTE $M/long.log ;;
12)
  # s30 (written without a device after s30-2): READOUT_ONLY_GRAD (the differentiated
  # forward on the read-out rows too) - its GPU test, then fwd+bwd with / without it
  # beside tuned FLA at the main shapes (the check vs float64 on)
  step 200 rog_test $P tests/test_cutedsl_gpu.py -k "readout_only_grad"
  step 330 rog_ab python -m benchmarks.run fwdbwd --impl cutedsl,cutedsl+rog,fla \
    --shapes main --deadline 310 --out $M/rog_ab
  grep -hE "^(FAILED|ERROR|PASSED)|passed|failed" $M/rog_test.log | tail -8 | cut -c1-200
  grep -h "readout only grad" $M/rog_test.log | cut -c1-250
  rows $M/rog_ab.log ;;
13)
  # mode 11 cut to what ~300 s of device time holds (s30): ours with / without PAIR_TILES
  # at one main shape, fwd and fwd+bwd (no FLA), then its GPU test's bf16 cases
  step 100 pair_ab python -m benchmarks.run fwdbwd --impl cutedsl,cutedsl+pair --no-check \
    --shapes "8,4096,16,2" --deadline 90 --out $M/pair_ab
  step 170 pair_test $P tests/test_cutedsl_gpu.py -k "pair_tiles and bfloat16"
  rows $M/pair_ab.log
  grep -hE "^(FAILED|ERROR|PASSED)|passed|failed" $M/pair_test.log | tail -8 | cut -c1-200
  grep -h "pair tiles" $M/pair_test.log | cut -c1-250 ;;
14)
  # modes 11 and 12 in one call (s30's two opt-ins, for a session with one device call):
  # their GPU tests' bf16 cases, then fwd and fwd+bwd with each and both beside tuned FLA
  # at two main shapes, then the long row with / without PAIR_TILES under "auto"
  step 200 opt_test $P tests/test_cutedsl_gpu.py -k "(pair_tiles or readout_only_grad) and bfloat16"
  step 230 ab python -m benchmarks.run fwdbwd \
    --impl cutedsl,cutedsl+pair,cutedsl+rog,cutedsl+pair+rog,fla \
    --shapes "8,4096,16,2;8,4096,16,3" --deadline 210 --out $M/ab
  step 100 long python -m benchmarks.run fwd --impl cutedsl-cpauto,cutedsl-cpauto+pair \
    --no-check --shapes "1,65536,16,2" --deadline 80 --out $M/long
  grep -hE "^(FAILED|ERROR|PASSED)|passed|failed" $M/opt_test.log | tail -10 | cut -c1-200
  grep -hE "pair tiles|readout only grad" $M/opt_test.log | cut -c1-250
  rows $M/ab.log $M/long.log ;;
15)
  # s31: the three opt-ins no GPU has run yet (s30 wrote them with its device starts
  # refused): their GPU tests' bf16 cases, then fwd+bwd with each, the read-out pair
  # (+rog+rob) and all three beside tuned FLA at two main shapes (float64 check on)
  step 230 opt_test $P tests/test_cutedsl_gpu.py \
    -k "(pair_tiles or readout_only_grad or readout_only_bwd) and bfloat16"
  step 300 ab python -m benchmarks.run fwdbwd \
    --impl cutedsl,fla,cutedsl+rog+rob,cutedsl+rog,cutedsl+pair,cutedsl+pair+rog+rob \
    --shapes "8,4096,16,2;8,4096,16,3" --deadline 280 --out $M/ab
  grep -hE "^(FAILED|ERROR|PASSED)|passed|failed" $M/opt_test.log | tail -12 | cut -c1-200
  grep -hE "pair tiles|readout only (grad|bwd)" $M/opt_test.log | cut -c1-250
  rows $M/ab.log ;;
16)
  # s32: the L2 norm's backward inside the local-gradient kernel (pipeline.FUSED_NORM_BWD):
  # its GPU test, fwd+bwd A/B beside tuned FLA at the main shapes (float64 check on)
  step 200 nb_test $P tests/test_cutedsl_gpu.py -k "fused_norm_bwd"
  step 330 ab python -m benchmarks.run fwdbwd --impl cutedsl,fla,cutedsl+nb,cutedsl+rob,cutedsl+nb+rob \
    --shapes main --deadline 300 --out $M/ab
  grep -hE "^(FAILED|ERROR|PASSED)|passed|failed" $M/nb_test.log | tail -6 | cut -c1-200
  grep -hE "fused norm" $M/nb_test.log | cut -c1-250
  rows $M/ab.log ;;
17)
  # s32 (cut for ~150 s of device time): DO_TOKENS's GPU test, then an A/B at the main
  # shape without FLA; run with BUILD_ONLY=bfloat16 (NOT run yet: no device time left in s32)
  step 90 do_test $P tests/test_cutedsl_gpu.py -k "do_tokens_same_bits"
  step 90 ab python -m benchmarks.run fwdbwd --impl cutedsl,cutedsl+dotok \
    --shapes "8,4096,16,2" --no-check --deadline 60 --out $M/ab
  grep -hE "^(FAILED|ERROR|PASSED)|passed|failed" $M/do_test.log | tail -4 | cut -c1-200
  grep -hE "do tokens" $M/do_test.log | cut -c1-250
  rows $M/ab.log ;;
18)
  # s33: DO_TOKENS's GPU test and A/B, TOKEN_BACKWARD re-checked on today's kernels, a
  # trace of today's default fwd+bwd, one long row (fwd, fwd+bwd) beside tuned FLA
  step 90 do_test $P tests/test_cutedsl_gpu.py -k "do_tokens_same_bits"
  step 150 ab python -m benchmarks.run fwdbwd --impl cutedsl,cutedsl+dotok,cutedsl+tb,fla \
    --shapes "8,4096,16,2" --no-check --deadline 120 --out $M/ab
  step 80 trace python -m benchmarks.trace --shape 8,4096,16,2 --impl cutedsl --hlo $M/f.hlo.gz
  [ -f $M/f.hlo.gz ] && python -m benchmarks.hlo_lines $M/trace.log $M/f.hlo.gz > $M/lines.log 2>&1
  step 170 long python -m benchmarks.run fwdbwd --impl cutedsl-cpauto,fla \
    --shapes "1,65536,16,2" --no-check --deadline 140 --out $M/long
  grep -hE "^(FAILED|ERROR|PASSED)|passed|failed" $M/do_test.log | tail -4 | cut -c1-200
  grep -hE "do tokens" $M/do_test.log | cut -c1-250
  head -30 $M/lines.log | cut -c1-160
  rows $M/ab.log $M/long.log ;;
19)
  # s33: TOKEN_BACKWARD with the read-out rows, NORM_IN_KERNELS (GPU tests), then fwd+bwd
  # A/B at the main shapes beside tuned FLA (float64 check on), one trace of +tb+nk
  step 150 nk_test $P tests/test_cutedsl_gpu.py -k "norm_in_kernels or token_backward_same_bits"
  step 250 ab python -m benchmarks.run fwdbwd --impl cutedsl,cutedsl+tb,cutedsl+tb+nk,fla \
    --shapes main --deadline 220 --out $M/ab
  step 60 trace python -m benchmarks.trace --shape 8,4096,16,2 --impl cutedsl \
    --set kernels.pipeline.TOKEN_BACKWARD=True --set kernels.pipeline.NORM_IN_KERNELS=True \
    --hlo $M/f.hlo.gz
  [ -f $M/f.hlo.gz ] && python -m benchmarks.hlo_lines $M/trace.log $M/f.hlo.gz > $M/lines.log 2>&1
  grep -hE "^(FAILED|ERROR|PASSED)|passed|failed" $M/nk_test.log | tail -8 | cut -c1-200
  grep -hE "norm in kernels|token backward" $M/nk_test.log | cut -c1-250
  head -24 $M/lines.log | cut -c1-160
  rows $M/ab.log ;;
20)
  # s33: the in-kernel L2 norm's pieces a step at a time (sm90.l2_normalize_rows): the GPU
  # tests of the kernels that normalise, the forward and fwd+bwd at the main shapes beside
  # tuned FLA (TOKEN_BACKWARD on by default now; +nk), one long row's forward
  step 120 norm_test $P tests/test_cutedsl_gpu.py -k "token_major_operands or norm_in_kernels or readout_only_same_bits"
  step 130 fwd python -m benchmarks.run fwd --impl cutedsl,fla --shapes main --no-check \
    --deadline 110 --out $M/fwd
  step 170 ab python -m benchmarks.run fwdbwd --impl cutedsl,cutedsl+nk,fla --shapes main \
    --no-check --deadline 150 --out $M/ab
  step 90 long python -m benchmarks.run fwd --impl cutedsl-cpauto,fla --shapes "1,65536,16,2" \
    --no-check --deadline 70 --out $M/long
  grep -hE "^(FAILED|ERROR|PASSED)|passed|failed" $M/norm_test.log | tail -12 | cut -c1-200
  rows $M/fwd.log $M/ab.log $M/long.log ;;
30)
  # s35-3 ran this (U16 then on by default; now off, so set here): U16 beside tuned FLA
  # with the check, then the tests that read or write u in the time left (52 s: cut)
  step 90 ab_u16 python -m benchmarks.run fwdbwd --impl cutedsl,fla --set kernels.chunk_prep.U16=True \
    --shapes "8,4096,16,2" --deadline 70 --out $M/ab_u16
  rows $M/ab_u16.log
  u_tests $(( $(left) - 5 )) ;;
29)
  # s35 (prepared; mode 30 ran a cut of it): u in bfloat16 (chunk_prep.U16, off) A/B in
  # separate processes (U16=True compiles its generic variants in the process):
  # fwd+bwd at (8, 4096, 16, 2) beside tuned FLA (the check column: each op's error vs
  # float64), the GPU tests that read or write u, then the forward of n = 3 and one long
  # row beside FLA in the time left (TOTAL)
  step 110 ab_f32 python -m benchmarks.run fwdbwd --impl cutedsl --set kernels.chunk_prep.U16=False \
    --shapes "8,4096,16,2" --deadline 60 --out $M/ab_f32
  step 90 ab_u16 python -m benchmarks.run fwdbwd --impl cutedsl,fla --set kernels.chunk_prep.U16=True \
    --shapes "8,4096,16,2" --deadline 70 --out $M/ab_u16
  rows $M/ab_f32.log $M/ab_u16.log
  t=$(( $(left) - ${TAIL:-100} )); [ $t -lt 60 ] && t=60; u_tests $t
  step 90 fwd_u16 python -m benchmarks.run fwd --impl cutedsl,fla --set kernels.chunk_prep.U16=True \
    --shapes "8,4096,16,3;1,131072,8,2" --deadline 60 --out $M/fwd_u16
  rows $M/fwd_u16.log ;;
33)
  mma_probe ;;
34)
  # s37: the local-gradient kernel with its products as warpgroup MMAs (local_grad.GMMA,
  # off; True and "overlap"): GPU tests, fwd+bwd A/B beside tuned FLA, the kernel alone and
  # its phase probe; then one product's cycles (mma_rate) and mode 32 if time is left
  gmma_ab
  step 60 mma64 python -m benchmarks.mma_rate --kd 64 --n 128 --reps 1,4,8 --ctas 132
  grep -hE "cycles|Error|error:" $M/mma64.log | cut -c1-200
  layers_and_trace ;;
35)
  gmma_ab ;;
40)
  # s38, NOT run: the float16 wgmma fix (its tests; pass -> drop the float16 step-down in
  # local_grad._mma_kind), "all" with / without overlap (ablate "serial") alone and probed,
  # mma_rate's register-A mode on its fixed operand read
  step 200 t_f16 $P tests/test_cutedsl_gpu.py -k "gmma_float16 or (gradients_match and float16)"
  grep -hE "^(FAILED|ERROR)|passed|failed|Error" $M/t_f16.log | tail -12 | cut -c1-250
  step 120 lg python -m benchmarks.prep_probe --local-grad --skip-prep-probe --bv "" \
    --shape 8,4096,16,2 --lg-variants "gmmaa;gmmaa,serial" --json $M/lg.json
  grep -hE "local grad" $M/lg.log | cut -c1-200
  step 60 mma64 python -m benchmarks.mma_rate --kd 64 --n 128 --reps 1,8 --ctas 132
  grep -hE "cycles|Error|error:" $M/mma64.log | cut -c1-200 ;;
41)
  # s38-s39, NOT run: the walks' products as warpgroup MMAs (chunk_forward.GMMA +wg,
  # state_grad.GMMA +wgb): fwd+bwd A/B beside tuned FLA, both walks alone, their GPU test
  # (both walks), one long row's forward
  step 150 wg python -m benchmarks.run fwdbwd --impl cutedsl,cutedsl+wg,cutedsl+wg+wgb,fla \
    --shapes "8,4096,16,2;2,16384,16,2" --deadline 130 --out $M/wg
  rows $M/wg.log
  step 70 walks python -m benchmarks.prep_probe --skip-prep-probe --bv 64,16 \
    --shape 8,4096,16,2 --json $M/walks.json
  grep -hE "s\] (fwd|rev)|Error" $M/walks.log | cut -c1-200
  step 230 t_wg $P tests/test_cutedsl_gpu.py -k "walk_gmma"
  grep -hE "^(FAILED|ERROR)|passed|failed|forward|Error" $M/t_wg.log | tail -24 | cut -c1-250
  step 80 wglong python -m benchmarks.run fwd --impl cutedsl-cpauto,cutedsl-cpauto+wg,fla \
    --shapes "1,65536,16,2" --deadline 70 --out $M/wglong
  rows $M/wglong.log ;;
43)
  # s39: the walks on warpgroup MMAs by default (float16's local gradients too): the main
  # table beside the walks on warp MMAs (+mmaf+mmab) and tuned FLA, then mode 4's GPU test
  # groups in five processes for what time is left
  step 200 op python -m benchmarks.run fwdbwd --impl cutedsl,cutedsl+mmaf+mmab,fla --shapes main \
    --deadline 180 --out $M/op
  rows $M/op.log
  SUITE_S=$(( $(left) - 15 )) suite ;;
45)
  # s39, NOT run: the operands kernel's products as warpgroup MMAs (chunk_prep.GMMA, +wgp)
  # and the forward walk's read-out rows' o products too (chunk_forward.GMMA="all", +wga):
  # fwd+bwd A/B beside tuned FLA, then their GPU tests and the walks'
  step 190 wgp python -m benchmarks.run fwdbwd \
    --impl cutedsl,cutedsl+wgp,cutedsl+wga,cutedsl+wga+wgp,fla \
    --shapes "8,4096,16,2;8,4096,16,1;2,16384,16,2" --deadline 170 --out $M/wgp
  rows $M/wgp.log
  step 260 t_wgp $P tests/test_cutedsl_gpu.py -k "operands_gmma or walk_gmma"
  grep -hE "^(FAILED|ERROR|PASSED)|passed|failed|Error" $M/t_wgp.log | tail -14 | cut -c1-250 ;;
54)
  stg_ab ;;
55)
  ncu_backward ;;
56)
  # mode 54, then mode 4's rest group with what time is left (the next session's first
  # call; mode 55's ncu of the backward moved to mode 57)
  stg_ab
  rest_in_what_is_left ;;
58)
  # s45: modes 56 and 57 cut to one call (device starts were scarce): the forward A/B of
  # the operands-kernel opt-ins beside tuned FLA at the main shapes, the same-bits GPU tests
  # of LATE_V and PIPELINED, fwd+bwd and one long row with +pipe2, then the rest group
  step 175 fwd python -m benchmarks.run fwd \
    --impl cutedsl,cutedsl+pipe2,cutedsl+pipe2+stg,cutedsl+pipe2+stg+u16f,cutedsl+latev,cutedsl+prep2,fla \
    --shapes "8,4096,16,2;8,4096,16,1;2,16384,16,2;8,4096,16,3" --deadline 165 --out $M/fwd
  rows $M/fwd.log
  step 130 t_stg $P tests/test_cutedsl_gpu.py -k "late_v or pipelined_same"
  same_bits_summary
  step 110 fb python -m benchmarks.run fwdbwd \
    --impl cutedsl,cutedsl+pipe2,cutedsl-cpauto,cutedsl-cpauto+pipe2,fla \
    --shapes "8,4096,16,2;1,65536,16,2" --no-check --deadline 100 --out $M/fb
  rows $M/fb.log
  rest_in_what_is_left ;;
59)
  # mode 58 cut to ~220 s (no prebuild): the pipelined operands kernel's forward A/B beside
  # tuned FLA at two main shapes, then its same-bits GPU test
  step 120 fwd python -m benchmarks.run fwd --impl cutedsl,cutedsl+pipe2,cutedsl+pipe2+stg,fla \
    --shapes "8,4096,16,2;8,4096,16,1" --deadline 110 --out $M/fwd
  rows $M/fwd.log
  step 90 t_stg $P tests/test_cutedsl_gpu.py -k "pipelined_same"
  same_bits_summary ;;
57)
  # s44: the operands kernel's phases (SM cycles a CTA, the probe of the op's forward
  # variant) on the default, +prep2 (2 CTAs an SM, ~186 registers) and +pipe2
  # (persistent, pipelined: where do its cycles go?), after a fwd+bwd and long-row A/B of
  # +pipe2; then mode 55 (Nsight Compute on fwd+bwd's kernels)
  probe() { step 90 $1 python -m benchmarks.prep_probe --tokens --bv "" \
    --shape 8,4096,16,2 --json $M/$1.json "${@:2}"
    grep -hE "s\] (prep tok|probe tok)|  probe tokens l2norm=1 readout|Error" $M/$1.log \
      | cut -c1-160; }
  # first fwd+bwd (its operands pass with X runs the same kernel) and one long row
  # (intra_cp "auto": the split forward) with the pipelined kernel beside tuned FLA
  step 150 fb python -m benchmarks.run fwdbwd \
    --impl cutedsl,cutedsl+pipe2,cutedsl-cpauto,cutedsl-cpauto+pipe2,fla \
    --shapes "8,4096,16,2;1,65536,16,2" --no-check --deadline 135 --out $M/fb
  rows $M/fb.log
  probe probe_def
  probe probe_prep2 --set kernels.chunk_prep.CTAS_PER_SM=2
  probe probe_pipe2 --set kernels.chunk_prep.PIPELINED=True
  ncu_backward
  rest_in_what_is_left ;;
53)
  # s43: where the operands kernel's and the walk's cycles go. The phase probe of the op's
  # forward variant (token-major, read-out rows, gram norm, wgmma), the kernels alone; then
  # Nsight Compute (counters: works on the H100's Firecracker runtime, not on gVisor) on
  # one launch of each forward kernel: stall reasons, occupancy, memory throughput;
  # a trace of the default forward; then mode 4's rest group
  step 100 probe python -m benchmarks.prep_probe --tokens --bv 64 --shape 8,4096,16,2 \
    --json $M/probe.json
  grep -hE "s\] (prep tok|probe tok|fwd BV=64 split=0 wgmma)|  probe tokens l2norm=1 readout|Error" \
    $M/probe.log | cut -c1-160
  step 150 ncu ncu --clock-control none --target-processes all \
    -k regex:"ChunkPrep|ChunkFwd" --launch-count 2 --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
    python -m benchmarks.run fwd --impl cutedsl --shapes 8,4096,16,2 --no-check --iters 1 \
    --reps 1 --out /tmp/ncub
  grep -vE "^==PROF==|^\[" $M/ncu.log | grep -E "ChunkPrep|ChunkFwd|Duration|Throughput|Registers|Shared Memory Config|Achieved Occupancy|Theoretical Occupancy|Warp Cycles|Stall|stall|Issued Ipc|No Eligible|ERR|rror" | cut -c1-180 | head -80
  step 60 trace_fwd python -m benchmarks.trace --shape 8,4096,16,2 --impl cutedsl --mode fwd
  head -14 $M/trace_fwd.log | cut -c1-160
  rest_in_what_is_left ;;
49)
  # s41: where the bytes go. The operands kernel and the forward walk alone (token-major,
  # read-out rows: the op's forward; BV = 64) on s40's defaults and with u in bfloat16
  # (chunk_prep.U16: 16 KB less a chunk-head written and read) - if the operands kernel's
  # time falls with its bytes it is bandwidth-bound and the next byte levers pay; then
  # the op's fwd+bwd A/B (+u16) beside tuned FLA, a trace of the default forward, one long
  # row on s40's defaults beside tuned FLA
  probe() { step 80 $1 python -m benchmarks.prep_probe --tokens --skip-prep-probe --bv 64 \
    --shape 8,4096,16,2 --json $M/$1.json "${@:2}"
    grep -hE "s\] (prep tok|probe|  probe tok|fwd BV=64 split=0 wgmma)|Error" $M/$1.log | cut -c1-160; }
  probe probe_f32u
  probe probe_u16 --set kernels.chunk_prep.U16=True
  step 150 u16 python -m benchmarks.run fwdbwd --impl cutedsl,cutedsl+u16,fla \
    --shapes "8,4096,16,2;8,4096,16,1;2,16384,16,2" --deadline 140 --out $M/u16
  rows $M/u16.log
  step 70 trace_fwd python -m benchmarks.trace --shape 8,4096,16,2 --impl cutedsl --mode fwd
  head -14 $M/trace_fwd.log | cut -c1-160
  step 100 long python -m benchmarks.run fwdbwd --impl cutedsl-cpauto,fla \
    --shapes "1,65536,16,2" --deadline 90 --out $M/long
  rows $M/long.log ;;
47)
  # s40: k's norms from K K^T's diagonal (chunk_prep.GRAM_NORM, +gram): fwd+bwd A/B beside
  # tuned FLA, then its GPU test beside mode 4's five test groups (s40's defaults), six
  # pytest processes at once for the time left
  step 100 gram python -m benchmarks.run fwdbwd --impl cutedsl,cutedsl+gram,fla \
    --shapes "8,4096,16,2;2,16384,16,2" --deadline 85 --out $M/gram
  rows $M/gram.log
  F=tests/test_cutedsl_gpu.py; t=$(( $(left) - 10 )); el "tests ($t s)"
  JOB_S=$t
  job t_gram $P $F -k "gram_norm"
  suite_jobs " and not gram_norm"
  wait
  grep -hE "forward (o|final)|vs normalise-first\]|vs float64: gram" $M/t_gram.log | cut -c1-230 | head -40
  results t_gram grad1 grad2 fwd rest prep ;;
46)
  # s40: the operands kernel's inverse on 16-byte shared loads - the kernel alone and its
  # probe on this tree, then on s39's kernel source (.ab/chunk_prep_sm90_s39.py: carry
  # ".ab"; a source other than the prebuilt objects' compiles when traced), then the main
  # table on s40's defaults beside s39's operands kernel and walk (+mmap+wg) and tuned FLA,
  # then the operands kernel's GPU tests in the time left
  probe() { step 110 $1 python -m benchmarks.prep_probe --tokens --bv "" --shape 8,4096,16,2 \
    --json $M/$1.json
    grep -hE "s\] (prep|probe|  probe)|CTA latency|Error" $M/$1.log | cut -c1-160; }
  probe probe_s40
  if [ -f .ab/chunk_prep_sm90_s39.py ]; then
    cp gdp_jax/kernels/chunk_prep_sm90.py /tmp/s40.py
    cp .ab/chunk_prep_sm90_s39.py gdp_jax/kernels/chunk_prep_sm90.py
    probe probe_s39
    cp /tmp/s40.py gdp_jax/kernels/chunk_prep_sm90.py
  fi
  step 200 op python -m benchmarks.run fwdbwd --impl cutedsl,cutedsl+mmap+wg,fla --shapes main \
    --deadline 180 --out $M/op
  rows $M/op.log
  t=$(( $(left) - 10 )); el "tests ($t s)"
  JOB_S=$t
  job t_prep $P tests/test_chunk_prep_gpu.py
  job t_ops $P tests/test_cutedsl_gpu.py -k "operands or inverse_kernel or forward_matches"
  wait
  results t_prep t_ops ;;
44)
  # s39, NOT run: where the time goes on s39's defaults at (8, 4096, 16, 2) - every kernel
  # alone (the operands kernel's variants and probe, both walks, the local gradients and
  # their probe), then traces of the op's forward and fwd+bwd
  step 130 probe python -m benchmarks.prep_probe --tokens --local-grad --bv 64,16 \
    --shape 8,4096,16,2 --json $M/probe.json
  grep -hE "s\] (prep|probe|fwd|rev|local grad)|cycles \(|CTA latency|Error" $M/probe.log | cut -c1-200
  step 90 trace_fwd python -m benchmarks.trace --shape 8,4096,16,2 --impl cutedsl --mode fwd
  head -14 $M/trace_fwd.log | cut -c1-160
  step 90 trace python -m benchmarks.trace --shape 8,4096,16,2 --impl cutedsl
  head -16 $M/trace.log | cut -c1-160
  # one long row's forward (issue 20): the split's operands, summary and apply walks, fold
  step 80 trace_long python -m benchmarks.trace --shape 1,65536,16,2 --impl cutedsl-cpauto \
    --mode fwd
  head -16 $M/trace_long.log | cut -c1-160 ;;
39)
  step 215 op python -m benchmarks.run fwdbwd --impl cutedsl,cutedsl+mma,fla --shapes main \
    --deadline 195 --out $M/op
  rows $M/op.log ;;
38)
  # s38: local_grad.GMMA = "all" the default - the gradient GPU tests (mode 4's grad1, grad2
  # and rest groups, the wgmma A/B test apart) in four pytest processes at once, then fwd+bwd
  # at the main shapes beside the warp-MMA kernel (+mma) and tuned FLA
  F=tests/test_cutedsl_gpu.py; t=$(( $(left) - 230 )); el "tests ($t s)"
  JOB_S=$t
  job grad1 $P $F -k "fused_ddo or token_major_gradients or local_grad_kernel_matches or packed_gradients"
  job grad2 $P $F -k "gradients_match and not token_major and not packed and not gmma"
  job gmma $P $F -k "gmma_gradients_match"
  job rest $P $F -k "$REST_K"
  wait; el "tests done"
  results grad1 grad2 gmma rest
  step 215 op python -m benchmarks.run fwdbwd --impl cutedsl,cutedsl+mma,fla --shapes main \
    --deadline 195 --out $M/op
  rows $M/op.log ;;
37)
  # s37, minimal (~200 s of device time): fwd+bwd of the default beside GMMA "all" (its check
  # column: o and the gradients vs float64), per-shape kernels (NO_BUILD=1), no FLA
  step 190 gm python -m benchmarks.run fwdbwd --impl cutedsl,cutedsl+gmmaa \
    --shapes "8,4096,16,2" --deadline 150 --baseline cutedsl --out $M/gm
  rows $M/gm.log ;;
36)
  # s37, short (little device time left): fwd+bwd A/B of GMMA True and "all" beside tuned
  # FLA (its check column: o and the gradients vs float64), then their op-level GPU tests
  step 200 gm python -m benchmarks.run fwdbwd --impl cutedsl,cutedsl+gmma,cutedsl+gmmaa,fla \
    --shapes "8,4096,16,2" --deadline 180 --out $M/gm
  rows $M/gm.log
  step 200 t_gmma $P tests/test_cutedsl_gpu.py -k "gmma_gradients_match and not overlap"
  grep -hE "^(FAILED|ERROR)|passed|failed|vs float64|vs warp|Error" $M/t_gmma.log | tail -30 | cut -c1-250 ;;
32)
  layers_and_trace ;;
31)
  # s36: SAVE_OPERANDS on the token-major path (the differentiated forward's operands
  # kernel writes X too, the backward reuses every operand: one operands pass fewer, ~90 KB
  # more kept a (chunk, head)): its GPU test, then fwd+bwd beside the default and tuned FLA
  # (time, peak, kept) at three shapes
  step 150 t_save $P tests/test_cutedsl_gpu.py -k "save_operands_same_bits"
  grep -hE "^(FAILED|ERROR)|passed|failed|save operands" $M/t_save.log | tail -8 | cut -c1-250
  step 330 save python -m benchmarks.run fwdbwd --impl cutedsl,cutedsl+save,fla \
    --shapes "8,4096,16,2;8,4096,16,3;2,16384,16,2" --deadline 300 --out $M/save
  rows $M/save.log ;;
28)
  # s34 (prepared, NOT run): sm90.OFFSETS32 - the shape-generic (prebuilt) local-gradient
  # and operands kernels with 32-bit strides (CPU compile: 6-7 KB less code each, most of
  # the gap to the per-shape objects, which were ~3.5% faster in s34). The op on prebuilt
  # objects without it (the script's build), then rebuilt with it: the kernels' GPU tests
  # on the prebuilt objects and the op again beside tuned FLA. Turn it on if the tests pass
  # and the time drops.
  step 90 op_off python -m benchmarks.run fwdbwd --impl cutedsl --no-check \
    --shapes "8,4096,16,2" --deadline 70 --out $M/op_off
  sed -i "s/^OFFSETS32 = False/OFFSETS32 = True/" gdp_jax/kernels/sm90.py
  step 100 build_on python ffi/build.py --jobs 15 --only bfloat16
  F=tests/test_cutedsl_gpu.py
  ( timeout 170 $P $F -k "local_grad_kernel_matches or token_major_gradients or norm_in_kernels_matches or gradients_match" > $M/t_lg.log 2>&1 ) &
  ( timeout 170 $P tests/test_chunk_prep_gpu.py $F -k "operands_match_xla or inverse_output or nonfinite_rows or token_major_operands or forward_matches" > $M/t_prep.log 2>&1 ) &
  wait
  for f in t_lg t_prep; do grep -hE "^(FAILED|ERROR)|passed|failed" $M/$f.log | tail -5 | cut -c1-250; done
  step 150 op_on python -m benchmarks.run fwdbwd --impl cutedsl,fla \
    --shapes "8,4096,16,2;8,4096,16,3" --deadline 130 --out $M/op_on
  rows $M/op_off.log $M/op_on.log ;;
27)
  # s34 (prepared, NOT run: no device time left): how fast one SM fills its shared memory -
  # cp.async by every thread (the kernels' loads today) vs bulk copies by one thread (the
  # TMA unit) - at one 192 KB CTA an SM (the local-gradient kernel) and three 64 KB ones
  # (the operands kernel), 4 / one wave / many waves of CTAs; then mode 26's trace (run
  # this mode with NO_BUILD=1 for it). If bulk copies fill an SM several times faster,
  # the kernels' first phases (a quarter of the local-gradient kernel) are the lever.
  step 90 rate192 python -m benchmarks.load_rate --kb 192 --ctas 4,132,16896
  step 90 rate64 python -m benchmarks.load_rate --kb 64 --ctas 12,396,16896
  cat $M/rate192.log $M/rate64.log | grep -E "ctas=|Error|rror" | cut -c1-160
  ;&  # falls through to mode 26
26)
  # s34: a trace of the default fwd+bwd at (8, 4096, 16, 2) with per-shape kernels (run it
  # with NO_BUILD=1: no prebuilt objects, so "auto" compiles static ones) - beside mode 22's
  # trace on prebuilt (shape-generic) ones, which kernels lose what (s34: static 8.29-8.39
  # ms, generic 8.57-8.59)
  step 150 trace python -m benchmarks.trace --shape 8,4096,16,2 --impl cutedsl --hlo $M/f.hlo.gz
  [ -f $M/f.hlo.gz ] && python -m benchmarks.hlo_lines $M/trace.log $M/f.hlo.gz > $M/lines.log 2>&1
  head -12 $M/lines.log | cut -c1-160 ;;
23)
  # s34: the GPU tests s33's defaults (TOKEN_BACKWARD, NORM_IN_KERNELS) had not run, then mode 22
  step 170 tests $P tests/test_cutedsl_gpu.py -k "sequence_alone or long_sequence_gradients or backend_resolution_on_sm90 or cp_cutedsl_equals_single_device or intra_cp_split_equals_unsplit or model_grad_inside_shard_map"
  grep -hE "^(FAILED|ERROR)|passed|failed" $M/tests.log | tail -8 | cut -c1-250
  ;&  # falls through to mode 22
22)
  # s33 (prepared for the next session): where the local-gradient kernel's time goes now -
  # alone, chunk tiles vs token-major reads vs the norm inside, and its phase probe; then a
  # trace of today's default fwd+bwd at (8, 4096, 16, 2)
  step 240 lg python -m benchmarks.prep_probe --local-grad --skip-prep-probe --bv "" \
    --shape 8,4096,16,2 --json $M/lg.json
  step 80 trace python -m benchmarks.trace --shape 8,4096,16,2 --impl cutedsl --hlo $M/f.hlo.gz
  [ -f $M/f.hlo.gz ] && python -m benchmarks.hlo_lines $M/trace.log $M/f.hlo.gz > $M/lines.log 2>&1
  grep -hE "local grad|probe" $M/lg.log | cut -c1-200
  head -12 $M/lines.log | cut -c1-160 ;;
esac
