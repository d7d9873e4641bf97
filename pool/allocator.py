"""Best-fit allocator of byte ranges inside a fixed set of slabs, with coalescing of free ranges.

Leases are slices of a few large slabs, never one allocation each: exporting a fresh CUDA
allocation costs about a millisecond, a slice costs nothing. Free ranges are kept in one sorted
list keyed by (size, slab, offset), so the best fit is one bisection; neighbours are found through
two dicts keyed by start and end, so freeing coalesces in O(log n).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sortedcontainers import SortedList

ALIGNMENT = 256


@dataclass(frozen=True, slots=True, order=True)
class Extent:
    """A byte range ``[offset, offset + size)`` of slab ``slab``."""

    slab: int
    offset: int
    size: int


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


class SlabAllocator:
    """Hands out aligned extents of the given slabs. Not thread-safe: the pool holds the lock."""

    def __init__(self, slab_sizes: Sequence[int], alignment: int = ALIGNMENT) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if any(s <= 0 or s % alignment for s in slab_sizes):
            raise ValueError(f"slab sizes must be positive multiples of {alignment}: {slab_sizes}")
        self.alignment = alignment
        self.slab_sizes = list(slab_sizes)
        self._by_size: SortedList = SortedList()  # (size, slab, offset) of free ranges
        self._free_at: dict[tuple[int, int], int] = {}  # (slab, start) -> size
        self._free_end: dict[tuple[int, int], int] = {}  # (slab, end) -> start
        self._allocated: dict[tuple[int, int], int] = {}  # (slab, offset) -> size
        self.used_bytes = 0
        for slab, size in enumerate(self.slab_sizes):
            self._add_free(slab, 0, size)

    @property
    def capacity_bytes(self) -> int:
        return sum(self.slab_sizes)

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    @property
    def largest_free(self) -> int:
        return int(self._by_size[-1][0]) if self._by_size else 0

    @property
    def max_extent(self) -> int:
        """The largest request that could ever succeed (an empty slab)."""
        return max(self.slab_sizes, default=0)

    @property
    def allocations(self) -> int:
        return len(self._allocated)

    def allocate(self, nbytes: int) -> Extent | None:
        """Best-fit allocation of ``nbytes`` rounded up to the alignment; None if nothing fits."""
        if nbytes <= 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        size = align_up(nbytes, self.alignment)
        i = self._by_size.bisect_left((size, -1, -1))
        if i == len(self._by_size):
            return None
        free_size, slab, offset = self._by_size[i]
        self._remove_free(slab, offset, free_size)
        if free_size > size:
            self._add_free(slab, offset + size, free_size - size)
        self._allocated[(slab, offset)] = size
        self.used_bytes += size
        return Extent(slab, offset, size)

    def free(self, extent: Extent) -> None:
        """Return an extent; merges it with free neighbours. Freeing twice raises ValueError."""
        key = (extent.slab, extent.offset)
        size = self._allocated.get(key)
        if size is None or size != extent.size:
            raise ValueError(f"{extent} is not allocated (double free?)")
        del self._allocated[key]
        self.used_bytes -= size
        start, end = extent.offset, extent.offset + size
        before = self._free_end.get((extent.slab, start))
        if before is not None:
            self._remove_free(extent.slab, before, start - before)
            start = before
        after = self._free_at.get((extent.slab, end))
        if after is not None:
            self._remove_free(extent.slab, end, after)
            end += after
        self._add_free(extent.slab, start, end - start)

    def free_ranges(self) -> list[Extent]:
        """Free ranges sorted by slab and offset (for tests and fragmentation reports)."""
        return sorted(Extent(s, o, n) for (s, o), n in self._free_at.items())

    def _add_free(self, slab: int, offset: int, size: int) -> None:
        self._by_size.add((size, slab, offset))
        self._free_at[(slab, offset)] = size
        self._free_end[(slab, offset + size)] = offset

    def _remove_free(self, slab: int, offset: int, size: int) -> None:
        self._by_size.remove((size, slab, offset))
        del self._free_at[(slab, offset)]
        del self._free_end[(slab, offset + size)]
