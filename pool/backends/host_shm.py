"""Host shared-memory tier: memfd slabs, mapped by consumers read-only.

Used on CPU-only nodes and in CI, and as the first fallback when the GPU tier is full. The
protocol is the GPU tier's: same control block, same descriptors; only the mapping differs.

Each slab is a memfd sealed against resizing and against any writable mapping made after the
producer's own (``pool.control.seal``); consumers receive a read-only descriptor of it
(``consumer_fds``). So an admitted consumer can neither write a lease nor ``ftruncate`` the
slab under the producer (which would turn the producer's next copy into SIGBUS).
"""

from __future__ import annotations

import mmap
import os
import warnings

import numpy as np
import torch

from pool.allocator import Extent
from pool.backends.vmm import typed_view
from pool.control import ControlBlock, reopen_read_only, seal, sealed_memfd


def map_slab(fd: int, size: int, *, writable: bool) -> mmap.mmap:
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, size, mmap.MAP_SHARED, prot)


def whole_tensor(buf: mmap.mmap) -> torch.Tensor:
    """A flat uint8 tensor over the whole mapping that keeps it mapped: numpy holds the mmap's
    buffer export (``mmap.close()`` then raises BufferError instead of unmapping) and torch
    holds the array, so every view of this tensor keeps the memory alive until the last one is
    gone. (``torch.frombuffer`` keeps the object but not the export: closing the mmap would
    unmap under it.) A read-only mapping gives read-only memory: a write through it faults."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    with warnings.catch_warnings():
        # torch warns that it cannot mark a tensor read-only; the mapping itself is.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(arr)


class HostSlab:
    """One mapped slab and its typed views (producer read-write, consumer read-only)."""

    def __init__(self, fd: int, size: int, *, writable: bool) -> None:
        mm = map_slab(fd, size, writable=writable)
        self.size = size
        self.base: torch.Tensor | None = whole_tensor(mm)
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    def tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        if self.base is None:
            raise ValueError("slab closed")
        return typed_view(self.base, offset, dtype, shape, self._typed)

    def close(self) -> None:
        """Drop this side's references: the mapping goes with the last view of it."""
        self.base = None
        self._typed.clear()


class HostShmBackend:
    tier = "host"
    transport = "host_shm"
    device = torch.device("cpu")

    def __init__(self, slab_sizes: list[int]) -> None:
        self.slab_sizes = list(slab_sizes)
        self._fds: list[int] = []
        self._slabs: list[HostSlab] = []
        try:
            for i, size in enumerate(self.slab_sizes):
                fd = sealed_memfd(f"featpool-host-{i}", size)
                self._fds.append(fd)
                self._slabs.append(HostSlab(fd, size, writable=True))
                seal(fd, read_only=True)  # after our mapping: the last writable one
        except BaseException:
            self.close()
            raise

    def publish(
        self, extent: Extent, tensor: torch.Tensor, ctrl: ControlBlock, slot: int, gen: int
    ) -> None:
        dst = self.view(extent, tensor.dtype, tuple(tensor.shape))
        dst.copy_(tensor)  # from any device: a GPU tensor is copied down here
        ctrl.set_ready(slot, gen)  # after the bytes: x86-64 keeps stores in order (not arm64)

    def view(self, extent: Extent, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return self._slabs[extent.slab].tensor(extent.offset, dtype, shape)

    def slab_fds(self) -> list[int]:
        return list(self._fds)

    def consumer_fds(self) -> list[int]:
        """A new read-only descriptor of each slab, for one consumer; the caller owns them."""
        fds: list[int] = []
        try:
            for fd in self._fds:
                fds.append(reopen_read_only(fd))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def close(self) -> None:
        for slab in self._slabs:
            slab.close()
        for fd in self._fds:
            os.close(fd)
        self._slabs, self._fds = [], []
