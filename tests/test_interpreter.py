"""app/interpreter.py: the collector's pauses are counted by generation, and what exists at
start-up is frozen out of later collections."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Counter

from app.interpreter import GcClock, freeze_startup_objects
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
