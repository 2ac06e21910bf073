#!/usr/bin/env bash
# Nineteenth session, device call 1: where today's cutedsl fwd+bwd spends its time at
# (8,4096,16,2) - trace of the op's fwd+bwd and of its backward alone, mapped to source lines.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
( timeout 80 python ffi/build.py --jobs 14 > $OUT/build.log 2>&1 ); tail -1 $OUT/build.log
mkdir -p /tmp/tr
for m in fwdbwd bwd; do
  timeout 90 python -m benchmarks.trace --shape 8,4096,16,2 --impl cutedsl --mode $m --top 40 \
    --out /tmp/t_$m --hlo /tmp/tr/$m.hlo.gz > $OUT/trace_$m.log 2>&1
  python -m benchmarks.hlo_lines $OUT/trace_$m.log /tmp/tr/$m.hlo.gz --top 40 > $OUT/lines_$m.log 2>&1
  echo "== $m"; head -2 $OUT/trace_$m.log; head -40 $OUT/lines_$m.log | cut -c1-230
done
