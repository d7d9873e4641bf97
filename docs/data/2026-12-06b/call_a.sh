#!/bin/bash
# Interleaved A/B rows, one server per row. ORDER: names in run order, e.g. "head prev efe+2 head":
# head = the working tree; NAME = scratch/NAME, a `git archive COMMIT` of another tree (this
# session: prev = 08eb684, efe = efe5475, nocopy = efe5475 with the ablation of the docs);
# NAME+K adds --prepare-threads K. NAIVE=1: the naive baseline in row 1. LIMIT: seconds.
# Run on the device from the repository root with .whl/ and .whl-extra/ carried.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl-extra/*.whl && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH || exit
export PYTHONUNBUFFERED=1
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc
B="--images 32 --seconds 5 --warmup 1.5 --client aiohttp --max-conns-per-proc 32 --client-procs 4"
FA="--max-batch-size 128 --max-batch-wait-ms 4 --decode-workers 8"
BIG="--max-inflight-decoded-bytes 8589934592"
NA="--max-batch-size 1 --max-batch-wait-ms 0 --gpu-decode off --decode-workers 4 --no-encoder-cuda-graphs"
START=$SECONDS; i=0; LIMIT=${LIMIT:-540}
for row in $ORDER; do
  i=$((i+1))
  [ $((SECONDS-START)) -gt $LIMIT ] && { echo "stop before row $i ($row): time"; break; }
  name=${row%%+*}; ex=""; [ "$name" != "$row" ] && ex="--prepare-threads ${row##*+}"
  case $name in head) root=$PWD;; *) root=$PWD/scratch/$name;; esac
  if [ $i -eq 1 ] && [ -n "$NAIVE" ]; then bl=(--baseline-points raw:1x16 "--baseline-args=$NA"); else bl=(--baseline-points=); fi
  tag=${row/+/p}; mkdir -p $OUT/logs-$i-$tag
  t0=$SECONDS
  python3 bench/bench_e2e.py $B --points ${POINTS:-raw:1x256,mp:16x32} "${bl[@]}" --server-root $root "--featpool-args=$FA $BIG $EXTRA $ex" --logs $OUT/logs-$i-$tag --out $OUT/e2e-$i-$tag.json > $OUT/e2e-$i-$tag.log 2>&1
  echo "row $i $row rc=$? $((SECONDS-t0)) s"
  python3 - $OUT/e2e-$i-$tag.json <<'PY'
import json,sys
d=json.load(open(sys.argv[1]))
rows=d["rows"] if isinstance(d,dict) and "rows" in d else d
for r in rows:
    ips=r.get("images_per_s") or 0; mb=r.get("mean_batch") or 0; pr=r.get("prepare_ms_per_batch") or 0
    cyc=(mb/ips*1000) if ips else 0
    print(f'  {r.get("server")} {r.get("body","")} {r.get("images_per_request")}x{r.get("concurrency")}: {ips:,.0f} img/s p99 {r.get("p99_ms")} batch {mb:.1f} queue {r.get("queue_ms")} prep {pr:.2f} run {r.get("run_ms_per_batch")} dec {r.get("decode_ms")} cyc-prep {cyc-pr:.2f} gpuproc {r.get("gpu_process_cores",0):.2f} sm {r.get("gpu_sm_busy_pct",0):.0f} pub {r.get("publish_us",0):.0f}')
PY
done
date -u
