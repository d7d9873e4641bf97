#!/bin/bash
# Twenty-eighth session: does the GPU process's prepare call slow down because the fronts and the
# load generator share its cores? A service row at 16x64 as it runs (no naive baseline: a
# diagnostic), then one with everything on cores 4-15 except the GPU process, moved (all its
# threads) onto cores 0-3 once its four fronts are up. Into $OUT.
A=docs/data/2026-12-06b; O=$OUT
source $A/common.sh
python3 bench/bench_e2e.py $B --points mp:16x64 --baseline-points= --server-root $PWD "--featpool-args=$FA $BIG" --out $O/e2e-plain.json > $O/e2e-plain.log 2>&1
echo "plain rc=$?"; python3 $A/rows.py $O/e2e-plain.json
(
  for i in $(seq 240); do [ "$(pgrep -c -f 'm app.front')" -ge 4 ] && break; sleep 0.5; done
  P=$(pgrep -o -f "m app --port 18080"); echo "gpu process $P, fronts $(pgrep -c -f 'm app.front')"
  taskset -a -p -c 0-3 "$P" | tail -1
) > $O/pin.txt 2>&1 &
taskset -c 4-15 python3 bench/bench_e2e.py $B --points mp:16x64 --baseline-points= --server-root $PWD "--featpool-args=$FA $BIG" --out $O/e2e-pin.json > $O/e2e-pin.log 2>&1
echo "pinned rc=$?"; wait; cat $O/pin.txt; python3 $A/rows.py $O/e2e-pin.json; date -u
