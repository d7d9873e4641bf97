#!/bin/bash
# Thirtieth session, right after call_o.sh on the same H100: the same rows in the reverse order
# (b256 head b256 head, then 1x256 b256 head), so that the machine's drift over minutes, which
# fell on b256 in call_o.sh, now falls on the default. Outputs tarred (too many files come back
# otherwise).
A=docs/data/2026-12-06b; O=$OUT
source $A/common.sh
declare -A X=([head]="" [b256]="--max-batch-size 256"); i=0
for run in mp:16x64/b256 mp:16x64/head mp:16x64/b256 mp:16x64/head raw:1x256/b256 raw:1x256/head; do
  point=${run%/*} row=${run#*/} i=$((i+1))
  python3 bench/bench_e2e.py $B --points $point --baseline-points= --server-root $PWD "--featpool-args=$FA $BIG ${X[$row]}" --out $O/e2e-$i-$row.json > $O/e2e-$i-$row.log 2>&1
  echo "$i $point $row rc=$?"; python3 $A/rows.py $O/e2e-$i-$row.json
done; date -u; cd $O && tar czf rows.tgz e2e-* && rm e2e-*
