#!/usr/bin/env bash
# Session 4, GPU call 2: stages (with cutedsl pieces and the local-grads A/B), kernel trace, AOT test, CP rank.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false GDP_BENCH_COMMIT=ec72b14+stages
mkdir -p $OUT/b
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
el stages
timeout 120 python -m benchmarks.stages --B 8 --T 4096 --H 16 --n 2 --backends xla,cutedsl > $OUT/b/stages.log 2>&1
el trace
timeout 90 python -m benchmarks.trace --shape 8,4096,16,2 --impl cutedsl --top 30 --out /tmp/tr > $OUT/b/trace_cutedsl.log 2>&1
el aot
timeout 220 python -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_aot_gpu.py > $OUT/b/aot_gpu.log 2>&1
el cp_rank
for be in cutedsl xla; do
  left=$(( 585 - ($(date +%s) - T0) )); [ $left -lt 30 ] && break
  tl=$(( left < 140 ? left : 140 ))
  timeout $tl python -m benchmarks.cp_rank --backend $be --T 131072 --P 2 --json $OUT/b/cp_rank_$be.json > $OUT/b/cp_rank_$be.log 2>&1
  el cp_rank $be rc=$?
done
el done
cat $OUT/b/stages.log; grep -v "no prebuilt" $OUT/b/trace_cutedsl.log | head -34; tail -15 $OUT/b/aot_gpu.log; for f in $OUT/b/cp_rank_*.log; do grep -v "no prebuilt" $f | tail -12; done
