#!/usr/bin/env bash
# Seventh session, device call 2: the xla engine's scans with the readout and the
# final/first-chunk states taken out of the loop (working tree) against HEAD e04d087
# (_ab/old, `git archive`), both backends, and the xla engine with smaller segments.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false
python ffi/build.py --jobs 14 --out /tmp/kern > $OUT/build.log 2>&1; tail -1 $OUT/build.log
export GDP_JAX_KERNEL_DIR=/tmp/kern
S="8,4096,16,2"
timeout 230 python -m benchmarks.run fwdbwd --impl xla,cutedsl,fla --shapes $S --out $OUT/new \
  --deadline 200 > $OUT/new.log 2>&1; tail -8 $OUT/new.log
(export PYTHONPATH=$PWD/_ab/old:$PYTHONPATH; timeout 150 python -m benchmarks.run fwdbwd \
  --impl xla,cutedsl --shapes $S --out $OUT/old --deadline 120 --no-check > $OUT/old.log 2>&1)
tail -5 $OUT/old.log
timeout 120 python - > $OUT/seg.log 2>&1 <<'PY'
import gdp_jax.recurrence as r
r.MAX_PROBLEMS, r.SEGMENT_PROBLEMS = 8192, 4096
from benchmarks.run import main
import os
main(["fwdbwd", "--impl", "xla", "--shapes", "8,4096,16,2", "--out", os.environ["OUT"] + "/seg",
      "--deadline", "90"])
PY
tail -5 $OUT/seg.log
