#!/bin/bash
# The sweep on main, with the naive baseline (not run: no device time was left); PAIR=1 adds
# an interleaved 08eb684 / main pair through call_a.sh.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl-extra/*.whl && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH || exit
export PYTHONUNBUFFERED=1
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc
B="--images 32 --seconds 5 --warmup 1.5 --client aiohttp --max-conns-per-proc 32 --client-procs 4"
FA="--max-batch-size 128 --max-batch-wait-ms 4 --decode-workers 8"
BIG="--max-inflight-decoded-bytes 8589934592"
NA="--max-batch-size 1 --max-batch-wait-ms 0 --gpu-decode off --decode-workers 4 --no-encoder-cuda-graphs"
mkdir -p $OUT/logs-sweep
python3 bench/bench_e2e.py $B --points raw:1x64,raw:1x128,raw:1x256,raw:1x512,mp:16x8,mp:16x16,mp:16x32,mp:16x64 \
  --baseline-points raw:1x16 "--baseline-args=$NA" "--featpool-args=$FA $BIG" --logs $OUT/logs-sweep --out $OUT/e2e-sweep.json > $OUT/e2e-sweep.log 2>&1
echo "sweep rc=$? $SECONDS s"
python3 - $OUT/e2e-sweep.json <<'PY'
import json,sys
d=json.load(open(sys.argv[1])); rows=d["rows"] if isinstance(d,dict) and "rows" in d else d
for r in rows:
    print(f'  {r["server"]} {r.get("body")} {r["images_per_request"]}x{r["concurrency"]}: {r["images_per_s"]:,.0f} img/s p50 {r["p50_ms"]:.0f} p99 {r["p99_ms"]:.0f} status {r.get("status")} batch {r.get("mean_batch") or 0:.0f} gpuproc {r.get("gpu_process_cores") or 0:.2f} fronts {r.get("fronts_cores") or 0:.2f} client {r.get("client_cores") or 0:.2f} sm {r.get("gpu_sm_busy_pct") or 0:.0f} jpeg {r.get("gpu_jpeg_busy_pct") or 0:.0f}')
PY
[ -n "$PAIR" ] && ORDER="prev head" LIMIT=120 bash scratch/call_a.sh 2>&1 | grep -E "row|featpool"
cd $OUT && tar czf all.tgz *.json *.log && date -u
