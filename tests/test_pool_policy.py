"""Pool policy: ``wait`` waits once per batch; no device -> host copy under the pool lock;
lease slots sized so bytes run out before slots at the default feature size; running out of
slots is counted under its own reason."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from fastapi.testclient import TestClient

from pool.backends.host_shm import HostShmBackend
from pool.errors import PoolExhausted, SlotsExhausted
from pool.featurepool import FeaturePool, lease_slots
from tests.conftest import image_bytes

MiB = 1 << 20


class StepClock:
    """Each reading moves time on by ``step`` seconds: waits end by count, not by real time."""

    def __init__(self, step: float) -> None:
        self.t = 1000.0
        self.step = step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def test_wait_policy_waits_once_per_batch_not_per_tensor() -> None:
    clock = StepClock(0.01)
    pool = FeaturePool(
        [HostShmBackend([MiB])],
        max_leases=64,
        policy="wait",
        wait_s=0.5,
        clock=clock,
        default_ttl_s=1e6,
    )
    waits: list[float] = []
    real_wait = pool._freed.wait

    def counting_wait(timeout: float | None = None) -> bool:
        waits.append(timeout or 0)
        return real_wait(timeout=0)

    pool._freed.wait = counting_wait  # type: ignore[method-assign]
    try:
        assert not isinstance(pool.put_many([torch.ones(MiB // 4)])[0], Exception)  # full now
        results = pool.put_many([torch.ones(MiB // 16) for _ in range(8)])
        assert all(isinstance(r, PoolExhausted) for r in results)
        # One shared 0.5 s deadline at 0.01 s per clock reading: a few dozen waits for the
        # whole batch. Per tensor it was eight times that.
        assert 0 < len(waits) <= 0.5 / 0.01
    finally:
        pool.close()


def test_wait_policy_gets_the_space_freed_within_the_bound() -> None:
    pool = FeaturePool([HostShmBackend([MiB])], max_leases=64, policy="wait", wait_s=5.0)
    try:
        [full] = pool.put_many([torch.ones(MiB // 4)])
        assert not isinstance(full, Exception)
        timer = threading.Timer(0.05, pool.release, args=(full.id,))
        timer.start()
        results = pool.put_many([torch.ones(MiB // 16) for _ in range(4)])
        timer.join()
        assert not [r for r in results if isinstance(r, Exception)]
    finally:
        pool.close()


def test_inline_copy_runs_outside_the_pool_lock() -> None:
    pool = FeaturePool([], max_leases=8, policy="fallback")
    held: list[bool] = []

    class Spy(torch.Tensor):
        def to(self, *args: Any, **kwargs: Any) -> Any:
            held.append(pool._lock.locked())
            return super().to(*args, **kwargs)

    try:
        lease = pool.put(torch.arange(12.0).as_subclass(Spy))
        [other] = pool.put_many([torch.arange(5.0).as_subclass(Spy)])
        assert held == [False, False]
        assert torch.equal(pool.read(lease.id).as_subclass(torch.Tensor), torch.arange(12.0))
        assert not isinstance(other, Exception)
        assert pool.ctrl.ready(lease.slot) == lease.generation  # ready once the copy is in
    finally:
        pool.close()


def test_failed_inline_copy_gives_everything_back() -> None:
    pool = FeaturePool([], max_leases=8, policy="fallback")

    class Broken(torch.Tensor):
        def to(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("copy failed")

    try:
        try:
            pool.put(torch.ones(4).as_subclass(Broken))
        except RuntimeError:
            pass
        s = pool.stats()
        assert s["leases_active"] == 0 and s["inline"]["used_bytes"] == 0
    finally:
        pool.close()


def test_slot_exhaustion_is_its_own_reason() -> None:
    pool = FeaturePool([HostShmBackend([MiB])], max_leases=2)
    try:
        pool.put(torch.ones(4))
        pool.put(torch.ones(4))
        results = pool.put_many([torch.ones(4)])
        assert isinstance(results[0], SlotsExhausted)
        assert results[0].type == "lease_slots_exhausted"
        s = pool.stats()
        assert s["slot_exhaustions"] == 1
        assert s["tiers"][0]["used_bytes"] < MiB // 2  # bytes were free: slots ran out
    finally:
        pool.close()


def test_lease_slots_outlast_bytes_at_the_default_feature_size() -> None:
    # The H200 case of the issue: a 4 GiB GPU tier of ViT-B/16 features (197 x 768 bf16).
    feature = 197 * 768 * 2
    slots = lease_slots(4 << 30, feature)
    assert slots * feature >= 4 << 30 and slots > 4096
    assert lease_slots(1 << 20, feature) == 4096  # a floor for small pools
    assert lease_slots(1 << 40, 256) == 1 << 20  # and a ceiling


def test_service_sizes_slots_from_the_encoder(make_client: Callable[..., TestClient]) -> None:
    c = make_client()
    pool = c.app.state.engine.pool  # type: ignore[attr-defined]
    enc = c.app.state.engine.encoder  # type: ignore[attr-defined]
    rows, dim = enc.output_shape
    feature = rows * dim * enc.dtype.itemsize
    info = c.get("/v1/pool").json()
    capacity = sum(t["capacity_bytes"] for t in info["tiers"]) + info["inline"]["capacity_bytes"]
    assert info["max_leases"] * feature >= capacity
    assert pool.leases.max_slots == info["max_leases"]


def test_service_counts_slot_exhaustion(make_client: Callable[..., TestClient]) -> None:
    small = make_client(max_leases=2)
    jpeg = image_bytes("JPEG")
    r = small.post("/v1/encode", files=[("image", jpeg)] * 3)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["type"] == "lease_slots_exhausted"
    metrics = small.get("/metrics").text
    assert 'featpool_rejected_total{reason="lease_slots_exhausted"} 1.0' in metrics
    assert "featpool_lease_slots_exhausted_total 1.0" in metrics
    info = small.get("/v1/pool").json()
    assert info["leases_active"] == 0
