#!/usr/bin/env bash
# Seventeenth session, device call 6 (issue 15, evidence for the next session): the
# backward's chunk-local gradient kernel alone at (8,4096,16,2) and its per-phase clock
# probe (benchmarks/prep_probe.py --local-grad).
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
timeout 200 python -m benchmarks.prep_probe --shape 8,4096,16,2 --bv "" --local-grad \
  --skip-prep-probe --json $OUT/probe_lg.json > $OUT/probe_lg.log 2>&1
echo "== rc=$?"; grep -v Warning $OUT/probe_lg.log | cut -c1-150 | tail -20
