"""The engine: pool, hand-off server, encoder and batcher, built and torn down in order. Routes
reach it through ``app.state.engine``; tests build it with a fake encoder."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from app.backends import Capabilities, build_backends, resolve_device
from app.batcher import Batcher, BatchStats
from app.encoders import build_encoder
from app.encoders.base import Encoder
from app.errors import ApiError
from app.imaging import decode
from app.metrics import Metrics
from app.settings import Settings
from pool.errors import PoolError
from pool.featurepool import FeaturePool
from pool.leases import Lease
from pool.server import HandoffServer

log = logging.getLogger(__name__)

MAX_BATCHES_ON_GPU = 2  # launched but unfinished; more would only grow the GPU queue


@dataclass
class Job:
    pixels: torch.Tensor  # [3, S, S] uint8, on the CPU
    ttl_s: float | None


class Engine:
    def __init__(self, settings: Settings, metrics: Metrics, encoder: Encoder | None = None
                 ) -> None:
        self.settings = settings
        self.metrics = metrics
        self._encoder = encoder
        self.device = torch.device("cpu")
        self.caps: Capabilities | None = None
        self.pool: FeaturePool | None = None
        self.server: HandoffServer | None = None
        self.encoder: Encoder | None = None
        self.batcher: Batcher[Job, Lease] | None = None
        self.decoder = ThreadPoolExecutor(settings.decode_workers,
                                          thread_name_prefix="featpool-decode")
        self.ready = False
        self.dead_reason: str | None = None
        self._in_flight: collections.deque[tuple[Any, Any, int]] = collections.deque()
        self._mean = self._std = torch.empty(0)

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        self.device = resolve_device(s) if self._encoder is None else self._encoder.device
        backends, self.caps = build_backends(s, self.device)
        self.pool = FeaturePool(backends, max_leases=s.max_leases, default_ttl_s=s.lease_ttl_s,
                                max_ttl_s=s.max_lease_ttl_s, policy=s.fallback,
                                wait_s=s.fallback_wait_s, inline_max_bytes=s.inline_max_bytes)
        for reason, tier in self.caps.startup_fallbacks:
            self.pool.fallbacks[(reason, tier)] += 1
        self.pool.start_reaper(s.reap_interval_s)
        self.metrics.watch_pool(self.pool.stats)
        self.server = HandoffServer(
            self.pool, s.socket_path, allowed_uids=s.socket_allowed_uids,
            allowed_gids=s.socket_allowed_gids,
            token=s.socket_token.get_secret_value() if s.socket_token else None,
            extra_welcome=self._welcome_extra)
        self.server.start()
        encoder = self._encoder
        if encoder is None:
            encoder = await asyncio.to_thread(self._build_encoder)
        self.encoder = encoder
        self._mean = torch.tensor(encoder.mean, device=self.device).view(1, 3, 1, 1) * 255
        self._std = torch.tensor(encoder.std, device=self.device).view(1, 3, 1, 1) * 255
        await asyncio.to_thread(encoder.warmup, [1, s.max_batch_size])
        self.batcher = Batcher(self._run_batch, max_batch_size=s.max_batch_size,
                               max_wait_s=s.max_batch_wait_ms / 1000, queue_size=s.queue_size,
                               discard=self._discard, on_batch=self._observe_batch)
        self.batcher.start()
        self.ready = True

    def _build_encoder(self) -> Encoder:
        s = self.settings
        dtype = None if s.dtype == "auto" else getattr(torch, s.dtype)
        return build_encoder(s.encoder, device=self.device, dtype=dtype, weights=s.encoder_weights)

    def _welcome_extra(self) -> dict[str, Any]:
        if self.device.type != "cuda":
            return {}
        return {"cuda": {"device_index": self.device.index or 0,
                         "device_uuid": str(torch.cuda.get_device_properties(self.device).uuid)}}

    async def stop(self) -> None:
        self.ready = False
        if self.batcher is not None:
            await self.batcher.stop()
        if self.server is not None:
            self.server.close()
        if self.pool is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.pool.close()
        self.decoder.shutdown(wait=False, cancel_futures=True)

    # ---- the encode path -------------------------------------------------------------------

    async def encode(self, images: Sequence[tuple[str, bytes]], ttl_s: float | None
                     ) -> list[Lease]:
        """Decode, batch, encode and publish; all or nothing: on any failure no lease remains."""
        if not self.ready or self.batcher is None or self.encoder is None:
            raise ApiError("not_ready", "the service is starting or draining")
        if self.pool is not None and ttl_s is not None:
            self.pool.clamp_ttl(ttl_s)  # reject a bad TTL before doing any work
        loop = asyncio.get_running_loop()
        size = self.encoder.image_size
        tasks = [loop.run_in_executor(self.decoder, self._decode, label, data, size)
                 for label, data in images]
        try:
            pixels = await asyncio.gather(*tasks)
        except ApiError:
            self.metrics.images.labels("rejected").inc(len(images))
            for t in tasks:
                t.cancel()
            raise
        leases = await self.batcher.submit([Job(p, ttl_s) for p in pixels])
        self.metrics.images.labels("encoded").inc(len(leases))
        return leases

    def _decode(self, label: str, data: bytes, size: int) -> torch.Tensor:
        t0 = time.perf_counter()
        s = self.settings
        out = decode(data, size, max_pixels=s.max_image_pixels, max_bytes=s.max_image_bytes,
                     label=label)
        self.metrics.decode_seconds.observe(time.perf_counter() - t0)
        return out

    def _run_batch(self, jobs: list[Job]) -> list[Lease | BaseException]:
        """Runs on the batch thread: normalise, encode, publish each row to the pool."""
        assert self.encoder is not None and self.pool is not None
        try:
            x = torch.stack([j.pixels for j in jobs])
            if self.device.type == "cuda":
                x = x.pin_memory().to(self.device, non_blocking=True)
            x = (x.float() - self._mean) / self._std
            start = self._event()
            feats = self.encoder.encode(x)
            self._track(start, len(jobs))
        except RuntimeError as e:
            if "CUDA" in str(e) or "cuda" in str(e):
                self.dead_reason = f"CUDA error in the encoder: {e}"
                log.critical("%s; the service reports not live", self.dead_reason)
            return [e] * len(jobs)
        results: list[Lease | BaseException] = []
        for i, job in enumerate(jobs):
            t0 = time.perf_counter()
            try:
                results.append(self.pool.put(feats[i], job.ttl_s))
            except (PoolError, ValueError) as e:
                results.append(e)
            self.metrics.publish_seconds.observe(time.perf_counter() - t0)
        return results

    def _event(self) -> Any:
        if self.device.type != "cuda":
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        ev.record()
        return ev

    def _track(self, start: Any, n: int) -> None:
        """Observe encode time; on CUDA, through events, waiting only when more than
        MAX_BATCHES_ON_GPU batches are still running (backpressure, not a sync per batch)."""
        if self.device.type != "cuda":
            self.metrics.encode_seconds.observe(time.perf_counter() - start)
            return
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end.record()
        self._in_flight.append((start, end, n))
        while len(self._in_flight) > MAX_BATCHES_ON_GPU:
            s, e, _ = self._in_flight.popleft()
            e.synchronize()
            self.metrics.encode_seconds.observe(s.elapsed_time(e) / 1000)

    def _discard(self, lease: Lease) -> None:
        assert self.pool is not None
        try:
            self.pool.release(lease.id)
        except PoolError:
            pass

    def _observe_batch(self, stats: BatchStats) -> None:
        self.metrics.batch_size.observe(stats.size)
        for w in stats.queue_wait_s:
            self.metrics.queue_seconds.observe(w)
        if stats.skipped:
            self.metrics.images.labels("abandoned").inc(stats.skipped)

    def release_all(self, leases: Sequence[Lease]) -> None:
        for lease in leases:
            self._discard(lease)
