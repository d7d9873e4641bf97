"""The EngineClient of the GPU process: calls ``app.engine.Engine`` and its pool directly."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import torch
from safetensors.torch import save

from app.engine import Engine
from app.engine_client import (
    EncodeOptions,
    EngineClient,
    EngineHealth,
    FeatureQuery,
    ImageIn,
)
from app.errors import ApiError
from pool.descriptor import FeatureInfo, LeaseDescriptor
from pool.featurepool import FeaturePool


class InProcessEngineClient(EngineClient):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def _pool(self) -> FeaturePool:
        p = self.engine.pool
        if p is None:
            raise ApiError("not_ready", "the pool is not built yet")
        return p

    async def encode(
        self, images: Sequence[ImageIn], options: EncodeOptions
    ) -> list[LeaseDescriptor]:
        dtype = getattr(torch, options.dtype) if options.dtype else None
        leases = await self.engine.encode_cached(
            images,
            options.ttl_s,
            pooled=options.pooled,
            dtype=dtype,
            scope=options.scope,
            ids=options.ids,
        )
        pool = self._pool()
        return [pool.describe(lease) for lease in leases]

    async def features(self, q: FeatureQuery) -> FeatureInfo:
        digest, shape, dtype = self.engine.feature_info(q.scope, q.ref, q.shape, q.dtype)
        return FeatureInfo(feature_hash=digest, shape=list(shape), dtype=dtype)

    async def lease_features(self, q: FeatureQuery, ttl_s: float | None) -> LeaseDescriptor:
        lease = await self.engine.maybe_waiting(
            self.engine.lease_features, q.scope, q.ref, ttl_s, q.shape, q.dtype
        )
        return self._pool().describe(lease)

    async def lease(self, lease_id: str) -> LeaseDescriptor:
        p = self._pool()
        return p.describe(p.get(lease_id))

    async def tensor(self, lease_id: str) -> bytes:
        p = self._pool()

        def read() -> bytes:
            t = p.read(lease_id)
            return save({"features": t.contiguous()}, metadata={"lease_id": lease_id})

        return await asyncio.to_thread(read)

    async def renew(self, lease_id: str, ttl_s: float | None) -> LeaseDescriptor:
        p = self._pool()
        return p.describe(p.renew(lease_id, ttl_s))

    async def release(self, lease_id: str) -> None:
        self._pool().release(lease_id)

    def discard(self, lease_id: str) -> None:
        """Give back a lease nobody will read (its requester went away)."""
        self.engine.release_quietly(lease_id)

    async def pool_info(self) -> dict[str, Any]:
        stats = self._pool().stats()
        stats["epoch"] = f"{stats['epoch']:016x}"
        stats["fallbacks"] = [
            {"reason": r, "tier": t, "count": n} for (r, t), n in stats["fallbacks"].items()
        ]
        stats["socket_path"] = str(self.engine.settings.socket_path)
        stats["capabilities"] = vars(self.engine.caps) if self.engine.caps else {}
        stats["decoder"] = self.engine.decoder_name
        stats["feature_cache"] = self.engine.index.stats()
        return stats

    async def health(self) -> EngineHealth:
        return EngineHealth(ready=self.engine.ready, dead_reason=self.engine.dead_reason)
