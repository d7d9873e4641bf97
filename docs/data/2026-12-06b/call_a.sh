#!/bin/bash
# Interleaved A/B rows, one server per row. ORDER: names in run order, e.g. "head prev efe+2 head":
# head = the working tree; NAME = scratch/NAME, a `git archive COMMIT` of another tree (this
# session: prev = 08eb684, efe = efe5475, nocopy = efe5475 with the ablation of the docs,
# pin = efe5475 with pin-prepare-thread.diff); NAME+K adds --prepare-threads K. A "pin" row runs
# with its prepare thread on CPU 0 and everything else on $OTHERS (call_p.sh sets it).
# NAIVE=1: the naive baseline in row 1. LIMIT: seconds. POINTS, EXTRA: more bench arguments.
D=$(dirname "$0")
source "$D/common.sh"
START=$SECONDS; i=0; LIMIT=${LIMIT:-540}
for row in $ORDER; do
  i=$((i+1))
  [ $((SECONDS-START)) -gt $LIMIT ] && { echo "stop before row $i ($row): time"; break; }
  name=${row%%+*}; ex=""; [ "$name" != "$row" ] && ex="--prepare-threads ${row##*+}"
  case $name in head) root=$PWD;; *) root=$PWD/scratch/$name;; esac
  pre=(); [ "$name" = pin ] && pre=(env FEATPOOL_PREPARE_CPUS=0 taskset -c "$OTHERS")
  if [ $i -eq 1 ] && [ -n "$NAIVE" ]; then bl=(--baseline-points raw:1x16 "--baseline-args=$NA"); else bl=(--baseline-points=); fi
  tag=${row/+/p}; mkdir -p $OUT/logs-$i-$tag
  t0=$SECONDS
  "${pre[@]}" python3 bench/bench_e2e.py $B --points ${POINTS:-raw:1x256,mp:16x32} "${bl[@]}" --server-root $root "--featpool-args=$FA $BIG $EXTRA $ex" --logs $OUT/logs-$i-$tag --out $OUT/e2e-$i-$tag.json > $OUT/e2e-$i-$tag.log 2>&1
  echo "row $i $row rc=$? $((SECONDS-t0)) s"
  python3 "$D/rows.py" $OUT/e2e-$i-$tag.json
done
cd $OUT && tar czf all.tgz *.json *.log; date -u
