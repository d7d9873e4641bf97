"""Bandwidth into a pool tier's memory, shared by bench_handoff.py and suite.py: back-to-back
publishes (copy + ready word) and plain copies into the same slice, against a plain copy of
the same bytes elsewhere."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from pool.allocator import Extent
from pool.control import ControlBlock


def time_copies(
    backend: Any,
    ctrl: ControlBlock,
    extent: Extent,
    src: torch.Tensor,
    *,
    copies: int,
    reps: int,
    slot: int,
    gen: int,
) -> dict[str, float]:
    """``copies`` back to back of each kind, ``reps`` times after one warm-up round (page
    faults, first launches); medians. On CUDA the copies are queued behind a GPU sleep, so the
    host enqueues all of them before the first runs, and CUDA events time them. ``slot`` must
    be one no lease uses: its ready word is written ``copies * reps`` times from ``gen`` up."""
    n = src.numel() * src.element_size()
    use_cuda = src.device.type == "cuda"
    dst = torch.empty_like(src)
    pool_dst = backend.view(extent, src.dtype, tuple(src.shape))
    secs: dict[str, list[float]] = {"publish": [], "copy": [], "plain": []}
    for rep in range(reps + 1):
        for which, spent in secs.items():
            if use_cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(50_000_000)
                start.record()
            else:
                t0 = time.perf_counter()
            for _ in range(copies):
                if which == "publish":
                    backend.publish(extent, src, ctrl, slot, gen)
                    gen += 1
                elif which == "copy":
                    pool_dst.copy_(src, non_blocking=True)
                else:
                    dst.copy_(src, non_blocking=True)
            if use_cuda:
                end.record()
                end.synchronize()
                took = start.elapsed_time(end) / 1e3
            else:
                took = time.perf_counter() - t0
            if rep:
                spent.append(took)
    tp, tc, td = (statistics.median(secs[k]) for k in ("publish", "copy", "plain"))
    return {
        "nbytes": n,
        "copies": copies,
        "publish_GBps": copies * n / tp / 1e9,
        "copy_GBps": copies * n / tc / 1e9,
        "plain_GBps": copies * n / td / 1e9,
        "publish_fraction": td / tp,
        "copy_fraction": td / tc,
        "publish_us_per_lease": tp / copies * 1e6,
        "plain_us_per_copy": td / copies * 1e6,
        "ready_write_us": (tp - tc) / copies * 1e6,
    }
