#!/usr/bin/env bash
# Eighth session, device call 3: the local-gradient kernel after the load / loop changes
# (precision, time, op A/B), the benchmark shapes for cutedsl beside fully tuned FLA (one
# process, checks vs float64), the cutedsl GPU gradient tests incl. the kernel's own.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false
python ffi/build.py --jobs 14 --out /tmp/kern > $OUT/build.log 2>&1; tail -1 $OUT/build.log
export GDP_JAX_KERNEL_DIR=/tmp/kern
timeout 150 python -m benchmarks.local_grad --variants "nogates,notail;nomma" \
  --json $OUT/local_grad.json > $OUT/local_grad.log 2>&1
echo "rc $?"; grep -E "^time" $OUT/local_grad.log; tail -9 $OUT/local_grad.log
timeout 250 python -m benchmarks.run fwdbwd --impl cutedsl,fla --shapes main --out $OUT/bench \
  --deadline 200 > $OUT/bench.log 2>&1; grep "^| " $OUT/bench.log | tail -8
timeout 120 python -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_cutedsl_gpu.py \
  -k "local_grad or gradients_match or deterministic or recompute" > $OUT/gputests.log 2>&1
grep -cE "PASSED" $OUT/gputests.log; grep -E "^FAILED|^ERROR|passed|failed" $OUT/gputests.log | tail -6
