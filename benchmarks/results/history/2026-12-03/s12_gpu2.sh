#!/usr/bin/env bash
# Twelfth session, device call 2 (issue 22), xla only (FLA's rows at these shapes:
# s11_gpu1_out): the chunk factors on plain products with the causal ones only for a call
# with a non-finite value (recurrence.OPTIMISTIC_FACTORS, now on) against always causal;
# the walks' scan unroll; the local gradients in blocks ordered by barriers; q and k in
# bf16; two-level walks at the long-row shape; then where the time goes by source line (engine backward alone, forward).
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false
run() {  # name, timeout, shapes, extra args
  local name=$1 t=$2 s=$3; shift 3
  timeout $t python -m benchmarks.run fwdbwd --impl xla --shapes "$s" --out /tmp/b_$name \
    --deadline $((t - 25)) "$@" > $OUT/$name.log 2>&1
  echo "== $name"; grep '^| [0-9]' $OUT/$name.log | cut -c1-150; cp /tmp/b_$name/*.md $OUT/$name.md 2>/dev/null
}
M="8,4096,16,1;8,4096,16,2"
run opt 110 "$M"
run causal 75 "$M" --no-check --set recurrence.OPTIMISTIC_FACTORS=False
run opt_u8 90 "8,4096,16,2;2,16384,16,2" --no-check --set "recurrence.SCAN_UNROLL={'gpu': 8}"
run opt_long 55 "2,16384,16,2" --no-check
run blocked_long 60 "2,16384,16,2" --no-check --set recurrence.MIN_BLOCKED_CHUNKS=64
run lg_unrolled 55 "8,4096,16,2" --no-check --set engine.LOCAL_GRAD_PROBLEMS=4096 --set "engine.LOCAL_GRAD_LOOP='unrolled'"
run narrowqk 60 "8,4096,16,2" --set engine.NARROW_QK=True
for m in bwd fwd; do
  timeout 60 python -m benchmarks.trace --shape 8,4096,16,2 --impl xla --mode $m --top 30 \
    --out /tmp/t_$m --hlo $OUT/xla_$m.hlo.gz > $OUT/trace_$m.log 2>&1
  python -m benchmarks.hlo_lines $OUT/trace_$m.log $OUT/xla_$m.hlo.gz --by line --top 30 \
    > $OUT/lines_$m.log 2>&1; echo "== $m"; head -2 $OUT/trace_$m.log; tail -32 $OUT/lines_$m.log | cut -c1-180
done
