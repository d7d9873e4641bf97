"""The GPU tier's logic against a fake driver layer: runs on machines without a GPU (CI).

The fake keeps honest state: allocations are bytearrays, mappings are VA ranges pointing at
them, exported FDs are real memfds (an import finds the allocation by inode, as SCM_RIGHTS dups
would), stream writes land in the registered host memory. Tests assert on that state and on the
recorded call order.
"""

from __future__ import annotations

import base64
import ctypes
import os
import threading
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pool.allocator import Extent
from pool.backends import cuda_vmm, vmm
from pool.backends.cuda_vmm import CudaConsumer, CudaVmmBackend, FabricStatus, probe_fabric
from pool.control import ACK_OFFSET, READY_OFFSET, ControlBlock
from pool.driver import Driver, HandleType, P2PAttribute, load_bindings
from pool.errors import (
    CudaError,
    CudaUnavailable,
    HandoffError,
    InvalidTensor,
    LeaseReleased,
    PeerRejected,
    PoolError,
    StaleLease,
)
from pool.featurepool import FeaturePool
from pool.server import FabricHandoffServer, HandoffServer

MiB = 1 << 20
GRAN = 2 * MiB
DEV_OFFSET = 0x1000_0000_0000  # fake device pointers of host memory differ from host addresses


class FakeHandle:
    _next = 1

    def __init__(self, size: int, types_: HandleType, mem: bytearray | None = None) -> None:
        self.id = FakeHandle._next
        FakeHandle._next += 1
        self.size = size
        self.types = types_
        self.mem = mem if mem is not None else bytearray(size)  # an import shares the memory

    def __repr__(self) -> str:
        return f"<handle {self.id}>"


class FakeDriver:
    """Same methods as pool.driver.Driver. ``fail`` maps a method name to the CudaError its next
    call raises; ``fabric_permitted`` says whether an IMEX channel exists."""

    def __init__(
        self, calls: list[tuple[Any, ...]] | None = None, *, fabric_permitted: bool = False
    ) -> None:
        self.calls: list[tuple[Any, ...]] = calls if calls is not None else []
        self.fabric_permitted = fabric_permitted
        self.fail: dict[str, CudaError] = {}
        self.live: dict[int, FakeHandle] = {}  # handle id -> handle, until released
        self.vas: dict[int, int] = {}  # reserved ptr -> size
        self.maps: dict[int, tuple[FakeHandle, bool | None]] = {}  # ptr -> (handle, read_only)
        self.registered: dict[int, int] = {}  # host addr -> size
        self.read_only_host: set[int] = set()  # registered with CU_MEMHOSTREGISTER_READ_ONLY
        self.by_inode: dict[int, FakeHandle] = {}
        self.retained = 0
        self._next_va = 0x7F00_0000_0000
        self.on_write: list[Any] = []
        # The node's GPUs as this process sees them (torch's spelling of UUIDs), which pairs
        # (consumer, owner) have peer access, and the device each mapping is accessible to.
        self.uuids = ["fake-0000"]
        self.peers: set[tuple[int, int]] = set()
        self.access_device: dict[int, int] = {}
        self.views: list[tuple[int, int, bool]] = []  # FakeRuntime.tensor_at: ptr, device, DLPack

    def _call(self, name: str, *args: Any) -> None:
        self.calls.append((name, *args))
        err = self.fail.pop(name, None)
        if err is not None:
            raise err

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def device_count(self) -> int:
        return len(self.uuids)

    def device_uuid(self, ordinal: int) -> str:
        return self.uuids[ordinal]

    def can_access_peer(self, ordinal: int, peer: int) -> bool:
        self._call("can_access_peer", ordinal, peer)
        return (ordinal, peer) in self.peers

    def p2p_attribute(self, attr: Any, src: int, dst: int) -> int:
        self._call("p2p_attribute", attr.name, src, dst)
        if attr.name == "PERFORMANCE_RANK":
            return 0
        return int((src, dst) in self.peers)

    def use_device(self, ordinal: int) -> None:
        self._call("use_device", ordinal)
        self.retained += 1

    def release_device(self) -> None:
        if self.retained:
            self._call("release_device")
            self.retained -= 1

    def current_context(self) -> int:
        return 0xC0

    def primary_context(self) -> int:
        return 0xC0

    def pointer_context(self, ptr: int) -> int:
        return 0xC0

    def granularity(self, ordinal: int, handle_types: HandleType) -> int:
        self._call("granularity", ordinal, handle_types)
        return GRAN

    def mem_create(self, size: int, ordinal: int, handle_types: HandleType) -> FakeHandle:
        self._call("mem_create", size, handle_types)
        if size % GRAN:
            raise CudaError("cuMemCreate", 1, "CUDA_ERROR_INVALID_VALUE")
        if HandleType.FABRIC in handle_types and not self.fabric_permitted:
            raise CudaError("cuMemCreate", 800, "CUDA_ERROR_NOT_PERMITTED")
        h = FakeHandle(size, handle_types)
        self.live[h.id] = h
        return h

    def mem_release(self, handle: FakeHandle) -> None:
        self._call("mem_release", handle)
        del self.live[handle.id]

    def address_reserve(self, size: int, alignment: int) -> int:
        self._call("address_reserve", size, alignment)
        ptr = self._next_va
        self._next_va += size + alignment
        self.vas[ptr] = size
        return ptr

    def address_free(self, ptr: int, size: int) -> None:
        self._call("address_free", ptr)
        assert ptr not in self.maps, "freeing a VA range that is still mapped"
        del self.vas[ptr]

    def mem_map(self, ptr: int, size: int, handle: FakeHandle) -> None:
        self._call("mem_map", ptr, handle)
        assert self.vas[ptr] == size == handle.size
        self.maps[ptr] = (handle, None)

    def mem_unmap(self, ptr: int, size: int) -> None:
        self._call("mem_unmap", ptr)
        del self.maps[ptr]
        self.access_device.pop(ptr, None)

    def set_access(self, ptr: int, size: int, ordinal: int, *, read_only: bool) -> None:
        self._call("set_access", ptr, read_only)
        self.maps[ptr] = (self.maps[ptr][0], read_only)
        self.access_device[ptr] = ordinal

    def export_fd(self, handle: FakeHandle) -> int:
        self._call("export_fd", handle)
        fd = os.memfd_create("fake-vmm", os.MFD_CLOEXEC)
        self.by_inode[os.fstat(fd).st_ino] = handle
        return fd

    def export_fabric(self, handle: FakeHandle) -> bytes:
        self._call("export_fabric", handle)
        if not self.fabric_permitted or HandleType.FABRIC not in handle.types:
            raise CudaError("cuMemExportToShareableHandle(FABRIC)", 800, "CUDA_ERROR_NOT_PERMITTED")
        return handle.id.to_bytes(8, "little") + b"\xfa" * 56

    def import_fd(self, fd: int) -> FakeHandle:
        self._call("import_fd", fd)
        orig = self.by_inode[os.fstat(fd).st_ino]
        h = FakeHandle(orig.size, orig.types, orig.mem)  # a handle of its own, same memory
        self.live[h.id] = h
        return h

    def import_fabric(self, data: bytes) -> FakeHandle:
        self._call("import_fabric", data)
        if not self.fabric_permitted:
            raise CudaError(
                "cuMemImportFromShareableHandle(FABRIC)", 800, "CUDA_ERROR_NOT_PERMITTED"
            )
        orig = self.live.get(int.from_bytes(data[:8], "little"))
        if orig is not None:
            h = FakeHandle(orig.size, orig.types, orig.mem)
            self.live[h.id] = h
            return h
        raise CudaError("cuMemImportFromShareableHandle(FABRIC)", 1, "CUDA_ERROR_INVALID_VALUE")

    def host_register(self, addr: int, size: int, *, read_only: bool = False) -> None:
        self._call("host_register", addr, size, read_only)
        self.registered[addr] = size
        if read_only:
            self.read_only_host.add(addr)

    def host_unregister(self, addr: int) -> None:
        self._call("host_unregister", addr)
        del self.registered[addr]
        self.read_only_host.discard(addr)

    def host_device_pointer(self, addr: int) -> int:
        self._call("host_device_pointer", addr)
        assert addr in self.registered
        return addr + DEV_OFFSET

    def _host(self, dptr: int) -> int:
        """The host address behind a device address: registered host memory, or the fake
        device memory of a mapped allocation (its bytearray)."""
        for ptr, (handle, _) in self.maps.items():
            if ptr <= dptr < ptr + handle.size:
                return ctypes.addressof((ctypes.c_char * handle.size).from_buffer(handle.mem)) + (
                    dptr - ptr
                )
        host = dptr - DEV_OFFSET
        assert any(a <= host < a + s for a, s in self.registered.items()), "unregistered word"
        return host

    def memcpy_dtod_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._call("memcpy_dtod_async", dst, src, nbytes, stream)
        for ptr, (handle, _) in self.maps.items():
            if ptr <= dst and dst + nbytes <= ptr + handle.size:
                view = (ctypes.c_char * nbytes).from_buffer(handle.mem, dst - ptr)
                ctypes.memmove(view, src, nbytes)  # the fake's "device" is host memory
                return
        raise CudaError("cuMemcpyDtoDAsync", 1, "CUDA_ERROR_INVALID_VALUE")

    def stream_write_value32(self, stream: int, addr: int, value: int) -> None:
        self._call("stream_write_value32", stream, addr, value)
        for hook in self.on_write:
            hook()
        self._write_word(addr, value, "cuStreamWriteValue32")

    def _write_word(self, addr: int, value: int, call: str) -> None:
        host = self._host(addr)
        for a, size in self.registered.items():
            if a <= host < a + size and a in self.read_only_host:  # the device refuses it
                raise CudaError(call, 700, "CUDA_ERROR_ILLEGAL_ADDRESS")
        ctypes.c_uint32.from_address(host).value = value

    def stream_write_values32(self, stream: int, writes: Sequence[tuple[int, int]]) -> None:
        self._call("stream_write_values32", stream, list(writes))
        for addr, value in writes:  # in order, each like stream_write_value32
            for hook in self.on_write:
                hook()
            self._write_word(addr, value, "cuStreamBatchMemOp")

    def stream_wait_value32_geq(self, stream: int, addr: int, value: int) -> None:
        self._call("stream_wait_value32_geq", stream, addr, value)
        self._host(addr)


class FakeRuntime:
    """Same methods as cuda_vmm.TorchCuda; device memory is the fake driver's bytearrays."""

    def __init__(self, driver: FakeDriver, device: str = "cpu", index: int = 0) -> None:
        self.driver = driver
        self.device = torch.device(device)
        self.index = index
        self.stream = 0x5157

    def init(self) -> None:
        self.driver.calls.append(("torch_init", self.index))

    def current_stream(self) -> int:
        return self.stream

    def tensor_at(
        self, ptr: int, nbytes: int, on_free: Any = None, *, explicit_device: bool = False
    ) -> torch.Tensor:
        self.driver.views.append((ptr, self.index, explicit_device))
        handle, _ = self.driver.maps[ptr]
        arr = np.frombuffer(handle.mem, dtype=np.uint8, count=nbytes)
        if on_free is not None:  # torch holds ``arr`` as long as the storage, like the real one
            weakref.finalize(arr, on_free)
        return torch.from_numpy(arr)

    def synchronize(self) -> None:
        self.driver.calls.append(("synchronize",))

    def copy_here(self, src: torch.Tensor) -> torch.Tensor:
        self.driver.calls.append(("copy_here", self.index, src.numel() * src.element_size()))
        return src.clone()

    def read_back(self, src: torch.Tensor) -> bytes:
        self.driver.calls.append(("read_back", src.numel()))
        return bytes(src.numpy())

    def uuid(self) -> str:
        return "GPU-fake-0000"


def make(
    pool_bytes: int = 8 * MiB,
    slab_bytes: int = 4 * MiB,
    *,
    fabric: str = "auto",
    permitted: bool = False,
    device: str = "cpu",
) -> tuple[CudaVmmBackend, FakeDriver]:
    drv = FakeDriver(fabric_permitted=permitted)
    be = CudaVmmBackend.create(
        0,
        pool_bytes,
        slab_bytes,
        fabric=fabric,  # type: ignore[arg-type]
        driver=drv,
        rt=FakeRuntime(drv, device),
    )
    return be, drv


def assert_nothing_left(drv: FakeDriver) -> None:
    assert drv.live == {} and drv.vas == {} and drv.maps == {} and drv.registered == {}
    assert drv.retained == 0


# ---- no driver ------------------------------------------------------------------------------


def test_no_driver_is_cuda_unavailable_naming_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    cu = pytest.importorskip("cuda.bindings.driver")

    def no_lib(flags: int) -> Any:
        raise RuntimeError(
            '"cuda" is an NVIDIA driver library and can only be found via system search'
        )  # what cuda.pathfinder raises without a driver

    monkeypatch.setattr(cu, "cuInit", no_lib)
    with pytest.raises(CudaUnavailable, match=r"no NVIDIA driver found.*--transport host_shm"):
        load_bindings()
    with pytest.raises(CudaUnavailable, match="--transport host_shm"):
        CudaVmmBackend.create(0, 8 * MiB, 4 * MiB)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_real_driver_absent_here() -> None:
    pytest.importorskip("cuda.bindings.driver")
    with pytest.raises(CudaUnavailable, match="--transport host_shm"):
        Driver()


def test_check_helper_names_call_and_result() -> None:
    cu = pytest.importorskip("cuda.bindings.driver")
    ok = cu.CUresult.CUDA_SUCCESS
    sets: list[int] = []
    fake_cu = types.SimpleNamespace(
        CUresult=cu.CUresult,
        cuDeviceGet=lambda n: (ok, 0),
        cuDevicePrimaryCtxRetain=lambda dev: (ok, 0xC0),
        cuDevicePrimaryCtxRelease=lambda dev: (ok,),
        cuCtxSetCurrent=lambda ctx: (sets.append(threading.get_ident()), (ok,))[1],
        cuMemUnmap=lambda p, s: (cu.CUresult.CUDA_ERROR_INVALID_VALUE,),
        cuStreamWriteValue32=lambda s, a, v, f: (cu.CUresult.CUDA_ERROR_NOT_SUPPORTED,),
    )
    d = Driver(fake_cu)
    d.use_device(0)
    with pytest.raises(CudaError, match=r"cuMemUnmap failed: CUDA_ERROR_INVALID_VALUE \(1\)") as e:
        d.mem_unmap(0x1000, 4096)
    assert (e.value.call, e.value.code, e.value.name) == (
        "cuMemUnmap",
        1,
        "CUDA_ERROR_INVALID_VALUE",
    )
    with pytest.raises(CudaError, match="cuStreamWriteValue32 failed: CUDA_ERROR_NOT_SUPPORTED"):
        d.stream_write_value32(0, 0x1000, 1)

    # The primary context is made current once per thread, including threads torch never saw.
    def other_thread() -> None:
        with pytest.raises(CudaError):
            d.mem_unmap(0, 1)

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert len(sets) == 2 and sets[0] != sets[1]
    d.release_device()
    with pytest.raises(CudaError, match="use_device"):
        d.mem_unmap(0, 1)


# ---- slabs ---------------------------------------------------------------------------------


def test_slab_size_rounds_up_to_granularity() -> None:
    be, drv = make(pool_bytes=5 * MiB, slab_bytes=3 * MiB)
    assert be.slab_sizes == [4 * MiB, 4 * MiB]
    assert [c[1] for c in drv.calls if c[0] == "mem_create"][-2:] == [4 * MiB, 4 * MiB]
    assert all(ro is False for _, ro in drv.maps.values())  # the producer maps read-write
    assert drv.names()[0] == "torch_init"  # torch's context exists before any driver call
    be.close()
    assert_nothing_left(drv)


@pytest.mark.parametrize("failing", ["mem_map", "set_access"])
def test_half_made_mapping_is_rolled_back(failing: str) -> None:
    drv = FakeDriver()
    first_ok = {"n": 0}
    orig = getattr(drv, failing)

    def fail_on_second(*a: Any, **k: Any) -> None:
        first_ok["n"] += 1
        if first_ok["n"] == 2:  # the second slab fails halfway
            drv.calls.append((failing, "FAILED"))
            raise CudaError(f"cu{failing}", 2, "CUDA_ERROR_OUT_OF_MEMORY")
        orig(*a, **k)

    setattr(drv, failing, fail_on_second)
    with pytest.raises(CudaError, match="CUDA_ERROR_OUT_OF_MEMORY"):
        CudaVmmBackend.create(0, 8 * MiB, 4 * MiB, driver=drv, rt=FakeRuntime(drv))
    names = drv.names()
    after = names[names.index(failing, names.index("mem_create", names.index("mem_map") + 1)) :]
    # Undo of the second slab in reverse, then teardown of the first (synchronize first).
    if failing == "set_access":
        assert after[:4] == ["set_access", "mem_unmap", "address_free", "mem_release"]
    else:
        assert after[:3] == ["mem_map", "address_free", "mem_release"]
    rest = after[after.index("mem_release") + 1 :]
    assert rest[:4] == ["synchronize", "mem_unmap", "address_free", "mem_release"]
    assert_nothing_left(drv)


def test_close_is_idempotent_and_synchronizes_before_unmap() -> None:
    be, drv = make()
    fds = be.slab_fds()
    assert be.slab_fds() == fds and drv.names().count("export_fd") == 2  # exported once
    be.close()
    names = drv.names()
    assert names.index("synchronize") < names.index("mem_unmap")
    n = len(drv.calls)
    be.close()
    assert len(drv.calls) == n
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    assert_nothing_left(drv)


# ---- publish --------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["driver", "torch"])
def test_publish_copies_then_writes_ready_on_the_same_stream(engine: str) -> None:
    be, drv = make()
    be.copy_engine = engine  # type: ignore[assignment]
    pool = FeaturePool([be], max_leases=8)
    try:
        assert "host_register" in drv.names()  # bound at pool creation, not on the hot path
        t = torch.arange(1000, dtype=torch.float32).reshape(10, 100)
        seen: list[bool] = []

        def bytes_in_place() -> None:  # what the slab holds when the ready write is issued
            lease = pool.leases.by_slot(0)
            assert lease is not None and lease.extent is not None
            seen.append(torch.equal(be.view(lease.extent, t.dtype, tuple(t.shape)), t))

        drv.on_write.append(bytes_in_place)
        be.rt.stream = 0xABC
        n0 = len(drv.calls)
        lease = pool.put(t)
        published = drv.calls[n0:]
        if engine == "driver":  # the copy, then the ready write, both on torch's stream
            assert [c[0] for c in published] == ["memcpy_dtod_async", "stream_write_value32"]
            assert published[0][2:] == (t.data_ptr(), t.numel() * 4, 0xABC)
            published = published[1:]
        assert [c[0] for c in published] == ["stream_write_value32"]  # nothing else, no sync
        _, stream, addr, value = published[0]
        assert stream == 0xABC and value == lease.generation == 1
        assert addr == pool.ctrl.slot_address(lease.slot, 4) + DEV_OFFSET
        assert seen == [True]
        assert pool.ctrl.ready(lease.slot) == lease.generation
        assert torch.equal(pool.read(lease.id), t)
    finally:
        pool.close()
    assert_nothing_left(drv)


def test_cpu_tensor_is_refused_with_a_clear_message() -> None:
    be, drv = make(device="cuda:0")
    ctrl = ControlBlock.create(4)
    try:
        with pytest.raises(InvalidTensor, match=r"a cpu tensor was given to the GPU pool.*cuda:0"):
            be.publish(Extent(0, 0, 256), torch.ones(4), ctrl, 0, 1)
        items = [(Extent(0, 256 * i, 256), torch.ones(4), i, 1) for i in range(4)]
        with pytest.raises(InvalidTensor, match=r"a cpu tensor was given to the GPU pool.*cuda:0"):
            be.publish_many(items, ctrl)
        rows = [(Extent(0, 256 * i, 256), i, i, 1) for i in range(4)]
        with pytest.raises(InvalidTensor, match=r"a cpu tensor was given to the GPU pool.*cuda:0"):
            be.publish_rows(rows, torch.ones(4, 4), ctrl)
        assert "stream_write_value32" not in drv.names()
        assert "stream_write_values32" not in drv.names()
    finally:
        be.close()
        ctrl.close()


# ---- FABRIC ---------------------------------------------------------------------------------


def test_fabric_probe_success_exports_handles_for_authenticated_peers() -> None:
    be, drv = make(permitted=True)
    try:
        assert be.fabric_status == FabricStatus("auto", True, "")
        assert be.handle_types == HandleType.POSIX_FD | HandleType.FABRIC
        probe = next(c for c in drv.calls if c[0] == "mem_create")
        assert probe[1] == GRAN and HandleType.FABRIC in probe[2]  # a real, small allocation
        hs = be.fabric_handles()
        assert len(hs) == 2 and all(len(h) == 64 for h in hs)
        assert be.fabric_handles() == hs
        assert drv.names().count("export_fabric") == 1 + 2  # the probe's, then once per slab
        info = be.device_info(fabric_handles=True)
        assert [base64.b64decode(h) for h in info["fabric_handles"]] == hs
        assert "fabric_handles" not in be.device_info()
        # The importing side: a peer with the channel maps the handle read-only.
        ctrl = ControlBlock.create(4)
        cons = CudaConsumer(ctrl, info, None, driver=drv, rt=FakeRuntime(drv))
        slab = cons.map_fabric(info["fabric_handles"][1], be.slab_sizes[1])
        assert ("import_fabric", hs[1]) in drv.calls
        mapped, read_only = drv.maps[slab.ptr]
        assert read_only and mapped.mem is drv.live[int.from_bytes(hs[1][:8], "little")].mem
        cons.close()
        ctrl.close()
    finally:
        be.close()


def test_fabric_not_permitted_falls_back_to_posix_fd() -> None:
    be, drv = make(permitted=False)
    try:
        st = be.fabric_status
        assert not st.available and "no IMEX channel (/dev/nvidia-caps-imex-channels)" in st.reason
        assert "falling back to POSIX FD" in st.reason
        assert be.handle_types == HandleType.POSIX_FD
        assert be.device_info(fabric_handles=True)["fabric"]["available"] is False
        with pytest.raises(CudaUnavailable, match="IMEX"):
            be.fabric_handles()
        assert len(be.slab_fds()) == 2
    finally:
        be.close()
    assert_nothing_left(drv)


def test_fabric_require_fails_start_up_and_leaks_nothing() -> None:
    drv = FakeDriver(fabric_permitted=False)
    with pytest.raises(CudaUnavailable, match=r"fabric=require.*no IMEX channel.*ComputeDomain"):
        CudaVmmBackend.create(
            0, 8 * MiB, 4 * MiB, fabric="require", driver=drv, rt=FakeRuntime(drv)
        )
    assert_nothing_left(drv)


def test_fabric_off_does_not_probe() -> None:
    drv = FakeDriver(fabric_permitted=True)
    st = probe_fabric(drv, 0, "off")
    assert not st.available and drv.calls == []


def test_fabric_import_without_channel_is_clear() -> None:
    drv = FakeDriver(fabric_permitted=False)
    ctrl = ControlBlock.create(4)
    info = {"device_uuid": "GPU-fake-0000"}
    cons = CudaConsumer(ctrl, info, None, driver=drv, rt=FakeRuntime(drv))
    try:
        with pytest.raises(CudaUnavailable, match="IMEX channel"):
            cons.map_fabric(base64.b64encode(b"\0" * 64).decode(), GRAN)
    finally:
        cons.close()
        ctrl.close()
    assert_nothing_left(drv)


# ---- consumer over the real socket ---------------------------------------------------------


def test_consumer_maps_read_only_waits_and_acks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    from pool.client import FeatureClient

    be, drv = make()
    pool = FeaturePool([be], max_leases=8)
    server = HandoffServer(pool, tmp_path / "fp.sock")
    server.start()
    fake_consumer_side(monkeypatch, drv)
    try:
        t = torch.randn(64, 33)
        lease = pool.put(t)
        desc = pool.describe(lease)
        with FeatureClient.connect(tmp_path / "fp.sock") as client:
            cons = client._cuda
            assert cons is not None and cons.info["device_uuid"] == "GPU-fake-0000"
            imports = [c for c in drv.calls if c[0] == "import_fd"]
            assert len(imports) == 2
            for _, fd in imports:  # the consumer closed each FD right after importing it
                with pytest.raises(OSError):
                    os.fstat(fd)
            consumer_maps = [p for p, (h, ro) in drv.maps.items() if ro is True]
            assert len(consumer_maps) == 2  # read-only, beside the producer's read-write ones

            out = client.open(desc)
            wait = drv.calls[-1]
            assert wait[0] == "stream_wait_value32_geq"
            assert wait[3] == lease.generation
            assert torch.equal(out, t)
            # The control block is registered read-only (its streams only wait on it); the
            # consumer's own ack block read-write, and the ack lands there.
            regs = {c[1]: c[3] for c in drv.calls if c[0] == "host_register"}
            assert client._ctrl is not None and client._acks is not None
            assert regs[client._ctrl.address] is True and regs[client._acks.address] is False
            client.release(desc)
            assert drv.calls[-1][0] == "stream_write_value32"
            assert client._acks.acks[lease.slot] == lease.generation
            assert pool.reap() == 1
            assert pool.stats()["tiers"][0]["used_bytes"] == 0
            with pytest.raises(StaleLease):
                client.open(desc)
        names = drv.names()
        assert names.index("host_unregister") > len(names) - 8  # consumer close unregistered
        # ``out`` still views its slab: the mapping stays, reading it reads the old bytes.
        assert len([p for p, (h, ro) in drv.maps.items() if ro is True]) == 1
        assert torch.equal(out, t)
        del out  # the last view: now that slab is unmapped and the device released
        assert [p for p, (h, ro) in drv.maps.items() if ro is True] == []
    finally:
        server.close()
        pool.close()
    assert_nothing_left(drv)


def bytes_in_place_at_each_word(
    drv: FakeDriver, pool: FeaturePool, tensors: list[torch.Tensor]
) -> list[bool]:
    """At each ready word the fake driver writes: whether every lease (in order) already
    reads its tensor, i.e. all bytes were copied before any word."""
    seen: list[bool] = []

    def check() -> None:
        reads = zip(pool.leases, tensors, strict=True)  # still reserved: read where they lie
        seen.append(all(torch.equal(pool._view_locked(lease).cpu(), t) for lease, t in reads))

    drv.on_write.append(check)
    return seen


def test_publish_many_copies_every_tensor_then_writes_each_ready_word() -> None:
    be, drv = make()
    pool = FeaturePool([be], max_leases=16)
    try:
        ts = [torch.full((7, 9), float(i)) for i in range(6)]
        seen = bytes_in_place_at_each_word(drv, pool, ts)
        n0 = len(drv.calls)
        leases = pool.put_many(ts)
        published = [c[0] for c in drv.calls[n0:]]
        # one copy launch (through torch), then the six ready words in one call
        assert published == ["stream_write_values32"]
        words = drv.calls[-1][2]
        assert [v for _, v in words] == [lease.generation for lease in leases]  # type: ignore[union-attr]
        assert seen == [True] * 6
        for lease, t in zip(leases, ts, strict=True):
            assert not isinstance(lease, BaseException)
            assert pool.ctrl.ready(lease.slot) == lease.generation
            assert torch.equal(pool.read(lease.id), t)
    finally:
        pool.close()
    assert_nothing_left(drv)


def test_put_many_of_rows_copies_every_row_then_writes_each_ready_word(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tensor of rows on the GPU tier: every row copied (one compiled call, no Python view
    per row) before any ready word, the words in one driver call; each lease reads its row,
    whatever slab it landed in."""
    copier_calls: list[int] = []

    def counted() -> Callable[..., None]:
        def call(*args: Any) -> None:
            copier_calls.append(len(args[1]))
            vmm.row_copier()(*args)

        return call

    monkeypatch.setattr(cuda_vmm, "row_copier", counted)
    be, drv = make(pool_bytes=8 * MiB, slab_bytes=1 * MiB)
    pool = FeaturePool([be], max_leases=64)
    try:
        rows = torch.arange(12 * 200 * 256, dtype=torch.float32).reshape(12, 200, 256)
        seen = bytes_in_place_at_each_word(drv, pool, list(rows))
        n0 = len(drv.calls)
        leases = pool.put_many(rows)
        assert [c[0] for c in drv.calls[n0:]] == ["stream_write_values32"]
        assert seen == [True] * 12  # checked at each word the fake driver writes
        assert copier_calls == [12]
        assert len({lease.extent.slab for lease in leases}) > 1  # type: ignore[union-attr]
        for lease, row in zip(leases, rows, strict=True):
            assert not isinstance(lease, BaseException)
            assert pool.ctrl.ready(lease.slot) == lease.generation
            assert lease.shape == (200, 256)
            assert torch.equal(pool.read(lease.id), row)
    finally:
        pool.close()
    assert_nothing_left(drv)


def test_batched_word_writes_are_cuda_batch_mem_ops_of_at_most_255() -> None:
    """The real Driver's stream_write_values32, against cuda-bindings' own parameter type:
    each write a WRITE_VALUE_32 op with its address, value and the default (fenced) flags, in
    order, 255 per cuStreamBatchMemOp call at most."""
    cu = pytest.importorskip("cuda.bindings.driver")
    ok = cu.CUresult.CUDA_SUCCESS
    batches: list[tuple[int, list[Any]]] = []

    def batch_mem_op(stream: int, n: int, ps: list[Any], flags: int) -> tuple[Any]:
        # What the driver reads, at the call: the params may be reused for the next one.
        w = [p.writeValue for p in ps]
        seen = [(int(x.address), int(x.value), int(x.flags), x.operation) for x in w]
        batches.append((n, seen))
        return (ok,)

    fake_cu = types.SimpleNamespace(
        CUresult=cu.CUresult,
        CUstreamBatchMemOpType=cu.CUstreamBatchMemOpType,
        CUstreamBatchMemOpParams=cu.CUstreamBatchMemOpParams,
        cuDeviceGet=lambda n: (ok, 0),
        cuDevicePrimaryCtxRetain=lambda dev: (ok, 0xC0),
        cuCtxSetCurrent=lambda ctx: (ok,),
        cuStreamBatchMemOp=batch_mem_op,
    )
    d = Driver(fake_cu)
    d.use_device(0)
    writes = [(0x10000 + 64 * i, 1000 + i) for i in range(300)]
    d.stream_write_values32(0, writes)
    assert [n for n, _ in batches] == [255, 45]
    got = [(address, value, flags) for _, ops in batches for address, value, flags, _ in ops]
    assert got == [(a, v, 0) for a, v in writes]
    assert {op for _, ops in batches for *_, op in ops} == {
        cu.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WRITE_VALUE_32
    }
    fake_cu.cuStreamBatchMemOp = lambda s, n, ps, f: (cu.CUresult.CUDA_ERROR_NOT_SUPPORTED,)
    with pytest.raises(CudaError, match="cuStreamBatchMemOp failed: CUDA_ERROR_NOT_SUPPORTED"):
        d.stream_write_values32(0, writes[:3])


_DTYPES = [torch.uint8, torch.int16, torch.bfloat16, torch.float32, torch.float64]


@given(
    offset=st.integers(0, 600),
    dtype=st.sampled_from(_DTYPES),
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple),
)
def test_typed_view_cached_path_equals_the_slice_path(
    offset: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    base = torch.arange(1024, dtype=torch.int64).to(torch.uint8)  # distinct bytes per offset
    typed: dict[torch.dtype, torch.Tensor] = {}
    nbytes = dtype.itemsize * torch.Size(shape).numel()
    if offset + nbytes > base.numel():
        with pytest.raises(ValueError, match="outside the slab"):
            vmm.typed_view(base, offset, dtype, shape, typed)
        return
    if offset % dtype.itemsize:
        with pytest.raises(ValueError, match="not aligned"):
            vmm.typed_view(base, offset, dtype, shape, typed)
        return
    fast = vmm.typed_view(base, offset, dtype, shape, typed)
    slow = vmm.typed_view(base, offset, dtype, shape)  # no cache: slice and two views
    assert fast.shape == slow.shape == torch.Size(shape)
    assert fast.dtype == dtype and fast.is_contiguous()
    if nbytes:  # zero-copy (an empty tensor's data_ptr is 0)
        assert fast.data_ptr() == slow.data_ptr() == base.data_ptr() + offset
    # The bytes under both views are base[offset:offset + nbytes] (compared as bytes: some
    # patterns are NaN as floats).
    for t in (fast, slow):
        assert torch.equal(t.reshape(-1).view(torch.uint8), base[offset : offset + nbytes])


# ---- a consumer on another node (FABRIC, device control words, TCP) -----------------------

TOKEN = "s3cret-token"


def fake_driver_and_runtime(monkeypatch: pytest.MonkeyPatch, drv: FakeDriver) -> None:
    """FeatureClient builds its CudaConsumer with the fake driver and runtime (and picks its
    GPU as it would on a real machine)."""
    monkeypatch.setattr(cuda_vmm, "Driver", lambda: drv)
    monkeypatch.setattr(cuda_vmm, "TorchCuda", lambda index: FakeRuntime(drv, index=index))


def fake_consumer_side(monkeypatch: pytest.MonkeyPatch, drv: FakeDriver) -> None:
    """``fake_driver_and_runtime``, the consumer on GPU 0."""
    fake_driver_and_runtime(monkeypatch, drv)
    monkeypatch.setattr(cuda_vmm, "_pick_device", lambda device, info: 0)


def remote_served(
    nslots: int = 8,
) -> tuple[CudaVmmBackend, FakeDriver, FeaturePool, FabricHandoffServer]:
    be, drv = make(permitted=True)
    pool = FeaturePool([be], max_leases=nslots)
    be.enable_remote(pool.ctrl.nslots)
    server = FabricHandoffServer(pool, "127.0.0.1", 0, token=TOKEN)
    server.start()
    return be, drv, pool, server


def test_remote_consumer_maps_through_fabric_waits_and_acks_in_gpu_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pool.client import FeatureClient

    be, drv, pool, server = remote_served()
    fake_consumer_side(monkeypatch, drv)
    try:
        assert be.remote is not None
        t = torch.randn(64, 33)
        lease = pool.put(t)
        desc = pool.describe(lease)
        # The copy, then the host ready word, then the device one, on the same stream.
        tail = drv.calls[-3:]
        assert tail[0][0] == "memcpy_dtod_async"
        assert [c[0] for c in tail[1:]] == ["stream_write_value32"] * 2
        assert tail[2][1:] == (0x5157, be.remote.word(lease.slot, READY_OFFSET), lease.generation)
        reads_before = drv.names().count("read_back")
        pool.reap()  # no remote consumer yet: GPU ack words are not read
        assert drv.names().count("read_back") == reads_before

        url = f"tcp://127.0.0.1:{server.port}"
        with FeatureClient.connect(url, token=TOKEN) as client:
            assert client.remote and client._ctrl is None
            assert pool.stats()["remote_consumers_attached"] == 1
            assert pool.stats()["consumers_attached"] == 1
            assert "import_fd" not in drv.names() and "host_register" not in [
                c[0] for c in drv.calls[-20:]
            ]
            assert drv.names().count("import_fabric") == 3  # two slabs, the control words
            cons = client._cuda
            assert cons is not None and cons._control is not None
            ctl_ptr = cons._control.ptr
            assert drv.maps[ctl_ptr][1] is False  # control words: read-write, for acks
            assert sum(1 for _, ro in drv.maps.values() if ro is True) == 2  # slabs: read-only

            out = client.open(desc)
            wait = drv.calls[-1]
            assert wait[0] == "stream_wait_value32_geq"
            assert wait[2:] == (ctl_ptr + lease.slot * 16 + READY_OFFSET, lease.generation)
            assert torch.equal(out, t)
            assert client.is_current(desc)  # asked the producer

            client.release(desc)
            assert drv.calls[-1][0] == "stream_write_value32"
            assert drv.calls[-1][2] == ctl_ptr + lease.slot * 16 + ACK_OFFSET
            assert pool.ctrl.ack(lease.slot) != lease.generation  # not in host memory
            reads = drv.names().count("read_back")
            assert pool.reap() == 1  # one batched read of the GPU ack words found it
            assert drv.names().count("read_back") == reads + 1
            assert pool.stats()["released"] == {"ack": 1}
            assert pool.stats()["tiers"][0]["used_bytes"] == 0
            assert not client.is_current(desc)
            del out  # its slab stays mapped while it lives

            # A stale ack (an older generation in the GPU word) does not end the next lease.
            second = pool.put(t)
            if second.slot == lease.slot:
                assert second.generation > lease.generation
            assert pool.reap() == 0 and pool.get(second.id) is second
            pool.release(second.id)
        for _ in range(200):
            if pool.stats()["remote_consumers_attached"] == 0:
                break
            threading.Event().wait(0.01)
        assert pool.stats()["remote_consumers_attached"] == 0
        assert pool.stats()["consumers_attached"] == 0
    finally:
        server.close()
        pool.close()
    assert_nothing_left(drv)


def test_remote_hand_off_refuses_a_bad_token_and_a_missing_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pool.client import FeatureClient

    _, drv, pool, server = remote_served()
    fake_consumer_side(monkeypatch, drv)
    try:
        url = f"tcp://127.0.0.1:{server.port}"
        with pytest.raises(PeerRejected, match="token"):
            FeatureClient.connect(url, token="wrong")
        with pytest.raises(ValueError, match="token"):
            FeatureClient.connect(url)
        assert pool.stats()["remote_consumers_attached"] == 0
        assert "import_fabric" not in drv.names()  # nothing was handed out
        with pytest.raises(HandoffError, match="needs a token"):
            FabricHandoffServer(pool, "127.0.0.1", 0, token="")
    finally:
        server.close()
        pool.close()
    assert_nothing_left(drv)


def test_remote_consumers_need_fabric() -> None:
    be, drv = make(permitted=False)
    try:
        with pytest.raises(CudaUnavailable, match=r"other nodes need FABRIC.*IMEX channel"):
            be.enable_remote(8)
        assert be.remote is None
        with pytest.raises(HandoffError, match="not enabled"):
            be.remote_control()
    finally:
        be.close()
    assert_nothing_left(drv)


def test_remote_consumer_is_told_to_fetch_host_tier_leases_over_http(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pool.backends.host_shm import HostShmBackend
    from pool.client import FeatureClient

    be, drv = make(permitted=True)
    pool = FeaturePool([be, HostShmBackend([8 * MiB])], max_leases=8)
    be.enable_remote(pool.ctrl.nslots)
    server = FabricHandoffServer(pool, "127.0.0.1", 0, token=TOKEN)
    server.start()
    fake_consumer_side(monkeypatch, drv)
    try:
        # Larger than a GPU slab (4 MiB): it falls back to the host tier.
        host_lease = pool.put(torch.ones(5 * MiB // 4))
        assert host_lease.tier == "host"
        desc = pool.describe(host_lease)
        with FeatureClient.connect(f"tcp://127.0.0.1:{server.port}", token=TOKEN) as client:
            with pytest.raises(PoolError, match=r"host tier.*GET /v1/leases/"):
                client.open(desc)
            client.release(desc)  # over the connection: the host block is not mapped here
            with pytest.raises(LeaseReleased):
                pool.get(host_lease.id)
    finally:
        server.close()
        pool.close()
    assert_nothing_left(drv)


def test_full_slots_are_freed_by_remote_acks_on_put(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every slot taken, put reads the GPU ack words itself (the reaper may not have run)."""
    from pool.client import FeatureClient

    _, drv, pool, server = remote_served(nslots=2)
    fake_consumer_side(monkeypatch, drv)
    try:
        with FeatureClient.connect(f"tcp://127.0.0.1:{server.port}", token=TOKEN) as client:
            t = torch.randn(8, 8)
            descs = [pool.describe(pool.put(t)) for _ in range(2)]
            for d in descs:
                client.open(d)
                client.release(d)
            third = pool.put(t)  # no reap() in between: put found the acks
            assert pool.get(third.id) is third
            assert pool.stats()["released"] == {"ack": 2}
            pool.release(third.id)
    finally:
        server.close()
        pool.close()
    assert_nothing_left(drv)


# ---- a consumer on another GPU of the node ------------------------------------------------

OWNER_UUID = "GPU-fake-0000"  # what the producer's welcome says (FakeRuntime.uuid)


def two_gpus(*, peer: bool) -> FakeDriver:
    drv = FakeDriver()
    drv.uuids = ["fake-0000", "fake-0001"]  # this process's ordinals: the producer's GPU is 0
    if peer:
        drv.peers = {(1, 0)}
    return drv


def test_driver_device_queries_go_through_the_checked_helper() -> None:
    import uuid as uuidlib

    cu = pytest.importorskip("cuda.bindings.driver")
    ok = cu.CUresult.CUDA_SUCCESS
    raw = bytes(range(0xA0, 0xB0))
    seen: list[tuple[Any, ...]] = []
    fake_cu = types.SimpleNamespace(
        CUresult=cu.CUresult,
        CUdevice_P2PAttribute=cu.CUdevice_P2PAttribute,
        cuDeviceGetCount=lambda: (ok, 2),
        cuDeviceGet=lambda n: (ok, 100 + n),
        cuDeviceGetUuid=lambda dev: (ok, types.SimpleNamespace(bytes=raw)),
        cuDeviceCanAccessPeer=lambda dev, peer: (seen.append(("peer", dev, peer)), (ok, 1))[1],
        cuDeviceGetP2PAttribute=lambda a, s, d: (
            (cu.CUresult.CUDA_ERROR_INVALID_DEVICE,)
            if s == d
            else (seen.append(("attr", a, s, d)), (ok, 3))[1]
        ),
    )
    d = Driver(fake_cu)
    assert d.device_count() == 2
    # Torch's spelling (get_device_properties(i).uuid): 8-4-4-4-12 lowercase hex.
    assert d.device_uuid(1) == str(uuidlib.UUID(bytes=raw))
    assert d.can_access_peer(1, 0) is True
    assert d.p2p_attribute(P2PAttribute.PERFORMANCE_RANK, 1, 0) == 3
    assert seen == [
        ("peer", 101, 100),  # (consumer, owner): can the consumer reach the owner's memory
        ("attr", cu.CUdevice_P2PAttribute.CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK, 101, 100),
    ]
    with pytest.raises(CudaError, match="cuDeviceGetP2PAttribute failed: CUDA_ERROR_INVALID"):
        d.p2p_attribute(P2PAttribute.ACCESS_SUPPORTED, 0, 0)


def test_link_decision_same_device_peer_and_copy() -> None:
    from pool.backends.peer import plan_link

    drv = two_gpus(peer=True)
    same = plan_link(drv, None, OWNER_UUID)
    assert (same.producer_device, same.device, same.path) == (0, 0, "same_device")
    assert plan_link(drv, 0, OWNER_UUID).path == "same_device"
    assert "can_access_peer" not in drv.names()  # no peer question on the producer's GPU

    peer = plan_link(drv, 1, OWNER_UUID)
    assert (peer.device, peer.path, peer.reason, peer.access_device) == (1, "peer", "", 1)
    assert ("can_access_peer", 1, 0) in drv.calls
    assert ("p2p_attribute", "ACCESS_SUPPORTED", 1, 0) in drv.calls
    forced = plan_link(drv, 1, OWNER_UUID, "copy")
    assert (forced.path, forced.reason, forced.access_device) == ("copy", "copy_requested", 0)

    drv = two_gpus(peer=False)
    copy = plan_link(drv, 1, OWNER_UUID)
    assert (copy.path, copy.reason) == ("copy", "no_peer_access")
    assert copy.access_device == 0  # mapped for the producer's GPU, which copies it over
    with pytest.raises(CudaUnavailable, match=r"GPU 1 cannot access GPU 0.*cross_gpu='map'"):
        plan_link(drv, 1, OWNER_UUID, "map")
    # The UUID is matched whatever its spelling; ordinals are this process's.
    drv.uuids = ["fake-0001", "FAKE-0000"]
    assert plan_link(drv, None, OWNER_UUID).producer_device == 1


def test_link_errors_are_clear() -> None:
    from pool.backends.peer import plan_link

    drv = two_gpus(peer=True)
    with pytest.raises(CudaUnavailable, match=r"GPU GPU-elsewhere is not among the 2 GPU\(s\)"):
        plan_link(drv, 1, "GPU-elsewhere")
    with pytest.raises(HandoffError, match="names no producer GPU"):
        plan_link(drv, 1, None)
    with pytest.raises(CudaUnavailable, match=r"CUDA device 5 does not exist \(2 visible\)"):
        plan_link(drv, 5, OWNER_UUID)
    with pytest.raises(ValueError, match="auto, map or copy"):
        plan_link(drv, 1, OWNER_UUID, "sometimes")  # type: ignore[arg-type]


def served_on_gpu0(
    drv: FakeDriver, tmp_path: Any
) -> tuple[CudaVmmBackend, FeaturePool, HandoffServer]:
    be = CudaVmmBackend.create(0, 8 * MiB, 4 * MiB, driver=drv, rt=FakeRuntime(drv))
    pool = FeaturePool([be], max_leases=8)
    server = HandoffServer(pool, tmp_path / "fp.sock")
    server.start()
    return be, pool, server


@pytest.mark.parametrize("peer", [True, False])
def test_consumer_on_another_gpu_maps_in_place_or_copies(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, peer: bool
) -> None:
    from pool.client import FeatureClient

    drv = two_gpus(peer=peer)
    _, pool, server = served_on_gpu0(drv, tmp_path)
    fake_driver_and_runtime(monkeypatch, drv)
    try:
        t = torch.randn(64, 33)
        lease = pool.put(t)
        desc = pool.describe(lease)
        n0, v0 = len(drv.calls), len(drv.views)
        with FeatureClient.connect(tmp_path / "fp.sock", device="cuda:1") as client:
            link = client.link
            assert link is not None and (link.producer_device, link.device) == (0, 1)
            assert link.path == ("peer" if peer else "copy")
            attach = drv.calls[n0:]
            assert ("use_device", 1) in attach  # the consumer's context is its own GPU's
            consumer_maps = [p for p, (h, ro) in drv.maps.items() if ro is True]
            assert len(consumer_maps) == 2
            # Access set for the consumer's GPU (peer) or the producer's (copy), read-only.
            want = 1 if peer else 0
            assert [drv.access_device[p] for p in consumer_maps] == [want, want]
            views = drv.views[v0:]
            assert [(v[1], v[2]) for v in views] == [(want, True)] * 2  # named device (DLPack)
            if not peer:
                assert ("torch_init", 0) in attach  # torch's context on the source GPU first

            out = client.open(desc)
            tail = [c[0] for c in drv.calls[-2:]]
            assert torch.equal(out, t)
            mem = drv.maps[consumer_maps[lease.extent.slab]][0].mem  # type: ignore[union-attr]
            shares = np.shares_memory(out.numpy(), np.frombuffer(mem, dtype=np.uint8))
            if peer:
                assert tail[-1] == "stream_wait_value32_geq" and shares  # a view, in place
                assert client.fallbacks == {}
            else:
                # The wait, then the copy into the consumer's GPU: counted, never silent.
                assert tail == ["stream_wait_value32_geq", "copy_here"] and not shares
                assert drv.calls[-1] == ("copy_here", 1, t.numel() * 4)
                assert client.fallbacks == {"no_peer_access": 1}
                client.open(desc)
                assert client.fallbacks == {"no_peer_access": 2}
            # The ack: this consumer's stream writes its own ack block, as on one GPU.
            client.release(desc)
            assert drv.calls[-1][0] == "stream_write_value32"
            assert client._acks is not None and client._acks.acks[lease.slot] == lease.generation
            assert pool.reap() == 1
            del out
    finally:
        server.close()
        pool.close()
    assert_nothing_left(drv)


def test_same_device_consumer_path_is_unchanged(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    from pool.client import FeatureClient

    drv = two_gpus(peer=True)
    _, pool, server = served_on_gpu0(drv, tmp_path)
    fake_driver_and_runtime(monkeypatch, drv)
    try:
        lease = pool.put(torch.ones(16))
        n0, v0 = len(drv.calls), len(drv.views)
        with FeatureClient.connect(tmp_path / "fp.sock", cross_gpu="copy") as client:
            assert client.link is not None and client.link.path == "same_device"
            attach = drv.calls[n0:]
            assert not {"can_access_peer", "p2p_attribute"} & {c[0] for c in attach}
            assert [(v[1], v[2]) for v in drv.views[v0:]] == [(0, False)] * 2
            out = client.open(pool.describe(lease))
            assert torch.equal(out, torch.ones(16)) and client.fallbacks == {}
            assert "copy_here" not in drv.names()
            client.release(pool.describe(lease))
            del out
    finally:
        server.close()
        pool.close()
    assert_nothing_left(drv)


def test_unknown_producer_gpu_is_a_clear_error_and_leaks_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    from pool.client import FeatureClient

    drv = FakeDriver()
    _, pool, server = served_on_gpu0(drv, tmp_path)
    drv.uuids = ["fake-1111", "fake-2222"]  # CUDA_VISIBLE_DEVICES hides the producer's GPU
    fake_driver_and_runtime(monkeypatch, drv)
    try:
        for device in (None, "cuda:1"):
            with pytest.raises(CudaUnavailable, match=r"GPU-fake-0000 is not among the 2 GPU"):
                FeatureClient.connect(tmp_path / "fp.sock", device=device)
        assert "import_fd" not in drv.names()
        # Visible but out of reach, with the copy refused: an error at attach, not a copy.
        drv.uuids = ["fake-0000", "fake-0001"]
        with pytest.raises(CudaUnavailable, match=r"GPU 1 cannot access GPU 0.*'map'"):
            FeatureClient.connect(tmp_path / "fp.sock", device="cuda:1", cross_gpu="map")
        assert "import_fd" not in drv.names()
        assert wait_for(lambda: pool.stats()["consumers_attached"] == 0)
    finally:
        server.close()
        pool.close()
    assert_nothing_left(drv)


def wait_for(cond: Any, timeout_s: float = 5.0) -> bool:
    for _ in range(int(timeout_s / 0.01)):
        if cond():
            return True
        threading.Event().wait(0.01)
    return bool(cond())


def test_dlpack_view_names_its_device_and_frees_with_the_last_view() -> None:
    from pool.backends.dlpack import _live, bytes_on_device

    buf = np.arange(256, dtype=np.uint8)
    freed: list[int] = []
    t = bytes_on_device(buf.ctypes.data, 200, torch.device("cpu"), lambda: freed.append(1))
    assert t.device == torch.device("cpu") and t.dtype == torch.uint8 and t.shape == (200,)
    assert t.data_ptr() == buf.ctypes.data  # zero-copy
    assert torch.equal(t, torch.from_numpy(buf[:200]))
    part = t[10:20].view(torch.int16)
    del t
    assert freed == []  # ``part`` still views it
    del part
    assert freed == [1] and not _live
    with pytest.raises(ValueError, match="no DLPack view on meta"):
        bytes_on_device(buf.ctypes.data, 1, torch.device("meta"))
