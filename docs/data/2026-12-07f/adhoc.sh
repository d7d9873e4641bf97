#!/bin/bash
# What ran on the device in the twenty-ninth session (the H100 that came for nvidia-h200):
# 16:54 `OUT=$OUT bash docs/data/2026-12-07e/call_m.sh` (its output is this folder's top level),
# then at 16:59 on the same warm machine the spread below (into spread/): the channel probe and
# the service's 16x64 row, alternated three times. The third probe's file did not come back
# ("count": too many files under $OUT); its line is in the docs.
A=docs/data/2026-12-06b; O=$OUT; source $A/common.sh >/dev/null 2>&1; date -u
for k in 1 2 3; do
  timeout 100 python3 docs/data/2026-12-07d/probe_channel.py 8 64 > $O/probe-$k.txt 2>&1; grep -h "^run 2" $O/probe-$k.txt
  python3 bench/bench_e2e.py $B --points mp:16x64 --baseline-points= --server-root $PWD "--featpool-args=$FA $BIG" --out $O/e2e-$k.json > $O/e2e-$k.log 2>&1
  echo "row $k rc=$?"; python3 $A/rows.py $O/e2e-$k.json
done; date -u
