"""Hand-off benchmark of the GPU tier (cuda_vmm) against the CPU transport (tensor -> bytes ->
tensor on the GPU) and torch.multiprocessing CUDA IPC, all in one run on one GPU.

    python3 bench/bench_handoff.py --out OUT_DIR

Measures: host time of one publish; producer -> consumer hand-off latency (the consumer process
has read the data on its GPU); copy bandwidth into the pool as a fraction of a plain D2D copy.
Prints a table and writes OUT_DIR/handoff.json.

    python3 bench/bench_handoff.py --cross-gpu --out OUT_DIR

instead measures a consumer on GPU 1 of a pool on GPU 0 (skipped with fewer than two GPUs):
hand-off latency and read bandwidth in place over peer access, with a copy into GPU 1's memory
(cross_gpu="copy"), and with torch CUDA IPC plus a copy to GPU 1; writes
OUT_DIR/handoff_crossgpu.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
import warnings
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.multiprocessing
from appserver import gpu_name
from pool_copies import time_copies

from pool.allocator import Extent
from pool.backends.cuda_vmm import CudaVmmBackend
from pool.featurepool import FeaturePool
from pool.server import HandoffServer

MB = 1_000_000
FEATURE_SHAPE = (2392, 2048)  # bf16: 9.80 MB, a typical vision-tower output
TARGET_PUBLISH_US = 20.0
TARGET_COPY_FRACTION = 0.90
TARGET_SPEEDUP = 100.0


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


# ---- consumer process ----------------------------------------------------------------------


def consumer(conn: Connection, sock: str) -> None:
    from pool.client import FeatureClient

    torch.cuda.init()
    client = FeatureClient.connect(sock)
    conn.send("attached")
    while True:
        kind, payload = conn.recv()
        t_recv = time.perf_counter()
        if kind == "quit":
            break
        t_open = t_recv  # when the consumer holds a tensor (before reading it)
        if kind == "ping":
            t1 = time.perf_counter()
            conn.send((t1, 0, t_recv, t_open))
            continue
        if kind == "cuda_vmm":
            t = client.open(payload)
            t_open = time.perf_counter()
            last = int(t.view(-1)[-1].view(torch.int16).item())
            t1 = time.perf_counter()
            client.release(payload)
        elif kind == "cuda_ipc":
            t = payload
            last = int(t.view(-1)[-1].view(torch.int16).item())
            t1 = time.perf_counter()
            del t, payload
        else:  # cpu_bytes
            raw = conn.recv_bytes()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t = torch.frombuffer(raw, dtype=torch.uint8).to("cuda")
            t = t.view(torch.bfloat16).view(payload)
            t_open = time.perf_counter()
            last = int(t.view(-1)[-1].view(torch.int16).item())
            t1 = time.perf_counter()
        conn.send((t1, last, t_recv, t_open))
    client.close()


# ---- producer measurements -----------------------------------------------------------------


def publish_host_time(
    backend: CudaVmmBackend, pool: FeaturePool, feat: torch.Tensor, iters: int
) -> dict[str, Any]:
    nbytes = feat.numel() * feat.element_size()
    extent = Extent(0, 0, nbytes)
    slot = pool.leases.max_slots - 1  # a slot the pool itself will not reach here
    gen = 1
    res: dict[str, Any] = {}
    for engine in ("driver", "torch"):
        backend.copy_engine = engine  # type: ignore[assignment]
        for name, t in (("9.8MB", feat), ("64KB", feat.view(-1)[:32768])):
            times: list[float] = []
            for i in range(iters):
                if i % 64 == 0:
                    torch.cuda.synchronize()
                t0 = time.perf_counter_ns()
                backend.publish(extent, t, pool.ctrl, slot, gen)
                times.append((time.perf_counter_ns() - t0) / 1e3)
                gen += 1
            torch.cuda.synchronize()
            key = f"publish_{engine}_copy_us_{name}"
            res[key] = {"median": statistics.median(times[10:]), "p90": pct(times[10:], 0.9)}
    backend.copy_engine = "driver"
    # The whole pool.put (allocator, lease table, publish), each lease released after.
    times = []
    for i in range(iters):
        if i % 64 == 0:
            torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        lease = pool.put(feat)
        times.append((time.perf_counter_ns() - t0) / 1e3)
        pool.release(lease.id)
    torch.cuda.synchronize()
    res["pool_put_us_9.8MB"] = {
        "median": statistics.median(times[10:]),
        "p90": pct(times[10:], 0.9),
    }
    # Baselines: what the producer's host spends on one hand-off with the other transports.
    from torch.multiprocessing.reductions import reduce_tensor

    cpu = []
    for _ in range(30):
        t0 = time.perf_counter_ns()
        feat.view(torch.uint8).cpu().numpy().tobytes()
        cpu.append((time.perf_counter_ns() - t0) / 1e3)
    ipc = []
    for _ in range(200):
        t0 = time.perf_counter_ns()
        reduce_tensor(feat)
        ipc.append((time.perf_counter_ns() - t0) / 1e3)
    res["cpu_bytes_serialize_us_9.8MB"] = {"median": statistics.median(cpu), "p90": pct(cpu, 0.9)}
    res["cuda_ipc_reduce_us_9.8MB"] = {"median": statistics.median(ipc), "p90": pct(ipc, 0.9)}
    return res


def copy_bandwidth(backend: CudaVmmBackend, pool: FeaturePool, reps: int) -> list[dict[str, Any]]:
    """20 publishes / copies into pool memory / plain D2D copies back to back, per size."""
    rows = []
    for i, mb in enumerate((1, 8, 32, 128)):
        n = mb * MB
        src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=backend.device)
        row = time_copies(
            backend,
            pool.ctrl,
            Extent(1, 0, n),
            src,
            copies=20,
            reps=reps,
            slot=pool.leases.max_slots - 1,  # a slot the pool itself will not reach here
            gen=10_000_000 + i * 1_000_000,
        )
        rows.append({"size_mb": mb, **row})
    return rows


def handoff_latency(
    conn: Connection, pool: FeaturePool, base: torch.Tensor, iters: int
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind, n in (
        ("ping", iters),
        ("cuda_vmm", iters),
        ("cuda_ipc", iters),
        ("cpu_bytes", max(10, iters // 5)),
    ):
        lat: list[float] = []
        send: list[float] = []
        read: list[float] = []
        put: list[float] = []  # cuda_vmm: FeaturePool.put alone
        opened: list[float] = []  # consumer: until it holds a tensor (open / rebuild)
        for i in range(n + 3):
            feat = base.clone()  # a fresh feature tensor each time, as an encoder would make
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            t_put = t0
            if kind == "ping":
                conn.send(("ping", None))
            elif kind == "cuda_vmm":
                lease = pool.put(feat)
                t_put = time.perf_counter()
                conn.send(("cuda_vmm", pool.describe(lease).wire()))
            elif kind == "cuda_ipc":
                conn.send(("cuda_ipc", feat))
            else:
                raw = feat.view(torch.uint8).cpu().numpy().tobytes()
                conn.send(("cpu_bytes", tuple(feat.shape)))
                conn.send_bytes(raw)
            t_sent = time.perf_counter()
            t1, last, t_recv, t_open = conn.recv()
            if kind != "ping":
                assert last == int(feat.view(-1)[-1].view(torch.int16).item()), kind
            if i >= 3:
                lat.append((t1 - t0) * 1e6)
                send.append((t_sent - t0) * 1e6)  # producer: publish + describe + send
                read.append((t1 - t_recv) * 1e6)  # consumer: open/rebuild + read one element
                put.append((t_put - t0) * 1e6)
                opened.append((t_open - t_recv) * 1e6)
            del feat
        out[kind] = {
            "median_us": statistics.median(lat),
            "p90_us": pct(lat, 0.9),
            "n": len(lat),
            "producer_median_us": statistics.median(send),
            "consumer_median_us": statistics.median(read),
            "put_median_us": statistics.median(put),
            "open_median_us": statistics.median(opened),
        }
    return out


# ---- --cross-gpu: a consumer on GPU 1 of a pool on GPU 0 -----------------------------------


def read_rates(src: torch.Tensor, reps: int) -> dict[str, float]:
    """GB/s of reading ``src`` from the current GPU: a reduction (the SMs read it), a copy
    into this GPU's memory, and the reduction over that local copy (the HBM baseline)."""
    words = src.reshape(-1).view(torch.int32)
    local = torch.empty_like(words)
    out: dict[str, float] = {}
    for name, fn in (
        ("sum_GBps", words.sum),
        ("copy_to_local_GBps", lambda: local.copy_(words)),
        ("local_sum_GBps", local.sum),
    ):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        out[name] = words.numel() * 4 * reps / (start.elapsed_time(end) / 1e3) / 1e9
    return out


def cross_consumer(conn: Connection, sock: str, device: str, mode: str) -> None:
    from pool.client import FeatureClient

    torch.cuda.set_device(device)
    client = FeatureClient.connect(sock, device=device, cross_gpu=mode)
    assert client.link is not None
    conn.send(client.link.path)
    while True:
        kind, payload = conn.recv()
        if kind == "quit":
            break
        if kind == "rates":
            t = client.open(payload)
            conn.send(read_rates(t, reps=20))
            client.release(payload)
            continue
        if kind == "lease":
            t = client.open(payload)
            last = int(t.view(-1)[-1].view(torch.int16).item())
            client.release(payload)
        else:  # cuda_ipc: the tensor arrives on GPU 0; reading it on GPU 1 takes a copy
            t = payload.to(device)
            last = int(t.view(-1)[-1].view(torch.int16).item())
            del payload
        conn.send((time.perf_counter(), last))
        del t
    conn.send(dict(client.fallbacks))
    client.close()


def cross_gpu(args: argparse.Namespace) -> None:
    out = args.out / "handoff_crossgpu.json"
    if torch.cuda.device_count() < 2:
        reason = f"--cross-gpu needs two GPUs, this machine has {torch.cuda.device_count()}"
        out.write_text(json.dumps({"skipped": reason, "machine": machine()}, indent=2))
        print(f"skipped: {reason}")
        return
    backend = CudaVmmBackend.create(0, 512 << 20, 256 << 20)
    pool = FeaturePool([backend], max_leases=1024, policy="reject")
    pool.start_reaper(0.005)
    sock = str(Path(tempfile.mkdtemp()) / "bench.sock")
    server = HandoffServer(pool, sock)
    server.start()
    base = torch.randn(FEATURE_SHAPE, device="cuda:0", dtype=torch.bfloat16)
    ctx = mp.get_context("spawn")
    ends: dict[str, Connection] = {}
    procs = []
    for mode in ("map", "copy"):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=cross_consumer, args=(child, sock, "cuda:1", mode), daemon=True)
        proc.start()
        ends[mode] = parent
        procs.append(proc)
    paths = {mode: end.recv() for mode, end in ends.items()}
    result: dict[str, Any] = {"machine": machine(), "paths": paths, "latency": {}}
    # Hand-off of a 9.8 MB bf16 feature until the consumer on GPU 1 has read its last element.
    for name, mode, kind in (
        ("in_place", "map", "lease"),
        ("copy_to_gpu1", "copy", "lease"),
        ("cuda_ipc_to_gpu1", "map", "cuda_ipc"),
    ):
        lat: list[float] = []
        for i in range(args.latency_iters + 3):
            feat = base.clone()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if kind == "lease":
                ends[mode].send(("lease", pool.describe(pool.put(feat)).wire()))
            else:
                ends[mode].send(("cuda_ipc", feat))
            t1, last = ends[mode].recv()
            assert last == int(feat.view(-1)[-1].view(torch.int16).item()), name
            if i >= 3:
                lat.append((t1 - t0) * 1e6)
            del feat
        result["latency"][name] = {
            "median_us": statistics.median(lat),
            "p90_us": pct(lat, 0.9),
            "n": len(lat),
        }
    # Read bandwidth of a 128 MB lease from GPU 1: in place, and the copy path's local copy.
    big = torch.randint(0, 255, (128 << 20,), dtype=torch.uint8, device="cuda:0")
    result["read_128MB"] = {}
    for name, mode in (("in_place", "map"), ("copy_to_gpu1", "copy")):
        lease = pool.put(big)
        ends[mode].send(("rates", pool.describe(lease).wire()))
        result["read_128MB"][name] = ends[mode].recv()
    for end in ends.values():
        end.send(("quit", None))
    result["fallbacks"] = {mode: end.recv() for mode, end in ends.items()}
    for proc in procs:
        proc.join(timeout=30)
    server.close()
    pool.close()
    out.write_text(json.dumps(result, indent=2))
    m = result["machine"]
    print(f"\n{m['gpu']} | torch {m['torch']} | {m['date']} | paths {paths}")
    print("\nhand-off of a 9.8 MB bf16 feature, pool on GPU 0 -> read on GPU 1 (us)")
    for k, v in result["latency"].items():
        print(f"  {k:18s} median {v['median_us']:9.1f}  p90 {v['p90_us']:9.1f}  n={v['n']}")
    print("\nreading a 128 MB lease on GPU 1 (GB/s)")
    for k, v in result["read_128MB"].items():
        print(f"  {k:18s} " + "  ".join(f"{n} {x:8.0f}" for n, x in v.items()))
    print(f"\nfallbacks counted by the clients: {result['fallbacks']}")


def machine() -> dict[str, str]:
    smi = gpu_name()
    try:
        import cuda.bindings

        cb = str(cuda.bindings.__version__)
    except ImportError:
        cb = "absent"
    return {
        "gpu": smi,
        "torch": torch.__version__,
        "cuda_bindings": cb,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--latency-iters", type=int, default=100)
    ap.add_argument(
        "--cross-gpu",
        action="store_true",
        help="only a consumer on GPU 1 of a pool on GPU 0 (skipped with one GPU)",
    )
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cross_gpu:
        cross_gpu(args)
        return

    backend = CudaVmmBackend.create(0, 512 << 20, 256 << 20)
    pool = FeaturePool([backend], max_leases=1024, policy="reject")
    pool.start_reaper(0.005)
    sock = str(Path(tempfile.mkdtemp()) / "bench.sock")
    server = HandoffServer(pool, sock)
    server.start()
    base = torch.randn(FEATURE_SHAPE, device="cuda", dtype=torch.bfloat16)

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=consumer, args=(child, sock), daemon=True)
    proc.start()
    assert parent.recv() == "attached"

    result: dict[str, Any] = {
        "machine": machine(),
        "fabric": backend.fabric_status.reason or "available",
    }
    result["publish"] = publish_host_time(backend, pool, base, args.iters)
    result["copy"] = copy_bandwidth(backend, pool, reps=5)
    result["handoff"] = handoff_latency(parent, pool, base, args.latency_iters)
    parent.send(("quit", None))
    proc.join(timeout=30)
    server.close()
    pool.close()

    pub = result["publish"]
    hand = result["handoff"]
    speedup = hand["cpu_bytes"]["median_us"] / hand["cuda_vmm"]["median_us"]
    result["targets"] = {
        "publish_us<=20": pub["publish_driver_copy_us_9.8MB"]["median"] <= TARGET_PUBLISH_US,
        "publish>=0.9_of_d2d_for_>=8MB": all(
            r["publish_fraction"] >= TARGET_COPY_FRACTION
            for r in result["copy"]
            if r["size_mb"] >= 8
        ),
        "copy>=0.9_of_d2d_for_>=8MB": all(
            r["copy_fraction"] >= TARGET_COPY_FRACTION for r in result["copy"] if r["size_mb"] >= 8
        ),
        "speedup_vs_cpu>=100x": speedup >= TARGET_SPEEDUP,
        "speedup_vs_cpu": speedup,
        "speedup_vs_ipc": hand["cuda_ipc"]["median_us"] / hand["cuda_vmm"]["median_us"],
    }
    (args.out / "handoff.json").write_text(json.dumps(result, indent=2))

    m = result["machine"]
    print(f"\n{m['gpu']} | torch {m['torch']} | cuda-bindings {m['cuda_bindings']} | {m['date']}")
    print("\nhost time per publish (us)           median      p90")
    for k, v in pub.items():
        print(f"  {k:34s} {v['median']:9.1f} {v['p90']:9.1f}")
    print("\ninto the pool vs plain D2D, 20 back to back (GB/s, bytes counted once)")
    print("  size MB  publish     copy      d2d  publish/d2d  copy/d2d  ready write us")
    for r in result["copy"]:
        print(
            f"  {r['size_mb']:7d} {r['publish_GBps']:8.0f} {r['copy_GBps']:8.0f} "
            f"{r['plain_GBps']:8.0f} {r['publish_fraction']:12.3f} {r['copy_fraction']:9.3f} "
            f"{r['ready_write_us']:15.2f}"
        )
    print("\nhand-off of a 9.8 MB bf16 feature, producer -> consumer has read it (us)")
    for k, v in hand.items():
        print(
            f"  {k:10s} median {v['median_us']:9.1f}  p90 {v['p90_us']:9.1f}  "
            f"producer {v['producer_median_us']:8.1f}  consumer {v['consumer_median_us']:8.1f}"
            f"  n={v['n']}"
        )
    v = hand["cuda_vmm"]
    print(
        f"  cuda_vmm breakdown: put {v['put_median_us']:.1f}, describe + send "
        f"{v['producer_median_us'] - v['put_median_us']:.1f}, open {v['open_median_us']:.1f}, "
        f"first read {v['consumer_median_us'] - v['open_median_us']:.1f} (medians, us)"
    )
    print(f"\ntargets: {json.dumps(result['targets'])}")


if __name__ == "__main__":
    main()
