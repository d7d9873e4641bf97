"""FeaturePool: the tiers, the allocator per tier, the lease table and the control block behind
one lock. This is what the HTTP service and the hand-off server talk to.

Placement follows a fallback chain (GPU tier -> host tier -> inline) under a policy:
  fallback  try each tier in order, then keep the tensor inline (served over HTTP only);
  wait      use the first tier only; if it is full, wait for releases, then fail: up to
            ``wait_s`` for a whole ``put_many`` batch, not per tensor;
  reject    use the first tier only; if it is full, fail at once.
Every step down the chain is counted by reason.

Consumers attach through ``attach_consumer`` (the hand-off server calls it once a peer is
authenticated) and get an ack block of their own. A lease that consumers opened ends when every
consumer that opened it has acked it or detached; if it ends earlier (deadline, DELETE), its
slot and memory are quarantined, not reused, until they have, or until ``quarantine_s`` more
seconds passed (after which only that consumer's own reads can see new bytes).
docs/protocol.md section 4 states the rule.
Every lease takes a slot of the control block too; running out of slots is counted apart
(``slot_exhaustions``, SlotsExhausted). Nothing is copied while the lock is held: the inline
tier's device -> host copy runs after reservation.
"""

from __future__ import annotations

import base64
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from pool.allocator import Extent, SlabAllocator
from pool.backends.base import Backend
from pool.control import AckBlock, ControlBlock, full_fence, reopen_read_only
from pool.descriptor import MIN_TTL_S, LeaseDescriptor
from pool.errors import (
    HandoffError,
    InvalidTensor,
    LeaseNotFound,
    PoolError,
    PoolExhausted,
    SlotsExhausted,
    StaleLease,
    TensorTooLarge,
)
from pool.leases import ImageGrid, Lease, LeaseState, LeaseTable
from pool.protocol import MAX_FDS, PROTOCOL_VERSION

log = logging.getLogger(__name__)

Policy = Literal["fallback", "wait", "reject"]
INLINE = "inline"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def epoch_hex(epoch: int) -> str:
    return f"{epoch:016x}"


def lease_slots(capacity_bytes: int, feature_bytes: int, *, floor: int = 4096) -> int:
    """Slots for a pool of ``capacity_bytes`` (every tier and inline) such that, at
    ``feature_bytes`` a lease, the bytes run out before the slots do. Capped at 1 Mi slots
    (a 16 MiB control block); smaller features than the default can still use every slot."""
    need = -(-capacity_bytes // max(feature_bytes, 1))
    return max(floor, min(need, 1 << 20))


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


@dataclass
class Attachment:
    """What ``FeaturePool.attach_consumer`` gives the hand-off server for one consumer: the
    ``welcome`` message and its FDs, in order (control block read-only, the consumer's ack
    block read-write, then one per slab). The caller owns ``fds``: it closes each exactly once,
    sent or not (the hand-off server's ``_send`` does, after the kernel has copied them;
    ``close_fds`` is for a caller that does not send them)."""

    consumer_id: int
    welcome: dict[str, Any]
    fds: list[int] = field(default_factory=list)

    def close_fds(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)


@dataclass
class Tier:
    backend: Backend
    allocator: SlabAllocator

    @property
    def name(self) -> str:
        return self.backend.tier


WELCOME_FDS = 2  # besides one per slab: the control block and the consumer's ack block


def check_welcome_fds(slabs_per_tier: Sequence[int]) -> None:
    """A consumer's welcome carries an FD per slab of every tier, and one message carries at
    most MAX_FDS (the kernel's SCM_MAX_FD is 253): a pool cut into more slabs than that could
    start, and then every consumer's attach would fail with the connection dropped. So it
    does not start (HandoffError, naming the flag that sets the slab size)."""
    fds = WELCOME_FDS + sum(slabs_per_tier)
    if fds > MAX_FDS:
        raise HandoffError(
            f"the pool's {sum(slabs_per_tier)} slabs need {fds} FDs in a consumer's welcome, "
            f"more than the {MAX_FDS} one message carries: use larger slabs (--slab-bytes, "
            "FEATPOOL_SLAB_BYTES) or a smaller pool"
        )


class FeaturePool:
    def __init__(
        self,
        backends: Sequence[Backend],
        *,
        max_leases: int = 4096,
        default_ttl_s: float = 60.0,
        max_ttl_s: float = 3600.0,
        policy: Policy = "fallback",
        wait_s: float = 0.5,
        inline_max_bytes: int = 256 << 20,
        quarantine_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not backends and policy != "fallback":
            raise ValueError("a pool without tiers can only keep tensors inline (policy fallback)")
        check_welcome_fds([len(b.slab_sizes) for b in backends])
        self.tiers = [Tier(b, SlabAllocator(b.slab_sizes)) for b in backends]
        self.ctrl = ControlBlock.create(max_leases)
        try:
            for b in backends:
                # A GPU tier registers the control block so its streams can write ready words.
                bind = getattr(b, "bind_control", None)
                if bind is not None:
                    bind(self.ctrl)
        except BaseException:
            self.ctrl.close()
            raise
        self.leases = LeaseTable(max_leases, clock=clock)
        self.default_ttl_s = default_ttl_s
        self.max_ttl_s = max_ttl_s
        self.policy: Policy = policy
        self.wait_s = wait_s
        self.inline_max_bytes = inline_max_bytes
        self.inline_bytes = 0
        self.quarantine_s = quarantine_s
        self.clock = clock
        # Attached consumers' ack blocks, by consumer id (``attach_consumer``).
        self._consumers: dict[int, AckBlock] = {}
        self._next_consumer = 1
        # Quarantine: leases that ended while a consumer had them open keep their slot and
        # extent. Per slot: the generation held (0: none) and since when (monotonic).
        self._held: dict[int, Lease] = {}
        self._held_gen = np.zeros(max_leases, dtype=np.uint32)
        self._held_since = np.zeros(max_leases, dtype=np.float64)
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._reaper: threading.Thread | None = None
        self._stop = threading.Event()
        self.closed = False
        # Counters, read by the metrics collector at scrape time.
        self.created: Counter[str] = Counter()  # by tier
        self.released: Counter[str] = Counter()  # by reason: ack, delete, discarded
        self.expired: Counter[str] = Counter()  # by tier
        self.fallbacks: Counter[tuple[str, str]] = Counter()  # by (reason, tier fallen to)
        self.alloc_failures: Counter[str] = Counter()  # by tier
        self.slot_exhaustions = 0  # tensors refused because every lease slot was taken
        self.quarantine: Counter[str] = Counter()  # by outcome: held, released, timed_out
        self.consumers_attached = 0  # kept by the hand-off servers (note_consumer)
        self.remote_consumers_attached = 0  # of those, on other nodes (the TCP server)
        self.handoff_refused: Counter[tuple[str, str]] = Counter()  # by (server, reason)

    @property
    def epoch(self) -> int:
        return self.ctrl.epoch

    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)

    # ---- placing tensors -------------------------------------------------------------------

    def clamp_ttl(self, ttl_s: float | None) -> float:
        ttl = self.default_ttl_s if ttl_s is None else ttl_s
        if not ttl >= MIN_TTL_S:
            raise ValueError(f"ttl_s must be at least {MIN_TTL_S} s, got {ttl_s}")
        return min(ttl, self.max_ttl_s)

    def put(self, tensor: torch.Tensor, ttl_s: float | None = None) -> Lease:
        """Place ``tensor`` in the first tier that takes it and return a READY lease.

        On the GPU tier the copy is stream-ordered: this returns before the copy finishes, and
        consumers wait on the ready word. Raises PoolExhausted, TensorTooLarge, InvalidTensor.
        """
        (result,) = self.put_many([tensor], ttl_s)
        if isinstance(result, PoolError):
            raise result
        return result

    def put_many(
        self,
        tensors: Sequence[torch.Tensor] | torch.Tensor,
        ttl_s: float | None = None,
        grids: Sequence[ImageGrid | None] | None = None,
    ) -> list[Lease | PoolError]:
        """``put`` for a batch: one result per tensor, a lease or the error that tensor met.

        A backend with ``publish_many`` publishes the whole batch in one go (on the GPU: one
        copy launch for every tensor), which keeps host time per lease low when the Python
        process is busy with other threads. Under ``wait`` the batch shares one deadline:
        it waits up to ``wait_s`` for its space in all, not that long for each tensor. A bad
        TTL raises ValueError for all. ``grids`` gives each tensor's image grid, for its
        descriptor.

        One tensor ``[k, ...]`` stands for its k rows, a lease each: checked once, and on a
        backend with ``publish_rows`` copied without a Python tensor per row (each one made
        or freed gives up the interpreter lock, and waits to take it back when the process
        is busy).
        """
        if self.closed:
            raise PoolError("the pool is closed")
        ttl = self.clamp_ttl(ttl_s)
        if grids is not None and len(grids) != len(tensors):
            raise ValueError(f"{len(grids)} grids for {len(tensors)} tensors")
        rows: torch.Tensor | None = None
        specimens: Sequence[torch.Tensor]
        if not isinstance(tensors, torch.Tensor):
            specimens = tensors
        else:
            if tensors.dim() < 2:
                raise ValueError(f"rows to publish need a [k, ...] tensor, got {tensors.dim()}-d")
            try:
                rows = self._checked(tensors)
            except PoolError as e:  # each row would meet it
                return [e] * len(tensors)
            # Every row has the first one's shape, dtype and device: reserved by it.
            specimens = [rows[0]] * len(rows)
        deadline = self._deadline()
        results: list[Lease | PoolError] = []
        checked: dict[int, torch.Tensor] = {}  # each tensor as checked (not for rows)
        placed: dict[str, list[tuple[Lease, int]]] = {}  # by tier name: (lease, which tensor)
        inline: list[tuple[Lease, int]] = []
        unbound: list[torch.Tensor] = []

        def published(n: int) -> torch.Tensor:
            """Tensor n as published; of ``rows``, a row (unbound once, only where needed)."""
            if rows is None:
                return checked[n]
            if not unbound:
                unbound.extend(rows.unbind(0))
            return unbound[n]

        try:
            for n, given in enumerate(specimens):
                try:
                    tensor = given if rows is not None else self._checked(given)
                    nbytes = tensor.numel() * tensor.element_size()
                    lease, tier = self._reserve(tensor, nbytes, ttl, deadline)
                except PoolError as e:
                    results.append(e)
                    continue
                if rows is None:
                    checked[n] = tensor
                if grids is not None:
                    lease.grid = grids[n]
                results.append(lease)
                if tier is not None:
                    placed.setdefault(tier.name, []).append((lease, n))
                else:
                    inline.append((lease, n))
            for name, items in placed.items():
                self._publish(self.tier(name), items, published, rows)
            self._fill_inline([(lease, published(n)) for lease, n in inline])
        except BaseException:  # a copy that failed, or out of memory making one contiguous
            self._undo([r for r in results if isinstance(r, Lease)])
            raise
        leases = [r for r in results if isinstance(r, Lease)]
        self._mark_ready(leases)
        return results

    @staticmethod
    def _checked(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.numel() == 0:
            raise InvalidTensor("cannot publish an empty tensor")
        if tensor.is_complex() or tensor.dtype == torch.bool:
            raise InvalidTensor(f"unsupported dtype {tensor.dtype}")
        if tensor.requires_grad:  # only bytes are published; no autograd graph rides along
            tensor = tensor.detach()
        return tensor.contiguous()

    def _publish(
        self,
        tier: Tier,
        items: Sequence[tuple[Lease, int]],
        tensor: Callable[[int], torch.Tensor],
        rows: torch.Tensor | None,
    ) -> None:
        """Copy reserved leases' tensors (item n's is ``tensor(n)``, row n of ``rows`` when the
        batch came as one tensor) into their tier and set their ready words: all in one go
        where the backend can (``publish_rows``, ``publish_many``), else one by one."""
        backend = tier.backend
        if len(items) > 1:
            publish_rows = getattr(backend, "publish_rows", None)
            if rows is not None and publish_rows is not None:
                publish_rows(
                    [(lease.extent, n, lease.slot, lease.generation) for lease, n in items],
                    rows,
                    self.ctrl,
                )
                return
            publish_many = getattr(backend, "publish_many", None)
            if publish_many is not None:
                publish_many(
                    [(lease.extent, tensor(n), lease.slot, lease.generation) for lease, n in items],
                    self.ctrl,
                )
                return
        for lease, n in items:
            assert lease.extent is not None
            backend.publish(lease.extent, tensor(n), self.ctrl, lease.slot, lease.generation)

    @staticmethod
    def _fill_inline(items: Sequence[tuple[Lease, torch.Tensor]]) -> None:
        """The inline tier's copy to host memory, outside the lock: from a GPU tensor it waits
        for the device, and the event loop takes the same lock to answer lease requests."""
        for lease, tensor in items:
            lease.inline = tensor.to("cpu", copy=True)

    def _deadline(self) -> float:
        return self.clock() + (self.wait_s if self.policy == "wait" else 0.0)

    def _undo(self, leases: Sequence[Lease]) -> None:
        """A publish failed: what was reserved goes back; published or not, nobody has it."""
        with self._lock:
            for lease in leases:
                if self.leases.by_slot(lease.slot) is lease:
                    self._end(lease, reason="discarded")

    def _mark_ready(self, leases: Sequence[Lease]) -> None:
        """The copies are done (or queued on the device): the leases are ready, or expired if
        their deadline passed meanwhile (the reaper leaves leases being copied alone, so that
        their memory is not reused under the copy)."""
        with self._lock:
            now = self.clock()
            late = []
            for lease in leases:
                if lease.state is not LeaseState.RESERVED:  # ended meanwhile
                    continue
                if lease.deadline <= now:
                    late.append(lease)
                    continue
                self.leases.mark_ready(lease.id)
                if lease.tier == INLINE:
                    self.ctrl.set_ready(lease.slot, lease.generation)
            self._end_many(late, LeaseState.EXPIRED)

    def _candidates(self, tensor: torch.Tensor) -> list[Tier]:
        tiers = self.tiers
        if tensor.device.type != "cuda":
            # A host tensor never goes up to the GPU tier: that would be a hidden H2D copy.
            tiers = [t for t in tiers if t.backend.device.type == "cpu"]
            if not tiers and self.tiers and self.policy != "fallback":
                raise InvalidTensor(
                    f"a {tensor.device} tensor was given to a pool whose only tier is "
                    f"{self.tiers[0].backend.transport}: move it to CUDA first"
                )
        return tiers if self.policy == "fallback" else tiers[:1]

    def _reserve(
        self, tensor: torch.Tensor, nbytes: int, ttl: float, deadline: float | None = None
    ) -> tuple[Lease, Tier | None]:
        """A lease (slot and storage) for ``tensor``, waiting until ``deadline`` (a batch's,
        or this tensor's own) under the ``wait`` policy; the caller fills the storage,
        outside the lock."""
        if deadline is None:
            deadline = self._deadline()
        candidates = self._candidates(tensor)
        if (
            candidates
            and all(nbytes > t.allocator.max_extent for t in candidates)
            and (self.policy != "fallback")
        ):
            raise TensorTooLarge(
                f"{nbytes} bytes is larger than a whole slab "
                f"({candidates[0].allocator.max_extent} bytes); raise the slab size"
            )
        with self._lock:
            reaped = False
            failed: set[str] = set()  # tiers counted as failing this tensor: once each
            # Live and quarantined leases both hold slots; acks may be waiting to free some.
            if self.leases.free_slots == 0:
                self._reap_locked(self._remote_acks())
                reaped = True
            while True:
                # Why the first tier refused, counted once the tensor lands lower in the chain.
                reason = "no_tier_for_device" if not candidates and self.tiers else None
                slots = self.leases.free_slots > 0
                for tier in candidates if slots else []:
                    extent = tier.allocator.allocate(nbytes)
                    if extent is None:
                        if tier.name not in failed:  # not once per retry of a wait
                            failed.add(tier.name)
                            self.alloc_failures[tier.name] += 1
                        if reason is None:
                            too_big = nbytes > tier.allocator.max_extent
                            reason = "oversize" if too_big else "pool_full"
                        continue
                    lease = self._lease_locked(tier, extent, tensor, nbytes, ttl)
                    if reason is not None:
                        self.fallbacks[(reason, tier.name)] += 1
                    return lease, tier
                if not reaped and self._reap_locked(self._remote_acks()):
                    # Acks or deadlines freed room since the reaper's last pass: try again
                    # before falling down the chain. (Counted failures above still stand.)
                    reaped = True
                    continue
                reaped = True
                remaining = deadline - self.clock()
                if not slots and (self.policy != "wait" or remaining <= 0):
                    self.slot_exhaustions += 1
                    raise SlotsExhausted(
                        f"all {self.leases.max_slots} lease slots are in use (bytes may be "
                        f"free); raise --max-leases, shorten TTLs or release leases"
                    )
                if slots and self.policy == "fallback":
                    lease = self._inline_locked(tensor, nbytes, ttl)
                    if reason is not None:
                        self.fallbacks[(reason, INLINE)] += 1
                    return lease, None
                if remaining <= 0:
                    name = candidates[0].name if candidates else "any"
                    raise PoolExhausted(
                        f"the {name} tier has no room for {nbytes} bytes "
                        f"(policy {self.policy}); retry later or release leases"
                    )
                self._freed.wait(timeout=min(remaining, 0.01))
                reaped = False

    def _lease_locked(
        self, tier: Tier, extent: Extent, tensor: torch.Tensor, nbytes: int, ttl: float
    ) -> Lease:
        try:
            lease = self.leases.reserve(
                tier=tier.name,
                extent=extent,
                shape=tuple(tensor.shape),
                dtype=dtype_name(tensor.dtype),
                nbytes=nbytes,
                ttl_s=ttl,
            )
        except BaseException:
            tier.allocator.free(extent)
            raise
        self.ctrl.set_gen(lease.slot, lease.generation)
        self.created[tier.name] += 1
        return lease

    def _inline_locked(self, tensor: torch.Tensor, nbytes: int, ttl: float) -> Lease:
        if self.inline_bytes + nbytes > self.inline_max_bytes:
            raise PoolExhausted(
                f"every tier is full and inline storage is at its limit "
                f"({self.inline_bytes} of {self.inline_max_bytes} bytes)"
            )
        lease = self.leases.reserve(
            tier=INLINE,
            extent=None,
            shape=tuple(tensor.shape),
            dtype=dtype_name(tensor.dtype),
            nbytes=nbytes,
            ttl_s=ttl,
        )
        self.inline_bytes += nbytes  # the copy is made by _fill_inline, outside the lock
        self.ctrl.set_gen(lease.slot, lease.generation)
        self.created[INLINE] += 1
        return lease

    # ---- lease operations ------------------------------------------------------------------

    def get(self, lease_id: str) -> Lease:
        with self._lock:
            return self._live(lease_id)

    def renew(self, lease_id: str, ttl_s: float | None = None) -> Lease:
        ttl = self.clamp_ttl(ttl_s)
        with self._lock:
            return self.leases.renew(self._live(lease_id).id, ttl)

    def release(self, lease_id: str, reason: str = "delete") -> Lease:
        """End a live lease: a DELETE (``delete``), or ``discarded``: made for a request that
        failed or went away, never given to anyone."""
        with self._lock:
            return self._end(self._live(lease_id), reason=reason)

    def _live(self, lease_id: str) -> Lease:
        """The lease, if it is live now: one acked by its consumers, or past its deadline, is
        ended on the spot (the reaper may not have run yet) and raises LeaseReleased or
        LeaseExpired."""
        lease = self.leases.get(lease_id)
        if lease.state is LeaseState.RESERVED:  # still being copied in: not anyone's yet
            raise LeaseNotFound(f"lease {lease_id} is not published yet")
        ready = lease.state is LeaseState.READY and lease.extent is not None
        if ready and self._acked(lease.slot):
            self._end(lease, reason="ack")
            self.leases.get(lease_id)  # raises LeaseReleased
        if lease.deadline <= self.clock():
            self._end_many([lease], LeaseState.EXPIRED)
            self.leases.get(lease_id)  # raises LeaseExpired
        return lease

    def read(self, lease_id: str) -> torch.Tensor:
        """A CPU copy of the lease's tensor. Raises StaleLease if the lease ended during the
        copy (its slot could have been overwritten halfway)."""
        with self._lock:
            lease = self._live(lease_id)
            if lease.tier == INLINE:
                return lease.inline  # type: ignore[no-any-return]
            view = self._view_locked(lease)
        # Copy outside the lock (it can be large); the GPU copy follows the producer stream, so
        # it sees the published bytes.
        out = view.to("cpu", copy=True)
        with self._lock:
            if self.leases.by_slot(lease.slot) is not lease:
                raise StaleLease(f"lease {lease_id} ended while it was being read")
        return out

    def _view_locked(self, lease: Lease) -> torch.Tensor:
        """The lease's tensor where it lies: its inline copy, or a view of its tier's storage
        (valid while the lease holds its extent)."""
        if lease.tier == INLINE:
            return lease.inline  # type: ignore[no-any-return]
        assert lease.extent is not None
        return self.tier(lease.tier).backend.view(
            lease.extent, parse_dtype(lease.dtype), lease.shape
        )

    def copy_lease(self, lease_id: str, ttl_s: float | None = None) -> Lease:
        """A new lease holding a copy of a live lease's tensor, in the same tier when it has
        room (GPU -> GPU is a device-to-device copy, stream-ordered after the source's publish;
        host -> host a memcpy). The source is untouched. Raises StaleLease if the source ended
        while it was being copied (the copy is then given back), and what ``put`` raises.

        This is how a content-cache hit gets its own lease: a lease has one slot and one ack
        word, so two readers cannot share one lease without the first ack ending it for both.
        """
        with self._lock:
            src = self._live(lease_id)
            view = self._view_locked(src)
        lease = self.put(view, ttl_s)
        lease.grid = src.grid  # a dynamic-resolution tower's image grid travels with its copy
        with self._lock:
            if self.leases.by_slot(src.slot) is not src:
                if self.leases.by_slot(lease.slot) is lease:
                    self._end(lease, reason="discarded")
                raise StaleLease(f"lease {lease_id} ended while it was being copied")
        return lease

    def describe(self, lease: Lease) -> LeaseDescriptor:
        """The lease descriptor that HTTP clients and socket consumers receive."""
        transport = INLINE if lease.tier == INLINE else self.tier(lease.tier).backend.transport
        return LeaseDescriptor(
            lease_id=lease.id,
            epoch=epoch_hex(self.epoch),
            state=lease.state.value,
            tier=lease.tier,
            transport=transport,
            slab=lease.extent.slab if lease.extent else None,
            offset=lease.extent.offset if lease.extent else None,
            nbytes=lease.nbytes,
            shape=list(lease.shape),
            dtype=lease.dtype,
            grid_thw=[g.t, g.h, g.w] if (g := lease.grid) else None,
            tokens=g.tokens if g else None,
            slot=lease.slot,
            generation=lease.generation,
            created_at=lease.created_at,
            expires_at=lease.expires_at(self.clock),
            ttl_s=lease.ttl_s,
            feature_hash=lease.feature_hash,
            cached=lease.cached,
        )

    # ---- the hand-off ----------------------------------------------------------------------

    def note_consumer(self, delta: int, *, remote: bool = False) -> None:
        """A hand-off server attached (+1) or lost (-1) a consumer."""
        with self._lock:
            self.consumers_attached += delta
            if remote:
                self.remote_consumers_attached += delta

    def note_refused(self, server: str, reason: str) -> None:
        """A hand-off server turned a connection away (``server``: unix or tcp)."""
        with self._lock:
            self.handoff_refused[(server, reason)] += 1

    # ---- reaping ---------------------------------------------------------------------------

    def reap(self) -> int:
        """Release acknowledged leases and expire overdue ones; returns how many ended."""
        remote = self._remote_acks()  # read outside the lock
        with self._lock:
            return self._reap_locked(remote)

    def _remote_acks(self) -> list[np.ndarray]:
        """Acks of consumers on other nodes live in GPU memory: one batched read per tier, and
        only while such consumers are attached. An ack read a moment ago still proves what it
        proves: the reap compares it with the slot's generation at that time."""
        remote: list[np.ndarray] = []
        if self.remote_consumers_attached > 0:
            for t in self.tiers:
                read = getattr(t.backend, "remote_acks", None)
                acks = read() if read is not None else None
                if acks is not None:
                    remote.append(acks)
        return remote

    def _reap_locked(self, remote_acks: Sequence[np.ndarray] = ()) -> int:
        acked = self._acked(slice(None), remote_acks)
        by_ack = []
        for slot in np.flatnonzero(acked).tolist():
            lease = self.leases.by_slot(slot)
            if lease is not None and lease.state is LeaseState.READY:
                by_ack.append(lease)
        ended = self._end_many(by_ack, LeaseState.RELEASED, reason="ack")
        ended += self._end_many(self.leases.due(), LeaseState.EXPIRED)
        self._release_held()
        return ended

    def _acked(
        self, idx: np.ndarray | slice | int, remote_acks: Sequence[np.ndarray] = ()
    ) -> np.ndarray:
        """For the slots ``idx``: is the live lease there done? True when some ack word (the
        producer's own, a remote consumer's, or an attached consumer's) holds its generation
        and no attached consumer that marked it opened has yet acked it. Vectorised: one numpy
        pass per ack block, none per lease. One slot (an int) gives a 0-d answer without
        building index arrays (a release's check, ~4 us less)."""
        gen = self.ctrl.slots["gen"][idx]
        acked = self.ctrl.slots["ack"][idx] == gen
        for acks in remote_acks:
            acked |= acks[idx] == gen
        pending = np.zeros(gen.shape, dtype=bool)
        for block in self._consumers.values():
            opened, ack = block.opened[idx], block.acks[idx]
            acked |= ack == gen
            pending |= (opened == gen) & (ack != gen)
        return acked & ~pending & (gen != 0)  # type: ignore[no-any-return]

    def _openers(self, slots: np.ndarray | int, gens: np.ndarray | np.uint32) -> np.ndarray:
        """For each (slot, generation): has an attached consumer opened it and not acked it?"""
        pending = np.zeros(np.shape(slots), dtype=bool)
        for block in self._consumers.values():
            pending |= (block.opened[slots] == gens) & (block.acks[slots] != gens)
        return pending

    def _end(self, lease: Lease, reason: str | None) -> Lease:
        self._end_many([lease], LeaseState.RELEASED, reason=reason)
        return lease

    def _end_many(
        self, leases: Sequence[Lease], state: LeaseState, reason: str | None = None
    ) -> int:
        """End live leases (released by ``reason``, or expired). Each slot's ``gen`` word is
        cleared first, then, after a full fence, the consumers' ``opened`` marks are read: a
        consumer marks ``opened`` and then reads ``gen``, so one of the two sees the other
        (docs/protocol.md 6). A lease still open in some consumer is quarantined."""
        if not leases:
            return 0
        slots: np.ndarray | int
        gens: np.ndarray | np.uint32
        if len(leases) == 1:  # a release or an ack: numpy scalars, no index arrays to build
            slots, gens = leases[0].slot, np.uint32(leases[0].generation)
        else:
            slots = np.fromiter((x.slot for x in leases), dtype=np.intp, count=len(leases))
            gens = np.fromiter((x.generation for x in leases), dtype=np.uint32, count=len(leases))
        self.ctrl.slots["gen"][slots] = 0  # consumers holding these leases now see them gone
        full_fence()
        keep = (
            np.atleast_1d(self._openers(slots, gens)).tolist()
            if self._consumers
            else [False] * len(leases)
        )
        now = self.clock()
        for lease, opened in zip(leases, keep, strict=True):
            held = opened and lease.extent is not None
            self.leases.end(lease, state, keep_slot=held)
            if held:
                self._held[lease.slot] = lease
                self._held_gen[lease.slot] = lease.generation
                self._held_since[lease.slot] = now
                self.quarantine["held"] += 1
            else:
                self._free_storage(lease)
            if state is LeaseState.EXPIRED:
                self.expired[lease.tier] += 1
            elif reason is not None:
                self.released[reason] += 1
        self._freed.notify_all()
        return len(leases)

    def _release_held(self) -> int:
        """Free quarantined leases whose openers have all acked or detached, and those held
        longer than ``quarantine_s``."""
        if not self._held:
            return 0
        held = self._held_gen
        pending = np.zeros(held.shape, dtype=bool)
        for block in self._consumers.values():
            pending |= (block.opened == held) & (block.acks != held)
        timed_out = self._held_since + self.quarantine_s <= self.clock()
        done = (held != 0) & (~pending | timed_out)
        freed = 0
        for slot in np.flatnonzero(done).tolist():
            lease = self._held.pop(slot)
            self.quarantine["timed_out" if timed_out[slot] and pending[slot] else "released"] += 1
            if timed_out[slot] and pending[slot]:
                log.warning(
                    "lease %s: a consumer held it open %.0f s past its end; its memory is reused",
                    lease.id,
                    self.quarantine_s,
                )
            held[slot] = 0
            self._free_storage(lease)
            self.leases.free_slot(slot)
            freed += 1
        if freed:
            self._freed.notify_all()
        return freed

    def _free_storage(self, lease: Lease) -> None:
        if self.leases.by_slot(lease.slot) is None:
            self.ctrl.set_gen(lease.slot, 0)  # (already 0 unless the slot was taken again)
        if lease.extent is not None:
            self.tier(lease.tier).allocator.free(lease.extent)
        else:
            self.inline_bytes -= lease.nbytes

    # ---- consumers -------------------------------------------------------------------------

    def attach_consumer(
        self, peer: str = "", *, remote: bool = False, fabric_handles: bool = False
    ) -> Attachment:
        """A consumer was admitted (a hand-off server authenticated it): its ``welcome``
        (docs/protocol.md, sections 2 and 7) and FDs. The one place the welcome is built, for
        both hand-off servers. ``peer`` is for the log.

        On the node (Unix socket): the consumer gets its own ack block, and the FDs are, in
        order, the control block read-only, its ack block read-write, then one per entry of
        ``slabs``. ``fabric_handles``: the ``cuda`` section also lists the GPU slabs' FABRIC
        handles; only for peers that proved the socket token (a uid means nothing on other
        nodes, and a handle maps the memory from any of them).

        ``remote`` (TCP, a consumer on another node): FABRIC handles of the GPU tier's slabs
        and device control words, no FDs and no ack block (``consumer_id`` 0: it acks in the
        device control words).
        """
        if self.closed:
            raise PoolError("the pool is closed")
        welcome: dict[str, Any] = {
            "op": "welcome",
            "version": PROTOCOL_VERSION,
            "epoch": epoch_hex(self.epoch),
        }
        gpu = next((t.backend for t in self.tiers if hasattr(t.backend, "device_info")), None)
        if remote:
            if gpu is None:
                raise HandoffError("consumers on other nodes need a GPU tier; this pool has none")
            control = gpu.remote_control()  # type: ignore[attr-defined]  # raises if not enabled
            handles = gpu.fabric_handles()  # type: ignore[attr-defined]
            welcome["remote"] = True
            welcome["cuda"] = gpu.device_info()
            welcome["slabs"] = [
                {
                    "tier": gpu.tier,
                    "transport": gpu.transport,
                    "index": i,
                    "size": size,
                    "fabric_handle": base64.b64encode(h).decode(),
                }
                for i, (h, size) in enumerate(zip(handles, gpu.slab_sizes, strict=True))
            ]
            welcome["control"] = control
            log.info("remote consumer attached (%s)", peer or "unnamed peer")
            return Attachment(0, welcome)
        block = AckBlock.create(self.ctrl.nslots)
        fds: list[int] = []
        try:
            fds.append(reopen_read_only(self.ctrl.fd))
            fds.append(os.dup(block.fd))
            slabs: list[dict[str, Any]] = []
            for tier in self.tiers:
                b = tier.backend
                fds.extend(b.consumer_fds())
                for i, size in enumerate(b.slab_sizes):
                    slabs.append(
                        {"tier": b.tier, "transport": b.transport, "index": i, "size": size}
                    )
            cuda = None if gpu is None else gpu.device_info(fabric_handles=fabric_handles)
            with self._lock:
                if self.closed:  # closed while we built the welcome: close() missed this block
                    raise PoolError("the pool is closed")
                cid = self._next_consumer
                self._next_consumer += 1
                self._consumers[cid] = block
        except BaseException:
            for fd in fds:
                os.close(fd)
            block.close()
            raise
        welcome.update(
            {
                "consumer_id": cid,
                "nslots": self.ctrl.nslots,
                "control_size": self.ctrl.size,
                "ack_size": block.size,
                "slabs": slabs,
            }
        )
        if cuda is not None:
            welcome["cuda"] = cuda
        log.info("consumer %d attached (%s)", cid, peer or "unnamed peer")
        return Attachment(cid, welcome, fds)

    def detach_consumer(self, consumer_id: int) -> None:
        """The consumer's connection ended: its ack block goes, and what only it held open
        is freed. Unknown ids are ignored (detach is called on every exit path)."""
        with self._lock:
            if consumer_id not in self._consumers:
                return
            self._reap_locked()  # its last acks count (it may ack and hang up at once)
            block = self._consumers.pop(consumer_id)
            block.close()
            self._release_held()
        log.info("consumer %d detached", consumer_id)

    def start_reaper(self, interval_s: float = 0.05) -> None:
        def run() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.reap()
                except Exception:  # keep reaping: one bad pass must not leak every lease
                    log.exception("reaper pass failed")

        self._reaper = threading.Thread(target=run, name="featpool-reaper", daemon=True)
        self._reaper.start()

    # ---- inspection ------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        with self._lock:
            active: Counter[str] = Counter(lease.tier for lease in self.leases)
            tiers = [
                {
                    "tier": t.name,
                    "transport": t.backend.transport,
                    "slabs": len(t.allocator.slab_sizes),
                    "capacity_bytes": t.allocator.capacity_bytes,
                    "used_bytes": t.allocator.used_bytes,
                    "largest_free_bytes": t.allocator.largest_free,
                    "leases_active": active[t.name],
                }
                for t in self.tiers
            ]
            return {
                "epoch": self.epoch,
                "policy": self.policy,
                "max_leases": self.leases.max_slots,
                "leases_active": len(self.leases),
                "tiers": tiers,
                "inline": {
                    "used_bytes": self.inline_bytes,
                    "capacity_bytes": self.inline_max_bytes,
                    "leases_active": active[INLINE],
                },
                "created": dict(self.created),
                "released": dict(self.released),
                "expired": dict(self.expired),
                "fallbacks": dict(self.fallbacks),
                "alloc_failures": dict(self.alloc_failures),
                "slot_exhaustions": self.slot_exhaustions,
                "quarantine": dict(self.quarantine),
                "quarantined_leases": len(self._held),
                "quarantined_bytes": sum(lease.nbytes for lease in self._held.values()),
                "consumer_ack_blocks": len(self._consumers),
                "consumers_attached": self.consumers_attached,
                "remote_consumers_attached": self.remote_consumers_attached,
                "handoff_refused": _nested(self.handoff_refused),
            }

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5)
        with self._lock:
            blocks = list(self._consumers.values())
            self._consumers.clear()
        for block in blocks:
            block.close()
        for t in self.tiers:
            t.backend.close()
        self.ctrl.close()


def _nested(counts: Counter[tuple[str, str]]) -> dict[str, dict[str, int]]:
    """{(a, b): n} -> {a: {b: n}}: JSON has no tuple keys (``GET /v1/pool`` serves stats)."""
    out: dict[str, dict[str, int]] = {}
    for (a, b), n in sorted(counts.items()):
        out.setdefault(a, {})[b] = n
    return out
