#!/usr/bin/env bash
# Seventeenth session, device call 1 (issue 14): where the cutedsl forward's kernels spend
# their time - each kernel alone at (8,4096,16,2) with the operands kernel's per-phase
# clock probe (benchmarks/prep_probe.py), and a trace of the op's fwd+bwd.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
timeout 260 python -m benchmarks.prep_probe --shape 8,4096,16,2 --json $OUT/probe.json \
  > $OUT/probe.log 2>&1
echo "== probe rc=$?"; cut -c1-150 $OUT/probe.log | grep -v Warning | tail -40
timeout 120 python -m benchmarks.trace --shape 8,4096,16,2 --impl cutedsl --top 30 \
  --out /tmp/t_fb > $OUT/trace_fb.log 2>&1
echo "== trace rc=$?"; head -40 $OUT/trace_fb.log | cut -c1-150
ls -la $OUT
