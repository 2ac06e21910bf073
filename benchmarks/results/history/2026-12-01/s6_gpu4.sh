#!/usr/bin/env bash
# Sixth session, device call 4: the forward's precision against tuned FLA (the GPU test).
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false
python ffi/build.py --jobs 14 --out /tmp/kern > /dev/null 2>&1
export GDP_JAX_KERNEL_DIR=/tmp/kern
timeout 150 python -m pytest -m gpu -v -rA -s -p no:cacheprovider tests/test_chunk_prep_gpu.py -k fla 2>&1 | grep -vE "^\s*$" | tail -15
