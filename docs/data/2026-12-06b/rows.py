"""One line per point of a bench_e2e.py JSON file: rate, latency, batch, the stage times per
batch and the cycle (batch / images/s) minus prepare, and the CPU the processes used."""

import json
import sys

d = json.load(open(sys.argv[1]))
for r in d["rows"] if isinstance(d, dict) and "rows" in d else d:
    ips, mb = r.get("images_per_s") or 0, r.get("mean_batch") or 0
    pr = r.get("prepare_ms_per_batch") or 0
    cyc = mb / ips * 1000 if ips else 0
    print(
        f"  {r.get('server')} {r.get('body', '')} {r.get('images_per_request')}x{r.get('concurrency')}:"
        f" {ips:,.0f} img/s p50 {r.get('p50_ms') or 0:.0f} p99 {r.get('p99_ms') or 0:.0f}"
        f" status {r.get('status')} batch {mb:.1f} queue {r.get('queue_ms')} prep {pr:.2f}"
        f" run {r.get('run_ms_per_batch')} dec {r.get('decode_ms')} cyc-prep {cyc - pr:.2f}"
        f" gpuproc {r.get('gpu_process_cores') or 0:.2f} fronts {r.get('fronts_cores') or 0:.2f}"
        f" client {r.get('client_cores') or 0:.2f} sm {r.get('gpu_sm_busy_pct') or 0:.0f}"
        f" jpeg {r.get('gpu_jpeg_busy_pct') or 0:.0f} pub {r.get('publish_us') or 0:.0f}"
    )
