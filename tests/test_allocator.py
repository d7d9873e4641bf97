import itertools
import random

import pytest

from pool.allocator import ALIGNMENT, Extent, SlabAllocator


def test_extents_are_aligned_and_disjoint() -> None:
    a = SlabAllocator([1 << 20, 1 << 20])
    extents = [a.allocate(n) for n in (1, 255, 256, 257, 1000, 4096, 3)]
    assert all(e is not None for e in extents)
    spans = sorted((e.slab, e.offset, e.offset + e.size) for e in extents if e)
    for e in extents:
        assert e is not None and e.offset % ALIGNMENT == 0 and e.size % ALIGNMENT == 0
    for (s1, _, end1), (s2, start2, _) in itertools.pairwise(spans):
        assert s1 != s2 or end1 <= start2
    assert a.used_bytes == sum(e.size for e in extents if e)


def test_best_fit_picks_the_smallest_hole() -> None:
    a = SlabAllocator([64 * 256])
    blocks = [a.allocate(256 * n) for n in (4, 1, 2, 1, 8, 1)]
    assert all(blocks)
    a.free(blocks[0])  # hole of 4 units
    a.free(blocks[2])  # hole of 2 units
    a.free(blocks[4])  # hole of 8 units
    got = a.allocate(2 * 256)
    assert got == Extent(0, blocks[2].offset, 512)  # type: ignore[union-attr]


def test_free_coalesces_with_both_neighbours() -> None:
    a = SlabAllocator([16 * 256])
    x, y, z = (a.allocate(4 * 256) for _ in range(3))
    assert x and y and z
    a.free(x)
    a.free(z)
    assert len(a.free_ranges()) == 2  # [x] and [z .. end]
    a.free(y)
    assert a.free_ranges() == [Extent(0, 0, 16 * 256)]
    assert a.largest_free == 16 * 256 and a.used_bytes == 0


def test_exhaustion_returns_none_and_changes_nothing() -> None:
    a = SlabAllocator([4096])
    assert a.allocate(4096) is not None
    before = (a.used_bytes, a.free_ranges())
    assert a.allocate(1) is None
    assert (a.used_bytes, a.free_ranges()) == before


def test_fragmentation_blocks_a_large_request_until_coalesced() -> None:
    a = SlabAllocator([8 * 256])
    blocks = [a.allocate(256) for _ in range(8)]
    for b in blocks[::2]:
        a.free(b)  # type: ignore[arg-type]
    assert a.free_bytes == 4 * 256
    assert a.allocate(2 * 256) is None  # enough bytes, no contiguous range
    for b in blocks[1::2]:
        a.free(b)  # type: ignore[arg-type]
    assert a.allocate(8 * 256) is not None


def test_request_never_spans_slabs() -> None:
    a = SlabAllocator([1024, 1024])
    assert a.allocate(2048) is None
    assert a.max_extent == 1024


def test_double_free_and_bad_sizes_raise() -> None:
    a = SlabAllocator([4096])
    e = a.allocate(100)
    assert e is not None
    a.free(e)
    with pytest.raises(ValueError, match="double free"):
        a.free(e)
    with pytest.raises(ValueError):
        a.allocate(0)
    with pytest.raises(ValueError):
        SlabAllocator([1000])  # not a multiple of the alignment


def test_random_churn_keeps_the_books_balanced() -> None:
    rng = random.Random(7)
    a = SlabAllocator([1 << 16, 1 << 16, 1 << 15])
    live: list[Extent] = []
    for _ in range(5000):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            e = a.allocate(rng.randint(1, 6000))
            if e is not None:
                live.append(e)
        assert a.used_bytes == sum(e.size for e in live)
        assert a.used_bytes + sum(r.size for r in a.free_ranges()) == a.capacity_bytes
    for e in live:
        a.free(e)
    assert len(a.free_ranges()) == 3 and a.used_bytes == 0
