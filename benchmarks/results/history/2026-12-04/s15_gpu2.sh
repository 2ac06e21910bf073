#!/usr/bin/env bash
# Fifteenth session, device call 2 (issue 22): the long shape (2, 16384, 16, 2), 32 problems
# per step, with the two-level walk (MIN_BLOCKED_CHUNKS=256: L = 16 chunks per block) and
# with unroll 16; the merged reverse step with a 16-bit right-hand side at n = 1 and n = 3.
# FLA beside, same process, each run.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
mkdir -p /tmp/tr
run() {  # name, shapes, impls, deadline, extra args
  timeout $(($4 + 20)) python -m benchmarks.run fwdbwd --impl $3 --shapes "$2" --out /tmp/b_$1 \
    --deadline $4 "${@:5}" > $OUT/$1.log 2>&1
  echo "== $1 ${*:5}"; grep -E '^\| [0-9]|check' $OUT/$1.log | cut -c1-200
}
run long_blocked "2,16384,16,2" xla,fla 110 --set recurrence.MIN_BLOCKED_CHUNKS=256
run long_unroll16 "2,16384,16,2" xla 70 --set "recurrence.SCAN_UNROLL={'gpu':16}"
run narrow_rhs "8,4096,16,1;8,4096,16,3" xla,fla 150 --set recurrence.NARROW_REVERSE_RHS=True
ls -la $OUT
