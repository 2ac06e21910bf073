#!/usr/bin/env bash
# Thirteenth session, device call 1 (issue 22): the xla engine's defaults (folded readout,
# 16-bit backward intermediates) beside fully tuned FLA in one process at the benchmark
# shapes; A/Bs of each new switch; kernel traces with the optimized HLO (one tarball).
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
run old 80 xla "$M" --set recurrence.FOLDED_READOUT=False --set chunked.NARROW_GRADS=False
run nofold 60 xla "8,4096,16,2" --set recurrence.FOLDED_READOUT=False
run wide_grads 60 xla "8,4096,16,2" --set chunked.NARROW_GRADS=False
run narrow_wy 60 xla "8,4096,16,2" --set chunked.NARROW_WY=True
for m in fwdbwd bwd fwd; do
  timeout 70 python -m benchmarks.trace --shape 8,4096,16,2 --impl xla --mode $m --top 80 \
    --out /tmp/t_$m --hlo /tmp/tr/xla_$m.hlo.gz > /tmp/tr/trace_$m.log 2>&1
  python -m benchmarks.hlo_lines /tmp/tr/trace_$m.log /tmp/tr/xla_$m.hlo.gz --top 80 \
    > /tmp/tr/kernels_$m.log 2>&1
  python -m benchmarks.hlo_lines /tmp/tr/trace_$m.log /tmp/tr/xla_$m.hlo.gz --by line --top 40 \
    > /tmp/tr/lines_$m.log 2>&1; echo "== $m"; head -2 /tmp/tr/trace_$m.log; tail -22 /tmp/tr/lines_$m.log | cut -c1-150
done
timeout 70 python -m benchmarks.trace --shape 2,16384,16,2 --impl xla --mode fwdbwd --top 60 \
  --out /tmp/t_long --hlo /tmp/tr/xla_long.hlo.gz > /tmp/tr/trace_long.log 2>&1
python -m benchmarks.hlo_lines /tmp/tr/trace_long.log /tmp/tr/xla_long.hlo.gz --top 60 > /tmp/tr/kernels_long.log 2>&1
echo "== long"; head -30 /tmp/tr/trace_long.log | cut -c1-150
tar -C /tmp -czf $OUT/tr.tar.gz tr; ls -la $OUT
