"""Every CUDA driver call of featpool, through cuda-bindings (``cuda.bindings.driver``).

One class, ``Driver``, wraps the calls the pool needs; each result goes through ``Driver._check``,
which raises ``CudaError(call, code, name)``. Tests inject a fake with the same methods
(``DriverAPI`` is the interface), so the backend logic runs on machines without a GPU.

Context: the driver calls run in the device's *primary* context, the one PyTorch uses. Torch must
create it first (``pool.backends.cuda_vmm.TorchCuda.init`` does); ``use_device`` then retains it
and every call makes it current on the calling thread once (threads start without a context).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from pool.errors import CudaError, CudaUnavailable

NO_DRIVER_HINT = "use --transport host_shm"
BATCH_MEM_OPS = 255  # cuStreamBatchMemOp: "count must be less than 256"


class HandleType(enum.IntFlag):
    """Shareable handle types requested at cuMemCreate (values of CUmemAllocationHandleType)."""

    POSIX_FD = 1
    FABRIC = 8


class P2PAttribute(enum.IntEnum):
    """Attributes of the link between two devices (values of CUdevice_P2PAttribute)."""

    PERFORMANCE_RANK = 1
    ACCESS_SUPPORTED = 2
    NATIVE_ATOMIC_SUPPORTED = 3


def normalize_uuid(uuid: str) -> str:
    """One spelling of a GPU UUID: torch writes ``c8596301-a927-...``, nvidia-smi and
    CUDA_VISIBLE_DEVICES ``GPU-c8596301-a927-...``."""
    u = uuid.strip().lower()
    return u[4:] if u.startswith("gpu-") else u


class DriverAPI(Protocol):
    """What the pool needs from the CUDA driver. ``Driver`` is the real one."""

    def device_count(self) -> int: ...
    def device_uuid(self, ordinal: int) -> str: ...
    def can_access_peer(self, ordinal: int, peer: int) -> bool: ...
    def p2p_attribute(self, attr: P2PAttribute, src: int, dst: int) -> int: ...
    def use_device(self, ordinal: int) -> None: ...
    def release_device(self) -> None: ...
    def current_context(self) -> int: ...
    def primary_context(self) -> int: ...
    def pointer_context(self, ptr: int) -> int: ...
    def granularity(self, ordinal: int, handle_types: HandleType) -> int: ...
    def mem_create(self, size: int, ordinal: int, handle_types: HandleType) -> Any: ...
    def mem_release(self, handle: Any) -> None: ...
    def address_reserve(self, size: int, alignment: int) -> int: ...
    def address_free(self, ptr: int, size: int) -> None: ...
    def mem_map(self, ptr: int, size: int, handle: Any) -> None: ...
    def mem_unmap(self, ptr: int, size: int) -> None: ...
    def set_access(self, ptr: int, size: int, ordinal: int, *, read_only: bool) -> None: ...
    def export_fd(self, handle: Any) -> int: ...
    def export_fabric(self, handle: Any) -> bytes: ...
    def import_fd(self, fd: int) -> Any: ...
    def import_fabric(self, data: bytes) -> Any: ...
    def host_register(self, addr: int, size: int, *, read_only: bool = False) -> None: ...
    def host_unregister(self, addr: int) -> None: ...
    def host_device_pointer(self, addr: int) -> int: ...
    def memcpy_dtod_async(self, dst: int, src: int, nbytes: int, stream: int) -> None: ...
    def stream_write_value32(self, stream: int, addr: int, value: int) -> None: ...
    def stream_write_values32(self, stream: int, writes: Sequence[tuple[int, int]]) -> None: ...
    def stream_wait_value32_geq(self, stream: int, addr: int, value: int) -> None: ...


def load_bindings() -> Any:
    """``cuda.bindings.driver`` with cuInit done, or CudaUnavailable naming the fix."""
    try:
        from cuda.bindings import driver as cu
    except ImportError as e:
        raise CudaUnavailable(
            f"cuda-bindings is not installed ({e}): pip install 'featpool[cuda]', or "
            f"{NO_DRIVER_HINT}"
        ) from e
    try:
        (err,) = cu.cuInit(0)
    except Exception as e:  # cuda.pathfinder's DynamicLibNotFoundError (a RuntimeError) and kin
        raise CudaUnavailable(
            f"no NVIDIA driver found (libcuda could not be loaded: {e}); {NO_DRIVER_HINT}"
        ) from e
    if err:
        name = cu.CUresult(int(err)).name
        raise CudaUnavailable(f"no usable NVIDIA GPU: cuInit failed with {name}; {NO_DRIVER_HINT}")
    return cu


class Driver:
    """The real driver layer. Build it with ``Driver()`` (raises CudaUnavailable without a
    driver), then ``use_device(ordinal)`` once torch has created that device's context."""

    def __init__(self, bindings: Any = None) -> None:
        self.cu = bindings if bindings is not None else load_bindings()
        self._ctx: Any = None
        self._device: Any = None
        self._tls = threading.local()

    # ---- the one checked-result helper -----------------------------------------------------

    def _check(self, call: str, result: tuple[Any, ...]) -> Any:
        err = result[0]
        if err:  # CUresult is an int enum; CUDA_SUCCESS is 0
            code = int(err)
            try:
                name = self.cu.CUresult(code).name
            except ValueError:
                name = f"CUresult {code}"
            raise CudaError(call, code, name)
        if len(result) == 1:
            return None
        return result[1] if len(result) == 2 else result[1:]

    def _current(self) -> None:
        """Make the primary context current on this thread (once per thread)."""
        if getattr(self._tls, "ctx", None) is not self._ctx or self._ctx is None:
            if self._ctx is None:
                raise CudaError(
                    "cuCtxSetCurrent",
                    201,
                    "CUDA_ERROR_INVALID_CONTEXT",
                    "Driver.use_device() was not called",
                )
            self._check("cuCtxSetCurrent", self.cu.cuCtxSetCurrent(self._ctx))
            self._tls.ctx = self._ctx

    # ---- devices (no context needed) ------------------------------------------------------

    def device_count(self) -> int:
        return int(self._check("cuDeviceGetCount", self.cu.cuDeviceGetCount()))

    def _dev(self, ordinal: int) -> Any:
        return self._check("cuDeviceGet", self.cu.cuDeviceGet(ordinal))

    def device_uuid(self, ordinal: int) -> str:
        """The device's UUID as torch spells it (8-4-4-4-12 lowercase hex, no ``GPU-``)."""
        uuid = self._check("cuDeviceGetUuid", self.cu.cuDeviceGetUuid(self._dev(ordinal)))
        h = bytes(uuid.bytes).hex()
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"

    def can_access_peer(self, ordinal: int, peer: int) -> bool:
        """Whether device ``ordinal`` can read and write memory that lives on ``peer``."""
        dev, peer_dev = self._dev(ordinal), self._dev(peer)
        return bool(
            self._check("cuDeviceCanAccessPeer", self.cu.cuDeviceCanAccessPeer(dev, peer_dev))
        )

    def p2p_attribute(self, attr: P2PAttribute, src: int, dst: int) -> int:
        """One attribute of the link from ``src`` to ``dst`` (two different devices)."""
        cu = self.cu
        return int(
            self._check(
                "cuDeviceGetP2PAttribute",
                cu.cuDeviceGetP2PAttribute(
                    cu.CUdevice_P2PAttribute(int(attr)), self._dev(src), self._dev(dst)
                ),
            )
        )

    # ---- context ---------------------------------------------------------------------------

    def use_device(self, ordinal: int) -> None:
        if self._ctx is not None:
            return
        dev = self._check("cuDeviceGet", self.cu.cuDeviceGet(ordinal))
        ctx = self._check("cuDevicePrimaryCtxRetain", self.cu.cuDevicePrimaryCtxRetain(dev))
        self._device, self._ctx = dev, ctx
        self._current()

    def release_device(self) -> None:
        if self._ctx is None:
            return
        dev, self._ctx, self._device = self._device, None, None
        self._tls = threading.local()
        self._check("cuDevicePrimaryCtxRelease", self.cu.cuDevicePrimaryCtxRelease(dev))

    def current_context(self) -> int:
        return int(self._check("cuCtxGetCurrent", self.cu.cuCtxGetCurrent()))

    def primary_context(self) -> int:
        return int(self._ctx) if self._ctx is not None else 0

    def pointer_context(self, ptr: int) -> int:
        attr = self.cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_CONTEXT
        return int(self._check("cuPointerGetAttribute", self.cu.cuPointerGetAttribute(attr, ptr)))

    # ---- physical memory and mappings ------------------------------------------------------

    def _prop(self, ordinal: int, handle_types: HandleType) -> Any:
        cu = self.cu
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ordinal
        # A bitmask (POSIX_FD | FABRIC = 9) is no member of the binding's enum: assign the int
        # (the setter stores it; only reading the field back would fail).
        prop.requestedHandleTypes = int(handle_types)
        return prop

    def granularity(self, ordinal: int, handle_types: HandleType) -> int:
        self._current()
        option = self.cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        return int(
            self._check(
                "cuMemGetAllocationGranularity",
                self.cu.cuMemGetAllocationGranularity(self._prop(ordinal, handle_types), option),
            )
        )

    def mem_create(self, size: int, ordinal: int, handle_types: HandleType) -> Any:
        self._current()
        return self._check(
            "cuMemCreate", self.cu.cuMemCreate(size, self._prop(ordinal, handle_types), 0)
        )

    def mem_release(self, handle: Any) -> None:
        self._current()
        self._check("cuMemRelease", self.cu.cuMemRelease(handle))

    def address_reserve(self, size: int, alignment: int) -> int:
        self._current()
        return int(
            self._check("cuMemAddressReserve", self.cu.cuMemAddressReserve(size, alignment, 0, 0))
        )

    def address_free(self, ptr: int, size: int) -> None:
        self._current()
        self._check("cuMemAddressFree", self.cu.cuMemAddressFree(ptr, size))

    def mem_map(self, ptr: int, size: int, handle: Any) -> None:
        self._current()
        self._check("cuMemMap", self.cu.cuMemMap(ptr, size, 0, handle, 0))

    def mem_unmap(self, ptr: int, size: int) -> None:
        self._current()
        self._check("cuMemUnmap", self.cu.cuMemUnmap(ptr, size))

    def set_access(self, ptr: int, size: int, ordinal: int, *, read_only: bool) -> None:
        self._current()
        cu = self.cu
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = ordinal
        desc.flags = (
            cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
            if read_only
            else cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        )
        self._check("cuMemSetAccess", cu.cuMemSetAccess(ptr, size, [desc], 1))

    # ---- shareable handles -----------------------------------------------------------------

    def export_fd(self, handle: Any) -> int:
        self._current()
        kind = self.cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return int(
            self._check(
                "cuMemExportToShareableHandle",
                self.cu.cuMemExportToShareableHandle(handle, kind, 0),
            )
        )

    def export_fabric(self, handle: Any) -> bytes:
        self._current()
        kind = self.cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC
        fabric = self._check(
            "cuMemExportToShareableHandle(FABRIC)",
            self.cu.cuMemExportToShareableHandle(handle, kind, 0),
        )
        return bytes(fabric.data)

    def import_fd(self, fd: int) -> Any:
        self._current()
        kind = self.cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        # The FD travels in the pointer-sized argument itself, as in C: (void *)(uintptr_t)fd.
        return self._check(
            "cuMemImportFromShareableHandle", self.cu.cuMemImportFromShareableHandle(fd, kind)
        )

    def import_fabric(self, data: bytes) -> Any:
        self._current()
        if len(data) != 64:
            raise ValueError(f"a FABRIC handle is 64 bytes, got {len(data)}")
        fabric = self.cu.CUmemFabricHandle()
        fabric.data = data
        kind = self.cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC
        return self._check(
            "cuMemImportFromShareableHandle(FABRIC)",
            self.cu.cuMemImportFromShareableHandle(fabric.getPtr(), kind),
        )

    # ---- host-mapped control words ---------------------------------------------------------

    def host_register(self, addr: int, size: int, *, read_only: bool = False) -> None:
        self._current()
        flags = self.cu.CU_MEMHOSTREGISTER_DEVICEMAP | self.cu.CU_MEMHOSTREGISTER_PORTABLE
        if read_only:  # a PROT_READ mapping can only be registered as device-read-only
            flags |= self.cu.CU_MEMHOSTREGISTER_READ_ONLY
        self._check("cuMemHostRegister", self.cu.cuMemHostRegister(addr, size, flags))

    def host_unregister(self, addr: int) -> None:
        self._current()
        self._check("cuMemHostUnregister", self.cu.cuMemHostUnregister(addr))

    def host_device_pointer(self, addr: int) -> int:
        self._current()
        return int(
            self._check("cuMemHostGetDevicePointer", self.cu.cuMemHostGetDevicePointer(addr, 0))
        )

    # ---- stream memory operations (the hot path: no allocation beyond the call) ------------

    def memcpy_dtod_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._current()
        err = self.cu.cuMemcpyDtoDAsync(dst, src, nbytes, stream)[0]
        if err:
            self._check("cuMemcpyDtoDAsync", (err,))

    def stream_write_value32(self, stream: int, addr: int, value: int) -> None:
        self._current()
        err = self.cu.cuStreamWriteValue32(stream, addr, value, 0)[0]
        if err:
            self._check("cuStreamWriteValue32", (err,))

    def stream_write_values32(self, stream: int, writes: Sequence[tuple[int, int]]) -> None:
        """``stream_write_value32`` for each (address, value), in order, in one driver call
        per 255 (cuStreamBatchMemOp): a batch's ready words without a call, and a wait for
        the interpreter lock after it, per word. Each write keeps the default memory barrier."""
        self._current()
        params, fields = self._write_params()
        for at in range(0, len(writes), BATCH_MEM_OPS):
            chunk = writes[at : at + BATCH_MEM_OPS]
            for w, (addr, value) in zip(fields, chunk, strict=False):
                w.address, w.value = addr, value
            err = self.cu.cuStreamBatchMemOp(stream, len(chunk), params[: len(chunk)], 0)[0]
            if err:
                self._check("cuStreamBatchMemOp", (err,))

    def _write_params(self) -> tuple[list[Any], list[Any]]:
        """This thread's BATCH_MEM_OPS write operations (and their writeValue fields), made
        once: making one costs ~8 us of Python, setting its address and value 0.2 us, and the
        driver reads them only during the call."""
        made = getattr(self._tls, "write_params", None)
        if made is None:
            cu = self.cu
            params = [cu.CUstreamBatchMemOpParams() for _ in range(BATCH_MEM_OPS)]
            fields = [p.writeValue for p in params]
            for w in fields:
                w.operation = cu.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WRITE_VALUE_32
                w.flags = 0  # the default: a memory barrier before the write
            made = self._tls.write_params = (params, fields)
        return made

    def stream_wait_value32_geq(self, stream: int, addr: int, value: int) -> None:
        # GEQ, never EQ: a slot's generations only grow, and EQ would hang forever on a word
        # that moved past the value (a recycled slot).
        self._current()
        err = self.cu.cuStreamWaitValue32(stream, addr, value, 0)[0]  # CU_STREAM_WAIT_VALUE_GEQ
        if err:
            self._check("cuStreamWaitValue32", (err,))


def is_not_permitted(e: CudaError) -> bool:
    return e.name == "CUDA_ERROR_NOT_PERMITTED"
