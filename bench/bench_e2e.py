"""End-to-end benchmark: the real server in a subprocess on a loopback port, driven over HTTP
by several client processes (httpx + asyncio), against a naive baseline in the same run (the
same server with Pillow decode and one forward per request: --max-batch-size 1 --gpu-decode off).

    python bench/bench_e2e.py --device cuda --encoder vit-b16-224 --out /tmp/bench.json

Reports images/s and p50/p99 request latency per point, where the server's time went
(decode, queue wait, encode per batch, mean batch size) from its own /metrics, and the CPU
that each side used while the point ran (cores: CPU seconds per second of wall time) of the
GPU process, of the front processes, of the load generator's client processes and of the
whole machine, so that a point limited by its load generator shows as one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from appserver import AppServer
from make_images import photo_jpeg

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Point:
    server: str  # "featpool" or "naive"
    concurrency: int
    per_request: int  # images per request
    multipart: bool


@dataclass(frozen=True)
class ClientJob:
    url: str
    images: list[bytes]
    conc: int
    seconds: float
    warmup: float
    per_request: int
    multipart: bool
    seed: int
    client: str = "httpx"  # or "aiohttp" (less CPU per request)


def client_proc(job: ClientJob) -> dict[str, Any]:
    return asyncio.run(_timed(job))


async def _timed(job: ClientJob) -> dict[str, Any]:
    """Run the client; also its CPU use over the measured window, and that window's bounds in
    Unix time (for the server's CPU samples)."""
    window: dict[str, float] = {}

    async def clock() -> None:
        await asyncio.sleep(job.warmup)
        window.update(t0=time.time(), cpu0=time.process_time())
        await asyncio.sleep(job.seconds)
        window.update(t1=time.time(), cpu1=time.process_time())

    timer = asyncio.create_task(clock())
    out = await (_client_aiohttp(job) if job.client == "aiohttp" else _client(job))
    await timer
    out["cpu_cores"] = (window["cpu1"] - window["cpu0"]) / (window["t1"] - window["t0"])
    out["window"] = (window["t0"], window["t1"])
    return out


async def _drive(job: ClientJob, send: Callable[[int], Awaitable[int | str]]) -> dict[str, Any]:
    """``job.conc`` workers, each sending requests back to back (``send(i)``: the request of
    images from index ``i``, answering its status or the name of its transport error) until
    the end of the window; latencies and statuses count for requests inside it."""
    lat: list[float] = []
    status: dict[int | str, int] = {}
    done_images = 0
    t_measure = time.perf_counter() + job.warmup
    t_end = t_measure + job.seconds

    async def worker(w: int) -> None:
        nonlocal done_images
        i = job.seed * 1000 + w
        while True:
            t0 = time.perf_counter()
            if t0 >= t_end:
                return
            code = await send(i)
            t1 = time.perf_counter()
            i += job.per_request
            if t0 >= t_measure and t1 <= t_end:
                status[code] = status.get(code, 0) + 1
                if code == 200:
                    lat.append(t1 - t0)
                    done_images += job.per_request

    await asyncio.gather(*(worker(w) for w in range(job.conc)))
    return {"lat": lat, "status": status, "images": done_images}


async def _client_aiohttp(job: ClientJob) -> dict[str, Any]:
    """The same requests as ``_client``, sent with aiohttp (a fraction of httpx's CPU per
    request: the load generator must not be what a point measures)."""
    import aiohttp

    images = job.images
    connector = aiohttp.TCPConnector(limit=job.conc, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:

        async def send(i: int) -> int | str:
            body: aiohttp.FormData | bytes
            if job.multipart:
                body = aiohttp.FormData()
                for k in range(job.per_request):
                    body.add_field(
                        "image",
                        images[(i + k) % len(images)],
                        filename=f"{k}.jpg",
                        content_type="image/jpeg",
                    )
                headers = None
            else:
                body = images[i % len(images)]
                headers = {"content-type": "image/jpeg"}
            try:
                async with http.post(job.url, data=body, headers=headers) as r:
                    await r.read()
                    return r.status
            except (aiohttp.ClientError, TimeoutError) as e:  # counted, not fatal
                return type(e).__name__

        return await _drive(job, send)


async def _client(job: ClientJob) -> dict[str, Any]:
    images = job.images
    limits = httpx.Limits(max_connections=job.conc, max_keepalive_connections=job.conc)
    async with httpx.AsyncClient(limits=limits, timeout=120.0) as http:

        async def send(i: int) -> int | str:
            try:
                if job.multipart:
                    files = [
                        ("image", (f"{k}.jpg", images[(i + k) % len(images)], "image/jpeg"))
                        for k in range(job.per_request)
                    ]
                    r = await http.post(job.url, files=files)
                else:
                    r = await http.post(
                        job.url,
                        content=images[i % len(images)],
                        headers={"content-type": "image/jpeg"},
                    )
                return r.status_code
            except httpx.TransportError as e:  # counted and reported, not fatal
                return type(e).__name__

        return await _drive(job, send)


def scrape(base: str) -> dict[str, float]:
    """Sums and counts of the server's histograms, to split its time."""
    return metric_sums(httpx.get(f"{base}/metrics", timeout=10).text)


def metric_sums(text: str) -> dict[str, float]:
    """``scrape``'s reading of one /metrics text, stamped with the monotonic clock: the
    histograms' sums and counts (``{stage}_stage_sum`` for the batch stages), the GC pauses."""
    out: dict[str, float] = {}
    for name in (
        "decode_duration_seconds",
        "queue_wait_seconds",
        "encode_duration_seconds",
        "batch_size",
        "publish_duration_seconds",
        "job_duration_seconds",
        "front_job_duration_seconds",
    ):
        for kind in ("sum", "count"):
            m = re.search(rf"^featpool_{name}_{kind} (\S+)$", text, re.M)
            out[f"{name}_{kind}"] = float(m.group(1)) if m else 0.0
    for kind, stage, v in re.findall(
        r'^featpool_batch_stage_seconds_(sum|count){stage="(\w+)"} (\S+)$', text, re.M
    ):
        out[f"{stage}_stage_{kind}"] = float(v)
    for key, name in (("gpu", "gc_pause"), ("front", "front_gc_pause")):
        found = re.findall(
            rf'^featpool_{name}_seconds_total{{generation="(\d)"}} (\S+)$', text, re.M
        )
        for gen, v in found:
            out[f"gc_{key}_gen{gen}_s"] = float(v)
        out[f"gc_{key}_s"] = sum(float(v) for _, v in found)
    out["t"] = time.monotonic()
    return out


_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """utime + stime of one process, in seconds (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a scan of /proc: not every kernel has
    /proc/PID/task/PID/children)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy (all cores), from /proc/stat."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / _TICK  # minus idle and iowait


def cpu_sample(server_pid: int, fronts: list[int]) -> dict[str, float]:
    """CPU seconds so far: the server (GPU) process, its front processes, the machine."""
    return {
        "wall": time.time(),
        "gpu_process": _cpu_s(server_pid),
        "fronts": sum(_cpu_s(c) for c in fronts),
        "machine": _machine_busy_s(),
    }


class CpuSampler:
    """Samples the server's and the machine's CPU every ``every`` s on a thread, so that the
    clients' measured window (known only afterwards) can be cut out of them."""

    def __init__(self, server_pid: int, every: float = 0.25) -> None:
        self._pid, self._fronts = server_pid, _children(server_pid)
        self._every = every
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(cpu_sample(self._pid, self._fronts))
            self._stop.wait(self._every)

    def cores(self, t0: float, t1: float) -> dict[str, float]:
        """Cores used between the first sample after t0 and the last before t1."""
        self._stop.set()
        self._thread.join()
        inside = [x for x in self.samples if t0 <= x["wall"] <= t1]
        if len(inside) < 2:
            return {}
        a, b = inside[0], inside[-1]
        wall = b["wall"] - a["wall"]
        return {f"{k}_cores": (b[k] - a[k]) / wall for k in ("gpu_process", "fronts", "machine")}


class GpuSampler:
    """``nvidia-smi``'s utilisation of GPU 0 every 250 ms, on a thread: the share of time a
    kernel ran (SMs) and the JPEG engines' (the hardware decoder that torchvision's batched
    nvJPEG and nvImageCodec both drive), averaged over the clients' window afterwards.
    Without nvidia-smi, nothing."""

    FIELDS = ("sm", "jpeg")

    def __init__(self) -> None:
        self.samples: list[tuple[float, list[float]]] = []
        try:
            self._proc: subprocess.Popen[str] | None = subprocess.Popen(
                [
                    "nvidia-smi",
                    "-i",
                    "0",
                    "--query-gpu=utilization.gpu,utilization.jpeg",
                    "--format=csv,noheader,nounits",
                    "-lms",
                    "250",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        except OSError:
            self._proc = None
            return
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            with contextlib.suppress(ValueError):  # "[N/A]" where a field is not supported
                self.samples.append((time.time(), [float(x) for x in line.split(",")]))

    def busy(self, t0: float, t1: float) -> dict[str, float]:
        """Mean utilisation (%) of the samples between t0 and t1."""
        if self._proc is None:
            return {}
        self._proc.terminate()
        self._proc.wait()
        inside = [v for t, v in self.samples if t0 <= t <= t1]
        if not inside:
            return {}
        return {
            f"gpu_{name}_busy_pct": float(np.mean([v[k] for v in inside]))
            for k, name in enumerate(self.FIELDS)
        }


def delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    d = {k: b[k] - a.get(k, 0.0) for k in b}

    def mean(name: str, scale: float = 1.0) -> float:
        n = d.get(f"{name}_count", 0.0)
        return d[f"{name}_sum"] / n * scale if n else float("nan")

    return {
        "decode_ms": mean("decode_duration_seconds", 1e3),
        "queue_ms": mean("queue_wait_seconds", 1e3),
        "encode_ms_per_batch": mean("encode_duration_seconds", 1e3),
        "publish_us": mean("publish_duration_seconds", 1e6),
        "mean_batch": mean("batch_size"),
        # each pipeline stage's time per batch, in its thread: the slower one is the cycle
        "prepare_ms_per_batch": mean("prepare_stage", 1e3),
        "run_ms_per_batch": mean("run_stage", 1e3),
        # an encode job as the fronts see it (sent -> answered) and inside the GPU process
        "front_job_ms": mean("front_job_duration_seconds", 1e3),
        "gpu_job_ms": mean("job_duration_seconds", 1e3),
        "batches": d["batch_size_count"],
        # ms of collector pauses per second of wall time (fronts: summed over them)
        "gc_gpu_ms_per_s": d["gc_gpu_s"] / d["t"] * 1e3,
        "gc_fronts_ms_per_s": d["gc_front_s"] / d["t"] * 1e3,
        "gc_gpu_ms_per_s_by_generation": [
            d.get(f"gc_gpu_gen{g}_s", 0.0) / d["t"] * 1e3 for g in range(3)
        ],
    }


class Server(AppServer):
    """The server for one side of the comparison, with the bench's fixed settings."""

    def __init__(self, args: argparse.Namespace, extra: list[str], log: Path) -> None:
        super().__init__(
            [
                "--device",
                args.device,
                "--encoder",
                args.encoder,
                "--socket-path",
                f"/tmp/featpool-bench-{args.port}.sock",
                "--max-leases",
                "65536",
                "--pool-bytes",
                str(args.pool_bytes),
                "--host-pool-bytes",
                str(args.pool_bytes),
                "--slab-bytes",
                str(512 << 20),
                "--queue-size",
                "8192",
                "--max-images-per-request",
                "64",
                "--lease-ttl-s",
                "2",
                "--log-level",
                "WARNING",
                # The bench cycles a few distinct images: with the feature index on, all but
                # the first of each would be copies of resident features, not encodes.
                "--feature-cache-entries",
                "0",
                *args.server_args,
                *extra,
            ],
            log,
            root=args.server_root,
            port=args.port,
            start_timeout_s=args.start_timeout,
        )
        self.base = self.url
        caps = httpx.get(f"{self.base}/v1/pool", timeout=5).json()["capabilities"]
        self.transport = str(caps.get("transport"))


def run_point(
    args: argparse.Namespace, srv: Server, images: list[bytes], p: Point
) -> dict[str, Any]:
    procs = args.client_procs
    if args.max_conns_per_proc > 0:  # more processes rather than more connections each
        procs = max(procs, -(-p.concurrency // args.max_conns_per_proc))
    procs = min(procs, p.concurrency)
    per = [p.concurrency // procs + (1 if i < p.concurrency % procs else 0) for i in range(procs)]
    before = scrape(srv.base)
    sampler, gpu = CpuSampler(srv.proc.pid), GpuSampler()
    spy = _py_spy(args, srv.proc.pid, p)
    ctx = get_context("spawn")
    with ProcessPoolExecutor(procs, mp_context=ctx) as ex:
        futs = [
            ex.submit(
                client_proc,
                ClientJob(
                    f"{srv.base}/v1/encode",
                    images,
                    c,
                    args.seconds,
                    args.warmup,
                    p.per_request,
                    p.multipart,
                    i,
                    args.client,
                ),
            )
            for i, c in enumerate(per)
        ]
        parts = [f.result() for f in futs]
    # The window every client measured in.
    t0 = max(part["window"][0] for part in parts)
    t1 = min(part["window"][1] for part in parts)
    cpu = {**sampler.cores(t0, t1), **gpu.busy(t0, t1)}
    if spy is not None:
        spy.wait()
    after = scrape(srv.base)
    lat = np.array([x for part in parts for x in part["lat"]])
    status: dict[str, int] = {}
    for part in parts:
        for k, v in part["status"].items():
            status[str(k)] = status.get(str(k), 0) + v
    n_img = sum(part["images"] for part in parts)
    row = {
        "server": p.server,
        "concurrency": p.concurrency,
        "images_per_request": p.per_request,
        "body": "multipart" if p.multipart else "raw",
        "images_per_s": n_img / args.seconds,
        "requests": int(lat.size),
        "p50_ms": float(np.percentile(lat, 50) * 1e3) if lat.size else float("nan"),
        "p99_ms": float(np.percentile(lat, 99) * 1e3) if lat.size else float("nan"),
        "status": status,
        **delta(before, after),
        "client_procs": procs,
        "client_cores": sum(part["cpu_cores"] for part in parts),
        **cpu,
    }
    print(json.dumps(row), flush=True)
    return row


def _py_spy(args: argparse.Namespace, pid: int, p: Point) -> subprocess.Popen[bytes] | None:
    """With ``--py-spy DIR``: sample the GPU process's Python stacks over the point's window,
    as collapsed stacks in DIR: the thread holding the interpreter lock at each sample (none
    held: no sample), so samples / (rate x duration) is how busy the lock was. With
    ``--py-spy-native``: every thread's stack at each sample, native frames (the driver's,
    nvJPEG's, the lock's waits) included; py-spy pauses the process to take them."""
    if args.py_spy is None:
        return None
    args.py_spy.mkdir(parents=True, exist_ok=True)
    name = f"{p.server}-{'mp' if p.multipart else 'raw'}-{p.per_request}x{p.concurrency}.txt"
    if args.py_spy_native:
        mode = ["--rate", "100", "--native", "--idle"]
    else:
        mode = ["--rate", "200", "--gil", "--nonblocking"]
    return subprocess.Popen(
        [
            "py-spy",
            "record",
            "--pid",
            str(pid),
            *mode,
            "--threads",
            "--format",
            "raw",
            "--duration",
            str(int(args.warmup + args.seconds)),
            "--output",
            str(args.py_spy / name),
        ],
        stdout=subprocess.DEVNULL,
    )


def parse_points(spec: str, server: str) -> list[Point]:
    """'raw:1x16,raw:1x64,mp:8x32' -> points (body:images_per_request x concurrency)."""
    out = []
    for item in filter(None, spec.split(",")):  # "" : no points (that server is not started)
        body, rest = item.split(":")
        k, c = rest.split("x")
        out.append(Point(server, int(c), int(k), body == "mp"))
    return out


def parser() -> argparse.ArgumentParser:
    """The bench's arguments (bench/suite.py starts from their defaults too)."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--encoder", default="vit-b16-224")
    ap.add_argument("--port", type=int, default=18080)
    ap.add_argument("--images", type=int, default=64, help="distinct JPEGs")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--height", type=int, default=768)
    ap.add_argument(
        "--mixed-shapes",
        action="store_true",
        help="photos of several aspect ratios (4:3, 3:4, 3:2, 16:9, 1:1, 2:3) with a long side "
        "of --width, as users send them, instead of all --width x --height",
    )
    ap.add_argument("--seconds", type=float, default=10.0, help="measured time per point")
    ap.add_argument("--warmup", type=float, default=2.0, help="unmeasured time per point")
    ap.add_argument("--client-procs", type=int, default=4, help="client processes, at least")
    ap.add_argument(
        "--max-conns-per-proc",
        type=int,
        default=16,
        help="start more client processes rather than give one more connections (0: no cap). "
        "One httpx process with ~43 connections topped out near 150 requests/s on the H200 "
        "host: past that the point measures the load generator",
    )
    ap.add_argument(
        "--client",
        choices=["httpx", "aiohttp"],
        default="httpx",
        help="HTTP client of the load generator (aiohttp spends less CPU per request)",
    )
    ap.add_argument("--pool-bytes", type=int, default=4 << 30)
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument(
        "--points",
        default="raw:1x16,raw:1x64,raw:1x256,mp:8x32",
        help="featpool points: body:images_per_request x concurrency",
    )
    ap.add_argument("--baseline-points", default="raw:1x16,raw:1x64")
    ap.add_argument(
        "--featpool-args", default="--max-batch-size 128 --max-batch-wait-ms 4 --decode-workers 8"
    )
    ap.add_argument(
        "--baseline-args",
        default="--max-batch-size 1 --max-batch-wait-ms 0 --gpu-decode off --decode-workers 1",
    )
    ap.add_argument("--server-args", nargs="*", default=[], help="passed to both servers")
    ap.add_argument(
        "--server-root",
        type=Path,
        default=ROOT,
        help="the checkout whose server runs (another tree's, for a same-run comparison)",
    )
    ap.add_argument("--logs", type=Path, default=Path("/tmp"))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--py-spy", type=Path, help="profile the GPU process with py-spy into DIR")
    ap.add_argument(
        "--py-spy-native",
        action="store_true",
        help="with --py-spy: all threads, native frames included, idle ones too (not the lock)",
    )
    return ap


def main() -> None:
    args = parser().parse_args()

    t0 = time.time()
    shapes = [(args.width, args.height)]
    if args.mixed_shapes:
        ratios = [(4, 3), (3, 4), (3, 2), (16, 9), (1, 1), (2, 3)]
        shapes = [(args.width * w // max(w, h), args.width * h // max(w, h)) for w, h in ratios]
    images = [photo_jpeg(i, *shapes[i % len(shapes)]) for i in range(args.images)]
    print(
        f"{len(images)} JPEGs {' '.join(f'{w}x{h}' for w, h in shapes)}, mean "
        f"{np.mean([len(i) for i in images]) / 1e3:.0f} KB, made in {time.time() - t0:.1f} s",
        flush=True,
    )
    rows = []
    args.logs.mkdir(parents=True, exist_ok=True)
    for name, extra, spec in (
        ("featpool", args.featpool_args, args.points),
        ("naive", args.baseline_args, args.baseline_points),
    ):
        if not parse_points(spec, name):
            continue
        srv = Server(args, extra.split(), args.logs / f"bench_server_{name}.log")
        print(f"{name} (transport {srv.transport}): {' '.join(srv.cmd[1:])}", flush=True)
        try:
            rows += [run_point(args, srv, images, p) for p in parse_points(spec, name)]
        finally:
            srv.close()
    best = {
        s: max((r["images_per_s"] for r in rows if r["server"] == s), default=0.0)
        for s in ("featpool", "naive")
    }
    nan = float("nan")
    print(
        "\n| server | body | img/req | conc | images/s | p50 ms | p99 ms | batch | "
        "decode ms | queue ms | encode ms/batch | stage ms/batch: prepare / run "
        "| cores: GPU proc / fronts / clients / machine "
        "| GC ms/s: GPU proc / fronts | job ms: front / GPU proc | GPU busy %: SMs / JPEG "
        "| non-200 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        bad = {k: v for k, v in r["status"].items() if k != "200"}
        print(
            f"| {r['server']} | {r['body']} | {r['images_per_request']} | {r['concurrency']} "
            f"| {r['images_per_s']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
            f"{r['mean_batch']:.1f} | {r['decode_ms']:.2f} | {r['queue_ms']:.1f} | "
            f"{r['encode_ms_per_batch']:.1f} | {r.get('prepare_ms_per_batch', nan):.1f} / "
            f"{r.get('run_ms_per_batch', nan):.1f} | {r.get('gpu_process_cores', nan):.1f} / "
            f"{r.get('fronts_cores', nan):.1f} / {r['client_cores']:.1f} / "
            f"{r.get('machine_cores', nan):.1f} | {r.get('gc_gpu_ms_per_s', nan):.1f} / "
            f"{r.get('gc_fronts_ms_per_s', nan):.1f} | {r.get('front_job_ms', nan):.1f} / "
            f"{r.get('gpu_job_ms', nan):.1f} | {r.get('gpu_sm_busy_pct', nan):.0f} / "
            f"{r.get('gpu_jpeg_busy_pct', nan):.0f} | {bad or '-'} |"
        )
    ratio = best["featpool"] / best["naive"] if best["naive"] else float("nan")
    print(
        f"\nbest featpool {best['featpool']:.0f} images/s, best naive {best['naive']:.0f} "
        f"images/s, ratio {ratio:.1f}x"
    )
    if args.out:
        served = {"server_root": str(args.server_root), "mixed_shapes": args.mixed_shapes}
        args.out.write_text(
            json.dumps({"rows": rows, "best": best, "ratio": ratio, **served}, indent=1)
        )


if __name__ == "__main__":
    main()
