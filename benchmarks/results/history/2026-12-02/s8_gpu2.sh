#!/usr/bin/env bash
# Eighth session, device call 2: the local-gradient kernel with 8 warps (4 x 2) - its
# precision, its time beside the 4-warp version and ablations (no hi/lo split, no MMAs,
# no gate loops / tail), and the cutedsl fwd+bwd with / without it at (8, 4096, 16, 2).
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 400 python -m benchmarks.local_grad \
  --variants "warps4;nosplit;nomma;nogates,notail" --json $OUT/local_grad.json > $OUT/local_grad.log 2>&1
echo "rc $?"; grep -E "^time" $OUT/local_grad.log; tail -12 $OUT/local_grad.log
