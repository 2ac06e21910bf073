#!/usr/bin/env bash
# Fourteenth session, device call 2 (issue 22), A/B on the whole-token grid, xla only
# (call 1 measured today's defaults beside FLA): q in 16 bits (engine.NARROW_INPUTS),
# then with chunked.NARROW_WY too, at the four benchmark shapes; intra_cp=2 at the long
# shape. Then the cutedsl n = 3 row and its failing GPU test on the tree before the grid
# change (3ca2496, carried as .s14old/) to attribute call 1's cutedsl n = 3 results.
source .gpu-deps/install.sh
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
R="python -m benchmarks.run fwdbwd"
ab() { name=$1; shift; ( export PYTHONPATH=$PWD:$PYTHONPATH; timeout $1 $R --out /tmp/b_$name --deadline $2 "${@:3}" > $OUT/$name.log 2>&1 );
       echo "== $name"; grep -E '^\| [0-9]' $OUT/$name.log | cut -c1-150; }
ab q 175 140 --impl xla --shapes main --set "engine.NARROW_INPUTS=('v','q')"
ab qwy 175 140 --impl xla --shapes main --set "engine.NARROW_INPUTS=('v','q')" --set chunked.NARROW_WY=True
( timeout 45 env PYTHONPATH=$PWD:$PYTHONPATH python ffi/build.py --jobs 14 > /tmp/build.log 2>&1 ); tail -1 /tmp/build.log
mkdir -p .s14old/ffi && cp -r ffi/build .s14old/ffi/
cd .s14old && export PYTHONPATH=$PWD:$PYTHONPATH
( timeout 75 python -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_cutedsl_gpu.py -k "forward_matches and 128-64-3" > $OUT/old_test.log 2>&1 )
echo "== old tree test"; grep -E "^(PASSED|FAILED)|passed|failed|AssertionError" $OUT/old_test.log | head -5
timeout 65 $R --impl cutedsl --shapes "8,4096,16,3" --out /tmp/b_old --deadline 40 > $OUT/old_cutedsl.log 2>&1
echo "== old tree cutedsl n3"; grep -E '^\| [0-9]' $OUT/old_cutedsl.log | cut -c1-150
cd .. && ab cp2 60 30 --impl xla-cp2 --shapes "2,16384,16,2"
ls -la $OUT
