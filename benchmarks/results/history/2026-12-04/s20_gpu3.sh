#!/usr/bin/env bash
# Twentieth session, device call 3: local_grad.SPLIT off by default (prebuilt), the gate
# loops of the local-gradient kernel without branches and both kernels' gate exps as
# ex2.approx; "kloop" (the ldmatrix products as dynamic k-loops) timed beside. Every
# cutedsl GPU test and the robust suite (five jobs), then the kernels alone with probes.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
( timeout 90 python ffi/build.py --jobs 14 > $OUT/build.log 2>&1 ); tail -1 $OUT/build.log
P="python -m pytest -m gpu -q -rA -s -p no:cacheprovider"
F=tests/test_cutedsl_gpu.py
run() { name=$1; shift; ( timeout 280 "$@" > $OUT/$name.log 2>&1; echo "rc=$?" >> $OUT/$name.log ) & }
run grad1 $P $F -k "fused_ddo or token_major_gradients or local_grad_kernel_matches or packed_gradients"
run grad2 $P $F -k "gradients_match and not token_major and not packed"
run fwd $P $F -k "forward_matches or token_major_operands or packed_matches or inverse_kernel or long_sequence_state"
run rest $P $F -k "not forward_matches and not packed_matches and not gradients_match and not long_sequence_state and not token_major and not fused_ddo and not local_grad_kernel and not inverse_kernel"
run robust $P tests/test_robust_gpu.py
wait
for f in grad1 grad2 fwd rest robust; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed|^rc=" $OUT/$f.log | tail -5 | cut -c1-250; done
grep -h "^precision" $OUT/grad1.log | cut -c1-330
timeout 130 python -m benchmarks.prep_probe --shape 8,4096,16,2 --bv "" --local-grad --tokens \
  --warps-n 2 --lg-variants kloop --json $OUT/probe.json > $OUT/probe.log 2>&1
echo "== probe rc=$?"; grep -E "ms$|cycles|latency" $OUT/probe.log | grep -v "prebuilt" | cut -c12-150
