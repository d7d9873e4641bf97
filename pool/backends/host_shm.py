"""Host shared-memory tier: memfd slabs, mapped by consumers read-only.

Used on CPU-only nodes and in CI, and as the first fallback when the GPU tier is full. The
protocol is the GPU tier's: same control block, same descriptors; only the mapping differs.
"""

from __future__ import annotations

import mmap
import os
import warnings

import torch

from pool.allocator import Extent
from pool.control import ControlBlock


def map_slab(fd: int, size: int, *, writable: bool) -> mmap.mmap:
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, size, mmap.MAP_SHARED, prot)


def tensor_over(
    buf: mmap.mmap, offset: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """A zero-copy tensor over ``buf[offset:]``. Read-only buffers give read-only memory:
    writing through such a tensor faults, which is the point."""
    count = 1
    for d in shape:
        count *= d
    with warnings.catch_warnings():
        # torch warns that it cannot mark a tensor read-only; the mapping itself is.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        flat = torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)
    return flat.view(shape)


class HostShmBackend:
    tier = "host"
    transport = "host_shm"
    device = torch.device("cpu")

    def __init__(self, slab_sizes: list[int]) -> None:
        self.slab_sizes = list(slab_sizes)
        self._fds: list[int] = []
        self._maps: list[mmap.mmap] = []
        try:
            for i, size in enumerate(self.slab_sizes):
                fd = os.memfd_create(f"featpool-host-{i}", os.MFD_CLOEXEC)
                self._fds.append(fd)
                os.ftruncate(fd, size)
                self._maps.append(map_slab(fd, size, writable=True))
        except BaseException:
            self.close()
            raise

    def publish(
        self, extent: Extent, tensor: torch.Tensor, ctrl: ControlBlock, slot: int, gen: int
    ) -> None:
        dst = self.view(extent, tensor.dtype, tuple(tensor.shape))
        dst.copy_(tensor)  # from any device: a GPU tensor is copied down here
        ctrl.set_ready(slot, gen)  # after the bytes: x86 and arm64 stores stay in order here

    def view(self, extent: Extent, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return tensor_over(self._maps[extent.slab], extent.offset, dtype, shape)

    def slab_fds(self) -> list[int]:
        return list(self._fds)

    def close(self) -> None:
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:  # a tensor view still holds it; it is unmapped with the view
                pass
        for fd in self._fds:
            os.close(fd)
        self._maps, self._fds = [], []
