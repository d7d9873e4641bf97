#!/bin/bash
# For the next device call (twenty-eighth session): on the machine that comes (an H200 is the
# point), the GPU process through the job channel without HTTP (probe_channel.py 8 64), then
# issue 17's row (16x64 with the same-run naive baseline), then the channel probe beside four
# loopback TCP streams whose rates are recorded this time, then the probe alone again; then
# py-spy --native of the service and of the probe (below). ~6 min plus the start; into
# $OUT/all.tgz.
A=docs/data/2026-12-06b; O=$OUT
source $A/common.sh
timeout 100 python3 docs/data/2026-12-07d/probe_channel.py 8 64 > $O/probe-channel-a.txt 2>&1; grep -h "^run" $O/probe-channel-a.txt
python3 bench/bench_e2e.py $B --points mp:16x64 --baseline-points raw:1x16 "--baseline-args=$NA" --server-root $PWD "--featpool-args=$FA $BIG" --out $O/e2e-16x64.json > $O/e2e-16x64.log 2>&1
echo "row rc=$?"; python3 $A/rows.py $O/e2e-16x64.json
for p in 19001 19002 19003 19004; do python3 docs/data/2026-12-07e/tcp_stream.py $p 45 > $O/tcp-$p.txt 2>&1 & done
sleep 1; timeout 100 python3 docs/data/2026-12-07d/probe_channel.py 8 64 > $O/probe-channel-tcp4.txt 2>&1; grep -h "^run" $O/probe-channel-tcp4.txt
wait; cat $O/tcp-*.txt
timeout 100 python3 docs/data/2026-12-07d/probe_channel.py 8 64 > $O/probe-channel-b.txt 2>&1; grep -h "^run" $O/probe-channel-b.txt
# Where the prepare call's wall time goes, with and without HTTP on the host: py-spy --native
# --idle (every thread, native frames, 100 Hz) of the service's GPU process at 16x64, and of the
# channel probe for 8 s of its second window. Compare the prepare thread's leaf frames.
mkdir -p $O/spy $O/logs-native
python3 bench/bench_e2e.py $B --points mp:16x64 --baseline-points= --server-root $PWD "--featpool-args=$FA $BIG" --py-spy $O/spy --py-spy-native --logs $O/logs-native --out $O/e2e-native.json > $O/e2e-native.log 2>&1
echo "row native rc=$?"; python3 $A/rows.py $O/e2e-native.json
timeout 100 python3 docs/data/2026-12-07d/probe_channel.py 8 64 > $O/probe-channel-native.txt 2>&1 &
for i in $(seq 160); do grep -q "^run 1" $O/probe-channel-native.txt && break; sleep 0.5; done
P=$(pgrep -n -f "probe_channel.py 8 64"); py-spy record --pid $P --native --idle --threads --rate 100 --duration 8 --format raw --output $O/spy/channel-native.txt > /dev/null 2>&1
wait; grep -h "^run" $O/probe-channel-native.txt
cd $O && tar czf /tmp/all.tgz . && rm -rf $O/* && mv /tmp/all.tgz $O/; date -u
