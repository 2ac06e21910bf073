#!/usr/bin/env bash
# Eighth session, device call 2: where the local-gradient kernel's time goes (ablations:
# no MMAs, no hi/lo split, no gate loops / tail), at (8, 4096, 16, 2).
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 200 python -m benchmarks.local_grad --skip-precision --skip-op \
  --variants "nomma;nosplit;nogates,notail;nomma,nogates,notail" --json $OUT/ablate.json > $OUT/ablate.log 2>&1
echo "rc $?"; grep -E "^time|alone" $OUT/ablate.log
