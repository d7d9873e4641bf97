"""app/interpreter.py: the collector's pauses are counted by generation, and what exists at
start-up is frozen out of later collections."""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Counter

from app.interpreter import GcClock, freeze_startup_objects, tune_collector
from tests.test_metrics import scrape, value


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_gc_clock_adds_each_collections_pause_to_its_generation() -> None:
    counter = Counter("t_gc_pause_seconds", "t", ["generation"], registry=CollectorRegistry())
    clock = GcClock(counter)
    clock.install()
    try:
        gc.collect(2)
        full = counter.labels("2")._value.get()
        assert full > 0
        gc.collect(0)
        assert counter.labels("0")._value.get() > 0
        assert counter.labels("2")._value.get() == full
    finally:
        clock.remove()
    gc.collect(2)
    assert counter.labels("2")._value.get() == full  # removed: no longer counting
    assert clock not in gc.callbacks


def test_gc_clock_called_near_the_recursion_limit_raises_nothing() -> None:
    """Where a collection starts a few frames short of the recursion limit, the counter's
    frames overflow it: the callback swallows that (an error out of a collector callback can
    only be printed as unraisable; pytest fails the test it lands in)."""
    counter = Counter("t_gc_deep_seconds", "t", ["generation"], registry=CollectorRegistry())
    clock = GcClock(counter)
    called: list[int] = []
    raised: list[BaseException] = []

    def deep(n: int) -> int:
        """Recurse to the limit, then call the clock two frames above the deepest one."""
        try:
            left = deep(n + 1)
        except RecursionError:
            return 2
        if left == 0:
            return -1
        if left == 1:
            try:
                clock("start", {"generation": 2})
                clock("stop", {"generation": 2})  # its counter's frames go past the limit
            except RecursionError as e:  # (caught here, or the frames above would swallow it)
                raised.append(e)
            called.append(n)
        return left - 1

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(300)
    try:
        deep(0)
    finally:
        sys.setrecursionlimit(limit)
    assert called and not raised


def test_frozen_objects_are_left_out_of_collections() -> None:
    node = Node()
    alive = weakref.ref(node)
    try:
        frozen = freeze_startup_objects()
        assert frozen >= gc.get_freeze_count() > 0
        del node
        gc.collect()
        assert alive() is not None  # frozen: the collector no longer looks at its cycle
    finally:
        gc.unfreeze()
    gc.collect()
    assert alive() is None


def test_the_service_exports_its_collector_pauses(make_client: Callable[..., TestClient]) -> None:
    c = make_client()
    before = value(scrape(c), "featpool_gc_pause_seconds_total", generation="2")
    gc.collect()
    after = value(scrape(c), "featpool_gc_pause_seconds_total", generation="2")
    assert after > before


def test_tune_collector_sets_the_thresholds_and_freezes_only_when_asked() -> None:
    before = gc.get_threshold()
    try:
        assert tune_collector(False, [10_000, 10, 100]) == 0
        assert gc.get_freeze_count() == 0
        assert gc.get_threshold() == (10_000, 10, 100)
        assert tune_collector(True, [700, 10, 10]) > 0
        assert gc.get_threshold() == (700, 10, 10)
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_thresholds_are_three_counts_not_below_zero() -> None:
    from pydantic import ValidationError

    from app.settings import Settings

    assert Settings().gc_thresholds == [10_000, 10, 100]
    for bad in ([1, 2], [700, -1, 10], [1, 2, 3, 4]):
        with pytest.raises(ValidationError):
            Settings(gc_thresholds=bad)
