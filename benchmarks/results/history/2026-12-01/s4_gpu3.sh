#!/usr/bin/env bash
# Session 4, GPU call 3: the GPU tests on the landed code (7 jobs in parallel) + the T = 256K xla fwd+bwd fit.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p $OUT/t
P="python -m pytest -m gpu -v -rA -p no:cacheprovider --durations=0"
run() { name=$1; shift; ( timeout 430 "$@" > $OUT/t/$name.log 2>&1; echo "rc=$?" >> $OUT/t/$name.log ) & }
run long python s4_long_xla_256k_s4.py 1,262144,16,2
run cutedsl_fwd $P tests/test_cutedsl_gpu.py -k "forward_matches or packed_matches"
run cutedsl_grad $P tests/test_cutedsl_gpu.py -k "gradients_match"
run cutedsl_rest $P tests/test_cutedsl_gpu.py -k "not forward_matches and not packed_matches and not gradients_match"
run robust $P tests/test_robust_gpu.py
run aot $P -s tests/test_aot_gpu.py
run chunk_prep $P tests/test_chunk_prep_gpu.py
wait
for f in $OUT/t/*.log; do echo "== $f"; grep -E "PASSED|FAILED|ERROR|passed|failed|rc=|grads_finite" $f | grep -v "^tests.*PASSED" | tail -4; grep -c "PASSED" $f; done
grep -h "FAILED" $OUT/t/*.log | head -20
