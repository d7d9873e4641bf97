"""Storage tiers of the pool. Each backend owns a few slabs and knows how to copy a tensor into
a slice of them and mark it ready; the allocator and the lease table live above them."""

from pool.backends.base import Backend

__all__ = ["Backend"]
