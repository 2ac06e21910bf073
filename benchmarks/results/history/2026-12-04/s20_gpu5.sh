#!/usr/bin/env bash
# Twentieth session, device call 5: the operands kernel's gate loop unrolled without
# branches (as the local-gradient kernel's in s20-3); kloop removed. The GPU tests that
# run the operands kernel (forward, gradients) with the step and AOT tests, four jobs;
# then the kernels alone with probes.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
( timeout 90 python ffi/build.py --jobs 14 > $OUT/build.log 2>&1 ); tail -1 $OUT/build.log
P="python -m pytest -m gpu -q -rA -s -p no:cacheprovider"
F=tests/test_cutedsl_gpu.py
run() { name=$1; shift; ( timeout 200 "$@" > $OUT/$name.log 2>&1; echo "rc=$?" >> $OUT/$name.log ) & }
run fwd $P $F -k "forward_matches or token_major_operands or packed_matches"
run grad $P $F -k "gradients_match and not token_major"
run step $P tests/test_step_gpu.py
run aot $P tests/test_aot_gpu.py tests/test_chunk_prep_gpu.py
wait
for f in fwd grad step aot; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed|^rc=" $OUT/$f.log | tail -5 | cut -c1-250; done
timeout 45 python -m benchmarks.prep_probe --shape 8,4096,16,2 --bv "" --tokens \
  --json $OUT/probe.json > $OUT/probe.log 2>&1
echo "== probe rc=$?"; grep -E "ms$|loads|latency" $OUT/probe.log | grep -v "prebuilt" | cut -c12-150
