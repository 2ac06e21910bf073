#!/usr/bin/env bash
# Seventh session, device call 5: the cutedsl GPU gradient tests call 4 did not reach
# (packed, recompute_chunk_num, determinism, long sequence, CP on one GPU, NNX grad in shard_map).
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false
python ffi/build.py --jobs 14 --out /tmp/kern > $OUT/build.log 2>&1; tail -1 $OUT/build.log
export GDP_JAX_KERNEL_DIR=/tmp/kern
timeout 200 python -m pytest -m gpu -v -rA -p no:cacheprovider tests/test_cutedsl_gpu.py \
  -k "packed_gradients or recompute or deterministic or long_sequence_gradients or cp_cutedsl or model_grad" > $OUT/gputests.log 2>&1
grep -E "PASSED|FAILED|ERROR" $OUT/gputests.log | sed 's/.*:://' | cut -c1-90; tail -1 $OUT/gputests.log
