#!/bin/bash
# For the next device call, on whatever GPU comes (twenty-ninth session): --max-batch-size 256
# against the default 128 at sixteen images a request, c=64, one server a row, interleaved
# (head b256 head b256), the naive baseline in the first row; then one image a request, c=256,
# for each (the first target's row must not suffer). Hypothesis: part of the prepare call's
# ~16-21 ms a batch of 128 is per batch (stream waits, taking the interpreter lock back), so
# twice the images a batch spread it thinner. Never run before (call_g.sh had it, refused).
# On an H200 the 16x64 head rows are issue 17's target measurement. ~6 min plus the start.
A=docs/data/2026-12-06b; O=$OUT
source $A/common.sh
declare -A X=([head]="" [b256]="--max-batch-size 256"); i=0
bl=(--baseline-points raw:1x16 "--baseline-args=$NA")  # the first row only
for run in mp:16x64/head mp:16x64/b256 mp:16x64/head mp:16x64/b256 raw:1x256/head raw:1x256/b256; do
  point=${run%/*} row=${run#*/} i=$((i+1))
  python3 bench/bench_e2e.py $B --points $point "${bl[@]}" --server-root $PWD "--featpool-args=$FA $BIG ${X[$row]}" --out $O/e2e-$i-$row.json > $O/e2e-$i-$row.log 2>&1
  echo "$i $point $row rc=$?"; python3 $A/rows.py $O/e2e-$i-$row.json
  bl=(--baseline-points=)
done; date -u
