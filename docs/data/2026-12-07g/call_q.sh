#!/bin/bash
# For the next H200 (thirtieth session): issue 17's second target, the 16x64 row, with
# --max-batch-size 256 (which led 128 by 5-10 % in four pairs on an H100, call_o.sh and
# call_p.sh) and with 128, interleaved (b256 head b256 head), the naive baseline in the first
# row. Stops at once on any other GPU, so an H100 landing costs only the start. ~3.5 min plus
# the start; the rows so far tarred into $OUT after each (a call cut short keeps them).
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { nvidia-smi -L; echo "not an H200: stopped"; exit 3; }
A=docs/data/2026-12-06b; O=$OUT
source $A/common.sh
declare -A X=([head]="" [b256]="--max-batch-size 256"); i=0
bl=(--baseline-points raw:1x16 "--baseline-args=$NA")  # the first row only
for row in ${ROWS:-b256 head b256 head}; do  # ROWS="b256 head" where little budget is left
  i=$((i+1))
  python3 bench/bench_e2e.py $B --points mp:16x64 "${bl[@]}" --server-root $PWD "--featpool-args=$FA $BIG ${X[$row]}" --out $O/e2e-$i-$row.json > $O/e2e-$i-$row.log 2>&1
  echo "$i mp:16x64 $row rc=$?"; python3 $A/rows.py $O/e2e-$i-$row.json
  bl=(--baseline-points=); (cd $O && tar czf rows.tgz e2e-*)
done; date -u; rm $O/e2e-*
