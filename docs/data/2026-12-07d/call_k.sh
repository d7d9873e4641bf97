#!/bin/bash
# Ran at 15:59 UTC Dec 7 on an H100 (written in the twenty-seventh session, cut down in the
# twenty-eighth to fit what budget is left): the engine fed through the job channel by four
# front-like child processes, no HTTP (probe_channel.py, 16 a job, c=64), first with the leases
# left to their 2 s TTL and py-spy --gil on the GPU process (not its fronts) for 8 s of its
# first window, then each lease released (RELEASE=1); a service row at 16x64 with bench_e2e's
# --py-spy (no naive baseline: a diagnostic, not an issue-17 figure); probe_engine.py (no job
# channel); on an H200, issue 17's row with its naive baseline. Into $OUT/all.tgz (~3-5 min).
A=docs/data/2026-12-06b; O=$OUT
source $A/common.sh
mkdir -p $O/spy $O/logs-spy
timeout 120 python3 docs/data/2026-12-07d/probe_channel.py 5 64 > $O/probe-channel-1.txt 2>&1 &
for i in $(seq 100); do grep -q "^device" $O/probe-channel-1.txt && break; sleep 1; done
P=$(pgrep -n -f "probe_channel.py 5 64"); echo "spy pid $P"
sleep 2.5; py-spy record --pid $P --gil --nonblocking --threads --rate 200 --duration 8 --format raw --output $O/spy/channel.txt > /dev/null 2>&1
wait; echo "channel (spied) done"; grep -v Warn $O/probe-channel-1.txt | tail -4
RELEASE=1 timeout 120 python3 docs/data/2026-12-07d/probe_channel.py 5 64 > $O/probe-channel-release.txt 2>&1; echo "channel release rc=$?"; grep -v Warn $O/probe-channel-release.txt | tail -4
python3 bench/bench_e2e.py $B --points mp:16x64 --baseline-points= --server-root $PWD "--featpool-args=$FA $BIG" --py-spy $O/spy --logs $O/logs-spy --out $O/e2e-spy.json > $O/e2e-spy.log 2>&1
echo "row spy rc=$?"; python3 $A/rows.py $O/e2e-spy.json
timeout 120 python3 docs/data/2026-12-07c/probe_engine.py 5 64 > $O/probe-engine.txt 2>&1; echo "engine rc=$?"; tail -3 $O/probe-engine.txt
# On an H200 only: issue 17's row at 16x64 with the same-run naive baseline, no profiler.
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  python3 bench/bench_e2e.py $B --points mp:16x64 --baseline-points raw:1x16 "--baseline-args=$NA" --server-root $PWD "--featpool-args=$FA $BIG" --out $O/e2e-h200.json > $O/e2e-h200.log 2>&1
  echo "row h200 rc=$?"; python3 $A/rows.py $O/e2e-h200.json
fi
cd $O && tar czf /tmp/all.tgz . && rm -rf $O/* && mv /tmp/all.tgz $O/; date -u
