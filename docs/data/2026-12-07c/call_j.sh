#!/bin/bash
# Twenty-sixth session, for the next device call: the engine with no fronts, job channel or HTTP
# (probe_engine.py, 16 a request, c=64, two runs), then a service row at 16x64 on the same
# machine (the naive baseline in it unless NONAIVE=1), then the probe again. If the probe's
# prepare stage is ~17 ms a batch like the service's, the GPU process's own threads make the
# call slower; if ~12.5 ms, the fronts and the job channel do. Into $OUT/all.tgz.
A=docs/data/2026-12-06b; O=$OUT
source $A/common.sh
timeout 150 python3 docs/data/2026-12-07c/probe_engine.py 5 64 > $O/probe-engine-1.txt 2>&1; echo "probe rc=$?"; tail -4 $O/probe-engine-1.txt
if [ -z "$NONAIVE" ]; then bl=(--baseline-points raw:1x16 "--baseline-args=$NA"); else bl=(--baseline-points=); fi
mkdir -p $O/logs-head
python3 bench/bench_e2e.py $B --points mp:16x64 "${bl[@]}" --server-root $PWD "--featpool-args=$FA $BIG" --logs $O/logs-head --out $O/e2e-head.json > $O/e2e-head.log 2>&1
echo "row head rc=$?"; python3 $A/rows.py $O/e2e-head.json
timeout 150 python3 docs/data/2026-12-07c/probe_engine.py 5 64 > $O/probe-engine-2.txt 2>&1; echo "probe rc=$?"; tail -4 $O/probe-engine-2.txt
cd $O && tar czf /tmp/all.tgz . && rm -rf $O/* && mv /tmp/all.tgz $O/; date -u
