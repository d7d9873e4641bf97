#!/bin/bash
# Twenty-fourth session. (1) EVICT=1 probe_cold.py: nvJPEG's one call on bytes another process just
# wrote (as a front does) against the same bytes again, alone and beside the forward, pageable
# and page-locked. (2) Sixteen per request, c=64, interleaved rows, one server each: head
# (nvjpeg, one prepare thread; the naive baseline in the first row unless NONAIVE=1), tc2 (--decoder torchcodec
# --prepare-threads 2: two decoders at once, so the host side of two batches overlaps), b256
# (--max-batch-size 256: the per-batch costs over twice the images), pin (this tree with
# docs/data/2026-12-06/pinned-arena.diff: the fronts' arenas page-locked). Into $OUT/all.tgz.
A=docs/data/2026-12-06b; O=$OUT
source $A/common.sh
EVICT=1 python3 docs/data/2026-12-07a/probe_cold.py > $O/probe-cold.txt 2>&1; echo "probe rc=$?"; grep -v "^ *$" $O/probe-cold.txt | tail -6
rm -rf /tmp/pin && mkdir /tmp/pin && tar --exclude=./.git --exclude=./.whl --exclude=./.whl-extra --exclude=./scratch -cf - . | tar -xf - -C /tmp/pin && (cd /tmp/pin && git apply docs/data/2026-12-06/pinned-arena.diff) && echo "pin tree ready"
declare -A X=([head]="" [tc2]="--decoder torchcodec --prepare-threads 2" [b256]="--max-batch-size 256" [tc3]="--decoder torchcodec --prepare-threads 3" [pin]="")
START=$SECONDS; i=0
for row in ${ORDER:-head tc2 pin head tc2 pin}; do
  i=$((i+1))
  [ $((SECONDS-START)) -gt ${LIMIT:-300} ] && { echo "stop before row $i ($row): time"; break; }
  if [ $i -eq 1 ] && [ -z "$NONAIVE" ]; then bl=(--baseline-points raw:1x16 "--baseline-args=$NA"); else bl=(--baseline-points=); fi
  t0=$SECONDS
  python3 bench/bench_e2e.py $B --points mp:16x64 "${bl[@]}" --server-root $([ $row = pin ] && echo /tmp/pin || echo $PWD) "--featpool-args=$FA $BIG ${X[$row]}" --logs $O/logs-$i-$row --out $O/e2e-$i-$row.json > $O/e2e-$i-$row.log 2>&1
  echo "row $i $row rc=$? $((SECONDS-t0)) s"
  python3 $A/rows.py $O/e2e-$i-$row.json
done
cd $O && tar czf all.tgz probe-cold.txt *.json *.log; date -u
