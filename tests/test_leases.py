import os

import pytest

import pool.leases
from pool.allocator import Extent
from pool.errors import LeaseExpired, LeaseNotFound, LeaseReleased, PoolExhausted
from pool.leases import GEN_MAX, LeaseIds, LeaseState, LeaseTable
from tests.conftest import FakeClock


def reserve(t: LeaseTable, ttl: float = 10.0):  # type: ignore[no-untyped-def]
    return t.reserve(
        tier="host", extent=Extent(0, 0, 256), shape=(2,), dtype="float32", nbytes=8, ttl_s=ttl
    )


def test_states_reserved_ready_released(clock: FakeClock) -> None:
    t = LeaseTable(4, clock=clock)
    lease = reserve(t)
    assert lease.state is LeaseState.RESERVED and lease.generation == 1
    t.mark_ready(lease.id)
    assert t.get(lease.id).state is LeaseState.READY
    t.release(lease.id)
    assert lease.state is LeaseState.RELEASED
    with pytest.raises(LeaseReleased):
        t.get(lease.id)


def test_double_release_raises(clock: FakeClock) -> None:
    t = LeaseTable(2, clock=clock)
    lease = reserve(t)
    t.release(lease.id)
    with pytest.raises(LeaseReleased):
        t.release(lease.id)


def ready(t: LeaseTable, ttl: float = 10.0):  # type: ignore[no-untyped-def]
    lease = reserve(t, ttl)
    t.mark_ready(lease.id)
    return lease


def test_ttl_expiry_with_fake_clock_and_renew(clock: FakeClock) -> None:
    t = LeaseTable(4, clock=clock)
    a, b = ready(t, ttl=5), ready(t, ttl=20)
    clock.advance(4.9)
    assert t.expire_due() == []
    t.renew(a.id, 10)  # now due at +14.9
    clock.advance(9.9)
    assert t.expire_due() == []
    clock.advance(0.2)
    assert [x.id for x in t.expire_due()] == [a.id]
    with pytest.raises(LeaseExpired):
        t.get(a.id)
    assert t.get(b.id).state is LeaseState.READY
    clock.advance(100)
    assert [x.id for x in t.expire_due()] == [b.id]
    assert len(t) == 0


def test_a_lease_still_being_copied_in_is_not_due(clock: FakeClock) -> None:
    """Past its deadline a RESERVED lease (its bytes still being copied in) is not handed to
    the reaper; the pool ends it when the copy is done (test_featurepool)."""
    t = LeaseTable(2, clock=clock)
    copying, done = reserve(t, ttl=1), ready(t, ttl=1)
    clock.advance(2)
    assert [x.id for x in t.expire_due()] == [done.id]
    assert t.get(copying.id).state is LeaseState.RESERVED


def test_generation_changes_on_every_reuse(clock: FakeClock) -> None:
    t = LeaseTable(1, clock=clock)
    seen = []
    for _ in range(5):
        lease = reserve(t)
        seen.append((lease.slot, lease.generation))
        t.release(lease.id)
    assert [s for s, _ in seen] == [0] * 5
    assert [g for _, g in seen] == [1, 2, 3, 4, 5]


def test_generation_wraps_past_zero(clock: FakeClock) -> None:
    """Generations are u32 words in the control block, and 0 there means "never used": after
    2**32 - 1 reuses of a slot the next generation is 1, never 0 (a consumer holding a
    descriptor from before could not tell a fresh slot from a stale one)."""
    t = LeaseTable(1, clock=clock)
    t._generations[0] = GEN_MAX - 1  # as after that many reuses, without making them
    seen = []
    for _ in range(3):
        lease = reserve(t)
        seen.append(lease.generation)
        t.release(lease.id)
    assert seen == [GEN_MAX, 1, 2]


def test_free_slots_are_reused_oldest_first(clock: FakeClock) -> None:
    t = LeaseTable(3, clock=clock)
    a, b, _ = reserve(t), reserve(t), reserve(t)
    t.release(b.id)
    t.release(a.id)
    assert reserve(t).slot == b.slot  # b's slot rested longest


def test_slots_exhausted_and_unknown_ids(clock: FakeClock) -> None:
    t = LeaseTable(1, clock=clock)
    reserve(t)
    with pytest.raises(PoolExhausted):
        reserve(t)
    with pytest.raises(LeaseNotFound):
        t.get("nope")


def test_ended_memory_is_bounded(clock: FakeClock) -> None:
    t = LeaseTable(1, clock=clock, remember_ended=2)
    ids = []
    for _ in range(3):
        lease = reserve(t)
        ids.append(lease.id)
        t.release(lease.id)
    with pytest.raises(LeaseNotFound):  # forgotten: the oldest ended lease
        t.get(ids[0])
    with pytest.raises(LeaseReleased):
        t.get(ids[2])


def test_expire_due_ends_exactly_the_leases_a_full_scan_finds(clock: FakeClock) -> None:
    """The reaper pops deadlines from a heap; against a scan of every live lease, under random
    reserves, renewals (longer and shorter), releases and time steps, with enough early
    releases that the heap is rebuilt."""
    import random

    rng = random.Random(7)
    t = LeaseTable(4096, clock=clock)
    live: list[str] = []
    for _ in range(20_000):
        op = rng.random()
        if op < 0.45 and len(live) < 4000:
            live.append(ready(t, ttl=rng.uniform(0.1, 5)).id)
        elif op < 0.6 and live:
            t.renew(rng.choice(live), rng.uniform(0.05, 5))
        elif op < 0.85 and live:
            t.release(live.pop(rng.randrange(len(live))))
        else:
            clock.advance(rng.uniform(0, 0.3))
            want = {i for i in live if t.get(i).deadline <= clock()}
            got = [x.id for x in t.expire_due()]
            assert len(got) == len(set(got)) and set(got) == want
            live = [i for i in live if i not in want]
    assert len(t) == len(live)


def test_lease_ids_are_the_csprngs_bytes_drawn_a_chunk_at_a_time(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each ID is 16 bytes of os.urandom's output in hex, and 600 leases draw from it 3 times
    (4 KiB each), not 600: each draw gives up the interpreter lock, and in the GPU process
    taking it back waits behind the other threads."""
    draws: list[bytes] = []
    real = os.urandom

    def urandom(n: int) -> bytes:
        draws.append(real(n))
        return draws[-1]

    monkeypatch.setattr(pool.leases.os, "urandom", urandom)
    t = LeaseTable(4, clock=clock)
    ids = []
    for _ in range(600):
        lease = reserve(t)
        ids.append(lease.id)
        t.release(lease.id)
    assert len(draws) == 3 and all(len(d) == 4096 for d in draws)
    drawn = b"".join(draws)
    assert ids == [drawn[16 * i : 16 * (i + 1)].hex() for i in range(600)]
    assert len(set(ids)) == 600


def test_lease_ids_chunk_must_hold_whole_ids() -> None:
    for bad in (0, 8, 4100):
        with pytest.raises(ValueError):
            LeaseIds(bad)
    ids = LeaseIds(32)
    assert len({ids.next() for _ in range(5)}) == 5
