"""GPU tier: slabs of CUDA VMM memory (cuMemCreate), exported once as POSIX FDs (same node) or
FABRIC handles (other nodes of an NVLink domain), mapped read-only by consumers.

Producer: ``CudaVmmBackend.create(...)``. ``publish`` copies into a slice of a slab on the
current torch stream, then writes the slot's ready word with cuStreamWriteValue32 on the same
stream (``publish_many``: a batch's words in one cuStreamBatchMemOp); the host never waits.
Consumer: ``CudaConsumer`` (used by ``pool.client``) imports the slab FDs, maps them
read-only, waits on ready words with cuStreamWaitValue32 (GEQ) and writes its own ack words
with cuStreamWriteValue32, on the consumer's current stream.

Control words: the control block is a memfd in host memory. The producer registers it with
cuMemHostRegister (DEVICEMAP | PORTABLE) so its streams write ready words; a consumer maps it
read-only and registers it READ_ONLY (its streams only wait on it), and registers its own ack
block (``pool.control.AckBlock``) read-write for its stream-ordered acks. The producer's reaper
reads every ack word with plain host loads.

A consumer on another GPU of the node (``FeatureClient(device=...)``) maps the same FDs with
access for its own GPU where the driver reports peer access, else for the producer's GPU, and
then ``open`` copies into its own (``pool.backends.peer``, docs/protocol.md 9).

A VMM allocation has no read-only export: whoever imports a slab's POSIX FD may map it
read-write. Consumers here map read-only; on this tier the hand-off socket's peer check is the
trust boundary (docs/security.md).
"""

from __future__ import annotations

import base64
import logging
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch

from pool.allocator import Extent
from pool.backends.device_control import DeviceControl
from pool.backends.dlpack import bytes_on_device
from pool.backends.peer import CrossGpu, GpuLink, plan_link
from pool.backends.vmm import (
    DevicePointer,
    Mapping,
    map_allocation,
    round_up,
    row_copier,
    unmap_allocation,
)
from pool.control import (
    ACK_OFFSET,
    ACK_STRIDE,
    HEADER_SIZE,
    READY_OFFSET,
    SLOT_STRIDE,
    AckBlock,
    ControlBlock,
)
from pool.driver import Driver, DriverAPI, HandleType, is_not_permitted
from pool.errors import CudaError, CudaUnavailable, HandoffError, InvalidTensor

log = logging.getLogger(__name__)

FabricMode = Literal["auto", "off", "require"]
IMEX_HINT = (
    "FABRIC handles unavailable: no IMEX channel (/dev/nvidia-caps-imex-channels); "
    "falling back to POSIX FD on a single node"
)


class TorchCuda:
    """The torch side of the GPU tier: the device, its current stream, tensors over raw device
    pointers, synchronisation. Tests inject a fake with the same methods."""

    def __init__(self, device_index: int) -> None:
        if not torch.cuda.is_available():
            raise CudaUnavailable(
                f"this torch build ({torch.__version__}) sees no CUDA device; "
                f"use --transport host_shm"
            )
        if not 0 <= device_index < torch.cuda.device_count():
            raise CudaUnavailable(
                f"CUDA device {device_index} does not exist "
                f"({torch.cuda.device_count()} visible; check CUDA_VISIBLE_DEVICES)"
            )
        self.device = torch.device("cuda", device_index)
        self.index = device_index
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._raw_stream = raw
        self._side: torch.cuda.Stream | None = None
        self._pinned: dict[int, torch.Tensor] = {}

    def init(self) -> None:
        """Make torch create the device's primary context, so the driver calls share it."""
        torch.cuda.init()  # type: ignore[no-untyped-call]
        torch.empty(1, device=self.device)

    def current_stream(self) -> int:
        if self._raw_stream is not None:
            return int(self._raw_stream(self.index))
        return int(torch.cuda.current_stream(self.device).cuda_stream)

    def tensor_at(
        self,
        ptr: int,
        nbytes: int,
        on_free: Callable[[], None] | None = None,
        *,
        explicit_device: bool = False,
    ) -> torch.Tensor:
        """A uint8 torch tensor over ``nbytes`` of device memory at ``ptr`` (zero-copy).
        ``on_free`` runs once the last tensor viewing this memory is gone: torch keeps the
        ``__cuda_array_interface__`` object alive as long as the storage.

        ``explicit_device``: the memory lives on another GPU than the one it is read from (a
        peer mapping); torch would ask the driver for the pointer's device, get the other GPU
        and copy, so the view is built through DLPack naming this device instead."""
        if explicit_device:
            return bytes_on_device(ptr, nbytes, self.device, on_free)
        owner = DevicePointer(ptr, nbytes)
        if on_free is not None:
            weakref.finalize(owner, on_free).atexit = False
        return torch.as_tensor(owner, device=self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def copy_here(self, src: torch.Tensor) -> torch.Tensor:
        """A copy of ``src`` (a tensor on another GPU) in this device's memory. Torch runs a
        cross-device copy on the source GPU's current stream between two event barriers: after
        the work queued so far on this device's current stream (our ready-word wait) and
        before what is queued on it next (the ack). Without peer access the driver stages it
        through host memory."""
        out = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        out.copy_(src, non_blocking=True)
        return out

    def read_back(self, src: torch.Tensor) -> bytes:
        """The bytes of a small uint8 device tensor: one copy on a side stream into pinned
        memory, then a wait on that copy alone (never on the device or other streams)."""
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        host = self._pinned.get(src.numel())
        if host is None:
            host = self._pinned[src.numel()] = torch.empty(
                src.numel(), dtype=torch.uint8, pin_memory=True
            )
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        with torch.cuda.stream(self._side):
            host.copy_(src, non_blocking=True)
            done.record(self._side)
        done.synchronize()
        return host.numpy().tobytes()

    def uuid(self) -> str:
        return str(torch.cuda.get_device_properties(self.index).uuid)


@dataclass(frozen=True)
class FabricStatus:
    """Outcome of the start-up FABRIC probe, for logs, metrics and the pool descriptor."""

    mode: str  # the configured mode: auto, off, require
    available: bool
    reason: str  # why not (empty when available)


def register_control(
    driver: DriverAPI, ctrl: ControlBlock | AckBlock, *, read_only: bool = False
) -> int:
    """Register a block of control words as mapped pinned memory in this process; its device
    pointer, for stream writes and waits on its words. ``read_only`` for a mapping this
    process may not write (a consumer's view of the control block): its streams may only
    wait on it."""
    driver.host_register(ctrl.address, ctrl.size, read_only=read_only)
    try:
        return driver.host_device_pointer(ctrl.address)
    except BaseException:
        driver.host_unregister(ctrl.address)
        raise


def probe_fabric(driver: DriverAPI, ordinal: int, mode: FabricMode) -> FabricStatus:
    """Try a real FABRIC allocation (the device attribute alone says yes without an IMEX
    channel). ``require`` turns a failure into CudaUnavailable."""
    if mode == "off":
        return FabricStatus(mode, False, "disabled (fabric=off)")
    types = HandleType.POSIX_FD | HandleType.FABRIC
    try:
        gran = driver.granularity(ordinal, types)
        handle = driver.mem_create(gran, ordinal, types)
        try:
            driver.export_fabric(handle)
        finally:
            driver.mem_release(handle)
    except CudaError as e:
        if is_not_permitted(e):
            reason = IMEX_HINT
        else:
            reason = f"FABRIC handles unavailable ({e}); falling back to POSIX FD on a single node"
        if mode == "require":
            raise CudaUnavailable(
                f"fabric=require but {reason.split(';')[0]}: multi-node hand-off needs an IMEX "
                f"channel (DRA ComputeDomain); set fabric to auto or off for a single node"
            ) from e
        return FabricStatus(mode, False, reason)
    return FabricStatus(mode, True, "")


class CudaVmmBackend:
    tier = "gpu"
    transport = "cuda_vmm"
    # "driver": cuMemcpyDtoDAsync for contiguous tensors; "torch": view.copy_ (any layout).
    copy_engine: Literal["driver", "torch"] = "driver"

    def __init__(
        self,
        driver: DriverAPI,
        rt: Any,
        slab_sizes: list[int],
        granularity: int,
        fabric: FabricStatus,
    ) -> None:
        """Use ``create``; this only records what it made."""
        self.driver = driver
        self.rt = rt
        self.device: torch.device = rt.device
        self.ordinal: int = rt.index
        self.granularity = granularity
        self.fabric_status = fabric
        self.handle_types = HandleType.POSIX_FD | (
            HandleType.FABRIC if fabric.available else HandleType(0)
        )
        self.slab_sizes: list[int] = []
        self._slabs: list[Mapping] = []
        self._fds: list[int] | None = None
        self._fabric: list[bytes] | None = None
        self._ctrl: ControlBlock | None = None
        self._ctrl_dptr = 0
        self.remote: DeviceControl | None = None  # control words for consumers on other nodes
        self._closed = False
        try:
            for size in slab_sizes:
                self._add_slab(size)
        except BaseException:
            self.close()  # tears down the slabs made so far
            raise

    @classmethod
    def create(
        cls,
        device_index: int,
        pool_bytes: int,
        slab_bytes: int,
        *,
        fabric: FabricMode = "auto",
        driver: DriverAPI | None = None,
        rt: Any = None,
    ) -> CudaVmmBackend:
        """Build the GPU tier: ``ceil(pool_bytes / slab)`` slabs of ``slab_bytes`` rounded up to
        the allocation granularity. Raises CudaUnavailable (no driver, no device, fabric=require
        without IMEX) or CudaError."""
        if pool_bytes <= 0 or slab_bytes <= 0:
            raise ValueError("pool_bytes and slab_bytes must be positive")
        drv: DriverAPI = driver if driver is not None else Driver()
        rt = rt if rt is not None else TorchCuda(device_index)
        rt.init()
        drv.use_device(device_index)
        try:
            status = probe_fabric(drv, device_index, fabric)
            if fabric != "off" and not status.available:
                log.warning("%s", status.reason)
            types = HandleType.POSIX_FD | (HandleType.FABRIC if status.available else HandleType(0))
            gran = drv.granularity(device_index, types)
            slab = round_up(slab_bytes, gran)
            count = max(1, -(-pool_bytes // slab))
            backend = cls(drv, rt, [slab] * count, gran, status)
        except BaseException:
            drv.release_device()
            raise
        log.info(
            "cuda_vmm pool on %s: %d slab(s) of %d bytes (granularity %d), handles %s",
            backend.device,
            count,
            slab,
            gran,
            backend.handle_types.name,
        )
        return backend

    def _add_slab(self, size: int) -> None:
        handle = self.driver.mem_create(size, self.ordinal, self.handle_types)
        try:
            ptr = map_allocation(
                self.driver, handle, size, self.granularity, self.ordinal, read_only=False
            )
        except BaseException:
            self.driver.mem_release(handle)
            raise
        m = Mapping(size, handle, ptr)
        self._slabs.append(m)  # from here close() undoes it
        self.slab_sizes.append(size)
        m.base = self.rt.tensor_at(ptr, size)

    # ---- control words ---------------------------------------------------------------------

    def bind_control(self, ctrl: ControlBlock) -> None:
        """Register the pool's control block for GPU stream writes (done once; ``publish``
        does it on first use if the pool did not call this)."""
        if self._ctrl is ctrl:
            return
        if self._ctrl is not None:
            self._unbind_control()
        self._ctrl_dptr = register_control(self.driver, ctrl)
        self._ctrl = ctrl

    def _unbind_control(self) -> None:
        ctrl, self._ctrl = self._ctrl, None
        if ctrl is not None:
            self.driver.host_unregister(ctrl.address)

    def enable_remote(self, nslots: int) -> None:
        """Keep ready and ack words in GPU memory as well, exported with FABRIC, for consumers
        on other nodes (``pool.backends.device_control``). Needs FABRIC handles."""
        if not self.fabric_status.available:
            raise CudaUnavailable(
                f"consumers on other nodes need FABRIC handles, but {self.fabric_status.reason}"
            )
        if self.remote is None:
            self.remote = DeviceControl(
                self.driver,
                self.rt,
                self.ordinal,
                granularity=self.granularity,
                nslots=nslots,
                handle_types=self.handle_types,
            )

    def remote_acks(self) -> Any:
        """Every slot's ack word as remote consumers wrote it (numpy u32), or None."""
        return None if self.remote is None else self.remote.read_slots()["ack"]

    def remote_control(self) -> dict[str, Any]:
        """The ``control`` section of a remote welcome: the device control words' FABRIC
        handle (base64), size and slot count. Only for authenticated peers: a handle maps the
        memory. ``FeaturePool.attach_consumer`` builds the message."""
        if self.remote is None:
            raise HandoffError("remote consumers are not enabled on this pool")
        return {
            "fabric_handle": base64.b64encode(self.remote.fabric_handle()).decode(),
            "size": self.remote.size,
            "nslots": self.remote.nslots,
        }

    # ---- the Backend protocol --------------------------------------------------------------

    def publish(
        self, extent: Extent, tensor: torch.Tensor, ctrl: ControlBlock, slot: int, gen: int
    ) -> None:
        self._take(tensor.device, ctrl)
        stream = self.rt.current_stream()
        nbytes = tensor.numel() * tensor.element_size()
        if self.copy_engine == "driver" and tensor.is_contiguous():
            # One cuMemcpyDtoDAsync on torch's current stream: the same cudaMemcpyAsync that
            # tensor.copy_ issues for contiguous tensors, without ~10 us of torch dispatch and
            # view building on the host (measured on the H200, docs/benchmarks.md).
            if nbytes > extent.size:
                raise ValueError(f"{nbytes} bytes do not fit the extent {extent}")
            base = self._slabs[extent.slab]
            self.driver.memcpy_dtod_async(
                base.ptr + extent.offset, tensor.data_ptr(), nbytes, stream
            )
        else:
            dst = self.view(extent, tensor.dtype, tuple(tensor.shape))
            dst.copy_(tensor, non_blocking=True)
        # Same stream, after the copy: the write is ordered behind it (with a memory barrier).
        self._write_ready(stream, ctrl, slot, gen)

    def _take(self, device: torch.device, ctrl: ControlBlock) -> None:
        """Before a copy into the pool: refuse a tensor on another device; bind the control
        block on first use."""
        if device != self.device:
            raise InvalidTensor(
                f"a {device} tensor was given to the GPU pool ({self.transport} on "
                f"{self.device}): move it there first (tensor.to('{self.device}')), or publish "
                f"host tensors to a host_shm tier"
            )
        if self._ctrl is not ctrl:
            self.bind_control(ctrl)

    def _write_ready(self, stream: int, ctrl: ControlBlock, slot: int, gen: int) -> None:
        for word, value in self._ready_words(ctrl, slot, gen):
            self.driver.stream_write_value32(stream, word, value)

    def _ready_words(self, ctrl: ControlBlock, slot: int, gen: int) -> list[tuple[int, int]]:
        """(device address, value) of a slot's ready word, and of its copy for consumers on
        other nodes where there are any."""
        words = [(self._ctrl_dptr + (ctrl.slot_address(slot, READY_OFFSET) - ctrl.address), gen)]
        if self.remote is not None:
            words.append((self.remote.word(slot, READY_OFFSET), gen))
        return words

    def publish_many(
        self, items: Sequence[tuple[Extent, torch.Tensor, int, int]], ctrl: ControlBlock
    ) -> None:
        """``publish`` for a batch: one multi-tensor copy launch for every tensor, then every
        slot's ready word (fenced, as in ``publish``) in one batched driver call, on the same
        stream. On a busy process each call that gives up the interpreter lock waits to take it
        back: this makes two calls of the B copies and B words."""
        if len(items) < 4:  # too few to be worth a multi-tensor launch
            for extent, tensor, slot, gen in items:
                self.publish(extent, tensor, ctrl, slot, gen)
            return
        for _, tensor, _, _ in items:
            self._take(tensor.device, ctrl)
        dsts = [self.view(e, t.dtype, tuple(t.shape)) for e, t, _, _ in items]
        torch._foreach_copy_(dsts, [t for _, t, _, _ in items])
        # After the copies on the same stream, every ready word in one driver call.
        words = [w for _, _, slot, gen in items for w in self._ready_words(ctrl, slot, gen)]
        self.driver.stream_write_values32(self.rt.current_stream(), words)

    def publish_rows(
        self, items: Sequence[tuple[Extent, int, int, int]], rows: torch.Tensor, ctrl: ControlBlock
    ) -> None:
        """``publish_many`` for rows of one contiguous tensor (``items``: extent, row, slot,
        generation): the copies in one TorchScript call, then the ready words in one driver
        call, on the same stream. No Python tensor per row: on a busy process each one made
        or freed waits to take the interpreter lock back."""
        self._take(rows.device, ctrl)
        src = rows.reshape(len(rows), -1).view(torch.uint8)
        for extent, _, _, _ in items:
            if extent.size < src.shape[1]:
                raise ValueError(f"{src.shape[1]} bytes do not fit the extent {extent}")
        slabs = [self._slabs[i].base for i in range(len(self._slabs))]
        if any(b is None for b in slabs):
            raise InvalidTensor("the GPU pool is closed")
        row_copier()(
            cast(list[torch.Tensor], slabs),
            [e.slab for e, _, _, _ in items],
            [e.offset for e, _, _, _ in items],
            src,
            [r for _, r, _, _ in items],
        )
        words = [w for _, _, slot, gen in items for w in self._ready_words(ctrl, slot, gen)]
        self.driver.stream_write_values32(self.rt.current_stream(), words)

    def view(self, extent: Extent, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        m = self._slabs[extent.slab]
        if m.base is None:
            raise InvalidTensor("the GPU pool is closed")
        return m.view(extent.offset, dtype, shape)

    def slab_fds(self) -> list[int]:
        """POSIX FDs of the slabs, exported once and kept (the socket server dups them)."""
        if self._fds is None:
            fds: list[int] = []
            try:
                for m in self._slabs:
                    fds.append(self.driver.export_fd(m.handle))
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
            self._fds = fds
        return list(self._fds)

    def consumer_fds(self) -> list[int]:
        """A dup of each slab's POSIX FD for one consumer (the caller owns them). There is no
        read-only export of a VMM allocation: whoever imports one may map it read-write, so
        on this tier the socket's peer check is the boundary (docs/security.md)."""
        fds: list[int] = []
        try:
            for fd in self.slab_fds():
                fds.append(os.dup(fd))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def fabric_handles(self) -> list[bytes]:
        """The slabs' 64-byte FABRIC handles, exported once. Only for authenticated peers:
        anyone holding one (and the IMEX channel) can map the slab."""
        if not self.fabric_status.available:
            raise CudaUnavailable(self.fabric_status.reason)
        if self._fabric is None:
            self._fabric = [self.driver.export_fabric(m.handle) for m in self._slabs]
        return list(self._fabric)

    def device_info(self, *, fabric_handles: bool = False) -> dict[str, Any]:
        """The welcome's ``cuda`` section: what consumers need beyond the FDs to find the GPU
        and map its slabs (``FeaturePool.attach_consumer`` builds the message)."""
        info: dict[str, Any] = {
            "device_index": self.ordinal,
            "device_uuid": self.rt.uuid(),
            "granularity": self.granularity,
            "fabric": {
                "available": self.fabric_status.available,
                "reason": self.fabric_status.reason,
            },
        }
        if fabric_handles and self.fabric_status.available:
            info["fabric_handles"] = [base64.b64encode(h).decode() for h in self.fabric_handles()]
        return info

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.rt.synchronize()  # no copy may still target memory we are about to unmap
        finally:
            errors: list[BaseException] = []
            remote, self.remote = self.remote, None
            if remote is not None:
                try:
                    remote.close()
                except CudaError as e:
                    errors.append(e)
            for m in reversed(self._slabs):
                try:
                    unmap_allocation(self.driver, m)
                except CudaError as e:
                    errors.append(e)
            self._slabs = []
            for fd in self._fds or []:
                os.close(fd)
            self._fds = None
            try:
                self._unbind_control()
            except CudaError as e:
                errors.append(e)
            self.driver.release_device()
            if errors:
                raise errors[0]


class _ConsumerSlab:
    """A slab imported and mapped read-only in a consumer process. ``close`` drops this side's
    references; the VA range is unmapped once the last tensor viewing it is gone (after a
    synchronize, for reads still queued), so a view never outlives its memory and a new
    mapping never lands under a live old view."""

    def __init__(self, consumer: CudaConsumer, m: Mapping) -> None:
        self._consumer = consumer
        self._m: Mapping | None = m

    @property
    def ptr(self) -> int:
        assert self._m is not None
        return self._m.ptr

    def tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        if self._m is None:
            raise HandoffError("slab closed; reattach")
        return self._m.view(offset, dtype, shape)

    def close(self) -> None:
        m, self._m = self._m, None
        if m is not None:
            self._consumer.slabs.discard(self)
            m.base = None  # the unmap runs when the last view is gone (now, if none is left)
            m.typed.clear()


class CudaConsumer:
    """The consumer side of the GPU tier, one per FeatureClient attachment."""

    def __init__(
        self,
        ctrl: ControlBlock | None,
        cuda_info: dict[str, Any],
        device: torch.device | None,
        *,
        acks: AckBlock | None = None,
        driver: DriverAPI | None = None,
        rt: Any = None,
        cross_gpu: CrossGpu = "auto",
    ) -> None:
        """``ctrl``: the producer's host control block, mapped read-only, and ``acks`` this
        consumer's own ack block (same node). Both None for a consumer on another node, which
        maps the device control words with ``map_remote_control``.

        ``device``: the GPU to read on (None: the producer's). On the same node another GPU
        than the producer's reads the slabs in place where it has peer access, else gets
        copies (``cross_gpu``, ``pool.backends.peer``)."""
        self.ctrl = ctrl
        self.acks = acks
        self.info = cuda_info
        self.driver: DriverAPI = driver if driver is not None else Driver()
        self.link: GpuLink | None = None  # None on another node: no local producer GPU
        if ctrl is not None:
            self.link = plan_link(
                self.driver, _requested(device), cuda_info.get("device_uuid"), cross_gpu
            )
            index = self.link.device
        else:
            index = _pick_device(device, cuda_info)
        self.rt = rt if rt is not None else TorchCuda(index)
        self.rt.init()
        self.ordinal: int = self.rt.index
        # The copy path maps the slabs for the producer's GPU and copies from there: torch's
        # context on that GPU must exist first (as for our own), and views are built on it.
        self._source_rt = self.rt
        if self.link is not None and self.link.path == "copy":
            self._source_rt = TorchCuda(self.link.producer_device)
            self._source_rt.init()
        self.driver.use_device(self.ordinal)
        self.slabs: set[_ConsumerSlab] = set()
        self._gran: int | None = cuda_info.get("granularity")
        # Where slot 0's record is, in device addresses, and how many slots there are.
        self._words = 0
        self._nslots = 0
        self._control: _ConsumerSlab | None = None  # the device control words (remote)
        self._ack_words = 0  # device address of our ack block (same node)
        self._mapped = 0  # VA ranges still mapped (views may outlive close)
        self._closed = False
        self._registered: list[int] = []
        try:
            if ctrl is not None:
                self._words = register_control(self.driver, ctrl, read_only=True) + HEADER_SIZE
                self._registered.append(ctrl.address)
                self._nslots = ctrl.nslots
            if acks is not None:
                self._ack_words = register_control(self.driver, acks)
                self._registered.append(acks.address)
        except BaseException:
            self._unregister()
            self.driver.release_device()
            raise

    def _granularity(self) -> int:
        if self._gran is None:
            self._gran = self.driver.granularity(self.ordinal, HandleType.POSIX_FD)
        return self._gran

    @property
    def copy_reason(self) -> str:
        """Why ``open`` returns copies on this attachment (empty: views in place)."""
        return self.link.reason if self.link is not None and self.link.path == "copy" else ""

    def copy_here(self, view: torch.Tensor) -> torch.Tensor:
        """The copy path: ``view`` (on the producer's GPU) copied into this consumer's GPU,
        stream-ordered after the ready wait already enqueued on the current stream."""
        return self.rt.copy_here(view)

    def _map(self, handle: Any, size: int, *, read_only: bool = True) -> _ConsumerSlab:
        link = self.link
        access = self.ordinal if link is None else link.access_device
        # Views of memory that lives on another GPU are built naming their device (DLPack):
        # the peer path's views are on this consumer's GPU, the copy path's on the producer's.
        explicit = link is not None and link.path != "same_device"
        try:
            ptr = map_allocation(
                self.driver, handle, size, self._granularity(), access, read_only=read_only
            )
        except BaseException:
            self.driver.mem_release(handle)
            raise
        m = Mapping(size, handle, ptr)
        slab = _ConsumerSlab(self, m)
        self._mapped += 1
        try:
            m.base = self._source_rt.tensor_at(
                ptr, size, lambda: self._unmap(m), explicit_device=explicit
            )
        except BaseException:
            self._unmap(m)
            raise
        self.slabs.add(slab)
        return slab

    def _unmap(self, m: Mapping) -> None:
        """The last view of ``m`` is gone: unmap it once the reads queued on it are done."""
        try:
            self.rt.synchronize()
            if self._source_rt is not self.rt:  # the copy path read it on the producer's GPU
                self._source_rt.synchronize()
            unmap_allocation(self.driver, m)
        except Exception:  # runs from a tensor's deleter: log, never raise there
            log.exception("unmapping a consumer slab failed")
        finally:
            self._mapped -= 1
            if self._closed and self._mapped == 0:
                self.driver.release_device()

    def map_slab(self, fd: int, size: int) -> _ConsumerSlab:
        """Import a slab's POSIX FD (closed here, imported or not) and map it read-only."""
        try:
            handle = self.driver.import_fd(fd)
        finally:
            os.close(fd)
        return self._map(handle, size)

    def map_fabric(self, handle_b64: str | bytes, size: int) -> _ConsumerSlab:
        """Import a slab's FABRIC handle (from ``welcome['cuda']['fabric_handles']``) and map it
        read-only: the path for a consumer on another node of the NVLink domain."""
        return self._map(self._import_fabric(handle_b64), size)

    def map_remote_control(self, handle_b64: str | bytes, size: int, nslots: int) -> None:
        """Map the producer's device control words (FABRIC) read-write: this process's streams
        wait on their ready words and write acks into them."""
        if self.ctrl is not None or self._control is not None:
            raise HandoffError("this consumer already has control words")
        if nslots * SLOT_STRIDE > size:
            raise HandoffError(f"{nslots} slots do not fit device control words of {size} bytes")
        slab = self._map(self._import_fabric(handle_b64), size, read_only=False)
        self.slabs.discard(slab)  # closed last, after the slabs' reads (see close)
        self._control, self._words, self._nslots = slab, slab.ptr, nslots

    def _import_fabric(self, handle_b64: str | bytes) -> Any:
        raw = base64.b64decode(handle_b64) if isinstance(handle_b64, str) else handle_b64
        try:
            return self.driver.import_fabric(raw)
        except CudaError as e:
            if is_not_permitted(e):
                raise CudaUnavailable(
                    "cannot import a FABRIC handle: this process has no access to the "
                    "exporter's IMEX channel (/dev/nvidia-caps-imex-channels)"
                ) from e
            raise

    def _word(self, slot: int, offset: int) -> int:
        if not 0 <= slot < self._nslots:
            raise ValueError(f"slot {slot} outside the control words ({self._nslots} slots)")
        return self._words + slot * SLOT_STRIDE + offset

    def wait_ready(self, slot: int, gen: int) -> None:
        """Enqueue, on the current stream, a wait until the slot's ready word >= ``gen``
        (cyclic 32-bit compare)."""
        self.driver.stream_wait_value32_geq(
            self.rt.current_stream(), self._word(slot, READY_OFFSET), gen
        )

    def ack(self, slot: int, gen: int) -> None:
        """Enqueue, on the current stream (after your reads), the write of this consumer's ack
        word: in its own ack block (same node) or the device control words (other node)."""
        if self._ack_words:
            self._word(slot, 0)  # checks the slot
            addr = self._ack_words + slot * ACK_STRIDE + 4
        else:
            addr = self._word(slot, ACK_OFFSET)
        self.driver.stream_write_value32(self.rt.current_stream(), addr, gen)

    def _unregister(self) -> None:
        while self._registered:
            self.driver.host_unregister(self._registered.pop())

    def close(self) -> None:
        """Synchronize (queued acks land), unregister the control words, drop the slabs. A
        slab still viewed by a tensor stays mapped until that tensor is gone; the device is
        released after the last unmap."""
        if self._closed:
            return
        self._closed = True
        self._mapped += 1  # hold the device while closing
        try:
            self.rt.synchronize()  # queued acks land before the control words are unregistered
        finally:
            try:
                for slab in list(self.slabs):
                    slab.close()
                if self._control is not None:
                    self._control.close()
                    self._control = None
                self._unregister()
            finally:
                self._mapped -= 1
                if self._mapped == 0:
                    self.driver.release_device()


def _requested(device: torch.device | None) -> int | None:
    """The ordinal of the GPU a same-node consumer asked for (None: the producer's)."""
    if device is None:
        return None
    if device.type != "cuda":
        raise CudaUnavailable(f"the GPU tier needs a CUDA device, not {device}")
    return device.index if device.index is not None else torch.cuda.current_device()


def _pick_device(device: torch.device | None, cuda_info: dict[str, Any]) -> int:
    """A consumer on another node: the device asked for, else a local GPU with the producer's
    UUID (the same-node path, when tested on one node), else the current one."""
    if device is not None:
        if device.type != "cuda":
            raise CudaUnavailable(f"the GPU tier needs a CUDA device, not {device}")
        return device.index if device.index is not None else torch.cuda.current_device()
    if not torch.cuda.is_available():
        raise CudaUnavailable(
            "the producer's pool is on the GPU (cuda_vmm) but this process sees no CUDA device"
        )
    uuid = cuda_info.get("device_uuid")
    if uuid:
        for i in range(torch.cuda.device_count()):
            if str(torch.cuda.get_device_properties(i).uuid) == uuid:
                return i
        raise CudaUnavailable(
            f"the producer's GPU {uuid} is not visible to this process; make it visible "
            f"(CUDA_VISIBLE_DEVICES, or the same ResourceClaim) or pass device="
        )
    return torch.cuda.current_device()
