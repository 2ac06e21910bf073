#!/usr/bin/env bash
# Fifteenth session, device call 4 (issue 22): the final defaults - the walks on each
# chunk's affine map only below 64 problems per step (TRANSITION_WALK={'gpu': 64}, 16-bit
# maps), the merged reverse step with a 16-bit right-hand side elsewhere - beside fully
# tuned FLA in one process at the four benchmark shapes.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
timeout 270 python -m benchmarks.run fwdbwd --impl xla,fla --shapes main --out /tmp/b_main \
  --deadline 250 > $OUT/main.log 2>&1
cp /tmp/b_main/*.md $OUT/main.md 2>/dev/null
grep -E '^\| [0-9]|check' $OUT/main.log | cut -c1-200
