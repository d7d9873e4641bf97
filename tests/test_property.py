"""Property-based tests (hypothesis) of the allocator, the lease table and FeaturePool under
heavy churn: random sequences of put / release / consumer ack / renew / clock advance / reap,
checked against a small model after every step.

Invariants:
- the allocator's used bytes are the sum of the live extents, live extents never overlap, free
  plus used is the capacity, and the free ranges are exactly the complement of the live extents;
- the allocator's live extents are exactly the extents of the live leases (so every ended
  lease's extent is back);
- a slot's generation strictly increases every time it is reused;
- ``ctrl.gen(slot)`` is 0 for a free slot and the lease's generation for a live one;
- a lease is live iff the model says so (not released, not acked-and-reaped, not expired);
- when everything ends, occupancy is zero in every tier and inline.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from pool.allocator import ALIGNMENT, Extent, SlabAllocator
from pool.backends.host_shm import HostShmBackend
from pool.errors import LeaseExpired, LeaseNotFound, LeaseReleased, PoolExhausted
from pool.featurepool import INLINE, FeaturePool
from pool.leases import Lease
from tests.conftest import FakeClock

SLABS = [4096, 8192, 2048]
MAX_LEASES = 8
INLINE_MAX = 12_288

CHURN = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def check_allocator(alloc: SlabAllocator, live: list[Extent]) -> None:
    """The allocator's books against the extents the caller believes are live."""
    assert alloc.used_bytes == sum(e.size for e in live)
    assert alloc.free_bytes + alloc.used_bytes == alloc.capacity_bytes
    assert alloc.allocations == len(live)
    free = alloc.free_ranges()
    assert sum(e.size for e in free) == alloc.free_bytes
    # Live and free ranges tile every slab exactly: no overlap, no gap, free ranges coalesced.
    for slab, size in enumerate(alloc.slab_sizes):
        spans = sorted(
            [(e.offset, e.size, "live") for e in live if e.slab == slab]
            + [(e.offset, e.size, "free") for e in free if e.slab == slab]
        )
        pos, prev_kind = 0, ""
        for offset, n, kind in spans:
            assert offset == pos, f"slab {slab}: gap or overlap at {pos} (next span {offset})"
            assert offset % alloc.alignment == 0 and n % alloc.alignment == 0 and n > 0
            assert not (kind == "free" and prev_kind == "free"), "adjacent free ranges"
            pos, prev_kind = offset + n, kind
        assert pos == size
    if free:
        assert alloc.largest_free == max(e.size for e in free)


class AllocatorMachine(RuleBasedStateMachine):
    """The allocator alone, with sizes that straddle the alignment and the slab sizes."""

    extents = Bundle("extents")
    freed = Bundle("freed")

    def __init__(self) -> None:
        super().__init__()
        self.alloc = SlabAllocator(SLABS)
        self.live: list[Extent] = []

    @rule(target=extents, nbytes=st.integers(1, 9000))
    def allocate(self, nbytes: int) -> Extent:
        largest_before = self.alloc.largest_free
        e = self.alloc.allocate(nbytes)
        size = -(-nbytes // ALIGNMENT) * ALIGNMENT
        if e is None:
            # Best fit fails only when no free range is big enough.
            assert size > largest_before
            return Extent(-1, -1, -1)  # a placeholder the free rule skips
        assert e.size == size and e.offset + e.size <= self.alloc.slab_sizes[e.slab]
        self.live.append(e)
        return e

    @rule(target=freed, e=consumes(extents))
    def free(self, e: Extent) -> Extent:
        if e.slab >= 0:
            self.alloc.free(e)
            self.live.remove(e)
        return e

    @rule(e=freed)
    def double_free_raises(self, e: Extent) -> None:
        if e.slab < 0 or e in self.live:
            return
        try:
            self.alloc.free(e)
        except ValueError:
            pass
        else:
            raise AssertionError(f"freeing {e} twice was accepted")

    @invariant()
    def books_balance(self) -> None:
        check_allocator(self.alloc, self.live)

    def teardown(self) -> None:
        for e in list(self.live):
            self.alloc.free(e)
        check_allocator(self.alloc, [])
        assert self.alloc.free_ranges() == [Extent(i, 0, s) for i, s in enumerate(SLABS)]


class PoolChurn(RuleBasedStateMachine):
    """FeaturePool (host tier of three slabs, few slots, bounded inline) with a fake clock.

    Which operations reap on the side is the pool's choice, so the model is exact only where it
    must be: a lease that is neither acked nor due is live; a deleted one is gone; an acked or
    overdue one may linger until the next reap, and is gone after ``reap()``."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.pool = FeaturePool(
            [HostShmBackend(SLABS)],
            max_leases=MAX_LEASES,
            default_ttl_s=10.0,
            max_ttl_s=100.0,
            inline_max_bytes=INLINE_MAX,
            clock=self.clock,
        )
        # The model: live lease id -> (lease, deadline, acked); ended id -> how it ended.
        self.live: dict[str, tuple[Lease, float, bool]] = {}
        self.ended: dict[str, str] = {}
        self.last_gen = [0] * MAX_LEASES

    def _may_end(self, lid: str) -> bool:
        """Acked or past its deadline: a reap may end it at any time."""
        _, deadline, acked = self.live[lid]
        return acked or deadline <= self.clock()

    def _ended_by_reaping(self, lid: str) -> None:
        assert self._may_end(lid), f"live lease {lid} (not acked, not due) was ended"
        acked = self.live.pop(lid)[2]
        self.ended[lid] = "acked" if acked else "expired"

    def _sync(self) -> None:
        """Leases the pool ended on the side (a reap inside put, get, renew...)."""
        pool_live = {lease.id for lease in self.pool.leases}
        for lid in [lid for lid in self.live if lid not in pool_live]:
            self._ended_by_reaping(lid)
        assert pool_live == set(self.live), "the pool has leases the model does not"

    def _pick(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(list(self.live)))

    # ---- rules --------------------------------------------------------------------------------

    @rule(
        n=st.integers(1, 2500),
        ttl=st.one_of(st.none(), st.floats(0.5, 200.0)),
        dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64]),
    )
    def put(self, n: int, ttl: float | None, dtype: torch.dtype) -> None:
        x = torch.arange(n, dtype=torch.float32).to(dtype)
        try:
            lease = self.pool.put(x, ttl)
        except PoolExhausted:
            self._sync()
            nbytes = n * x.element_size()
            alloc = self.pool.tiers[0].allocator
            slots_full = len(self.pool.leases) == MAX_LEASES
            no_room = alloc.largest_free < nbytes and self.pool.inline_bytes + nbytes > INLINE_MAX
            assert slots_full or no_room, "PoolExhausted with free slots and room"
            return
        self._sync_except(lease.id)
        assert lease.generation > self.last_gen[lease.slot], "generation did not grow"
        self.last_gen[lease.slot] = lease.generation
        assert lease.id not in self.ended
        deadline = self.clock() + min(10.0 if ttl is None else ttl, 100.0)
        self.live[lease.id] = (lease, deadline, False)
        self._sync()
        assert torch.equal(self.pool.read(lease.id), x)

    def _sync_except(self, new_id: str) -> None:
        pool_live = {lease.id for lease in self.pool.leases} - {new_id}
        for lid in [lid for lid in self.live if lid not in pool_live]:
            self._ended_by_reaping(lid)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        lid = self._pick(data)
        may_end = self._may_end(lid)
        try:
            self.pool.release(lid)
        except (LeaseReleased, LeaseExpired):
            assert may_end, f"live lease {lid} refused"
            self._sync()
            assert lid in self.ended
            return
        self.live.pop(lid)
        self.ended[lid] = "deleted"
        self._sync()

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def consumer_ack(self, data: st.DataObject) -> None:
        """A consumer writes the ack word; the lease ends at a reap, not before."""
        lid = self._pick(data)
        lease, deadline, _ = self.live[lid]
        self.pool.ctrl.set_ack(lease.slot, lease.generation)
        self.live[lid] = (lease, deadline, True)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), ttl=st.floats(0.5, 500.0))
    def renew(self, data: st.DataObject, ttl: float) -> None:
        lid = self._pick(data)
        lease, deadline, acked = self.live[lid]
        due = deadline <= self.clock()
        try:
            self.pool.renew(lid, ttl)
        except (LeaseReleased, LeaseExpired):
            assert acked or due, f"live lease {lid} could not be renewed"
            self._sync()
            return
        assert not due, f"lease {lid} renewed after its deadline had passed"
        self.live[lid] = (lease, self.clock() + min(ttl, 100.0), acked)
        self._sync()

    @rule(dt=st.floats(0.0, 60.0))
    def advance(self, dt: float) -> None:
        self.clock.advance(dt)

    @rule()
    def reap(self) -> None:
        self.pool.reap()
        self._sync()
        assert not [lid for lid in self.live if self._may_end(lid)], "reap left acked/due"

    @precondition(lambda self: bool(self.ended))
    @rule(data=st.data())
    def ended_lease_stays_ended(self, data: st.DataObject) -> None:
        lid = data.draw(st.sampled_from(list(self.ended)))
        try:
            self.pool.get(lid)
        except (LeaseReleased, LeaseExpired, LeaseNotFound) as e:
            how = self.ended[lid]
            want = {
                "deleted": {"lease_released"},
                "expired": {"lease_expired"},
                "acked": {"lease_released", "lease_expired"},
            }[how]
            assert e.type in want, (how, e.type)
        else:
            raise AssertionError(f"ended lease {lid} is still served")
        self._sync()

    # ---- invariants ---------------------------------------------------------------------------

    @invariant()
    def pool_matches_model_and_books_balance(self) -> None:
        self._sync()
        pool_live = {lease.id: lease for lease in self.pool.leases}
        tier = self.pool.tiers[0]
        extents = [
            lease.extent
            for lease in pool_live.values()
            if lease.tier == tier.name and lease.extent is not None
        ]
        check_allocator(tier.allocator, extents)
        assert self.pool.inline_bytes == sum(
            lease.nbytes for lease in pool_live.values() if lease.tier == INLINE
        )
        by_slot = {lease.slot: lease for lease in pool_live.values()}
        assert len(by_slot) == len(pool_live)  # one lease per slot
        for slot in range(MAX_LEASES):
            lease = by_slot.get(slot)
            assert self.pool.ctrl.gen(slot) == (lease.generation if lease else 0)
            assert self.pool.leases.by_slot(slot) is lease

    def teardown(self) -> None:
        try:
            self.pool.reap()
            for lease in list(self.pool.leases):
                self.pool.release(lease.id)
            stats = self.pool.stats()
            assert stats["leases_active"] == 0
            assert stats["tiers"][0]["used_bytes"] == 0 and stats["inline"]["used_bytes"] == 0
            assert all(self.pool.ctrl.gen(s) == 0 for s in range(MAX_LEASES))
            assert self.pool.tiers[0].allocator.free_ranges() == [
                Extent(i, 0, s) for i, s in enumerate(SLABS)
            ]
        finally:
            self.pool.close()


TestAllocatorChurn = AllocatorMachine.TestCase
TestAllocatorChurn.settings = settings(CHURN, max_examples=100, stateful_step_count=60)
TestPoolChurn = PoolChurn.TestCase
TestPoolChurn.settings = settings(CHURN, max_examples=150, stateful_step_count=50)
