"""The interface every storage tier implements."""

from __future__ import annotations

from typing import Protocol

import torch

from pool.allocator import Extent
from pool.control import ControlBlock


class Backend(Protocol):
    """A tier of slabs that consumers map through FDs sent over the hand-off socket."""

    tier: str  # "gpu" or "host": the name in metrics and lease descriptors
    transport: str  # "cuda_vmm" or "host_shm": how consumers map it
    slab_sizes: list[int]
    device: torch.device  # where tensors of this tier live

    def publish(
        self, extent: Extent, tensor: torch.Tensor, ctrl: ControlBlock, slot: int, gen: int
    ) -> None:
        """Copy ``tensor`` into ``extent`` and set the slot's ready word to ``gen`` after the
        copy, in order. On the GPU this is stream-ordered and does not wait for the copy."""

    def view(self, extent: Extent, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A producer-side tensor over the extent (used to serve the bytes over HTTP)."""

    def slab_fds(self) -> list[int]:
        """One shareable FD per slab, owned by the backend."""

    def consumer_fds(self) -> list[int]:
        """New FDs of the slabs for one consumer, owned by the caller: read-only where the tier
        allows it (host_shm); a VMM POSIX FD cannot be made read-only (docs/security.md)."""

    def close(self) -> None:
        """Release the slabs. Safe to call twice."""
