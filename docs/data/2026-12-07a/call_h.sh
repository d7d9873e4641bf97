#!/bin/bash
# For the next device call: where the prepare thread's time goes inside a loaded server's GPU
# process. One row, head at 16x64 (nvjpeg, one prepare thread), with every thread's native
# stacks sampled at 100 Hz over the window (bench_e2e.py --py-spy-native; py-spy pauses the
# process for each sample, so this row's rate is not a figure); then the prepare thread's and
# the batch thread's innermost frames (spy_leaves.py). Compare with nvJPEG's call alone in
# probe_cold.py (~0.10-0.11 ms an image, its thread's CPU equal to its wall time). Into
# $OUT/all.tgz; run call_g.sh after it for the end-to-end rows.
A=docs/data/2026-12-06b; D=docs/data/2026-12-07a; O=$OUT
source $A/common.sh
mkdir -p $O/logs-spy; python3 bench/bench_e2e.py $B --points mp:16x64 --baseline-points= --server-root $PWD "--featpool-args=$FA $BIG" --py-spy $O/spy --py-spy-native --logs $O/logs-spy --out $O/e2e-spy.json > $O/e2e-spy.log 2>&1
echo "spy row rc=$?"; python3 $A/rows.py $O/e2e-spy.json
for f in $O/spy/*.txt; do python3 $D/spy_leaves.py $f "" 4 > $O/leaves-$(basename $f); head -80 $O/leaves-$(basename $f); done
cd $O && tar czf all.tgz e2e-spy.json e2e-spy.log spy leaves-*.txt; date -u
