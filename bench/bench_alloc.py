"""Allocator cost and fragmentation under lease churn (CPU only; the same code decides where a
lease goes on the GPU tier, so these figures hold for both tiers).

    python bench/bench_alloc.py --out /tmp/alloc.json [--quick]

Measures, with a mix of feature sizes (0.3 MB ViT-B/16 tokens to 32 MB):
- ``SlabAllocator.allocate`` / ``free``: ns per call at 10-90 % occupancy, and how often a request
  fails although enough bytes are free (fragmentation);
- ``FeaturePool.put`` / ``release`` over a host_shm tier whose publish writes only the ready word
  (allocator + lease table + control block; the byte copy is measured by the hand-off sweep);
- fragmentation over time under steady churn: ``1 - largest free extent / min(free bytes, slab)``
  and the share of free bytes that could still hold a 9.8 MB feature;
- ns per allocate/free against pool size (number of slabs, number of live leases).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pool.allocator import Extent, SlabAllocator

MiB = 1 << 20
SLAB_BYTES = 128 * MiB  # the server's default --slab-bytes
POOL_BYTES = 1024 * MiB  # the server's default --pool-bytes
PROBE_BYTES = 9_797_632  # a 2392 x 2048 bf16 feature: "can a 9.8 MB lease still fit?"
# (bytes, weight): ViT-B/16 at 224 (197 x 768 bf16), SigLIP-so400m at 384 (729 x 1152 bf16),
# 4 MB, a 9.8 MB vision-tower output, and a few large 32 MB tensors.
MIX: tuple[tuple[int, float], ...] = (
    (302_592, 0.45),
    (1_679_616, 0.20),
    (4_000_000, 0.15),
    (PROBE_BYTES, 0.12),
    (32_000_000, 0.08),
)
OCCUPANCIES = (0.1, 0.3, 0.5, 0.7, 0.9)


def draw(rng: random.Random) -> int:
    return rng.choices([s for s, _ in MIX], weights=[w for _, w in MIX])[0]


def timer_overhead_ns() -> float:
    xs = []
    for _ in range(2000):
        t0 = time.perf_counter_ns()
        xs.append(time.perf_counter_ns() - t0)
    return float(statistics.median(xs))


def summary(ns: list[float], overhead: float) -> dict[str, float]:
    if not ns:
        return {"median": float("nan"), "mean": float("nan"), "p99": float("nan"), "n": 0}
    s = sorted(max(0.0, x - overhead) for x in ns)
    return {
        "median": s[len(s) // 2],
        "mean": sum(s) / len(s),
        "p99": s[min(len(s) - 1, int(0.99 * len(s)))],
        "n": len(s),
    }


def fragmentation(alloc: SlabAllocator) -> dict[str, float]:
    """0 = the free bytes are as contiguous as the slabs allow; 1 = all in crumbs."""
    free = alloc.free_bytes
    if free == 0:
        return {"frag": 0.0, "usable_for_9.8MB": 0.0, "free_extents": 0}
    ranges = alloc.free_ranges()
    usable = sum(r.size // PROBE_BYTES * PROBE_BYTES for r in ranges)
    return {
        "frag": 1.0 - alloc.largest_free / min(free, alloc.max_extent),
        "usable_for_9.8MB": usable / free,
        "free_extents": len(ranges),
    }


class _Churn:
    """Live extents kept near a target occupancy: free one at random, allocate until back."""

    def __init__(self, alloc: SlabAllocator, rng: random.Random) -> None:
        self.alloc = alloc
        self.rng = rng
        self.live: list[Extent] = []
        self.alloc_ns: list[float] = []
        self.free_ns: list[float] = []
        self.fails = 0
        self.frag_fails = 0  # failed although free_bytes >= the request
        self.requests = 0

    def allocate(self, nbytes: int, timed: bool) -> bool:
        t0 = time.perf_counter_ns()
        ext = self.alloc.allocate(nbytes)
        dt = time.perf_counter_ns() - t0
        if timed:
            self.alloc_ns.append(dt)
            self.requests += 1
        if ext is None:
            if timed:
                self.fails += 1
                if self.alloc.free_bytes >= nbytes:
                    self.frag_fails += 1
            return False
        self.live.append(ext)
        return True

    def free_one(self, timed: bool) -> None:
        i = self.rng.randrange(len(self.live))
        self.live[i], self.live[-1] = self.live[-1], self.live[i]
        ext = self.live.pop()
        t0 = time.perf_counter_ns()
        self.alloc.free(ext)
        if timed:
            self.free_ns.append(time.perf_counter_ns() - t0)

    def fill(self, target: float, timed: bool) -> None:
        cap = self.alloc.capacity_bytes
        misses = 0
        while self.alloc.used_bytes < target * cap and misses < 8:
            if not self.allocate(draw(self.rng), timed):
                misses += 1

    def step(self, target: float) -> None:
        if self.live:
            self.free_one(timed=True)
        self.fill(target, timed=True)


def allocator_point(
    occupancy: float,
    ops: int,
    *,
    pool_bytes: int = POOL_BYTES,
    slab_bytes: int = SLAB_BYTES,
    seed: int = 0,
    overhead: float = 0.0,
) -> dict[str, Any]:
    alloc = SlabAllocator([slab_bytes] * max(1, pool_bytes // slab_bytes))
    churn = _Churn(alloc, random.Random(seed))
    churn.fill(occupancy, timed=False)
    for _ in range(ops):
        churn.step(occupancy)
    return {
        "occupancy_target": occupancy,
        "occupancy": alloc.used_bytes / alloc.capacity_bytes,
        "pool_bytes": alloc.capacity_bytes,
        "slabs": len(alloc.slab_sizes),
        "live_extents": len(churn.live),
        "ops": ops,
        "allocate_ns": summary(churn.alloc_ns, overhead),
        "free_ns": summary(churn.free_ns, overhead),
        "requests": churn.requests,
        "fails": churn.fails,
        "frag_fails": churn.frag_fails,
        **fragmentation(alloc),
    }


def frag_series(occupancy: float, ops: int, every: int, seed: int = 1) -> dict[str, Any]:
    alloc = SlabAllocator([SLAB_BYTES] * (POOL_BYTES // SLAB_BYTES))
    churn = _Churn(alloc, random.Random(seed))
    churn.fill(occupancy, timed=False)
    series = []
    for i in range(ops + 1):
        if i % every == 0:
            series.append(
                {
                    "op": i,
                    "occupancy": alloc.used_bytes / alloc.capacity_bytes,
                    "fails": churn.fails,
                    **fragmentation(alloc),
                }
            )
        churn.step(occupancy)
    return {"occupancy_target": occupancy, "series": series}


def pool_point(occupancy: float, ops: int, seed: int = 2, overhead: float = 0.0) -> dict[str, Any]:
    """FeaturePool.put / release at a steady occupancy (host_shm tier, publish = ready word)."""
    import torch

    from pool.backends.host_shm import HostShmBackend
    from pool.control import ControlBlock
    from pool.errors import PoolError
    from pool.featurepool import FeaturePool

    class ReadyOnlyBackend(HostShmBackend):
        """memfd slabs (never touched), publish writes only the ready word."""

        def publish(
            self, extent: Extent, tensor: torch.Tensor, ctrl: ControlBlock, slot: int, gen: int
        ) -> None:
            ctrl.set_ready(slot, gen)

    rng = random.Random(seed)
    tensors = {s: torch.empty(s // 2, dtype=torch.bfloat16) for s, _ in MIX}
    backend = ReadyOnlyBackend([SLAB_BYTES] * (POOL_BYTES // SLAB_BYTES))
    pool = FeaturePool([backend], max_leases=4096, policy="reject", default_ttl_s=3600)
    alloc = pool.tiers[0].allocator
    live: list[str] = []
    put_ns: list[float] = []
    rel_ns: list[float] = []
    fails = 0

    def put(timed: bool) -> bool:
        nonlocal fails
        t = tensors[draw(rng)]
        t0 = time.perf_counter_ns()
        try:
            lease = pool.put(t)
        except PoolError:
            if timed:
                fails += 1
            return False
        if timed:
            put_ns.append(time.perf_counter_ns() - t0)
        live.append(lease.id)
        return True

    try:
        misses = 0
        while alloc.used_bytes < occupancy * alloc.capacity_bytes and misses < 8:
            misses += 0 if put(False) else 1
        for _ in range(ops):
            if live:
                i = rng.randrange(len(live))
                live[i], live[-1] = live[-1], live[i]
                lid = live.pop()
                t0 = time.perf_counter_ns()
                pool.release(lid)
                rel_ns.append(time.perf_counter_ns() - t0)
            misses = 0
            while alloc.used_bytes < occupancy * alloc.capacity_bytes and misses < 8:
                misses += 0 if put(True) else 1
        return {
            "occupancy_target": occupancy,
            "occupancy": alloc.used_bytes / alloc.capacity_bytes,
            "live_leases": len(live),
            "ops": ops,
            "put_ns": summary(put_ns, overhead),
            "release_ns": summary(rel_ns, overhead),
            "fails": fails,
        }
    finally:
        pool.close()


def run(
    quick: bool = False,
    deadline: float | None = None,
    on_point: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every part of the sweep; ``on_point(partial_result)`` is called after each row (the suite
    saves partial results there). Rows past ``deadline`` (time.time()) are skipped."""
    ops = 300 if quick else 4000
    series_ops = 600 if quick else 20000
    occs = (0.1, 0.5, 0.9) if quick else OCCUPANCIES
    pool_sizes = (
        (256 * MiB, 1024 * MiB) if quick else (256 * MiB, 1024 * MiB, 4096 * MiB, 16384 * MiB)
    )
    overhead = timer_overhead_ns()
    out: dict[str, Any] = {
        "config": {
            "slab_bytes": SLAB_BYTES,
            "pool_bytes": POOL_BYTES,
            "mix": [list(m) for m in MIX],
            "ops_per_point": ops,
            "timer_overhead_ns": overhead,
            "quick": quick,
        },
        "allocator": [],
        "pool": [],
        "frag_series": [],
        "pool_size": [],
    }

    def add(part: str, make: Callable[[], dict[str, Any]]) -> None:
        if deadline is not None and time.time() > deadline:
            row: dict[str, Any] = {"skipped": "out of the time budget"}
        else:
            try:
                row = make()
            except Exception as e:  # one failed row must not end the sweep
                row = {"error": f"{type(e).__name__}: {e}"}
        out[part].append(row)
        if on_point is not None:
            on_point(out)

    for occ in occs:
        add("allocator", lambda occ=occ: allocator_point(occ, ops, overhead=overhead))
    for occ in occs:
        add("pool", lambda occ=occ: pool_point(occ, ops // 2, overhead=overhead))
    for occ in (0.7, 0.9):
        add("frag_series", lambda occ=occ: frag_series(occ, series_ops, max(1, series_ops // 50)))
    for pb in pool_sizes:
        add("pool_size", lambda pb=pb: allocator_point(0.7, ops, pool_bytes=pb, overhead=overhead))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quick", action="store_true", help="a few hundred ops per point")
    args = ap.parse_args()
    t0 = time.time()
    res = run(args.quick)
    print("occupancy  allocate ns  free ns  fails(frag)  frag  usable-for-9.8MB")
    for r in res["allocator"]:
        if "error" in r or "skipped" in r:
            print(r)
            continue
        print(
            f"{r['occupancy']:9.2f} {r['allocate_ns']['median']:12.0f} "
            f"{r['free_ns']['median']:8.0f} {r['fails']:6d}({r['frag_fails']}) "
            f"{r['frag']:6.3f} {r['usable_for_9.8MB']:8.3f}"
        )
    print("occupancy  put ns  release ns")
    for r in res["pool"]:
        if "put_ns" in r:
            print(
                f"{r['occupancy']:9.2f} {r['put_ns']['median']:7.0f} "
                f"{r['release_ns']['median']:10.0f}"
            )
    print(f"{time.time() - t0:.1f} s")
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
