#!/usr/bin/env bash
# Twelfth session, device call 2 (issue 22): where the xla engine's time goes, by source
# line (forward and the engine's backward alone, traced with their optimized HLO), the
# scan unroll on the two-product walks, q and k in bf16 (engine.NARROW_QK), and the
# backward's local gradients in blocks ordered by barriers (engine.LOCAL_GRAD_LOOP), and the
# long-row shape s12-1 ran out of time for.
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false
for m in fwd bwd; do
  timeout 75 python -m benchmarks.trace --shape 8,4096,16,2 --impl xla --mode $m --top 30 \
    --out /tmp/t_$m --hlo $OUT/xla_$m.hlo.gz > $OUT/trace_$m.log 2>&1
  python -m benchmarks.hlo_lines $OUT/trace_$m.log $OUT/xla_$m.hlo.gz --by line --top 40 \
    > $OUT/lines_$m.log 2>&1; echo "== $m"; head -3 $OUT/trace_$m.log; tail -42 $OUT/lines_$m.log | cut -c1-200
done
run() {  # name, timeout, shapes, extra args
  local name=$1 t=$2 s=$3; shift 3
  timeout $t python -m benchmarks.run fwdbwd --impl xla --shapes "$s" --out /tmp/b_$name \
    --deadline $((t - 30)) "$@" > $OUT/$name.log 2>&1
  echo "== $name"; grep '^| [0-9]' $OUT/$name.log | cut -c1-150; cp /tmp/b_$name/*.md $OUT/$name.md 2>/dev/null
}
run base_u8 60 "8,4096,16,2" --no-check --set "recurrence.SCAN_UNROLL={'gpu': 8}"
run narrowqk 110 "8,4096,16,1;8,4096,16,2" --set engine.NARROW_QK=True
run lg_unrolled 80 "8,4096,16,1;8,4096,16,2" --no-check --set engine.LOCAL_GRAD_PROBLEMS=4096 --set "engine.LOCAL_GRAD_LOOP='unrolled'"
run long 80 "2,16384,16,2" --no-check
run long_u8 80 "2,16384,16,2" --no-check --set "recurrence.SCAN_UNROLL={'gpu': 8}"
