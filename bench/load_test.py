"""Bounded load test on loopback: the real server process (``python -m app``, CPU, host pool),
many concurrent HTTP clients uploading images of mixed sizes, a small queue so that overload
shows, and a sampler that reads the server's RSS, ``featpool_queue_depth`` (from /metrics) and
pool occupancy every second.

    python bench/load_test.py --duration 180 --clients 32 --queue-size 8
    python bench/load_test.py --duration 30 --clients 8 --encoder vit-b16-224

Every lease a client gets is released, half by ``DELETE /v1/leases/{id}``, half by a consumer
ack written through FeatureClient (the reaper recycles it). At the end it checks, prints and
(with --json) writes: 429s appeared under overload, no 5xx, RSS did not keep growing (mean of
the last third of the samples against the first third), occupancy is back to zero, and no
image was decoded for a request that was then refused (every upload is a valid image, so the
images decoded, ``featpool_decode_duration_seconds_count``, minus the images of 200 answers
are the ones decoded for nothing).
Exit status 1 if a check fails. All traffic goes to 127.0.0.1, bounded by --duration.

    # a same-run baseline: the server of another checkout (e.g. `git worktree add /tmp/m main`)
    python bench/load_test.py --duration 30 --server-root /tmp/m
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
import numpy as np
from appserver import AppServer
from PIL import Image

from pool.client import FeatureClient

ROOT = Path(__file__).resolve().parents[1]
SIZES = [(64, 48), (320, 240), (640, 480), (1280, 960)]


def make_images(seed: int = 0) -> list[tuple[str, bytes, str]]:
    rng = np.random.default_rng(seed)
    out = []
    for w, h in SIZES:
        arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        for fmt, ctype in (("JPEG", "image/jpeg"), ("PNG", "image/png")):
            buf = io.BytesIO()
            Image.fromarray(arr).save(buf, fmt)
            out.append((f"{w}x{h}.{fmt.lower()}", buf.getvalue(), ctype))
    return out


def git_head(root: Path) -> str:
    r = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
        check=False,
        capture_output=True,
        text=True,
    )
    return r.stdout.strip() or "unknown"


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.status: Counter[str] = Counter()
        self.latency: list[float] = []
        self.images_ok = 0
        self.released = Counter[str]()
        self.samples: list[dict[str, float]] = []
        self.errors: list[str] = []
        self.consumer: FeatureClient | None = None
        self.consumer_lock = threading.Lock()

    async def client(
        self,
        http: httpx.AsyncClient,
        url: str,
        deadline: float,
        images: list[tuple[str, bytes, str]],
        rng: random.Random,
    ) -> None:
        while time.monotonic() < deadline:
            n = rng.choice([1, 1, 1, 2, 3])
            files = [("image", rng.choice(images)) for _ in range(n)]
            t0 = time.perf_counter()
            try:
                r = await http.post(
                    f"{url}/v1/encode", files=files, params={"ttl_s": self.args.ttl}
                )
            except httpx.HTTPError as e:
                self.status[f"transport:{type(e).__name__}"] += 1
                continue
            self.status[str(r.status_code)] += 1
            if r.status_code == 200:
                self.latency.append(time.perf_counter() - t0)
                for item in r.json()["items"]:
                    self.images_ok += 1
                    await self.release(http, url, item, rng)
            elif r.status_code == 429:
                await asyncio.sleep(rng.uniform(0.01, 0.05))  # back off a little, not a lot
            elif r.status_code >= 500:
                self.errors.append(r.text[:300])

    async def release(
        self, http: httpx.AsyncClient, url: str, item: dict[str, Any], rng: random.Random
    ) -> None:
        if item["tier"] != "inline" and self.consumer is not None and rng.random() < 0.5:
            with self.consumer_lock:
                self.consumer.release(item)  # writes the ack word; the reaper recycles it
            self.released["ack"] += 1
            return
        r = await http.delete(f"{url}/v1/leases/{item['lease_id']}")
        self.released["delete" if r.status_code == 204 else f"delete:{r.status_code}"] += 1

    async def sampler(
        self, http: httpx.AsyncClient, url: str, pid: int, t0: float, stop: asyncio.Event
    ) -> None:
        while not stop.is_set():
            try:
                m = (await http.get(f"{url}/metrics")).text
                p = (await http.get(f"{url}/v1/pool")).json()
                used = sum(t["used_bytes"] for t in p["tiers"]) + p["inline"]["used_bytes"]
                self.samples.append(
                    {
                        "t": round(time.monotonic() - t0, 2),
                        "rss_mb": rss_bytes(pid) / 2**20,
                        "queue_depth": metric(m, "featpool_queue_depth"),
                        "used_bytes": used,
                        "leases_active": p["leases_active"],
                    }
                )
            except (httpx.HTTPError, OSError) as e:
                self.errors.append(f"sampler: {e}")
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass


async def drive(run: Run, url: str, pid: int) -> dict[str, Any]:
    a = run.args
    images = make_images()
    limits = httpx.Limits(max_connections=a.clients + 4, max_keepalive_connections=a.clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=limits) as http:
        t0 = time.monotonic()
        stop = asyncio.Event()
        sampler = asyncio.create_task(run.sampler(http, url, pid, t0, stop))
        deadline = t0 + a.duration
        await asyncio.gather(
            *(run.client(http, url, deadline, images, random.Random(i)) for i in range(a.clients))
        )
        elapsed = time.monotonic() - t0
        # Acks are read by the reaper every --reap-interval-s; give it a moment.
        final: dict[str, int] = {}
        for _ in range(100):
            p = (await http.get(f"{url}/v1/pool")).json()
            final = {
                "used_bytes": sum(t["used_bytes"] for t in p["tiers"]) + p["inline"]["used_bytes"],
                "leases_active": p["leases_active"],
            }
            if final == {"used_bytes": 0, "leases_active": 0}:
                break
            await asyncio.sleep(0.05)
        stop.set()
        await sampler
        metrics_text = (await http.get(f"{url}/metrics")).text
    return {
        "elapsed_s": elapsed,
        "final_occupancy": final,
        "rejected_queue_full": metric(metrics_text, 'featpool_rejected_total{reason="queue_full"}'),
        "images_decoded": metric(metrics_text, "featpool_decode_duration_seconds_count"),
    }


def summarize(run: Run, extra: dict[str, Any]) -> dict[str, Any]:
    a = run.args
    s = run.samples
    third = max(1, len(s) // 3)
    rss_first = statistics.mean(x["rss_mb"] for x in s[:third]) if s else 0.0
    rss_last = statistics.mean(x["rss_mb"] for x in s[-third:]) if s else 0.0
    lat = sorted(run.latency)

    def pct(p: float) -> float:
        return lat[min(len(lat) - 1, int(p * len(lat)))] * 1000 if lat else float("nan")

    requests = sum(run.status.values())
    res: dict[str, Any] = {
        "encoder": a.encoder,
        "clients": a.clients,
        "queue_size": a.queue_size,
        "max_batch_size": a.max_batch_size,
        "duration_s": a.duration,
        "elapsed_s": round(extra["elapsed_s"], 1),
        "requests": requests,
        "status_counts": dict(run.status),
        "images_encoded": run.images_ok,
        "images_per_s": round(run.images_ok / extra["elapsed_s"], 1),
        "share_429": round(run.status.get("429", 0) / max(requests, 1), 3),
        "latency_ms_200": {
            "p50": round(pct(0.5), 1),
            "p90": round(pct(0.9), 1),
            "p99": round(pct(0.99), 1),
        },
        "released": dict(run.released),
        "samples": len(s),
        "rss_mb": {
            "first_third_mean": round(rss_first, 1),
            "last_third_mean": round(rss_last, 1),
            "max": round(max((x["rss_mb"] for x in s), default=0.0), 1),
        },
        "max_queue_depth": max((x["queue_depth"] for x in s), default=0.0),
        "mean_queue_depth": round(statistics.mean(x["queue_depth"] for x in s), 2) if s else 0,
        "max_leases_active": max((x["leases_active"] for x in s), default=0),
        "final_occupancy": extra["final_occupancy"],
        "rejected_queue_full_metric": extra["rejected_queue_full"],
        "images_decoded": extra["images_decoded"],
        "images_decoded_then_refused": extra["images_decoded"] - run.images_ok,
        "errors": run.errors[:10],
    }
    checks = {
        "429s under overload": run.status.get("429", 0) > 0,
        "no 5xx": not any(k.startswith("5") for k in run.status),
        "no transport errors": not any(k.startswith("transport") for k in run.status),
        "RSS bounded (last third <= first third * 1.2 + 64 MiB)": rss_last <= rss_first * 1.2 + 64,
        "queue depth never above the limit": res["max_queue_depth"] <= a.queue_size,
        "no leaked lease (occupancy 0 at the end)": extra["final_occupancy"]
        == {"used_bytes": 0, "leases_active": 0},
        "no image decoded for a refused request": res["images_decoded_then_refused"] == 0,
    }
    res["checks"] = checks
    return res


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    p.add_argument("--clients", type=int, default=32, help="concurrent HTTP clients")
    p.add_argument("--queue-size", type=int, default=8, help="server --queue-size (small)")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--encoder", default="tiny-test")
    p.add_argument("--ttl", type=float, default=30.0, help="lease TTL asked by the clients")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--socket-dir", type=Path, help="directory for the hand-off socket")
    p.add_argument(
        "--server-root", type=Path, default=ROOT, help="checkout whose server to run (baseline)"
    )
    a = p.parse_args()

    sock_dir = a.socket_dir or Path(tempfile.mkdtemp(prefix="featpool-load-"))
    sock = sock_dir / "featpool.sock"
    log = sock_dir / "server.log"
    args = [
        "--device",
        "cpu",
        "--encoder",
        a.encoder,
        "--queue-size",
        str(a.queue_size),
        "--max-batch-size",
        str(a.max_batch_size),
        "--socket-path",
        str(sock),
        "--host-pool-bytes",
        str(64 << 20),
        "--reap-interval-s",
        "0.02",
        "--feature-cache-entries",  # repeated images are encoded, as the load test means
        "0",
    ]
    try:
        server = AppServer(
            args, log, env={"FEATPOOL_LOG_LEVEL": "WARNING"}, root=a.server_root.resolve()
        )
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 2
    run = Run(a)
    try:
        run.consumer = FeatureClient.connect(sock)
        extra = asyncio.run(drive(run, server.url, server.proc.pid))
    finally:
        if run.consumer is not None:
            run.consumer.close()
        exit_code = server.close()
    res = summarize(run, extra)
    res["command"] = " ".join(["python", "bench/load_test.py", *sys.argv[1:]])
    res["server_commit"] = git_head(a.server_root)
    res["date_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    res["server_exit"] = exit_code
    print(json.dumps({k: v for k, v in res.items() if k != "checks"}, indent=1))
    for name, ok in res["checks"].items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    if a.json:
        a.json.write_text(json.dumps({**res, "timeline": run.samples}, indent=1))
    return 0 if all(res["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
