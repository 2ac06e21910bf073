#!/usr/bin/env bash
# Seventh session, device call 3: the xla engine's lean scans (working tree: state-only
# scans, no per-chunk flags for batched rows, bf16 checkpoints read as they are) against
# the session's start e04d087 (_ab/old = `git archive e04d087`, run from inside it so its
# own packages are imported), both backends, one process each; then a kernel trace of the
# new xla fwd+bwd with its HLO.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false
python ffi/build.py --jobs 14 --out /tmp/kern > $OUT/build.log 2>&1; tail -1 $OUT/build.log
export GDP_JAX_KERNEL_DIR=/tmp/kern
S="8,4096,16,2"
timeout 230 python -m benchmarks.run fwdbwd --impl xla,cutedsl,fla --shapes $S --out $OUT/new \
  --deadline 200 > $OUT/new.log 2>&1; grep "^| 8" $OUT/new.log
(cd _ab/old && python -c "import gdp_jax, benchmarks; print(gdp_jax.__file__, benchmarks.__file__)" \
  && timeout 150 python -m benchmarks.run fwdbwd --impl xla,cutedsl --shapes $S --out $OUT/old \
  --deadline 120 --no-check) > $OUT/old.log 2>&1
head -1 $OUT/old.log; grep "^| 8" $OUT/old.log
timeout 150 python - > $OUT/nosplit.log 2>&1 <<'PY'
import os
import gdp_jax.chunked as c
c.SPLIT_ROW_SUMS = False        # the variant: dg, dbeta row sums fused as XLA likes
from benchmarks.run import main
main(["fwdbwd", "--impl", "xla,cutedsl", "--shapes", "8,4096,16,2", "--out",
      os.environ["OUT"] + "/nosplit", "--deadline", "120", "--no-check"])
PY
grep "^| 8" $OUT/nosplit.log
timeout 150 python -m benchmarks.trace --shape $S --impl xla --mode fwdbwd --top 120 \
  --out /tmp/trx --hlo $OUT/xla_fwdbwd.hlo.gz > $OUT/trace_xla.log 2>&1; head -30 $OUT/trace_xla.log
