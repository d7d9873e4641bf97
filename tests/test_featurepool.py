import threading

import pytest
import torch

from pool.backends.host_shm import HostShmBackend
from pool.errors import (
    InvalidTensor,
    LeaseExpired,
    LeaseNotFound,
    LeaseReleased,
    PoolError,
    PoolExhausted,
    TensorTooLarge,
)
from pool.featurepool import FeaturePool
from tests.conftest import FakeClock

MiB = 1 << 20


def make_pool(slabs: list[int], **kw: object) -> FeaturePool:
    return FeaturePool([HostShmBackend(slabs)], **kw)  # type: ignore[arg-type]


def test_put_read_release_roundtrip() -> None:
    p = make_pool([MiB], max_leases=8)
    x = torch.randn(17, 33)
    lease = p.put(x)
    assert p.ctrl.gen(lease.slot) == lease.generation == p.ctrl.ready(lease.slot)
    assert torch.equal(p.read(lease.id), x)
    p.release(lease.id)
    assert p.stats()["tiers"][0]["used_bytes"] == 0
    assert p.ctrl.gen(lease.slot) == 0  # consumers see at once that it is gone
    with pytest.raises(LeaseReleased):
        p.read(lease.id)
    p.close()


def test_consumer_ack_word_releases_on_reap() -> None:
    p = make_pool([MiB])
    lease = p.put(torch.ones(10))
    p.ctrl.set_ack(lease.slot, lease.generation - 1)  # an old ack must not count
    assert p.reap() == 0
    p.ctrl.set_ack(lease.slot, lease.generation)
    assert p.reap() == 1
    assert p.stats()["released"] == {"ack": 1}
    assert p.stats()["leases_active"] == 0
    p.close()


def test_deadline_expires_and_frees(clock: FakeClock) -> None:
    p = make_pool([MiB], clock=clock, default_ttl_s=5)
    lease = p.put(torch.ones(1000))
    clock.advance(6)
    with pytest.raises(LeaseExpired):
        p.get(lease.id)
    s = p.stats()
    assert s["tiers"][0]["used_bytes"] == 0 and s["expired"] == {"host": 1}
    p.close()


def test_fallback_chain_counts_reasons() -> None:
    p = make_pool([MiB], inline_max_bytes=4 * MiB)
    big = p.put(torch.zeros(MiB // 4 - 64))  # nearly the whole slab
    spill = p.put(torch.zeros(1024))  # host full -> inline
    assert (big.tier, spill.tier) == ("host", "inline")
    oversize = p.put(torch.zeros(MiB // 2))  # larger than any slab -> inline
    assert oversize.tier == "inline"
    assert p.stats()["fallbacks"] == {("pool_full", "inline"): 1, ("oversize", "inline"): 1}
    assert torch.equal(p.read(spill.id), torch.zeros(1024))
    p.release(spill.id)
    p.release(oversize.id)
    assert p.inline_bytes == 0
    p.close()


def test_inline_is_bounded() -> None:
    p = make_pool([4096], inline_max_bytes=8192)
    p.put(torch.zeros(1024))  # host
    p.put(torch.zeros(2048))  # inline, 8192 bytes
    with pytest.raises(PoolExhausted, match="inline"):
        p.put(torch.zeros(1))
    p.close()


def test_reject_policy_fails_fast_and_places_nothing() -> None:
    p = make_pool([4096], policy="reject")
    p.put(torch.zeros(1024))
    with pytest.raises(PoolExhausted):
        p.put(torch.zeros(1))
    with pytest.raises(TensorTooLarge):
        p.put(torch.zeros(4096))
    assert p.stats()["leases_active"] == 1
    p.close()


def test_wait_policy_succeeds_when_space_frees_in_time() -> None:
    p = make_pool([4096], policy="wait", wait_s=2.0)
    first = p.put(torch.zeros(1024))
    threading.Timer(0.1, p.release, args=(first.id,)).start()
    second = p.put(torch.zeros(1024))  # waits for the release
    assert second.tier == "host"
    p.close()


def test_wait_policy_gives_up_after_its_bound() -> None:
    p = make_pool([4096], policy="wait", wait_s=0.3)
    p.put(torch.zeros(1024))
    with pytest.raises(PoolExhausted, match="policy wait"):
        p.put(torch.zeros(1024))
    # One failure for the one tensor, not one per 10 ms retry of its wait (~30 here): the
    # alert on failures per second fired for a single waiting request.
    assert p.stats()["alloc_failures"] == {"host": 1}
    p.close()


def test_bad_tensors_are_refused() -> None:
    p = make_pool([MiB])
    with pytest.raises(InvalidTensor, match="empty"):
        p.put(torch.zeros(0))
    with pytest.raises(InvalidTensor):
        p.put(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(ValueError):
        p.put(torch.zeros(3), ttl_s=-1)
    assert p.stats()["leases_active"] == 0
    p.close()


def test_non_contiguous_and_bf16_tensors_roundtrip() -> None:
    p = make_pool([MiB])
    x = torch.randn(8, 6).t()  # non-contiguous
    y = torch.randn(5, 7).to(torch.bfloat16)
    assert torch.equal(p.read(p.put(x).id), x)
    assert torch.equal(p.read(p.put(y).id), y)
    p.close()


def test_ttl_is_clamped_to_the_maximum() -> None:
    p = make_pool([MiB], max_ttl_s=30)
    assert p.put(torch.ones(1), ttl_s=1e9).ttl_s == 30
    p.close()


def test_put_many_returns_a_result_per_tensor() -> None:
    p = make_pool([4096], inline_max_bytes=4096)
    results = p.put_many([torch.ones(768), torch.zeros(0), torch.ones(768), torch.ones(2048)])
    first, empty, spilled, refused = results
    assert not isinstance(first, BaseException) and first.tier == "host"
    assert isinstance(empty, InvalidTensor)
    assert not isinstance(spilled, BaseException) and spilled.tier == "inline"
    assert isinstance(refused, PoolExhausted)  # host full, inline bound reached
    assert p.stats()["leases_active"] == 2
    assert torch.equal(p.read(first.id), torch.ones(768))
    p.close()


def test_put_many_of_rows_gives_each_row_a_lease() -> None:
    """One tensor [k, ...] stands for its k rows: a lease each, holding that row, placed down
    the tier chain as k tensors would be; a row-less or 1-d tensor is refused."""
    p = make_pool([4096], inline_max_bytes=2 * 3072)
    rows = torch.arange(4 * 768, dtype=torch.float32).reshape(4, 768)
    first, spilled, spilled2, refused = p.put_many(rows)
    assert not isinstance(first, BaseException) and first.tier == "host"
    assert not isinstance(spilled, BaseException) and spilled.tier == "inline"
    assert not isinstance(spilled2, BaseException) and spilled2.tier == "inline"
    assert isinstance(refused, PoolExhausted)
    for lease, row in zip((first, spilled, spilled2), rows, strict=False):
        assert lease.shape == (768,) and torch.equal(p.read(lease.id), row)
    assert [type(r) for r in p.put_many(torch.ones(3, 0))] == [InvalidTensor] * 3
    with pytest.raises(ValueError, match="rows"):
        p.put_many(torch.ones(5))
    assert p.put_many(torch.ones(0, 4)) == []
    p.close()


def test_full_slots_of_acked_leases_are_reused() -> None:
    p = make_pool([MiB], max_leases=2)
    a, b = p.put(torch.ones(4)), p.put(torch.ones(4))
    p.ctrl.set_ack(a.slot, a.generation)  # acked; the reaper has not run
    c = p.put(torch.zeros(4))  # no free slot until the ack is reaped
    assert c.slot == a.slot and c.generation == a.generation + 1
    p.ctrl.set_ack(b.slot, b.generation)
    with pytest.raises(LeaseReleased):  # an acked lease is gone even before the reaper runs
        p.get(b.id)
    p.close()


class _FailingBackend(HostShmBackend):
    """A tier whose copy fails (a CUDA error, say) after the lease was reserved."""

    def publish(self, *args: object) -> None:
        raise RuntimeError("copy failed")


def test_a_failed_publish_gives_the_reservation_back() -> None:
    p = FeaturePool([_FailingBackend([MiB])])
    with pytest.raises(RuntimeError, match="copy failed"):
        p.put(torch.ones(8))
    with pytest.raises(RuntimeError, match="copy failed"):
        p.put_many([torch.ones(8), torch.ones(8)])
    s = p.stats()
    assert s["leases_active"] == 0 and s["tiers"][0]["used_bytes"] == 0
    assert not p.ctrl.slots["gen"].any()  # no slot is left looking live to consumers
    p.close()


class _SlowBackend(HostShmBackend):
    """A host tier whose first copy waits until the test lets it go."""

    def __init__(self, slabs: list[int]) -> None:
        super().__init__(slabs)
        self.copying = threading.Event()
        self.go = threading.Event()

    def publish(self, *args: object) -> None:  # type: ignore[override]
        if not self.copying.is_set():
            self.copying.set()
            assert self.go.wait(10)
        super().publish(*args)  # type: ignore[arg-type]


def test_a_lease_whose_deadline_passes_during_its_copy_keeps_its_memory_until_the_copy_ends(
    clock: FakeClock,
) -> None:
    """The copy into the pool runs outside the lock. If the reaper ended a lease still being
    copied (a TTL as short as 0.01 s, a slow copy) its memory would go back to the allocator
    while the copy still writes it, and the next put could be given the same bytes: two
    copies into one place, and a consumer of the second lease reading the first's bytes.
    It expires once its copy is done instead."""
    backend = _SlowBackend([4096])
    p = FeaturePool([backend], clock=clock, inline_max_bytes=0)
    first: list[object] = []
    t = threading.Thread(target=lambda: first.append(p.put(torch.ones(1024), ttl_s=0.01)))
    t.start()
    try:
        assert backend.copying.wait(10)
        clock.advance(1.0)
        p.reap()  # the deadline has passed while the copy runs
        (reserved,) = list(p.leases)
        for end in (p.get, p.release, p.read):  # nor is it anyone's to look up or end yet
            with pytest.raises(LeaseNotFound, match="not published yet"):
                end(reserved.id)
        with pytest.raises(PoolExhausted):  # its bytes are still being written
            p.put(torch.full((1024,), 2.0), ttl_s=60)
    finally:
        backend.go.set()
        t.join(10)
    (lease,) = first
    assert lease.state.value == "expired"  # type: ignore[attr-defined]
    backend.go.set()
    second = p.put(torch.full((1024,), 2.0), ttl_s=60)  # now its memory is free to reuse
    assert torch.equal(p.read(second.id), torch.full((1024,), 2.0))
    assert p.stats()["expired"] == {"host": 1}
    p.close()


def test_a_batch_that_fails_midway_gives_back_what_it_reserved(clock: FakeClock) -> None:
    """An error that is no PoolError for tensor k of a batch (here: out of memory making a
    huge expanded view contiguous) must not leave tensors 0..k-1 reserved: the reaper leaves
    reserved leases to their put, so nothing else would ever free them."""
    p = FeaturePool([HostShmBackend([MiB])], max_leases=8, clock=clock)
    huge = torch.zeros(1).expand(1 << 42)  # 16 TiB once contiguous
    with pytest.raises((RuntimeError, MemoryError)):
        p.put_many([torch.ones(1024), huge])
    s = p.stats()
    assert s["leases_active"] == 0 and s["tiers"][0]["used_bytes"] == 0
    assert not p.ctrl.slots["gen"].any()
    p.close()


def test_put_into_a_closed_pool_is_a_pool_error() -> None:
    p = make_pool([MiB])
    p.close()
    with pytest.raises(PoolError, match="closed"):
        p.put(torch.ones(8))
