#!/usr/bin/env bash
# Twelfth session, device call 1 (issue 22): A/B of the xla engine's new switches at three
# benchmark shapes, xla only (FLA's rows at these shapes: s11_gpu1_out, same machine kind):
# the affine-form walks (recurrence.AFFINE_STEPS, default on) against the two-product
# steps, the walks' scan unroll, and the backward's local gradients in blocks of chunks.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false
S="8,4096,16,1;8,4096,16,2;2,16384,16,2"
run() {  # name, timeout, extra args
  local name=$1 t=$2; shift 2
  timeout $t python -m benchmarks.run fwdbwd --impl xla --shapes "$S" --out /tmp/b_$name \
    --deadline $((t - 40)) "$@" > $OUT/$name.log 2>&1
  echo "== $name"; grep '^| [0-9]' $OUT/$name.log | cut -c1-150; cp /tmp/b_$name/*.md $OUT/$name.md 2>/dev/null
}
run affine 130
run affine_u8 100 --no-check --set "recurrence.SCAN_UNROLL={'gpu': 8}"
run affine_u4 90 --no-check --set "recurrence.SCAN_UNROLL={'gpu': 4}"
run affine_lg 100 --no-check --set engine.LOCAL_GRAD_PROBLEMS=4096
run base 100 --no-check --set recurrence.AFFINE_STEPS=False
