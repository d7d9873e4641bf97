"""Interpreter-wide tuning of a serving process: the garbage collector.

A full collection walks every object the process holds, and it holds the interpreter lock
while it does: after start-up that is torch, transformers and the model's modules, ~400,000
objects and ~150 ms on a CPU box (scratch measurement in docs/benchmarks.md), during which the
event loop, the decode thread and the batch thread all stand still. Under load the leases and
their descriptors survive long enough to reach the oldest generation, so full collections come
every few seconds. ``gc.freeze()`` after start-up moves what start-up made to a permanent
generation that collections skip; collections then walk only what serving made.

The thresholds then: with Python's (700, 10, 10) a young collection comes every 700 net
allocations, i.e. several per request, and what a request holds while it waits for its batch
(~70 ms) survives them into the older generations, whose collections then come every few
hundred requests. On the H200 at ~3,500 images/s that was still 60-70 ms of collections per
second in the GPU process after the freeze; with (10000, 10, 100) 4 ms (docs/benchmarks.md).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from typing import Any

from prometheus_client import Counter


def tune_collector(freeze: bool, thresholds: Sequence[int]) -> int:
    """For a serving process, once started: freeze what start-up made (``freeze``) and set the
    collection thresholds; returns how many objects are frozen."""
    frozen = freeze_startup_objects() if freeze else 0
    gc.set_threshold(*thresholds)
    return frozen


def freeze_startup_objects() -> int:
    """Collect once, then freeze what is left; returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcClock:
    """Adds each collection's pause to a counter labelled by generation (a callback of the
    collector: it runs in whichever thread triggered the collection)."""

    def __init__(self, counter: Counter) -> None:
        self._by_generation = [counter.labels(str(g)) for g in range(3)]
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        # A collection can start anywhere, also a few frames short of the recursion limit (a
        # deeply nested JSON frame being refused, say): there the pause goes uncounted rather
        # than out as an error the collector can only print.
        try:
            if phase == "start":
                self._started = time.perf_counter()
            else:
                self._by_generation[info["generation"]].inc(time.perf_counter() - self._started)
        except RecursionError:
            pass

    def install(self) -> None:
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)
