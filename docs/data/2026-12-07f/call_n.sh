#!/bin/bash
# Superseded by call_o.sh (its first row is the same measurement). Ran once, at 17:33, and
# stopped at its check on an H100. Written for the next H200 (twenty-ninth session): issue 17's
# second target, the 16x64 row with its naive baseline in the same run, twice, the channel
# probe between them (the machine drifts over minutes, so a reading on each side). ~3 min plus the start; into $OUT.
# It stops at once on any other GPU (the target is an H200's), so that a start on an H100 costs
# only the start.
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { nvidia-smi -L; echo "not an H200: stopped"; exit 3; }
A=docs/data/2026-12-06b; O=$OUT
source $A/common.sh
lscpu | grep -E "^Model name|^Socket|^Core|^Thread" ; grep -o -m1 -w sha_ni /proc/cpuinfo
for k in 1 2; do
  python3 bench/bench_e2e.py $B --points mp:16x64 --baseline-points raw:1x16 "--baseline-args=$NA" --server-root $PWD "--featpool-args=$FA $BIG" --out $O/e2e-16x64-$k.json > $O/e2e-16x64-$k.log 2>&1
  echo "row $k rc=$?"; python3 $A/rows.py $O/e2e-16x64-$k.json
  [ $k = 1 ] && { timeout 100 python3 docs/data/2026-12-07d/probe_channel.py 8 64 > $O/probe-channel.txt 2>&1; grep -h "^run 2" $O/probe-channel.txt; }
done; date -u
