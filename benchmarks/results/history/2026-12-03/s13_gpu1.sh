#!/usr/bin/env bash
# Thirteenth session, device call 1 (issue 22): the xla engine's defaults (folded readout,
# 16-bit backward intermediates) beside fully tuned FLA in one process at the benchmark
# shapes; A/Bs of the new switches and of grouped walks at the long shape; the backward's kernel
# trace with its optimized HLO (one tarball).
source .gpu-deps/install.sh
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
mkdir -p /tmp/tr
run() {  # name, timeout, impls, shapes, extra args
  local name=$1 t=$2 impl=$3 s=$4; shift 4
  timeout $t python -m benchmarks.run fwdbwd --impl $impl --shapes "$s" --out /tmp/b_$name \
    --deadline $((t - 25)) "$@" > /tmp/tr/$name.log 2>&1
  echo "== $name $*"; grep '^| [0-9]' /tmp/tr/$name.log | cut -c1-150
  cp /tmp/b_$name/*.md /tmp/tr/$name.md 2>/dev/null
}
run main 260 xla,fla main
cp /tmp/tr/main.md $OUT/main.md; cp /tmp/tr/main.log $OUT/main.log
M="8,4096,16,2;2,16384,16,2"
run old 85 xla "$M" --no-check --set recurrence.FOLDED_READOUT=False --set chunked.NARROW_GRADS=False
run group2 50 xla "2,16384,16,2" --no-check --set "recurrence.GROUP_WALK={'gpu': 2}"
run group4 50 xla "2,16384,16,2" --set "recurrence.GROUP_WALK={'gpu': 4}"
m=bwd
timeout 70 python -m benchmarks.trace --shape 8,4096,16,2 --impl xla --mode $m --top 80 \
  --out /tmp/t_$m --hlo /tmp/tr/xla_$m.hlo.gz > /tmp/tr/trace_$m.log 2>&1
python -m benchmarks.hlo_lines /tmp/tr/trace_$m.log /tmp/tr/xla_$m.hlo.gz --top 80 \
  > /tmp/tr/kernels_$m.log 2>&1
python -m benchmarks.hlo_lines /tmp/tr/trace_$m.log /tmp/tr/xla_$m.hlo.gz --by line --top 40 \
  > /tmp/tr/lines_$m.log 2>&1; echo "== $m"; head -2 /tmp/tr/trace_$m.log; tail -22 /tmp/tr/lines_$m.log | cut -c1-150
tar -C /tmp -czf $OUT/tr.tar.gz tr; ls -la $OUT
