"""The one boundary between HTTP and the engine: what the routes may ask of it.

Two implementations: ``app.inprocess.InProcessEngineClient`` over ``app.engine.Engine`` in the
GPU process, and ``app.jobs.JobClient`` in each HTTP front process (``--http-workers N``), which
asks the GPU process over the job channel. The routes see only this class, the lease
descriptor (``pool.descriptor``) and the error table (``app.errors``); they fetch the client
with ``engine_client(request)``, set on ``app.state`` by the app factory.

This module must not import torch, the engine or the pool's torch modules: front processes
import it (tests/test_entrance.py checks that a front never loads torch).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from app.imaging import Header, ImageData
from app.job_arena import ArenaView
from pool.descriptor import FeatureInfo, LeaseDescriptor


class EngineDeadError(Exception):
    """The engine cannot do any more work (a sticky CUDA error, say): the process should be
    restarted. ``/health/live`` answers 503 with the reason."""


@dataclass(frozen=True)
class ImageIn:
    """One uploaded image: its label for error messages, its bytes, and the header the
    entrance already parsed (so the engine does not parse it again). Behind front processes
    the bytes are a view of the front's job arena, which the front leaves untouched until the
    job is answered: nothing may keep them past that (copy what must outlive the job)."""

    label: str
    data: ImageData
    header: Header | None = None
    digest: bytes | None = None  # SHA-256 of data, as the entrance computed it (featindex)
    # Behind front processes: the job arena that data is a view of, and where in it data starts
    arena: ArenaView | None = None
    arena_offset: int = 0


@dataclass(frozen=True)
class EncodeOptions:
    ttl_s: float | None = None  # lease deadline; None: the pool's default
    pooled: bool = False  # publish the mean over tokens, [D], instead of [T, D]
    dtype: str | None = None  # "float32", "bfloat16", "float16"; None: the encoder's
    scope: str = ""  # the caller's feature-cache scope (app/featindex.py scope_of)
    ids: tuple[str | None, ...] | None = None  # client ids naming each image's features


@dataclass(frozen=True)
class FeatureQuery:
    scope: str  # the caller's feature-cache scope
    ref: str  # a feature hash or a client id
    shape: tuple[int, ...] | None = None  # what the caller expects: 409 if it disagrees
    dtype: str | None = None


@dataclass(frozen=True)
class EngineHealth:
    ready: bool  # takes encode work now (false while starting or draining)
    dead_reason: str | None  # set once the engine can do no more work


class EngineClient(ABC):
    """Every call may raise ``ApiError`` or ``PoolError`` (answered through the error table)."""

    @abstractmethod
    async def encode(
        self, images: Sequence[ImageIn], options: EncodeOptions
    ) -> list[LeaseDescriptor]:
        """Decode, encode and publish: one lease per image, in order, or an error and none."""

    @abstractmethod
    async def lease(self, lease_id: str) -> LeaseDescriptor: ...

    @abstractmethod
    async def features(self, q: FeatureQuery) -> FeatureInfo:
        """Resident features named by a hash or client id, in the caller's scope (404/409)."""

    @abstractmethod
    async def lease_features(self, q: FeatureQuery, ttl_s: float | None) -> LeaseDescriptor:
        """A new lease on a copy of resident features, without encoding (404/409)."""

    @abstractmethod
    async def tensor(self, lease_id: str) -> bytes:
        """The lease's features as a safetensors file with one tensor named ``features``."""

    @abstractmethod
    async def renew(self, lease_id: str, ttl_s: float | None) -> LeaseDescriptor: ...

    @abstractmethod
    async def release(self, lease_id: str) -> None: ...

    @abstractmethod
    async def pool_info(self) -> dict[str, Any]:
        """The pool's occupancy, counters, socket path and capabilities (``GET /v1/pool``)."""

    @abstractmethod
    async def health(self) -> EngineHealth: ...

    async def check_health(self) -> None:
        """Raise EngineDeadError if the engine is dead."""
        h = await self.health()
        if h.dead_reason:
            raise EngineDeadError(h.dead_reason)


def engine_client(request: Request) -> EngineClient:
    return request.app.state.engine_client  # type: ignore[no-any-return]
