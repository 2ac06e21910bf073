#!/usr/bin/env bash
# Nineteenth session, device call 5 (the warm machine after s19-4, 141 s of device time
# left): the gradient cases s19-4's parallel test job did not finish (its 215 s timeout).
# Killed by its own 125 s timeout after 8 of the 11 cases; output in s19_gpu5_out/.
source .gpu-deps/install.sh; export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1; ls ffi/build/kernels | wc -l; timeout 125 python -m pytest -m gpu -q -s -p no:cacheprovider tests/test_cutedsl_gpu.py -k "gradients_match and not token_major" 2>&1 | grep -E "^\[|passed|failed|FAILED|Error" | cut -c1-200
