#!/usr/bin/env bash
# Seventeenth session, device call 2 (issue 14): the operands kernel at 3 CTAs an SM
# (registers capped at 168) with ballot row flags and row rules - kernels alone
# (benchmarks/prep_probe.py) - and the op's fwd+bwd with the value tile 32 / 64 and the
# hi + lo split on / off (benchmarks/kernel_ab.py).
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
timeout 200 python -m benchmarks.prep_probe --shape 8,4096,16,2 --bv 64 --json $OUT/probe.json \
  > $OUT/probe.log 2>&1
echo "== probe rc=$?"; cut -c1-150 $OUT/probe.log | grep -v Warning | tail -30
timeout 200 python -m benchmarks.kernel_ab --shape 8,4096,16,2 \
  --configs "split=1,bv=32;split=1,bv=64;split=0,bv=64" > $OUT/kernel_ab.log 2>&1
echo "== kernel_ab rc=$?"; grep -v Warning $OUT/kernel_ab.log | tail -12 | cut -c1-200
