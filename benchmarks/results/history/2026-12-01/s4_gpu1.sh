#!/usr/bin/env bash
# Session 4, GPU call 1: time the landed code (benchmark runner, stages, CP rank, cold start).
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false GDP_BENCH_COMMIT=ec72b14
mkdir -p $OUT/b
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
el fwdbwd
timeout 330 python -m benchmarks.run fwdbwd --impl xla,cutedsl,fla --shapes main --deadline 260 --out $OUT/b/fwdbwd > $OUT/b/fwdbwd.log 2>&1
el stages
timeout 100 python -m benchmarks.stages --B 8 --T 4096 --H 16 --n 2 --backends xla,cutedsl > $OUT/b/stages.log 2>&1
el cp_rank
for be in cutedsl xla; do timeout 60 python -m benchmarks.cp_rank --backend $be --T 131072 --P 2 --json $OUT/b/cp_rank_$be.json > $OUT/b/cp_rank_$be.log 2>&1; done
el cold
timeout $(( 585 - ($(date +%s) - T0) )) python -m benchmarks.cold_start --build --kernels /tmp/kern > $OUT/b/cold.log 2>&1
el done
tail -30 $OUT/b/fwdbwd.log; tail -25 $OUT/b/stages.log; tail -6 $OUT/b/cp_rank_*.log; tail -12 $OUT/b/cold.log
