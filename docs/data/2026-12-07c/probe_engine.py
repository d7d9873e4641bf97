"""Is the prepare call slower in the service because of the GPU process's own threads, or
because of what the fronts and the job channel add? The engine as ``python -m app`` builds it
(create_app, the same settings as bench_e2e's 16x64 rows), with no fronts, no job channel and
no HTTP: C tasks on the app's own event loop each send 16 photos at a time, as spans of one
sealed memfd arena (as a front's), through the in-process client, and release the leases.
Prints images/s and the prepare and run stages per batch from the engine's own metrics;
compare with a service row of the same machine (~17 ms prepare a batch on an H100) and with
probe_ceiling.py's bare call (~12.5 ms).

    python3 docs/data/2026-12-07c/probe_engine.py [seconds] [concurrency]
Env: DEVICE=cpu for a smoke run of the mechanics (the numbers then mean nothing)."""

from __future__ import annotations

import asyncio
import fcntl
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # as python -m app sets it

from fastapi.testclient import TestClient  # noqa: E402
from make_images import photo_jpeg  # noqa: E402

from app.engine_client import EncodeOptions, ImageIn  # noqa: E402
from app.imaging import image_limits, inspect  # noqa: E402
from app.job_arena import ArenaView  # noqa: E402
from app.main import create_app  # noqa: E402
from app.settings import Settings  # noqa: E402

SECONDS = float(sys.argv[1]) if len(sys.argv) > 1 else 5.0
CONC = int(sys.argv[2]) if len(sys.argv) > 2 else 64
PER = 16
DEVICE = os.environ.get("DEVICE", "cuda")

photos = [photo_jpeg(i) for i in range(32)]
fd = os.memfd_create("probe-arena", os.MFD_ALLOW_SEALING)
blob = b"".join(photos)
os.write(fd, blob)
fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
arena = ArenaView(fd, len(blob))
offsets = [sum(map(len, photos[:i])) for i in range(len(photos))]
views = [arena.images(o, [len(p)])[0] for o, p in zip(offsets, photos, strict=True)]

s = Settings(
    device=DEVICE,
    encoder="vit-b16-224",
    socket_path=Path(tempfile.mkdtemp()) / "probe.sock",
    max_leases=65536,
    pool_bytes=4 << 30 if DEVICE == "cuda" else 512 << 20,
    host_pool_bytes=4 << 30 if DEVICE == "cuda" else 512 << 20,
    slab_bytes=512 << 20 if DEVICE == "cuda" else 64 << 20,
    queue_size=8192,
    max_images_per_request=64,
    lease_ttl_s=2,
    feature_cache_entries=0,
    max_batch_size=128,
    max_batch_wait_ms=4,
    decode_workers=8,
    max_inflight_decoded_bytes=8 << 30,
    gpu_decode="on" if DEVICE == "cuda" else "off",
)
limits = image_limits(s)
headers = [inspect(v, **limits) for v in views]
sys.setswitchinterval(s.gil_switch_interval_ms / 1e3)  # as python -m app sets it


def stages(c: TestClient) -> dict[str, float]:
    text = c.get("/metrics").text
    out = {
        f"{st}_{k}": float(v)
        for k, st, v in re.findall(
            r'^featpool_batch_stage_seconds_(sum|count){stage="(\w+)"} (\S+)$', text, re.M
        )
    }
    out["t"] = time.monotonic()
    return out


async def load(client: object, seconds: float) -> int:
    done = 0
    stop = time.monotonic() + seconds

    async def one(k: int) -> None:
        nonlocal done
        i = k
        while time.monotonic() < stop:
            idx = [(i + j) % len(photos) for j in range(PER)]
            i += PER
            imgs = [ImageIn(f"p{j}", views[j], headers[j], None, arena, offsets[j]) for j in idx]
            descs = await client.encode(imgs, EncodeOptions(ttl_s=2))  # type: ignore[attr-defined]
            for d in descs:
                await client.release(d.lease_id)  # type: ignore[attr-defined]
            done += len(descs)

    await asyncio.gather(*(one(k) for k in range(CONC)))
    return done


with TestClient(create_app(s, tune_gc=True)) as c:
    client = c.app.state.engine_client  # type: ignore[attr-defined]
    print(f"device {DEVICE}, decoder {c.app.state.engine.decoder_name}, {CONC} tasks of {PER}")  # type: ignore[attr-defined]
    for label, secs in (("warm-up", 2.0), ("run 1", SECONDS), ("run 2", SECONDS)):
        a = stages(c)
        n = c.portal.call(load, client, secs)  # type: ignore[union-attr]
        b = stages(c)
        dt = b["t"] - a["t"]
        line = f"{label}: {n / dt:,.0f} images/s"
        for st in ("prepare", "run"):
            cnt = b.get(f"{st}_count", 0) - a.get(f"{st}_count", 0)
            took = b.get(f"{st}_sum", 0) - a.get(f"{st}_sum", 0)
            if cnt:
                line += f", {st} {took / cnt * 1e3:.2f} ms a batch"
        batches = b.get("prepare_count", 0) - a.get("prepare_count", 0)
        if batches:
            line += f", batch {n / batches:.1f}"
        print(line, flush=True)
