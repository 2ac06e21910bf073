#!/usr/bin/env bash
# Ninth session, device call 2: the backward's factors on the operands kernel (X output):
# its GPU tests, the benchmark shapes beside fully tuned FLA, where the time goes now, the
# gradient tests.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false
python ffi/build.py --jobs 14 --out /tmp/kern > $OUT/build.log 2>&1; tail -1 $OUT/build.log
export GDP_JAX_KERNEL_DIR=/tmp/kern
timeout 90 python -m pytest -m gpu -q -rA -s -p no:cacheprovider tests/test_chunk_prep_gpu.py \
  -k "inverse or match_xla" > $OUT/gputests_prep.log 2>&1
grep -E "^X |PASSED|FAILED|ERROR|passed|failed" $OUT/gputests_prep.log | tail -9
timeout 240 python -m benchmarks.run fwdbwd --impl cutedsl,fla --shapes main --out $OUT/bench \
  --deadline 200 > $OUT/bench.log 2>&1; grep "^| " $OUT/bench.log | tail -8
timeout 70 python -m benchmarks.trace --shape 8,4096,16,2 --impl cutedsl --top 90 \
  --hlo $OUT/fb.hlo.gz --out /tmp/t1 > $OUT/trace_fb.log 2>&1; head -2 $OUT/trace_fb.log
python -m benchmarks.hlo_lines $OUT/trace_fb.log $OUT/fb.hlo.gz --top 70 > $OUT/lines_fb.log 2>&1
head -30 $OUT/lines_fb.log | cut -c1-150
timeout 100 python -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_cutedsl_gpu.py \
  -k "gradients_match or deterministic or recompute or local_grad" > $OUT/gputests.log 2>&1
grep -cE "PASSED" $OUT/gputests.log; grep -E "^FAILED|^ERROR|passed|failed" $OUT/gputests.log | tail -6
