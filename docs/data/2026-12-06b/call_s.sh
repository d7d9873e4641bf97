#!/bin/bash
# The sweep on main, with the naive baseline (run in the twenty-second session: ../2026-12-06c/
# sweep-2158-h200.json); PAIR=1 adds
# an interleaved 08eb684 / main pair through call_a.sh.
D=$(dirname "$0")
source "$D/common.sh"
mkdir -p $OUT/logs-sweep
python3 bench/bench_e2e.py $B --points raw:1x64,raw:1x128,raw:1x256,raw:1x512,mp:16x8,mp:16x16,mp:16x32,mp:16x64 \
  --baseline-points raw:1x16 "--baseline-args=$NA" "--featpool-args=$FA $BIG" --logs $OUT/logs-sweep --out $OUT/e2e-sweep.json > $OUT/e2e-sweep.log 2>&1
echo "sweep rc=$? $SECONDS s"
python3 "$D/rows.py" $OUT/e2e-sweep.json
[ -n "$PAIR" ] && ORDER="prev head" LIMIT=120 bash "$D/call_a.sh" 2>&1 | grep -E "row|featpool"
cd $OUT && tar czf all.tgz *.json *.log && date -u
