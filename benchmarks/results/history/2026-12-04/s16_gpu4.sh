#!/usr/bin/env bash
# Sixteenth session, device call 4: s16-3's GPU test jobs again after the fix of
# tests/_compile_flags.py (jaxlib 0.11.2 rejected --xla_cpu_use_fusion_emitters, every
# pytest process exited at once with status 1 and no output). 7 parallel jobs, each cut at
# 300 s. test_aot_gpu is left out (it rebuilds every kernel variant itself).
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
( timeout 60 python ffi/build.py --jobs 14 > $OUT/build.log 2>&1 ); tail -1 $OUT/build.log
mkdir -p $OUT/tests
P="python -m pytest -m gpu -q -rA -p no:cacheprovider --durations=5"
run() { name=$1; shift; ( timeout 300 "$@" > $OUT/tests/$name.log 2>&1; echo "rc=$?" >> $OUT/tests/$name.log ) & }
run cutedsl_fwd $P tests/test_cutedsl_gpu.py -k "forward_matches or packed_matches or long_sequence_state"
run cutedsl_grad $P tests/test_cutedsl_gpu.py -k "gradients_match"
run cutedsl_rest $P tests/test_cutedsl_gpu.py -k "not forward_matches and not packed_matches and not gradients_match and not long_sequence_state"
run step_smallT_xla $P tests/test_step_gpu.py -k "small_T and xla"
run step_smallT_cutedsl $P tests/test_step_gpu.py -k "small_T and cutedsl"
run step_rest $P tests/test_step_gpu.py -k "not small_T"
run robust $P tests/test_robust_gpu.py
wait
for f in $OUT/tests/*.log; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed|rc=" $f | tail -6; done
