#!/usr/bin/env bash
# Fifteenth session, device call 3 (issue 22): the walks on each chunk's affine map
# (TRANSITION_WALK: Kt^T w, Kt^T u built before the scan, one product per step), with the
# maps in float32 (WIDE_TRANSITIONS, default) and in bf16, against the s15-2 walk
# (TRANSITION_WALK=False, merged reverse step with a 16-bit right-hand side) at the two
# shapes s15-2 did not cover. FLA beside in the first run (same process).
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
run() {  # name, shapes, impls, deadline, extra args
  timeout $(($4 + 20)) python -m benchmarks.run fwdbwd --impl $3 --shapes "$2" --out /tmp/b_$1 \
    --deadline $4 "${@:5}" > $OUT/$1.log 2>&1
  echo "== $1 ${*:5}"; grep -E '^\| [0-9]|check' $OUT/$1.log | cut -c1-200
}
run transition main xla,fla 200
run narrow main xla 120 --set recurrence.WIDE_TRANSITIONS=False
run steps "8,4096,16,2;2,16384,16,2" xla 60 --set recurrence.TRANSITION_WALK=False
