"""featpool's transport library: a pool of shared slabs, leases on slices of them, and the
Unix-socket hand-off that lets consumer processes map the slabs zero-copy.

Importable without FastAPI: consumers need only ``pool.client``.
"""

from pool.errors import PoolError

__all__ = ["PoolError"]
