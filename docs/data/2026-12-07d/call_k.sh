#!/bin/bash
# Twenty-seventh session, for the next device call: the engine fed through the job channel by
# four front-like child processes, no HTTP (probe_channel.py, 16 a job, c=64; the leases left
# to their TTL, then each released); a service row at 16x64 (no naive baseline: a diagnostic,
# not an issue-17 figure); one with 64 MB job arenas a front instead of 256 (fewer distinct
# pages under the decoder's copies); probe_engine.py (no job channel). All on one machine,
# into $OUT/all.tgz (~5 min plus the start).
# Then (twenty-eighth session) py-spy --gil of the service row and of the channel probe.
A=docs/data/2026-12-06b; O=$OUT
source $A/common.sh
timeout 120 python3 docs/data/2026-12-07d/probe_channel.py 5 64 > $O/probe-channel-1.txt 2>&1; echo "channel rc=$?"; grep -v Warn $O/probe-channel-1.txt | tail -4
RELEASE=1 timeout 120 python3 docs/data/2026-12-07d/probe_channel.py 5 64 > $O/probe-channel-release.txt 2>&1; echo "channel release rc=$?"; grep -v Warn $O/probe-channel-release.txt | tail -4
mkdir -p $O/logs-head
python3 bench/bench_e2e.py $B --points mp:16x64 --baseline-points= --server-root $PWD "--featpool-args=$FA $BIG" --logs $O/logs-head --out $O/e2e-head.json > $O/e2e-head.log 2>&1
echo "row head rc=$?"; python3 $A/rows.py $O/e2e-head.json
mkdir -p $O/logs-arena64
python3 bench/bench_e2e.py $B --points mp:16x64 --baseline-points= --server-root $PWD "--featpool-args=$FA $BIG --job-arena-bytes 67108864" --logs $O/logs-arena64 --out $O/e2e-arena64.json > $O/e2e-arena64.log 2>&1
echo "row arena64 rc=$?"; python3 $A/rows.py $O/e2e-arena64.json
timeout 120 python3 docs/data/2026-12-07c/probe_engine.py 5 64 > $O/probe-engine.txt 2>&1; echo "engine rc=$?"; tail -3 $O/probe-engine.txt
# Who holds the interpreter lock (py-spy --gil, 200 Hz): the service row at 16x64 again (its
# 6.5 s window), then the channel probe, to compare the prepare thread's samples per batch.
mkdir -p $O/logs-spy $O/spy
python3 bench/bench_e2e.py $B --points mp:16x64 --baseline-points= --server-root $PWD "--featpool-args=$FA $BIG" --py-spy $O/spy --logs $O/logs-spy --out $O/e2e-spy.json > $O/e2e-spy.log 2>&1
echo "row spy rc=$?"; python3 $A/rows.py $O/e2e-spy.json
# The channel probe for 2x10 s; once it is up, py-spy on it (not its fronts) for 12 s.
timeout 150 python3 docs/data/2026-12-07d/probe_channel.py 10 64 > $O/probe-channel-spy.txt 2>&1 &
for i in $(seq 120); do grep -q "^device" $O/probe-channel-spy.txt && break; sleep 1; done
sleep 3; py-spy record --pid $! --gil --nonblocking --threads --rate 200 --duration 12 --format raw --output $O/spy/channel.txt > /dev/null 2>&1
wait; echo "channel spy done"; grep -v Warn $O/probe-channel-spy.txt | tail -4
cd $O && tar czf /tmp/all.tgz . && rm -rf $O/* && mv /tmp/all.tgz $O/; date -u
