"""The benchmark suite: every sweep in one command, one JSON file of results.

    python3 bench/suite.py --mode gpu --out $OUT/suite.json     # on the H200, about 3.5 min
    python3 bench/suite.py --mode cpu --out /tmp/suite-cpu.json # reduced, host_shm, tiny-test

Sweeps (each in its own subprocess with a time cap, so that one crash or hang costs that sweep
only; each point inside a sweep is guarded too, and its error is recorded in the JSON):
  handoff    feature size 0.3-128 MB: hand-off latency (producer publish -> consumer has read it)
             for the pool and the baselines (CPU transport tensor -> bytes -> tensor,
             torch.multiprocessing CUDA IPC, a fresh VMM allocation exported per lease; on the CPU
             a fresh memfd per lease), and bandwidth into the pool against a plain copy (D2D on
             the GPU, memcpy on the CPU: the device's own limit);
  consumers  1, 2, 4, 8 consumer processes on one pool, closed loop: latency, leases/s;
  encoder    the encoder's own throughput without HTTP (batch 128, CUDA events on the GPU);
  e2e        concurrency 1-256 over HTTP (bench_e2e's server and clients), one image per
             request and sixteen: images/s, p50/p99, against the naive encode path in the
             same run;
  alloc      allocator ns/op and fragmentation under lease churn (bench_alloc.py, CPU).

Results are written after every sweep (and the running sweep's points as they come), so a run
cut short by an outer time limit still leaves what it measured. ``bench/report.py`` turns the
JSON into docs/report.md and docs/img/*.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from appserver import free_port, gpu_name  # noqa: E402

MB = 1_000_000
MiB = 1 << 20
SWEEPS = ("handoff", "consumers", "encoder", "e2e", "alloc")
HIDDEN = 2048  # feature width: a size of S MB is a [S * 1e6 / 4096, 2048] bf16 tensor


@dataclass(frozen=True)
class Budget:
    cap_s: float  # the most this sweep may take
    min_s: float  # below this, the sweep is skipped rather than started


# Caps sum to more than the total budget on purpose: a sweep that finishes early leaves its
# time to the next; ``min_s`` of the sweeps still to come is always held back.
BUDGETS: dict[str, dict[str, Budget]] = {
    "gpu": {
        "handoff": Budget(45, 20),
        "consumers": Budget(30, 15),
        "encoder": Budget(25, 12),
        "e2e": Budget(135, 50),
        "alloc": Budget(20, 8),
    },
    "cpu": {
        "handoff": Budget(45, 15),
        "consumers": Budget(35, 12),
        "encoder": Budget(20, 8),
        "e2e": Budget(60, 25),
        "alloc": Budget(20, 6),
    },
}
TOTAL_BUDGET_S = {"gpu": 240.0, "cpu": 165.0}


@dataclass(frozen=True)
class HandoffCfg:
    sizes_mb: tuple[float, ...]
    iters: dict[float, int]  # per size: pool, IPC; the slow baselines get fewer
    bw_reps: int


HANDOFF = {
    "gpu": HandoffCfg(
        (0.3, 1, 4, 9.8, 32, 128), {0.3: 40, 1: 40, 4: 30, 9.8: 30, 32: 15, 128: 6}, 3
    ),
    "cpu": HandoffCfg(
        (0.3, 1, 4, 9.8, 32, 128), {0.3: 40, 1: 30, 4: 20, 9.8: 12, 32: 6, 128: 3}, 3
    ),
    "quick": HandoffCfg((0.3, 1), {0.3: 4, 1: 3}, 1),
}
CONSUMERS = {
    "gpu": ((1, 2, 4, 8), 9.8, 1.5),
    "cpu": ((1, 2, 4, 8), 1.0, 1.5),
    "quick": ((1, 2), 0.3, 0.3),
}  # counts, feature MB, seconds per point


def e2e_cfg(mode: str) -> dict[str, Any]:
    if mode == "gpu":
        return {
            "device": "cuda",
            "encoder": "vit-b16-224",
            "images": 16,
            "width": 1024,
            "height": 768,
            "seconds": 2.5,
            "warmup": 1.0,
            # aiohttp, as issue 17's runs: httpx took ~7 of the 16 cores at 1x256 (Dec 4 18:41,
            # 12.5 busy in all) and the point measured the load generator; aiohttp ~1.4.
            "client": "aiohttp",
            "client_procs": 4,
            "max_conns_per_proc": 32,
            "pool_bytes": 4 << 30,
            "start_timeout": 90.0,
            # One and sixteen images per request, each against concurrency (issue 17).
            "points": "raw:1x1,raw:1x16,raw:1x64,raw:1x256,mp:16x4,mp:16x16,mp:16x32,mp:16x64",
            "baseline_points": "raw:1x1,raw:1x16,raw:1x64",
            # The decoded-bytes bound raised: 64 requests of 16 photos (2.4 MB each decoded)
            # go over the default 2 GiB, and the point would measure admission, not capacity.
            "featpool_args": "--max-batch-size 128 --max-batch-wait-ms 4 --decode-workers 8 "
            "--max-inflight-decoded-bytes 8589934592",
            "baseline_args": "--max-batch-size 1 --max-batch-wait-ms 0 --gpu-decode off "
            "--decode-workers 4 --no-encoder-cuda-graphs",
            "point_s": 6.0,
            "baseline_reserve_s": 35.0,
        }
    return {
        "device": "cpu",
        "encoder": "tiny-test",
        "images": 8,
        "width": 320,
        "height": 240,
        "seconds": 3.0,
        "warmup": 0.5,
        "client_procs": 1,
        "max_conns_per_proc": 0,  # two cores: the tiny encoder, not the client, is the limit
        "pool_bytes": 1 << 30,
        "start_timeout": 40.0,
        "points": "raw:1x1,raw:1x16,raw:1x64,mp:16x8",
        "baseline_points": "raw:1x1,raw:1x16",
        "featpool_args": "--max-batch-size 64 --max-batch-wait-ms 4 --decode-workers 2",
        "baseline_args": "--max-batch-size 1 --max-batch-wait-ms 0 --gpu-decode off "
        "--decode-workers 2 --no-encoder-cuda-graphs",
        "point_s": 5.0,
        "baseline_reserve_s": 18.0,
    }


# ---- machine and provenance ----------------------------------------------------------------


def date_u() -> str:
    try:
        return subprocess.run(
            ["date", "-u"], capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return time.strftime("%a %b %d %H:%M:%S UTC %Y", time.gmtime())


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(with_torch: bool = True) -> dict[str, Any]:
    m: dict[str, Any] = {
        "gpu": gpu_name(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        # other work on the machine at the start (1, 5, 15 min load averages)
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    if with_torch:
        import torch

        m["torch"] = torch.__version__
        m["cuda_available"] = bool(torch.cuda.is_available())
        try:
            import cuda.bindings

            m["cuda_bindings"] = str(cuda.bindings.__version__)
        except ImportError:
            m["cuda_bindings"] = "absent"
    return m


def stats_us(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"median_us": float("nan"), "p90_us": float("nan"), "p99_us": float("nan"), "n": 0}
    s = sorted(xs)
    return {
        "median_us": s[len(s) // 2],
        "p90_us": s[min(len(s) - 1, int(0.9 * len(s)))],
        "p99_us": s[min(len(s) - 1, int(0.99 * len(s)))],
        "n": len(s),
    }


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2] if xs else float("nan")


# ---- a fresh VMM allocation per lease (baseline), through pool.driver's Driver methods -------


@dataclass
class FreshAlloc:
    handle: Any
    ptr: int
    size: int


def fresh_vmm_export(
    drv: Any, ordinal: int, gran: int, *, src_ptr: int, nbytes: int, stream: int
) -> tuple[FreshAlloc, int]:
    """Producer: cuMemCreate, reserve + map + set access, copy the feature in, export a POSIX FD.
    The caller syncs the stream before sending the FD (there is no ready word here)."""
    from pool.backends.vmm import map_allocation, round_up
    from pool.driver import HandleType

    size = round_up(nbytes, gran)
    handle = drv.mem_create(size, ordinal, HandleType.POSIX_FD)
    try:
        ptr = map_allocation(drv, handle, size, gran, ordinal, read_only=False)
    except BaseException:
        drv.mem_release(handle)
        raise
    alloc = FreshAlloc(handle, ptr, size)
    try:
        drv.memcpy_dtod_async(ptr, src_ptr, nbytes, stream)
        fd = drv.export_fd(handle)
    except BaseException:
        fresh_vmm_free(drv, alloc)
        raise
    return alloc, fd


def fresh_vmm_import(drv: Any, fd: int, size: int, gran: int, ordinal: int) -> FreshAlloc:
    """Consumer: import the FD (closed here), reserve + map read-only."""
    from pool.backends.vmm import map_allocation

    try:
        handle = drv.import_fd(fd)
    finally:
        os.close(fd)
    try:
        ptr = map_allocation(drv, handle, size, gran, ordinal, read_only=True)
    except BaseException:
        drv.mem_release(handle)
        raise
    return FreshAlloc(handle, ptr, size)


def fresh_vmm_free(drv: Any, a: FreshAlloc) -> None:
    drv.mem_unmap(a.ptr, a.size)
    drv.address_free(a.ptr, a.size)
    drv.mem_release(a.handle)


# ---- the consumer process ------------------------------------------------------------------


def last_word(t: Any) -> int:
    import torch

    return int(t.reshape(-1)[-1:].view(torch.int16).item())


def consumer_main(conn: Any, sock: str, use_cuda: bool) -> None:
    """A consumer process: attach once, then serve (kind, payload) messages; answer
    (t_done, last_word, t_received, extra) with perf_counter times (CLOCK_MONOTONIC, shared
    by the processes of one machine)."""
    import mmap
    from multiprocessing.reduction import ForkingPickler, recv_handle

    import torch
    import torch.multiprocessing  # CUDA tensors unpickle as IPC handles

    from pool.backends.host_shm import whole_tensor
    from pool.client import FeatureClient

    if use_cuda:
        torch.cuda.init()  # type: ignore[no-untyped-call]
        torch.empty(1, device="cuda")
    client = FeatureClient.connect(sock)
    drv: Any = None
    rt: Any = None
    conn.send("attached")
    while True:
        buf = conn.recv_bytes()
        t_recv = time.perf_counter()
        kind, payload = ForkingPickler.loads(buf)  # CUDA IPC opens its handle in here
        extra: dict[str, float] = {}
        if kind == "quit":
            break
        if kind == "ping":
            conn.send((time.perf_counter(), 0, t_recv, extra))
            continue
        if kind == "pool":
            t = client.open(payload)
            last = last_word(t)
            t1 = time.perf_counter()
            client.release(payload)
            del t
        elif kind == "cuda_ipc":
            t = payload
            last = last_word(t)
            t1 = time.perf_counter()
            del t, payload
        elif kind == "cpu_bytes":
            shape = payload
            raw = conn.recv_bytes()
            with warnings.catch_warnings():  # read-only bytes: torch warns, we only read
                warnings.simplefilter("ignore")
                t = torch.frombuffer(raw, dtype=torch.uint8)
            if use_cuda:
                t = t.to("cuda")
            t = t.view(torch.bfloat16).view(shape)
            last = last_word(t)
            t1 = time.perf_counter()
            del t, raw
        elif kind == "fresh_vmm":
            size, shape = payload
            fd = recv_handle(conn)
            if drv is None:
                from pool.backends.cuda_vmm import TorchCuda
                from pool.driver import Driver

                rt = TorchCuda(0)
                rt.init()
                drv = Driver()
                drv.use_device(0)
            from pool.backends.vmm import typed_view
            from pool.driver import HandleType

            gran = drv.granularity(0, HandleType.POSIX_FD)
            a = fresh_vmm_import(drv, fd, size, gran, 0)
            base = rt.tensor_at(a.ptr, size)
            t = typed_view(base, 0, torch.bfloat16, tuple(shape))
            last = last_word(t)
            t1 = time.perf_counter()
            del t, base
            fresh_vmm_free(drv, a)
            extra["teardown_us"] = (time.perf_counter() - t1) * 1e6
        elif kind == "fresh_shm":
            size, shape = payload
            fd = recv_handle(conn)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
            os.close(fd)
            n = math.prod(shape)
            t = whole_tensor(mm)[: 2 * n].view(torch.bfloat16).view(tuple(shape))
            last = last_word(t)
            t1 = time.perf_counter()
            del t
            mm.close()
            extra["teardown_us"] = (time.perf_counter() - t1) * 1e6
        else:
            raise ValueError(kind)
        conn.send((t1, last, t_recv, extra))
    client.close()


# ---- the producer side: a pool, a hand-off server, consumers -------------------------------


class Rig:
    """A pool (cuda_vmm on the GPU, host_shm on the CPU) with a hand-off server, and consumer
    processes attached to it."""

    def __init__(self, use_cuda: bool, consumers: int, *, pool_bytes: int, slab_bytes: int) -> None:
        import multiprocessing as mp

        import torch.multiprocessing  # noqa: F401  (CUDA tensors pickle as IPC handles)

        from pool.featurepool import FeaturePool
        from pool.server import HandoffServer

        self.use_cuda = use_cuda
        self.backend: Any
        if use_cuda:
            from pool.backends.cuda_vmm import CudaVmmBackend

            self.backend = CudaVmmBackend.create(0, pool_bytes, slab_bytes, fabric="off")
        else:
            from pool.backends.host_shm import HostShmBackend

            self.backend = HostShmBackend([slab_bytes] * max(1, pool_bytes // slab_bytes))
        self.pool = FeaturePool(
            [self.backend], max_leases=1024, policy="wait", wait_s=5.0, default_ttl_s=60
        )
        self.pool.start_reaper(0.002)
        self._dir = tempfile.mkdtemp(prefix="featpool-suite-")
        self.sock = str(Path(self._dir) / "suite.sock")
        self.server = HandoffServer(self.pool, self.sock)
        self.server.start()
        ctx = mp.get_context("spawn")
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        for _ in range(consumers):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=consumer_main, args=(child, self.sock, use_cuda), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for c in self.conns:
            if not c.poll(120):
                raise RuntimeError("a consumer did not attach within 120 s")
            msg = c.recv()
            if msg != "attached":
                raise RuntimeError(f"consumer answered {msg!r}")

    def sync(self) -> None:
        if self.use_cuda:
            import torch

            torch.cuda.synchronize()

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("quit", None))
            except OSError:
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self.server.close()
        self.pool.close()


def feature(size_mb: float, device: str) -> Any:
    import torch

    rows = max(1, round(size_mb * MB / (HIDDEN * 2)))
    return torch.randn(rows, HIDDEN, dtype=torch.bfloat16, device=device)


def send_once(rig: Rig, conn: Any, kind: str, feat: Any, pid: int) -> tuple[float, Any]:
    """Start one hand-off; returns (t_sent, cleanup state). t0 is taken by the caller."""
    from multiprocessing.reduction import send_handle

    import torch

    nbytes = feat.numel() * feat.element_size()
    state: Any = None
    if kind == "ping":
        conn.send(("ping", None))
    elif kind == "pool":
        conn.send(("pool", rig.pool.describe(rig.pool.put(feat)).wire()))
    elif kind == "cuda_ipc":
        conn.send(("cuda_ipc", feat))
    elif kind == "cpu_bytes":
        raw = feat.view(torch.uint8).cpu().numpy().tobytes()
        conn.send(("cpu_bytes", tuple(feat.shape)))
        conn.send_bytes(raw)
    elif kind == "fresh_vmm":
        drv = rig.backend.driver
        from pool.driver import HandleType

        gran = drv.granularity(rig.backend.ordinal, HandleType.POSIX_FD)
        stream = rig.backend.rt.current_stream()
        alloc, fd = fresh_vmm_export(
            drv, rig.backend.ordinal, gran, src_ptr=feat.data_ptr(), nbytes=nbytes, stream=stream
        )
        torch.cuda.current_stream().synchronize()  # no ready word: the bytes must be there
        conn.send(("fresh_vmm", (alloc.size, tuple(feat.shape))))
        send_handle(conn, fd, pid)
        os.close(fd)
        state = alloc
    elif kind == "fresh_shm":
        import mmap

        fd = os.memfd_create("featpool-fresh", os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        torch.frombuffer(mm, dtype=torch.uint8, count=nbytes).copy_(feat.view(-1).view(torch.uint8))
        conn.send(("fresh_shm", (nbytes, tuple(feat.shape))))
        send_handle(conn, fd, pid)
        os.close(fd)
        state = mm
    else:
        raise ValueError(kind)
    return time.perf_counter(), state


def handoff_series(
    rig: Rig, conn: Any, pid: int, kind: str, base: Any, *, n: int, deadline: float
) -> dict[str, Any]:
    lat: list[float] = []
    prod: list[float] = []
    cons: list[float] = []
    teardown_c: list[float] = []
    teardown_p: list[float] = []
    bad = 0
    warm = 2
    for i in range(n + warm):
        if time.time() > deadline and len(lat) >= 3:
            break
        # A fresh tensor each time, as an encoder makes one (and CUDA IPC then opens a
        # handle per tensor, as it would in a server). Not on the CPU: no IPC there.
        feat = base.clone() if rig.use_cuda and kind != "ping" else base
        rig.sync()
        t0 = time.perf_counter()
        t_sent, state = send_once(rig, conn, kind, feat, pid)
        t1, last, t_recv, extra = conn.recv()
        if state is not None:
            tp = time.perf_counter()
            if kind == "fresh_vmm":
                fresh_vmm_free(rig.backend.driver, state)
            else:
                state.close()
            teardown_p.append((time.perf_counter() - tp) * 1e6)
        if kind != "ping" and last != last_word(feat):
            bad += 1
        if i >= warm:
            lat.append((t1 - t0) * 1e6)
            prod.append((t_sent - t0) * 1e6)
            cons.append((t1 - t_recv) * 1e6)
            if "teardown_us" in extra:
                teardown_c.append(extra["teardown_us"])
        del feat
    out = {
        **stats_us(lat),
        "producer_median_us": median(prod),
        "consumer_median_us": median(cons),
        "wrong_reads": bad,
    }
    if teardown_p:
        out["producer_teardown_median_us"] = median(teardown_p)
    if teardown_c:
        out["consumer_teardown_median_us"] = median(teardown_c)
    return out


def bandwidth(rig: Rig, size_mb: float, reps: int) -> dict[str, Any]:
    """GB/s into the pool (publish = copy + ready word; copy alone) and of a plain copy, with
    back-to-back copies (pool_copies.time_copies)."""
    import torch
    from pool_copies import time_copies

    from pool.allocator import Extent

    n = max(HIDDEN * 2, round(size_mb * MB / (HIDDEN * 2)) * HIDDEN * 2)
    dev = "cuda" if rig.use_cuda else "cpu"
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
    alloc = rig.pool.tiers[0].allocator
    with rig.pool._lock:
        ext = alloc.allocate(n)
    if ext is None:
        raise RuntimeError(f"no room in the pool for {n} bytes")
    try:
        return time_copies(
            rig.backend,
            rig.pool.ctrl,
            Extent(ext.slab, ext.offset, n),
            src,
            copies=int(min(20, max(3, 2e9 // n)))
            if rig.use_cuda
            else int(min(10, max(2, 2e8 // n))),
            reps=reps,
            slot=rig.pool.leases.max_slots - 1,  # a slot the hand-offs here never reach
            gen=1_000_000,
        )
    finally:
        with rig.pool._lock:
            alloc.free(ext)


def publish_host_us(rig: Rig, feat: Any, iters: int) -> dict[str, float]:
    """Host time of FeaturePool.put + release (the producer's bookkeeping + publish launch)."""
    put: list[float] = []
    for _ in range(iters):
        t0 = time.perf_counter()
        lease = rig.pool.put(feat)
        put.append((time.perf_counter() - t0) * 1e6)
        rig.pool.release(lease.id)
    rig.sync()
    return {"pool_put_median_us": median(put[2:] or put)}


# ---- sweeps --------------------------------------------------------------------------------


Save = Callable[[], None]


def guarded(
    rec: dict[str, Any],
    save: Save,
    key: str,
    label: dict[str, Any],
    *,
    fn: Callable[[], dict[str, Any]],
    deadline: float,
) -> None:
    """Run one point; any exception becomes an error row, the sweep goes on."""
    row = dict(label)
    if time.time() > deadline:
        row["skipped"] = "out of the time budget"
    else:
        t0 = time.time()
        try:
            row.update(fn())
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc(limit=6)
        row["wall_s"] = round(time.time() - t0, 2)
    rec.setdefault(key, []).append(row)
    save()


def sweep_handoff(mode: str, quick: bool, rec: dict[str, Any], save: Save, deadline: float) -> None:
    import torch

    use_cuda = mode == "gpu"
    cfg = HANDOFF["quick" if quick else mode]
    dev = "cuda" if use_cuda else "cpu"
    transports = (
        ["pool", "cuda_ipc", "fresh_vmm", "cpu_bytes"]
        if use_cuda
        else ["pool", "fresh_shm", "cpu_bytes"]
    )
    rec["config"] = {
        "sizes_mb": cfg.sizes_mb,
        "iters": {str(k): v for k, v in cfg.iters.items()},
        "transports": transports,
        "pool": "cuda_vmm" if use_cuda else "host_shm",
        "baselines": {
            "cpu_bytes": "tensor -> bytes -> pipe -> tensor",
            "cuda_ipc": "torch.multiprocessing CUDA IPC",
            "fresh_vmm": "cuMemCreate + export FD + import + map per lease, unmapped after",
            "fresh_shm": "memfd_create + copy + send FD + mmap per lease "
            "(the CPU analogue of fresh_vmm)",
        },
    }
    slab = 256 * MiB
    rig = Rig(use_cuda, 1, pool_bytes=1024 * MiB if use_cuda else 512 * MiB, slab_bytes=slab)
    try:
        conn, pid = rig.conns[0], rig.procs[0].pid
        floor = handoff_series(rig, conn, pid, "ping", torch.zeros(1), n=50, deadline=deadline)
        rec["pipe_floor"] = floor
        save()
        for size in cfg.sizes_mb:

            def point(size: float = size) -> dict[str, Any]:
                base = feature(size, dev)
                nbytes = base.numel() * base.element_size()
                n = cfg.iters.get(size, 5)
                row: dict[str, Any] = {"nbytes": nbytes, "transports": {}}
                per_point = max(5.0, (deadline - time.time()) / 3)
                stop = time.time() + per_point
                for kind in transports:
                    k = n if kind in ("pool", "cuda_ipc") else max(3, n // 3)
                    try:
                        row["transports"][kind] = handoff_series(
                            rig, conn, pid, kind, base, n=k, deadline=min(deadline, stop)
                        )
                    except Exception as e:
                        row["transports"][kind] = {"error": f"{type(e).__name__}: {e}"}
                try:
                    row["bandwidth"] = bandwidth(rig, size, cfg.bw_reps)
                except Exception as e:
                    row["bandwidth"] = {"error": f"{type(e).__name__}: {e}"}
                row.update(publish_host_us(rig, base, max(5, min(50, n))))
                return row

            guarded(rec, save, "points", {"size_mb": size}, fn=point, deadline=deadline)
    finally:
        rig.close()


def sweep_consumers(
    mode: str, quick: bool, rec: dict[str, Any], save: Save, deadline: float
) -> None:
    from multiprocessing.connection import wait

    use_cuda = mode == "gpu"
    counts, size_mb, seconds = CONSUMERS["quick" if quick else mode]
    rec["config"] = {
        "consumers": counts,
        "size_mb": size_mb,
        "seconds_per_point": seconds,
        "loop": "closed: one lease in flight per consumer; the producer puts the "
        "next lease as soon as a consumer answers",
    }
    rig = Rig(use_cuda, max(counts), pool_bytes=512 * MiB, slab_bytes=128 * MiB)
    try:
        base = feature(size_mb, "cuda" if use_cuda else "cpu")
        expect = last_word(base)

        def point(k: int) -> dict[str, Any]:
            conns = rig.conns[:k]
            sent_at: dict[Any, float] = {}
            lat: list[float] = []
            cons: list[float] = []
            bad = 0
            for c in conns:  # warm-up: one round trip each
                c.send(("pool", rig.pool.describe(rig.pool.put(base)).wire()))
                c.recv()
            t_start = time.perf_counter()
            t_end = t_start + seconds
            for c in conns:
                sent_at[c] = time.perf_counter()
                c.send(("pool", rig.pool.describe(rig.pool.put(base)).wire()))
            done = 0
            while sent_at:
                for c in wait(list(sent_at), timeout=30):
                    t1, last, t_recv, _ = c.recv()
                    t0 = sent_at.pop(c)
                    lat.append((t1 - t0) * 1e6)
                    cons.append((t1 - t_recv) * 1e6)
                    bad += last != expect
                    done += 1
                    now = time.perf_counter()
                    if now < t_end:
                        sent_at[c] = now
                        c.send(("pool", rig.pool.describe(rig.pool.put(base)).wire()))
                if time.perf_counter() > t_end + 30:
                    raise RuntimeError("consumers stopped answering")
            elapsed = time.perf_counter() - t_start
            return {
                **stats_us(lat),
                "leases_per_s": done / elapsed,
                "leases": done,
                "consumer_median_us": median(cons),
                "wrong_reads": bad,
            }

        for k in counts:
            guarded(
                rec, save, "points", {"consumers": k}, fn=lambda k=k: point(k), deadline=deadline
            )
    finally:
        rig.close()


def sweep_encoder(mode: str, quick: bool, rec: dict[str, Any], save: Save, deadline: float) -> None:
    import torch

    from app.encoders import build_encoder

    use_cuda = mode == "gpu"
    name = "vit-b16-224" if use_cuda else "tiny-test"
    batch = 8 if quick else 128
    iters = 3 if quick else (20 if use_cuda else 10)
    rec["config"] = {
        "encoder": name,
        "batch": batch,
        "iters": iters,
        "timing": "CUDA events around encode() calls"
        if use_cuda
        else "perf_counter around encode() calls",
    }
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    variants = ("cuda_graphs", "eager") if use_cuda else ("eager",)
    for variant in variants:

        def point(variant: str = variant) -> dict[str, Any]:
            enc = build_encoder(name, device=device)
            if variant == "cuda_graphs":
                enc.enable_cuda_graphs()  # type: ignore[attr-defined]
            enc.warmup([batch])
            s = enc.image_size
            x = torch.randn(batch, 3, s, s, device=device, dtype=enc.dtype)
            for _ in range(2):
                enc.encode(x)
            host: list[float] = []
            if use_cuda:
                torch.cuda.synchronize()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    h0 = time.perf_counter()
                    enc.encode(x)
                    host.append(time.perf_counter() - h0)
                end.record()
                end.synchronize()
                secs = start.elapsed_time(end) / 1e3
            else:
                t0 = time.perf_counter()
                for _ in range(iters):
                    h0 = time.perf_counter()
                    enc.encode(x)
                    host.append(time.perf_counter() - h0)
                secs = time.perf_counter() - t0
            return {
                "images_per_s": batch * iters / secs,
                "ms_per_batch": secs / iters * 1e3,
                "host_ms_per_call": median(host) * 1e3,
                "dtype": str(enc.dtype),
                "output_shape": list(enc.output_shape),
            }

        guarded(
            rec,
            save,
            "points",
            {"variant": variant, "encoder": name, "batch": batch},
            fn=point,
            deadline=deadline,
        )


# Servers run in sessions of their own (bench_e2e starts them so): the parent's kill of this
# child's process group would miss them, so SIGTERM kills them here first.
LIVE_SERVERS: list[subprocess.Popen[bytes]] = []


def on_sigterm(signum: int, frame: Any) -> None:
    for proc in LIVE_SERVERS:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    raise SystemExit(128 + signum)


def sweep_e2e(mode: str, quick: bool, rec: dict[str, Any], save: Save, deadline: float) -> None:
    import bench_e2e as e2e
    from make_images import photo_jpeg

    cfg = e2e_cfg(mode)
    if quick:
        cfg.update(
            images=2,
            width=64,
            height=48,
            seconds=0.5,
            warmup=0.2,
            points="raw:1x1",
            baseline_points="raw:1x1",
            point_s=2.0,
            baseline_reserve_s=8.0,
        )
    rec["config"] = cfg
    # The JPEGs are made on a thread while the first server starts (numpy and Pillow release
    # the GIL for most of it).
    pool = ThreadPoolExecutor(1)
    made = pool.submit(
        lambda: [photo_jpeg(i, cfg["width"], cfg["height"]) for i in range(cfg["images"])]
    )
    pool.shutdown(wait=False)
    images: list[bytes] = []

    def get_images() -> list[bytes]:
        if not images:
            images.extend(made.result())
            rec["images"] = {
                "count": len(images),
                "size": f"{cfg['width']}x{cfg['height']}",
                "mean_kb": sum(map(len, images)) / len(images) / 1e3,
            }
            save()
        return images

    logs = Path(tempfile.mkdtemp(prefix="featpool-suite-e2e-"))
    rec["servers"] = {}
    for name, extra, spec in (
        ("featpool", cfg["featpool_args"], cfg["points"]),
        ("naive", cfg["baseline_args"], cfg["baseline_points"]),
    ):
        reserve = cfg["baseline_reserve_s"] if name == "featpool" else 3.0
        args = e2e.parser().parse_args([])  # the bench's defaults, then the sweep's own
        vars(args).update(
            device=cfg["device"],
            encoder=cfg["encoder"],
            port=free_port(),
            pool_bytes=cfg["pool_bytes"],
            start_timeout=min(cfg["start_timeout"], max(5.0, deadline - time.time() - reserve)),
            seconds=cfg["seconds"],
            warmup=cfg["warmup"],
            client_procs=cfg["client_procs"],
            max_conns_per_proc=cfg.get("max_conns_per_proc", 0),
        )
        args.client = cfg.setdefault("client", args.client)  # recorded: the report names it
        srv_rec: dict[str, Any] = {"args": extra}
        rec["servers"][name] = srv_rec
        try:
            s0 = time.time()
            srv = e2e.Server(args, extra.split(), logs / f"server_{name}.log")
            LIVE_SERVERS.append(srv.proc)
            srv_rec.update(
                command=shlex.join(srv.cmd),
                transport=srv.transport,
                start_s=round(time.time() - s0, 1),
            )
        except Exception as e:
            srv_rec["error"] = f"{type(e).__name__}: {e}"
            try:
                srv_rec["log_tail"] = (logs / f"server_{name}.log").read_text()[-2000:]
            except OSError:
                pass
            save()
            continue
        save()
        try:
            get_images()
            for p in e2e.parse_points(spec, name):
                label = {
                    "server": name,
                    "body": "multipart" if p.multipart else "raw",
                    "images_per_request": p.per_request,
                    "concurrency": p.concurrency,
                }
                stop = deadline - reserve - cfg["point_s"]
                guarded(
                    rec,
                    save,
                    "points",
                    label,
                    deadline=stop,
                    fn=lambda p=p, a=args, s=srv: e2e.run_point(a, s, images, p),
                )
        finally:
            srv.close()
            LIVE_SERVERS.remove(srv.proc)
    failed = [name for name, srv_rec in rec["servers"].items() if "error" in srv_rec]
    if failed:  # the sweep measured nothing for these: not ok
        raise RuntimeError(f"server(s) failed to start: {', '.join(failed)}")


def sweep_alloc(mode: str, quick: bool, rec: dict[str, Any], save: Save, deadline: float) -> None:
    import bench_alloc

    def on_point(partial: dict[str, Any]) -> None:
        rec["result"] = partial
        save()

    rec["result"] = bench_alloc.run(quick=quick, deadline=deadline, on_point=on_point)


SWEEP_FUNCS: dict[str, Callable[[str, bool, dict[str, Any], Save, float], None]] = {
    "handoff": sweep_handoff,
    "consumers": sweep_consumers,
    "encoder": sweep_encoder,
    "e2e": sweep_e2e,
    "alloc": sweep_alloc,
}


# ---- child: one sweep ----------------------------------------------------------------------


def run_child(
    name: str, mode: str, part: Path, *, deadline: float, quick: bool, inject_fail: str | None
) -> int:
    rec: dict[str, Any] = {
        "name": name,
        "mode": mode,
        "date": date_u(),
        "command": shlex.join([sys.executable, *sys.argv]),
        "status": "running",
    }

    def save() -> None:
        tmp = part.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec, indent=1, default=str))
        tmp.replace(part)

    save()
    signal.signal(signal.SIGTERM, on_sigterm)
    t0 = time.time()
    rc = 0
    try:
        if inject_fail == name:
            raise RuntimeError("failure injected by --inject-fail (a test of the suite)")
        rec["machine"] = machine()
        save()
        SWEEP_FUNCS[name](mode, quick, rec, save, deadline)
        rec["status"] = "ok"
    except Exception as e:
        rec["status"] = "error"
        rec["error"] = f"{type(e).__name__}: {e}"
        rec["traceback"] = traceback.format_exc(limit=8)
        rc = 1
    rec["wall_s"] = round(time.time() - t0, 1)
    save()
    return rc


# ---- parent: every sweep, each in a subprocess with a cap ----------------------------------


def run_sweep_process(
    name: str, args: argparse.Namespace, cap: float, workdir: Path
) -> dict[str, Any]:
    part = workdir / f"{name}.json"
    log = workdir / f"{name}.log"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        name,
        "--mode",
        args.mode,
        "--part",
        str(part),
        "--deadline",
        f"{time.time() + cap - 8:.3f}",
    ]
    if args.quick:
        cmd.append("--quick")
    if args.inject_fail:
        cmd += ["--inject-fail", args.inject_fail]
    t0 = time.time()
    with log.open("w") as lf:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True
        )
        timed_out = False
        try:
            proc.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)  # the child's own session: its consumers, server
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=5)
                    break
                except subprocess.TimeoutExpired:
                    continue
    try:
        rec: dict[str, Any] = json.loads(part.read_text())
    except (OSError, ValueError):
        rec = {"name": name, "mode": args.mode}
    rec["cap_s"] = round(cap, 1)
    rec["wall_s"] = round(time.time() - t0, 1)
    if timed_out:
        rec["status"] = "timeout"
        rec["error"] = f"killed after its cap of {cap:.0f} s; points measured so far are kept"
    elif proc.returncode != 0 and rec.get("status") != "error":
        rec["status"] = "error"
        rec["error"] = f"exited with {proc.returncode}"
    if rec.get("status") != "ok":
        try:
            rec["log_tail"] = log.read_text()[-3000:]
        except OSError:
            pass
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("gpu", "cpu"), required=True)
    ap.add_argument("--out", type=Path, help="the results JSON")
    ap.add_argument("--only", default=",".join(SWEEPS), help=f"subset of {','.join(SWEEPS)}")
    ap.add_argument(
        "--budget-s", type=float, help="total wall-time budget (default: gpu 215, cpu 165)"
    )
    ap.add_argument("--quick", action="store_true", help="tiny sweeps (tests)")
    ap.add_argument("--inject-fail", help=argparse.SUPPRESS)  # a sweep that raises (tests)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--part", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        assert args.part is not None and args.deadline is not None
        return run_child(
            args.child,
            args.mode,
            args.part,
            deadline=args.deadline,
            quick=args.quick,
            inject_fail=args.inject_fail,
        )

    if args.out is None:
        ap.error("--out is required")
    names = [n for n in args.only.split(",") if n]
    unknown = set(names) - set(SWEEPS)
    if unknown:
        ap.error(f"unknown sweeps {sorted(unknown)}; choose from {SWEEPS}")
    budget = args.budget_s or TOTAL_BUDGET_S[args.mode]
    t_start = time.time()
    deadline = t_start + budget
    result: dict[str, Any] = {
        "suite_version": 1,
        "mode": args.mode,
        "quick": args.quick,
        "command": shlex.join(
            ["python3", "bench/suite.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "date": date_u(),
        "machine": machine(with_torch=False),
        "budget_s": budget,
        "sweeps": {},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        result["wall_s"] = round(time.time() - t_start, 1)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=str))
        tmp.replace(args.out)

    write()
    workdir = Path(tempfile.mkdtemp(prefix="featpool-suite-"))
    budgets = BUDGETS[args.mode]
    for i, name in enumerate(names):
        held_back = sum(budgets[n].min_s for n in names[i + 1 :])
        cap = min(budgets[name].cap_s, deadline - time.time() - held_back)
        if args.quick:
            cap = min(budgets[name].cap_s, deadline - time.time())
        if cap < budgets[name].min_s and not args.quick:
            result["sweeps"][name] = {
                "name": name,
                "status": "skipped",
                "error": f"only {cap:.0f} s of the budget left",
            }
            write()
            continue
        print(f"[suite] {name}: up to {cap:.0f} s", flush=True)
        rec = run_sweep_process(name, args, cap, workdir)
        result["sweeps"][name] = rec
        print(
            f"[suite] {name}: {rec.get('status')} in {rec.get('wall_s')} s"
            + (f" ({rec.get('error')})" if rec.get("error") else ""),
            flush=True,
        )
        write()
    write()
    print(f"[suite] wrote {args.out} in {result['wall_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
