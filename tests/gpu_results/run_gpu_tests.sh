#!/usr/bin/env bash
# GPU tests on the current tree, 7 jobs in parallel; logs under $OUT/tests.
# s16-4 (2026-12-04): every job but the small-T xla one finished within 300 s each with the
# kernels prebuilt first (~35 s); a device call is limited to 600 s in all.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false
( timeout 60 python ffi/build.py --jobs 14 > $OUT/build.log 2>&1 ); tail -1 $OUT/build.log
mkdir -p $OUT/tests
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/tests/gpu.txt
python -c "import jax, jaxlib; print(jax.__version__, jax.devices())" >> $OUT/tests/gpu.txt 2>&1
P="python -m pytest -m gpu -q -rA -p no:cacheprovider --durations=0"
run() { name=$1; shift; ( timeout 480 "$@" > $OUT/tests/$name.log 2>&1; echo "rc=$?" >> $OUT/tests/$name.log ) & }
run cutedsl_fwd $P tests/test_cutedsl_gpu.py -k "forward_matches or packed_matches"
run cutedsl_grad $P tests/test_cutedsl_gpu.py -k "gradients_match"
run cutedsl_rest $P tests/test_cutedsl_gpu.py -k "not forward_matches and not packed_matches and not gradients_match"
run step_smallT_xla $P tests/test_step_gpu.py -k "small_T and xla"
run step_smallT_cutedsl $P tests/test_step_gpu.py -k "small_T and cutedsl"
run step_rest bash -c "$P tests/test_step_gpu.py -k 'not small_T'; python -m gdp_jax check --out $OUT/tests/check"
run robust $P tests/test_robust_gpu.py
wait
for f in $OUT/tests/*.log; do echo "== $f"; grep -E "passed|failed|error|rc=" $f | tail -3; done
