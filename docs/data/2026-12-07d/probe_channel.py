"""probe_engine.py's engine, now fed through the job channel: the engine and its JobServer as
``python -m app`` builds them in the GPU process (create_app with --http-workers 4), and four
child processes that each send encode jobs as a front does (JobClient, the bytes through the
connection's memfd arena, the header and digest computed in the child), 16 photos a job,
CONC/4 jobs in flight each, no HTTP. Leases are left to their 2 s TTL, as bench_e2e's clients
leave them; with RELEASE=1 each is released through the channel, as probe_engine.py releases
them, which leaves the pool's reaper (it ends expired leases in passes) nothing to do. Prints
images/s and the prepare and run stages per batch from the engine's own metrics.

Against probe_engine.py (~13 ms prepare a batch on an H100) and a service row (~17-18 ms):
~17 here puts the service's extra cost in the GPU process's side of the job channel, or, if
RELEASE=1 gives ~13, in the reaper's passes; ~13 both ways puts it in the HTTP fronts.

    python3 docs/data/2026-12-07d/probe_channel.py [seconds] [concurrency]
Env: RELEASE=1 (above); DEVICE=cpu for a smoke run (the numbers then mean nothing)."""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # as python -m app sets it

from bench_e2e import delta, metric_sums  # noqa: E402
from make_images import photo_jpeg  # noqa: E402

from app.engine_client import EncodeOptions, ImageIn  # noqa: E402
from app.featindex import content_digest  # noqa: E402
from app.imaging import image_limits, inspect  # noqa: E402
from app.jobs import JobClient, channel_paths  # noqa: E402
from app.settings import Settings  # noqa: E402

PER = 16
FRONTS = 4
DEVICE = os.environ.get("DEVICE", "cuda")
RELEASE = os.environ.get("RELEASE") == "1"  # release each lease, as probe_engine.py does


def settings(sock: Path) -> Settings:
    big = DEVICE == "cuda"
    return Settings(
        device=DEVICE,
        encoder="vit-b16-224",
        socket_path=sock,
        http_workers=FRONTS,  # the JobServer starts; the fronts are this script's children
        max_leases=65536,
        pool_bytes=16 << 30 if big else 512 << 20,
        host_pool_bytes=1 << 30 if big else 512 << 20,
        slab_bytes=512 << 20 if big else 64 << 20,
        queue_size=8192,
        max_images_per_request=64,
        lease_ttl_s=2,
        feature_cache_entries=0,
        max_batch_size=128,
        max_batch_wait_ms=4,
        decode_workers=8,
        max_inflight_decoded_bytes=8 << 30,
        gpu_decode="on" if big else "off",
    )


async def front(sock: Path, seconds: float, tasks: int, first: int) -> None:
    """One child: a front's JobClient, ``tasks`` jobs of PER photos in flight until the end."""
    s = settings(sock)
    photos = [photo_jpeg(i) for i in range(32)]
    limits = image_limits(s)
    ready = [(p, inspect(p, **limits), content_digest(p)) for p in photos]
    client = JobClient(channel_paths(sock)[0], s.job_arena_bytes)
    stop = time.monotonic() + seconds

    async def one(k: int) -> None:
        i = k * PER
        while time.monotonic() < stop:
            picked = [ready[(i + j) % len(ready)] for j in range(PER)]
            i += PER
            imgs = [ImageIn(f"p{n}", p, h, d) for n, (p, h, d) in enumerate(picked)]
            descs = await client.encode(imgs, EncodeOptions(ttl_s=2))
            if RELEASE:
                for d in descs:
                    await client.release(d.lease_id)

    try:
        await asyncio.gather(*(one(first + k) for k in range(tasks)))
    finally:
        await client.close()


def main() -> None:
    if sys.argv[1:2] == ["--front"]:
        sock, seconds, tasks, first = Path(sys.argv[2]), *map(float, sys.argv[3:6])
        asyncio.run(front(sock, seconds, int(tasks), int(first)))
        return
    from fastapi.testclient import TestClient

    from app.main import create_app

    secs = float(sys.argv[1]) if len(sys.argv) > 1 else 5.0
    conc = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    sock = Path(tempfile.mkdtemp()) / "probe.sock"
    s = settings(sock)
    sys.setswitchinterval(s.gil_switch_interval_ms / 1e3)  # as python -m app sets it
    with TestClient(create_app(s, tune_gc=True)) as c:
        engine = c.app.state.engine  # type: ignore[attr-defined]
        print(f"device {DEVICE}, decoder {engine.decoder_name}, {FRONTS} fronts, c={conc}")
        total = 2.0 + 2 * secs + 1.0
        each = conc // FRONTS
        kids = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--front",
                    str(sock),
                    str(total),
                    str(each),
                    str(k * each),
                ]
            )
            for k in range(FRONTS)
        ]
        time.sleep(2.0)  # warm-up: the children start and fill the pipeline
        marks = [metric_sums(c.get("/metrics").text)]
        for _ in range(2):
            time.sleep(secs)
            marks.append(metric_sums(c.get("/metrics").text))
        for label, (a, b) in zip(("run 1", "run 2"), itertools.pairwise(marks), strict=True):
            d = delta(a, b)  # bench_e2e's per-batch means of the same metrics
            n = b["batch_size_sum"] - a["batch_size_sum"]
            line = f"{label}: {n / (b['t'] - a['t']):,.0f} images/s"
            for st in ("prepare", "run"):
                if d["batches"] and not math.isnan(d[f"{st}_ms_per_batch"]):
                    line += f", {st} {d[f'{st}_ms_per_batch']:.2f} ms a batch"
            if d["batches"]:
                line += f", batch {d['mean_batch']:.1f}"
            print(line, flush=True)
        for k in kids:
            print(f"front rc={k.wait(timeout=60)}")


if __name__ == "__main__":
    main()
