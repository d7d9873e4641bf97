"""The lease table: the one place where a lease changes state.

    reserve() -> RESERVED --publish--> READY --ack / delete--> RELEASED
                    |                    |
                    +------deadline------+--> EXPIRED

Each lease occupies a numbered slot. A slot's generation goes up every time the slot is reused,
so a consumer holding an old (slot, generation) pair can tell that its lease is gone. Ended leases
are remembered for a while (bounded), so that a late caller hears "expired" or "released" (410)
rather than "not found" (404).
"""

from __future__ import annotations

import heapq
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pool.allocator import Extent
from pool.errors import LeaseExpired, LeaseNotFound, LeaseReleased, SlotsExhausted

GEN_MAX = 2**32 - 1  # generations are u32 words in the control block; 0 means "never used"


class LeaseState(StrEnum):
    RESERVED = "reserved"
    READY = "ready"
    RELEASED = "released"
    EXPIRED = "expired"


@dataclass(frozen=True, slots=True)
class ImageGrid:
    """The image grid of a dynamic-resolution encoder (Qwen2-VL): (t, h, w) in patches, and
    the number of tokens the image gives (t*h*w / merge**2), which the consumer needs to
    place the features and build their positions."""

    t: int
    h: int
    w: int
    tokens: int


@dataclass(slots=True)
class Lease:
    id: str
    slot: int
    generation: int
    tier: str  # "gpu", "host" or "inline"
    extent: Extent | None  # None for inline leases
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    nbytes: int
    created_at: float  # wall clock (seconds since the epoch), for humans
    deadline: float  # monotonic clock
    ttl_s: float
    state: LeaseState = LeaseState.RESERVED
    grid: ImageGrid | None = None  # set by dynamic-resolution encoders only
    inline: Any = field(default=None, repr=False)  # the tensor itself for the inline tier
    # Set by the service that published it (app.engine): the hash naming the features, and
    # whether this lease is a copy of features already resident. Every descriptor carries them.
    feature_hash: str | None = None
    cached: bool | None = None

    def expires_at(self, clock: Callable[[], float]) -> float:
        """The deadline as wall-clock seconds since the epoch."""
        return time.time() + (self.deadline - clock())


class LeaseIds:
    """Lease IDs: 128 bits each from the operating system's CSPRNG (``os.urandom``, what
    ``secrets.token_hex`` reads), drawn ``chunk`` bytes at a time. ``os.urandom`` gives up the
    interpreter lock for its system call, and in the GPU process, where other threads want
    the lock, taking it back can wait up to the switch interval: one draw per 256 IDs
    instead of one per lease (docs/benchmarks.md, "Fifteenth session"). Not thread-safe. A
    process forked (not exec'd) after a draw would repeat its parent's next IDs; featpool
    starts its other processes with subprocess."""

    SIZE = 16  # bytes of an ID

    def __init__(self, chunk: int = 4096) -> None:
        if chunk < self.SIZE or chunk % self.SIZE:
            raise ValueError(f"chunk must be a positive multiple of {self.SIZE}")
        self._chunk = chunk
        self._pool = b""
        self._at = 0

    @classmethod
    def valid(cls, text: str) -> bool:
        """Whether ``text`` has the form of an ID (``2 * SIZE`` lowercase hex digits)."""
        return len(text) == 2 * cls.SIZE and all(ch in "0123456789abcdef" for ch in text)

    def next(self) -> str:
        if self._at == len(self._pool):
            self._pool, self._at = os.urandom(self._chunk), 0
        at, self._at = self._at, self._at + self.SIZE
        return self._pool[at : self._at].hex()


class LeaseTable:
    """Slot bookkeeping and the lease state machine. Not thread-safe: the pool holds the lock."""

    def __init__(
        self,
        max_slots: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        remember_ended: int = 65536,
    ) -> None:
        if max_slots <= 0:
            raise ValueError("max_slots must be positive")
        self.max_slots = max_slots
        self.clock = clock
        self._generations = [0] * max_slots
        # Free slots are reused in FIFO order, so a slot rests as long as possible before its
        # generation moves on: stale readers are caught, not confused.
        self._free_slots: OrderedDict[int, None] = OrderedDict.fromkeys(range(max_slots))
        self._active: dict[str, Lease] = {}
        self._by_slot: dict[int, Lease] = {}
        self._ended: OrderedDict[str, LeaseState] = OrderedDict()
        self._remember_ended = remember_ended
        # (deadline, lease id) of every deadline given, earliest first: the reaper pops what is
        # due instead of scanning every live lease 50 times a second. Entries of leases that
        # ended or were renewed since are skipped when popped (and dropped when they pile up).
        self._deadlines: list[tuple[float, str]] = []
        self._ids = LeaseIds()

    def __len__(self) -> int:
        return len(self._active)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def __iter__(self) -> Iterator[Lease]:
        return iter(list(self._active.values()))

    def reserve(
        self,
        *,
        tier: str,
        extent: Extent | None,
        shape: tuple[int, ...],
        dtype: str,
        nbytes: int,
        ttl_s: float,
    ) -> Lease:
        if not self._free_slots:
            raise SlotsExhausted(f"all {self.max_slots} lease slots are in use")
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        slot, _ = self._free_slots.popitem(last=False)
        gen = self._generations[slot] % GEN_MAX + 1  # skip 0 on wrap-around
        self._generations[slot] = gen
        lease = Lease(
            id=self._ids.next(),
            slot=slot,
            generation=gen,
            tier=tier,
            extent=extent,
            shape=shape,
            dtype=dtype,
            nbytes=nbytes,
            created_at=time.time(),
            deadline=self.clock() + ttl_s,
            ttl_s=ttl_s,
        )
        self._active[lease.id] = lease
        self._by_slot[slot] = lease
        self._push_deadline(lease)
        return lease

    def _push_deadline(self, lease: Lease) -> None:
        if len(self._deadlines) > 2 * len(self._active) + 1024:  # mostly ended leases
            self._deadlines = [(x.deadline, x.id) for x in self._active.values()]
            heapq.heapify(self._deadlines)
        heapq.heappush(self._deadlines, (lease.deadline, lease.id))

    def get(self, lease_id: str) -> Lease:
        """The live lease, or LeaseExpired / LeaseReleased / LeaseNotFound."""
        lease = self._active.get(lease_id)
        if lease is not None:
            return lease
        ended = self._ended.get(lease_id)
        if ended is LeaseState.EXPIRED:
            raise LeaseExpired(f"lease {lease_id} expired")
        if ended is LeaseState.RELEASED:
            raise LeaseReleased(f"lease {lease_id} was released")
        raise LeaseNotFound(f"no lease {lease_id}")

    def by_slot(self, slot: int) -> Lease | None:
        return self._by_slot.get(slot)

    def mark_ready(self, lease_id: str) -> Lease:
        lease = self.get(lease_id)
        if lease.state is not LeaseState.RESERVED:
            raise ValueError(f"lease {lease_id} is {lease.state.value}, not reserved")
        lease.state = LeaseState.READY
        return lease

    def renew(self, lease_id: str, ttl_s: float) -> Lease:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        lease = self.get(lease_id)
        lease.deadline = self.clock() + ttl_s
        self._push_deadline(lease)
        lease.ttl_s = ttl_s
        return lease

    def release(self, lease_id: str) -> Lease:
        """End a lease by ack or delete. A second release raises LeaseReleased."""
        return self._end(self.get(lease_id), LeaseState.RELEASED)

    def expire_due(self) -> list[Lease]:
        """End every lease whose deadline has passed; returns them (their extents to free)."""
        return [self._end(lease, LeaseState.EXPIRED) for lease in self.due()]

    def due(self) -> list[Lease]:
        """The live leases whose deadline has passed (not ended yet). Their deadlines leave the
        heap: the caller ends every one (the pool's reaper does). A lease still RESERVED is
        left out: its bytes are being copied in, outside the pool's lock, and ending it would
        hand its memory to the next put while that copy still writes it. Whoever marks it
        ready after the copy ends it instead (``FeaturePool._mark_ready``)."""
        now = self.clock()
        due: dict[str, Lease] = {}
        while self._deadlines and self._deadlines[0][0] <= now:
            _, lease_id = heapq.heappop(self._deadlines)
            lease = self._active.get(lease_id)
            # not ended, not renewed since, not still being copied in
            if lease is not None and lease.deadline <= now and lease.state is LeaseState.READY:
                due[lease_id] = lease
        return list(due.values())

    def end(self, lease: Lease, state: LeaseState, *, keep_slot: bool = False) -> Lease:
        """End a live lease as released or expired. ``keep_slot``: the slot is not reused until
        ``free_slot`` (its memory is quarantined: a consumer that opened it may still read)."""
        return self._end(self.get(lease.id), state, keep_slot=keep_slot)

    def free_slot(self, slot: int) -> None:
        """Return a slot kept by ``end(..., keep_slot=True)`` to the free list."""
        if slot in self._by_slot or slot in self._free_slots:
            raise ValueError(f"slot {slot} is not held")
        self._free_slots[slot] = None

    def _end(self, lease: Lease, state: LeaseState, *, keep_slot: bool = False) -> Lease:
        lease.state = state
        lease.inline = None
        del self._active[lease.id]
        del self._by_slot[lease.slot]
        if not keep_slot:
            self._free_slots[lease.slot] = None
        self._ended[lease.id] = state
        while len(self._ended) > self._remember_ended:
            self._ended.popitem(last=False)
        return lease
