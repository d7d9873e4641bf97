#!/bin/bash
# Does CPU contention slow nvJPEG's call? The probe, then efe against "pin" (the prepare thread
# alone on CPU 0; the server's other threads, the fronts and the load generator on the CPUs
# other than CPU 0 and its hyperthread sibling), interleaved.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl-extra/*.whl && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH || exit
export PYTHONUNBUFFERED=1
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
lscpu | grep -E "Model name|Thread|Core|Socket|MHz"
SIB=$(cat /sys/devices/system/cpu/cpu0/topology/thread_siblings_list); echo "cpu0 siblings: $SIB"
OTHERS=$(python3 -c "
import sys
sib = set()
for part in '$SIB'.split(','):
    a, _, b = part.partition('-'); sib |= set(range(int(a), int(b or a) + 1))
import os; print(','.join(str(c) for c in sorted(os.sched_getaffinity(0) - sib - {0})))")
echo "others: $OTHERS"
python3 scratch/probe_contention.py 2>&1 | tail -9
B="--images 32 --seconds 5 --warmup 1.5 --client aiohttp --max-conns-per-proc 32 --client-procs 4"
FA="--max-batch-size 128 --max-batch-wait-ms 4 --decode-workers 8"
BIG="--max-inflight-decoded-bytes 8589934592"
i=0
for row in ${ORDER:-efe pin efe pin}; do
  i=$((i+1)); mkdir -p $OUT/logs-$i-$row
  if [ $row = pin ]; then pre=(env FEATPOOL_PREPARE_CPUS=0 taskset -c $OTHERS); else pre=(); fi
  t0=$SECONDS
  "${pre[@]}" python3 bench/bench_e2e.py $B --points raw:1x256,mp:16x32 --baseline-points= --server-root $PWD/scratch/$row "--featpool-args=$FA $BIG" --logs $OUT/logs-$i-$row --out $OUT/e2e-$i-$row.json > $OUT/e2e-$i-$row.log 2>&1
  echo "row $i $row rc=$? $((SECONDS-t0)) s"
  python3 - $OUT/e2e-$i-$row.json <<'PY'
import json,sys
d=json.load(open(sys.argv[1])); rows=d["rows"] if isinstance(d,dict) and "rows" in d else d
for r in rows:
    mb=r.get("mean_batch") or 0; pr=r.get("prepare_ms_per_batch") or 0
    print(f'  {r["images_per_request"]}x{r["concurrency"]}: {r["images_per_s"]:,.0f} img/s p99 {r["p99_ms"]:.0f} batch {mb:.0f} prep/img {pr/mb if mb else 0:.3f} dec {r.get("decode_ms")} gpuproc {r.get("gpu_process_cores") or 0:.2f} fronts {r.get("fronts_cores") or 0:.2f} client {r.get("client_cores") or 0:.2f}')
PY
done
cd $OUT && tar czf all.tgz *.json *.log; date -u
