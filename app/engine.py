"""The engine: pool, hand-off server, encoder and batcher, built and torn down in order. Routes
reach it only through ``app.engine_client.EngineClient`` (``app.inprocess`` in this process);
tests build it with a fake encoder."""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch

from app.admission import BoundedExecutor
from app.backends import (
    Capabilities,
    build_backends,
    resolve_device,
    socket_in_use,
    wants_cuda,
)
from app.batcher import Batcher, BatchStats
from app.encoders import build_encoder
from app.encoders.base import DynamicEncoder, Encoder, is_dynamic
from app.engine_client import ImageIn
from app.errors import RETRY_AFTER, ApiError
from app.featindex import Entry, FeatureIndex, content_digest, feature_hash, identity_digest
from app.gpu_decode import ByteSpans, Held, JpegDecoder, held, preprocess
from app.imaging import ImageData, decode, decode_upright, image_limits, inspect
from app.job_arena import ArenaView
from app.metrics import Metrics
from app.preprocess import ImageSpec, device_index, orient
from app.settings import Settings, resolve_batching
from pool.errors import (
    CudaError,
    CudaUnavailable,
    LeaseExpired,
    LeaseNotFound,
    LeaseReleased,
    PoolError,
    SocketInUse,
    StaleLease,
)
from pool.featurepool import FeaturePool, lease_slots
from pool.leases import ImageGrid, Lease
from pool.server import FabricHandoffServer, HandoffServer, Limits

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_BATCHES_ON_GPU = 2  # launched but unfinished; more would only grow the GPU queue

# CUDA errors that leave the context unusable ("sticky": every later call fails too), so the
# process must restart: the runtime's code and its cudaGetErrorString text (the driver's
# CUresult numbers are the same). Anything else fails its batch and the service lives on.
STICKY_CUDA_ERRORS = {
    214: "uncorrectable ECC error encountered",
    700: "an illegal memory access was encountered",
    702: "the launch timed out and was terminated",
    709: "context is destroyed",
    710: "device-side assert triggered",
    714: "hardware stack error",
    715: "an illegal instruction was encountered",
    716: "misaligned address",
    717: "operation not supported on global/shared address space",
    718: "invalid program counter",
    719: "unspecified launch failure",
}
_STICKY_BY_TEXT = {text: code for code, text in STICKY_CUDA_ERRORS.items()}
CUDA_OUT_OF_MEMORY = 2  # cudaErrorMemoryAllocation, CUDA_ERROR_OUT_OF_MEMORY


def cuda_error_code(e: BaseException) -> int | None:
    """The CUDA error code an exception carries: a driver call's CUresult (pool.errors.
    CudaError), torch.AcceleratorError's ``error_code``, or, from a torch that raises a plain
    RuntimeError, the code whose error string follows torch's "CUDA error: " prefix."""
    if isinstance(e, CudaError):
        return e.code
    code = getattr(e, "error_code", None)
    if isinstance(code, int):
        return code
    head, sep, rest = str(e).partition("CUDA error: ")
    if isinstance(e, RuntimeError) and sep and not head:
        return _STICKY_BY_TEXT.get(rest.split("\n", 1)[0].strip().rstrip("."))
    return None


def is_out_of_memory(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or cuda_error_code(e) == CUDA_OUT_OF_MEMORY


def is_sticky(e: BaseException) -> bool:
    return cuda_error_code(e) in STICKY_CUDA_ERRORS


def batch_buckets(max_batch_size: int, steps: int = 8) -> list[int]:
    """The batch sizes the encoder is prepared for (a CUDA graph or a compiled graph each):
    ``steps`` evenly spaced sizes up to ``max_batch_size``, and the powers of two below the
    first. A batch is padded to the next one, so at most 1/steps of the largest batch's forward
    is padding (128: 1, 2, 4, 8, 16, 32, ..., 112, 128). Powers of two alone padded a batch of
    80 (five requests of 16 images) to 128: 38 % of that forward wasted. Each size keeps its own
    input and output buffers (the graphs share one memory pool for the rest): for ViT-B/16 in
    bf16 at 128, ~0.36 GB in all against ~0.15 GB with powers of two."""
    step = -(-max_batch_size // steps)
    sizes = {1 << k for k in range(step.bit_length()) if 1 << k < step}
    sizes.update(range(step, max_batch_size, step))
    sizes.add(max_batch_size)
    return sorted(sizes)


def named(lease: Lease, digest: str, cached: bool) -> Lease:
    """``lease`` with the hash of its features and whether they were reused (a copy of
    resident ones): kept on the lease, every descriptor of it names them (the encode answer,
    HTTP GET and renew, the socket's lookup and renew)."""
    lease.feature_hash, lease.cached = digest, cached
    return lease


# What the prepare stage hands the batch stage: the indices of the jobs that decoded, their
# pixels as one batch on the device (None if none decoded), each failed job's error, and the
# CUDA event the forward waits for (None off the decode stream).
Prepared = tuple[list[int], torch.Tensor | None, dict[int, BaseException], Any]


@dataclass
class Job:
    label: str
    ttl_s: float | None
    # [3, S, S] uint8 on the CPU (Pillow decoded it; with the model's own preprocessing or a
    # dynamic encoder, [3, H, W] at full size, upright)
    pixels: torch.Tensor | None = None
    jpeg: ImageData = b""  # or: a JPEG for nvJPEG, already validated
    # the EXIF orientation still to apply after the GPU decode (1 where the decoder applies it)
    orientation: int = 1
    arena: ArenaView | None = None  # the job arena jpeg is a view of (ImageIn.arena), and where
    arena_offset: int = 0
    pooled: bool = False  # publish the mean over tokens, [D], instead of [T, D]
    dtype: torch.dtype | None = None  # cast before publishing; None keeps the encoder's

    @classmethod
    def of_jpeg(cls, img: ImageIn, ttl_s: float | None, orientation: int) -> Job:
        """A JPEG for nvJPEG, with where its bytes lie in a front's job arena, if they do."""
        return cls(
            img.label,
            ttl_s,
            jpeg=img.data,
            orientation=orientation,
            arena=img.arena,
            arena_offset=img.arena_offset,
        )


def byte_tensor(data: ImageData) -> torch.Tensor:
    """A uint8 tensor of an image's bytes for the JPEG decoders: a view of a writable buffer
    (the job arena behind front processes), else a copy (torch takes no read-only buffer)."""
    if isinstance(data, memoryview) and not data.readonly:
        return torch.frombuffer(data, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def arena_tensor(arena: ArenaView) -> torch.Tensor | None:
    """A front's whole job arena as one uint8 tensor, made once per connection and kept on the
    arena, ``held`` (the arena drops both at close); None once the connection closed."""
    kept = arena.tensor
    if kept is None:
        view = arena.whole()
        if view is None:
            return None
        # (two prepare threads may both make one: either serves, and the loser is dropped)
        kept = arena.tensor = held(torch.frombuffer(view, dtype=torch.uint8))
        if arena.closed:  # it closed meanwhile: only this batch holds the tensor now
            arena.tensor = None
    return cast(Held, kept).tensor


def byte_spans(jobs: Sequence[Job]) -> ByteSpans:
    """The jobs' JPEGs for a one-call decode: spans of their arenas' tensors, without a tensor
    per image; a JPEG that is not in an open arena (sent inline) gets a tensor of its own."""
    sources: list[torch.Tensor] = []
    index: dict[int, int] = {}  # id(an arena's tensor) -> its place in sources
    which, offsets, sizes = [], [], []
    for job in jobs:
        whole = arena_tensor(job.arena) if job.arena is not None else None
        if whole is None:
            which.append(len(sources))
            sources.append(byte_tensor(job.jpeg))
            offsets.append(0)
        else:
            k = index.setdefault(id(whole), len(sources))
            if k == len(sources):
                sources.append(whole)
            which.append(k)
            offsets.append(job.arena_offset)
        sizes.append(len(job.jpeg))
    return ByteSpans(sources, which, offsets, sizes)


class Engine:
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        encoder: Encoder | DynamicEncoder | None = None,
    ) -> None:
        # The device is resolved (and checked) at start; the batching defaults need to know
        # now whether there will be one, before admission and the batcher are made.
        cuda = encoder.device.type == "cuda" if encoder else wants_cuda(settings)
        resolve_batching(settings, cuda=cuda)
        self.settings = settings
        self.metrics = metrics
        self._encoder = encoder
        self.device = torch.device("cpu")
        self.caps: Capabilities | None = None
        self.pool: FeaturePool | None = None
        self.server: HandoffServer | None = None
        self.fabric_server: FabricHandoffServer | None = None
        self.encoder: Encoder | DynamicEncoder | None = None
        self.batcher: Batcher[Job, Lease] | None = None
        self.jpeg: JpegDecoder | None = None
        # Bounded like admission: admitted images never find it full; anything else does.
        self.decoder = BoundedExecutor(
            settings.decode_workers, settings.queue_size, "featpool-decode"
        )
        self.ready = False
        self.dead_reason: str | None = None
        self._in_flight: collections.deque[tuple[Any, Any, int]] = collections.deque()
        self._mean = self._std = torch.empty(0)
        self._spec: ImageSpec | None = None  # the model's own preprocessing, if it has one
        self._buckets: list[int] = []
        self.index = FeatureIndex(settings.feature_cache_entries)
        # identity_digest per (pooled, dtype): the encoder is fixed once started, and the JSON
        # and hash of its identity were ~9 % of the event loop's time per request
        self._identity_digests: dict[tuple[bool, torch.dtype | None], bytes] = {}
        # CUDA: decode and preprocess run on streams of their own, one per prepare thread
        self._decode_streams: queue.SimpleQueue[Any] = queue.SimpleQueue()

    @property
    def decoder_name(self) -> str:
        """The JPEG decoder chosen at start-up (``--decoder``): nvjpeg, nvimgcodec or pillow."""
        return self.jpeg.name if self.jpeg is not None else "pillow"

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()  # what started goes down: socket file, pool memory, threads
            raise

    async def _start(self) -> None:
        s = self.settings
        self.device = resolve_device(s) if self._encoder is None else self._encoder.device
        # The encoder first: its output size sets how many lease slots the pool needs.
        encoder = self._encoder
        if encoder is None:
            log.info("loading encoder %s on %s", s.encoder, self.device)
            encoder = await asyncio.to_thread(self._build_encoder)
        self.encoder = encoder
        self._identity_digests.clear()
        backends, self.caps = build_backends(s, self.device)
        self.pool = FeaturePool(
            backends,
            max_leases=s.max_leases or self._lease_slots(backends),
            default_ttl_s=s.lease_ttl_s,
            max_ttl_s=s.max_lease_ttl_s,
            policy=s.fallback,
            wait_s=s.fallback_wait_s,
            inline_max_bytes=s.inline_max_bytes,
            quarantine_s=s.quarantine_s,
        )
        for reason, tier in self.caps.startup_fallbacks:
            self.pool.fallbacks[(reason, tier)] += 1
        self.pool.start_reaper(s.reap_interval_s)
        self.metrics.watch_pool(self.pool.stats)
        self.server = HandoffServer(
            self.pool,
            s.socket_path,
            allowed_uids=s.socket_allowed_uids,
            allowed_gids=s.socket_allowed_gids,
            token=s.socket_token.get_secret_value() if s.socket_token else None,
            limits=self._handoff_limits(),
        )
        try:
            self.server.start()
        except SocketInUse as e:  # started meanwhile: preflight() checked before the model
            raise socket_in_use(str(e)) from e
        self._start_remote()
        if self.device.type == "cuda":  # one per prepare thread, taken for a batch
            for _ in range(s.prepare_threads):
                self._decode_streams.put(torch.cuda.Stream(self.device))  # type: ignore[no-untyped-call]
        self.jpeg = await asyncio.to_thread(
            JpegDecoder.create, self.device, s.gpu_decode, s.decoder
        )
        self._spec = None
        if not is_dynamic(encoder):  # a dynamic encoder normalises by its own processor
            fixed = cast(Encoder, encoder)
            self._mean = torch.tensor(fixed.mean, device=self.device).view(1, 3, 1, 1) * 255
            self._std = torch.tensor(fixed.std, device=self.device).view(1, 3, 1, 1) * 255
            self._spec = getattr(encoder, "preprocess_spec", None)
        graphs = (
            s.encoder_cuda_graphs
            and hasattr(encoder, "enable_cuda_graphs")
            and self.device.type == "cuda"
        )
        if graphs:
            encoder.enable_cuda_graphs()  # type: ignore[union-attr]
        if (
            (s.encoder_compile or graphs)
            and self.device.type == "cuda"
            and (self._encoder is None or graphs)
        ):
            # A compiled graph or a captured CUDA graph per batch size: batches are padded up to
            # a handful of sizes, prepared once, here, and never while serving.
            self._buckets = batch_buckets(s.max_batch_size)
        sizes = self._buckets or [1, s.max_batch_size]
        log.info(
            "warming up the encoder at batch sizes %s%s", sizes, " (CUDA graphs)" if graphs else ""
        )
        await asyncio.to_thread(encoder.warmup, sizes)
        self.batcher = Batcher(
            self._run_batch,
            max_batch_size=s.max_batch_size,
            max_wait_s=s.max_batch_wait_ms / 1000,
            queue_size=s.queue_size,
            discard=self._discard,
            on_batch=self._observe_batch,
            prepare=self._prepare_batch,
            prepare_threads=s.prepare_threads,
        )
        self.batcher.start()
        self.ready = True

    def _lease_slots(self, backends: Sequence[Any]) -> int:
        """--max-leases 0: enough slots that, at the encoder's (unpooled) feature size, every
        tier and the inline bound run out of bytes before the slots run out."""
        assert self.encoder is not None
        rows, dim = self.encoder.output_shape  # type: ignore[union-attr]
        if is_dynamic(self.encoder):
            # Tokens vary per image: size the slots for a small one (448 px square), so that
            # bytes still run out before slots for almost every image.
            t, h, w = cast(DynamicEncoder, self.encoder).grid(448, 448)
            rows = t * h * w // int(getattr(self.encoder, "merge_unit", 1))
        feature = rows * dim * self.encoder.dtype.itemsize
        capacity = sum(sum(b.slab_sizes) for b in backends) + self.settings.inline_max_bytes
        return lease_slots(capacity, feature)

    def _build_encoder(self) -> Encoder | DynamicEncoder:
        s = self.settings
        dtype = None if s.dtype == "auto" else getattr(torch, s.dtype)
        return build_encoder(
            s.encoder,
            device=self.device,
            dtype=dtype,
            weights=s.encoder_weights,
            compile=s.encoder_compile,
            tower_compile=s.tower_compile,
        )

    def _start_remote(self) -> None:
        """--fabric-listen: device control words on the GPU tier and the TCP hand-off for
        consumers on other nodes. Any reason it cannot work stops start-up, naming the flag."""
        address = self.settings.fabric_address()
        if address is None or self.pool is None:
            return
        token = self.settings.socket_token
        flag = "--fabric-listen (FEATPOOL_FABRIC_LISTEN)"
        gpu = next((t.backend for t in self.pool.tiers if hasattr(t.backend, "remote")), None)
        if token is None:
            raise PoolError(f"{flag} needs --socket-token (FEATPOOL_SOCKET_TOKEN)")
        if gpu is None:
            raise CudaUnavailable(
                f"{flag} serves the GPU pool, but this server has none "
                f"(tiers: {[t.name for t in self.pool.tiers]}); see the start-up log"
            )
        try:
            gpu.enable_remote(self.pool.ctrl.nslots)  # type: ignore[attr-defined]
        except CudaUnavailable as e:
            raise CudaUnavailable(
                f"{flag}: {e}. Run where an IMEX channel exists (a DRA ComputeDomain) or drop "
                f"{flag} for a single node"
            ) from e
        self.fabric_server = FabricHandoffServer(
            self.pool,
            address[0],
            address[1],
            token=token.get_secret_value(),
            limits=self._handoff_limits(),
        )
        self.fabric_server.start()

    def _handoff_limits(self) -> Limits:
        s = self.settings
        return Limits(
            auth_timeout_s=s.socket_auth_timeout_s, max_connections=s.socket_max_connections
        )

    async def stop(self) -> None:
        self.ready = False
        if self.batcher is not None:
            await self.batcher.stop()
        if self.server is not None:
            self.server.close()
        if self.fabric_server is not None:
            self.fabric_server.close()
        if self.pool is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.pool.close()
        self.decoder.shutdown()

    # ---- the encode path -------------------------------------------------------------------

    async def encode(
        self,
        images: Sequence[ImageIn],
        ttl_s: float | None,
        *,
        pooled: bool = False,
        dtype: torch.dtype | None = None,
    ) -> list[Lease]:
        """Decode, batch, encode and publish; all or nothing: on any failure no lease remains.
        Every image is decoded (or, for nvJPEG, its header checked) before any is queued. The
        caller holds an admission permit for these images (app/admission.py)."""
        if not self.ready or self.batcher is None or self.encoder is None:
            raise ApiError("not_ready", "the service is starting or draining")
        if self.dead_reason:
            raise ApiError("not_ready", f"the engine is dead ({self.dead_reason}); restarting")
        if self.pool is not None and ttl_s is not None:
            try:
                self.pool.clamp_ttl(ttl_s)  # reject a bad TTL before doing any work
            except ValueError as e:
                raise ApiError("validation_error", str(e)) from None
        # A dynamic encoder takes each image at its full size and resizes it by its own rule.
        size = None if is_dynamic(self.encoder) else cast(Encoder, self.encoder).image_size
        # A JPEG for nvJPEG whose header the entrance parsed needs nothing more here.
        jobs: list[Job | None] = [
            self._jpeg_job(img, ttl_s, img.header.orientation)
            if self.jpeg is not None and img.header is not None and img.header.gpu_jpeg
            else None
            for img in images
        ]
        todo = [i for i, j in enumerate(jobs) if j is None]
        try:
            # Off the event loop, on the bounded decode pool: a header can take seconds to
            # parse (a JPEG full of empty markers), a decode longer.
            tasks = [
                asyncio.ensure_future(self.decoder.run(self._prepare, images[i], size))
                for i in todo
            ]
            try:
                for i, done in zip(todo, await asyncio.gather(*tasks), strict=True):
                    jobs[i] = done
            except BaseException:
                for t in tasks:  # the ones not started yet are dropped from the pool's queue
                    t.cancel()
                raise
        except ApiError:
            self.metrics.images.labels("rejected").inc(len(images))
            raise
        ready = [j for j in jobs if j is not None]
        for j in ready:
            j.ttl_s, j.pooled, j.dtype = ttl_s, pooled, dtype
        leases = await self.batcher.submit(ready)
        self.metrics.images.labels("encoded").inc(len(leases))
        return leases

    # ---- content-addressed features (app/featindex.py) --------------------------------------

    def identity(self, pooled: bool, dtype: torch.dtype | None) -> dict[str, Any]:
        """What the features of given bytes depend on, besides the bytes: the model, its
        preprocessing (a fixed-size tower's size, mean, std and processor configuration, or a
        dynamic tower's processor: pixel budget, patch and merge sizes), and the dtype."""
        enc = self.encoder
        assert enc is not None
        pre = getattr(enc, "pre", None) if is_dynamic(enc) else self._spec
        return {
            "encoder": enc.name,
            "weights": str(self.settings.encoder_weights or ""),
            "image_size": getattr(enc, "image_size", None),
            "mean": list(getattr(enc, "mean", ())),
            "std": list(getattr(enc, "std", ())),
            "output_shape": list(getattr(enc, "output_shape", ())),
            "preprocess": repr(pre) if pre is not None else "",
            "encoder_dtype": str(enc.dtype).removeprefix("torch."),
            "dtype": str(dtype or enc.dtype).removeprefix("torch."),
            "pooled": pooled,
        }

    async def encode_cached(
        self,
        images: Sequence[ImageIn],
        ttl_s: float | None,
        *,
        pooled: bool = False,
        dtype: torch.dtype | None = None,
        scope: str = "",
        ids: Sequence[str | None] | None = None,
    ) -> list[Lease]:
        """``encode``, except that images whose features are still in the pool (same bytes,
        same encoder identity, same scope) get a new lease on a copy of them: no decode, no
        forward pass. All or nothing, like ``encode``."""
        if not self.ready or self.encoder is None or self.pool is None:
            raise ApiError("not_ready", "the service is starting or draining")
        ident = self._identity_digests.get((pooled, dtype))
        if ident is None:
            ident = identity_digest(self.identity(pooled, dtype))
            self._identity_digests[(pooled, dtype)] = ident
        digests = [feature_hash(ident, img.digest or content_digest(img.data)) for img in images]
        names = list(ids) if ids is not None else [None] * len(images)
        named_as: dict[str, str] = {}
        for name, digest in zip(names, digests, strict=True):
            if name is None:
                continue
            if named_as.setdefault(name, digest) != digest:
                raise ApiError("id_conflict", f"id {name!r} names two different images")
            bound = self.index.resolve(scope, name)
            if bound is not None and bound != digest:
                self._resident(scope, bound)  # an id whose leases have all ended is free
            self.index.check_id(scope, name, digest)  # 409 before any work
        out: list[Lease | None] = [None] * len(images)
        indexed: list[tuple[str, str]] = []  # (hash, lease id) this request put in the index
        try:
            if self.index.max_entries > 0:
                for i, digest in enumerate(digests):
                    lease = await self.maybe_waiting(self._reuse, scope, digest, ttl_s)
                    if lease is not None:
                        out[i] = named(lease, digest, True)
            todo = [i for i, lease in enumerate(out) if lease is None]
            if todo:
                leases = await self.encode(
                    [images[i] for i in todo], ttl_s, pooled=pooled, dtype=dtype
                )
                for i, lease in zip(todo, leases, strict=True):
                    out[i] = named(lease, digests[i], False)
            # Indexed once every lease is in `out`: a 409 here (another request bound an id
            # meanwhile) releases them all, and takes this request's entries out again.
            for i, made in enumerate(out):
                if made is not None and self.index.max_entries > 0:
                    self.index.add(
                        scope,
                        digests[i],
                        made.id,
                        shape=made.shape,
                        dtype=made.dtype,
                        client_id=names[i],
                        deadline=self._deadline_of,
                    )
                    indexed.append((digests[i], made.id))
        except BaseException:
            for digest, lease_id in indexed:
                self.index.forget_lease(scope, digest, lease_id)
            for made in out:
                if made is not None:
                    self.release_quietly(made.id)
            raise
        return [lease for lease in out if lease is not None]

    def _reuse(self, scope: str, digest: str, ttl_s: float | None) -> Lease | None:
        """A new lease on a copy of the indexed features, or None (counted as a miss)."""
        assert self.pool is not None
        _, candidates = self.index.candidates(scope, digest)
        for lease_id in candidates:
            try:
                lease = self.pool.copy_lease(lease_id, ttl_s)
            except (LeaseExpired, LeaseReleased, LeaseNotFound, StaleLease):
                self.index.forget_lease(scope, digest, lease_id)
                continue
            self.index.count(hit=True)
            return lease
        self.index.count(hit=False)
        return None

    def feature_info(
        self,
        scope: str,
        ref: str,
        shape: Sequence[int] | None = None,
        dtype: str | None = None,
    ) -> tuple[str, tuple[int, ...], str]:
        """(hash, shape, dtype) of the features named by a hash or client id in this scope.
        404 when unknown or no longer resident; 409 when they disagree with what the caller
        expects (``shape``, ``dtype``)."""
        if self.pool is None:
            raise ApiError("not_ready", "the pool is not built yet")
        digest = self.index.resolve(scope, ref)
        entry = self._resident(scope, digest) if digest else None
        if entry is None or digest is None:
            raise ApiError(
                "feature_not_found", f"no features for {ref[:80]!r} are resident in this pool"
            )
        if (shape is not None and tuple(shape) != entry.shape) or (
            dtype is not None and dtype != entry.dtype
        ):
            raise ApiError(
                "feature_mismatch",
                f"{ref[:80]!r} holds {entry.dtype} {list(entry.shape)}, "
                f"not {dtype or entry.dtype} {list(shape) if shape else list(entry.shape)}",
            )
        return digest, entry.shape, entry.dtype

    async def maybe_waiting(self, copy: Callable[..., T], *args: Any) -> T:
        """``copy(*args)``, a call that copies features into the pool: under the wait policy
        it may wait for room, so it runs off the event loop then (the DELETE that would make
        room is served meanwhile); at once otherwise."""
        if self.pool is not None and self.pool.policy == "wait":
            return await asyncio.to_thread(copy, *args)
        return copy(*args)

    def _resident(self, scope: str, digest: str) -> Entry | None:
        """The index entry of ``digest`` if one of its leases is still live; the ended ones
        are forgotten on the way (the entry, and the ids naming it, with the last)."""
        assert self.pool is not None
        entry, candidates = self.index.candidates(scope, digest)
        for lease_id in candidates:
            try:
                self.pool.get(lease_id)
                return entry
            except PoolError:
                self.index.forget_lease(scope, digest, lease_id)
        return None

    def _deadline_of(self, lease_id: str) -> float | None:
        """A lease's deadline (monotonic), or None once it has ended."""
        assert self.pool is not None
        try:
            return self.pool.get(lease_id).deadline
        except PoolError:
            return None

    def lease_features(
        self,
        scope: str,
        ref: str,
        ttl_s: float | None,
        shape: Sequence[int] | None = None,
        dtype: str | None = None,
    ) -> Lease:
        """A new lease on the resident features named by a hash or client id."""
        if self.pool is not None and ttl_s is not None:
            self.pool.clamp_ttl(ttl_s)
        try:
            digest, _, _ = self.feature_info(scope, ref, shape, dtype)
        except ApiError as e:
            if e.type == "feature_not_found":
                self.index.count(hit=False)
            raise
        lease = self._reuse(scope, digest, ttl_s)
        if lease is None:  # its last lease ended a moment ago
            raise ApiError(
                "feature_not_found", f"no features for {ref[:80]!r} are resident in this pool"
            )
        self.index.add(
            scope,
            digest,
            lease.id,
            shape=lease.shape,
            dtype=lease.dtype,
            deadline=self._deadline_of,
        )
        return named(lease, digest, True)

    def _prepare(self, img: ImageIn, size: int | None) -> Job:
        """A JPEG that nvJPEG can take keeps its bytes (decoded on the GPU in batches, its
        header already parsed at the entrance); anything else is decoded here by Pillow."""
        s = self.settings
        if self.jpeg is not None and img.data[:3] == b"\xff\xd8\xff":
            h = img.header or inspect(
                img.data,
                **image_limits(s),
                label=img.label,
            )
            if h.gpu_jpeg:
                return self._jpeg_job(img, None, h.orientation)
        return Job(img.label, None, pixels=self._decode(img.label, img.data, size))

    def _jpeg_job(self, img: ImageIn, ttl_s: float | None, orientation: int) -> Job:
        """A JPEG for the GPU decoder, with the EXIF orientation still to apply after it: none
        where the decoder turns its output upright itself (torchcodec)."""
        upright = self.jpeg is not None and self.jpeg.upright
        return Job.of_jpeg(img, ttl_s, 1 if upright else orientation)

    def _decode(self, label: str, data: ImageData, size: int | None) -> torch.Tensor:
        t0 = time.perf_counter()
        s = self.settings
        if size is None or self._spec is not None:
            # a dynamic encoder, or the model's preprocessing: on the device, at full size
            out = decode_upright(
                data,
                **image_limits(s),
                label=label,
            )
        else:
            out = decode(
                data,
                size,
                **image_limits(s),
                label=label,
            )
        self.metrics.decode_seconds.observe(time.perf_counter() - t0)
        return out

    def _pixels(
        self, jobs: list[Job]
    ) -> tuple[list[int], torch.Tensor | None, dict[int, BaseException]]:
        """Decode what is still encoded (nvJPEG, batched) and assemble the batch of the jobs
        that decoded: (their indices, [n, 3, S, S] normalised floats on the device, failures)."""
        assert self.encoder is not None and not is_dynamic(self.encoder)
        size = cast(Encoder, self.encoder).image_size
        failed: dict[int, BaseException] = {}
        host: dict[int, torch.Tensor] = {
            i: j.pixels for i, j in enumerate(jobs) if j.pixels is not None
        }
        on_gpu: dict[int, torch.Tensor] = {}
        parts: list[tuple[list[int], torch.Tensor]] = []  # (jobs, their preprocessed pixels)
        gpu_idx = [i for i, j in enumerate(jobs) if j.pixels is None]
        in_one_call: list[int] = []
        if gpu_idx:
            t0 = time.perf_counter()
            whole = self._decode_preprocess(jobs, gpu_idx, size)
            if whole is not None:
                in_one_call = gpu_idx
                parts.append((gpu_idx, whole))
            else:
                on_gpu, by_pillow = self._decode_jpegs(jobs, gpu_idx, size, failed)
                host.update(by_pillow)
            spent = (time.perf_counter() - t0) / len(gpu_idx)
            for _ in gpu_idx:
                self.metrics.decode_seconds.observe(spent)
        ok = sorted([*host, *on_gpu, *in_one_call])
        if not ok:
            return ok, None, failed
        if self._spec is not None:
            images = [on_gpu[i] if i in on_gpu else self._to_device(host[i]) for i in ok]
            orientations = [jobs[i].orientation if i in on_gpu else 1 for i in ok]
            return ok, self._spec.apply(images, orientations), failed
        if on_gpu:
            g = sorted(on_gpu)
            parts.append(
                (g, preprocess([on_gpu[i] for i in g], [jobs[i].orientation for i in g], size))
            )
        if host:
            h = sorted(host)
            parts.append((h, self._to_device(torch.stack([host[i] for i in h])).float()))
        if len(parts) == 1:
            x = parts[0][1]
        else:
            x = torch.empty(len(ok), 3, size, size, device=self.device)
            row = {i: r for r, i in enumerate(ok)}
            for idx, part in parts:
                x[device_index([row[i] for i in idx], self.device)] = part
        return ok, (x - self._mean) / self._std, failed

    def _decode_preprocess(self, jobs: list[Job], idx: list[int], size: int) -> torch.Tensor | None:
        """The JPEGs of ``jobs[idx]`` decoded and preprocessed in one call where the decoder
        has one and the model has no preprocessing of its own; None otherwise, or when the
        batch fails (``_decode_jpegs`` then decodes image by image)."""
        assert self.jpeg is not None
        if self._spec is not None:
            return None
        spans = byte_spans([jobs[i] for i in idx])
        return self.jpeg.decode_preprocess(spans, [jobs[i].orientation for i in idx], size)

    def _decode_jpegs(
        self, jobs: list[Job], idx: list[int], size: int | None, failed: dict[int, BaseException]
    ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """The JPEGs of ``jobs[idx]`` decoded by nvJPEG in one batch: (on the device, still to
        be turned by ``Job.orientation``; the ones nvJPEG refused, decoded by Pillow as
        ``_decode`` does).
        What Pillow refuses too goes into ``failed``."""
        assert self.jpeg is not None
        on_gpu: dict[int, torch.Tensor] = {}
        by_pillow: dict[int, torch.Tensor] = {}
        datas = [byte_tensor(jobs[i].jpeg) for i in idx]
        for i, out in zip(idx, self.jpeg.decode(datas), strict=True):
            if isinstance(out, torch.Tensor):
                on_gpu[i] = out
                continue
            log.info("nvJPEG could not decode %s (%s); trying Pillow", jobs[i].label, out)
            try:
                by_pillow[i] = self._decode(jobs[i].label, jobs[i].jpeg, size)
            except ApiError as e:
                failed[i] = e
        return on_gpu, by_pillow

    def _to_device(self, x: torch.Tensor) -> torch.Tensor:
        """Pixels decoded on the host, to the device (pinned, without waiting for the copy)."""
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True)
        return x

    def _prepare_batch(self, jobs: list[Job]) -> Callable[[], list[Lease | BaseException]]:
        """Stage one, on the batcher's prepare thread: decode (nvJPEG, nvImageCodec) and
        preprocess batch N+1 while the batch thread launches and publishes batch N. On CUDA it
        runs on a stream of its own, so on the GPU too this decode runs beside the forward the
        batch thread launched, instead of queueing behind it; that batch's forward waits for
        the event recorded here. Returns stage two, ``_run_batch`` with what was prepared."""
        if self.encoder is None or is_dynamic(self.encoder):  # it decodes in _run_dynamic
            return functools.partial(self._run_batch, jobs)
        # (never waits: the batcher prepares at most as many batches at once as there are streams)
        side = self._decode_streams.get() if self.device.type == "cuda" else None
        prepared: Prepared | BaseException
        try:
            if side is None:
                prepared = (*self._pixels(jobs), None)
            else:
                with torch.cuda.stream(side):
                    ok, x, failed = self._pixels(jobs)
                    ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    ready.record(side)
                if x is not None:  # not reused by the side stream before the forward is done
                    x.record_stream(torch.cuda.current_stream(self.device))
                prepared = (ok, x, failed, ready)
        except Exception as e:  # _run_batch reports it like its own errors
            prepared = e
        finally:
            if side is not None:
                self._decode_streams.put(side)
        return functools.partial(self._run_batch, jobs, prepared)

    def _run_batch(
        self, jobs: list[Job], prepared: Prepared | BaseException | None = None
    ) -> list[Lease | BaseException]:
        """Runs on the batch thread: decode, normalise, encode, publish each row to the pool.
        An image that cannot be decoded fails alone; a CUDA out-of-memory in the encoder splits
        the batch; any other error fails the batch, and a sticky CUDA error marks the service
        not live."""
        assert self.encoder is not None and self.pool is not None
        if is_dynamic(self.encoder):
            return self._run_dynamic(jobs, cast(DynamicEncoder, self.encoder))
        encoder = cast(Encoder, self.encoder)
        try:
            if prepared is None:  # called without the prepare stage
                prepared = (*self._pixels(jobs), None)
            if isinstance(prepared, BaseException):
                raise prepared
            ok, x, failed, ready = prepared
            if ready is not None:
                torch.cuda.current_stream(self.device).wait_event(ready)
            results = self._unpublished(len(jobs), failed)
            if x is None:
                return results
            start = self._event()
            chunks = self._forward_split(x)
            self._track(start, len(ok))
        except Exception as e:
            return [self._batch_error(e, "the encoder")] * len(jobs)
        first = 0
        for k, chunk in chunks:
            rows_of = ok[first : first + k]
            first += k
            if isinstance(chunk, BaseException):
                for i in rows_of:
                    results[i] = chunk
            else:
                self._publish_rows(jobs, rows_of, chunk, encoder.dtype, results)
        return results

    def _publish_rows(
        self,
        jobs: list[Job],
        idx: list[int],
        feats: torch.Tensor,
        dtype: torch.dtype,
        results: list[Lease | BaseException],
    ) -> None:
        """Row r of ``feats`` ([n, T, D]) is the features of ``jobs[idx[r]]``. The jobs that
        want the same form, dtype and TTL (all, usually) are published as one tensor of rows,
        not as a tensor per image: on a busy process every torch call from Python, and every
        tensor freed, waits to take the interpreter lock back."""
        groups: dict[tuple[bool, torch.dtype, float | None], list[int]] = {}
        for r, i in enumerate(idx):
            job = jobs[i]
            groups.setdefault((job.pooled, job.dtype or dtype, job.ttl_s), []).append(r)
        for (pooled, to, ttl), rs in groups.items():
            members = [idx[r] for r in rs]
            try:
                x = feats
                if len(rs) < len(idx):
                    x = x[device_index(rs, x.device)]
                if pooled:
                    x = x.float().mean(1)
                x = x.to(to)
            except Exception as e:
                for i in members:
                    results[i] = self._batch_error(e, "the encoder")
                continue
            self._put(members, x, ttl, None, results)

    @staticmethod
    def _unpublished(n: int, failed: dict[int, BaseException]) -> list[Lease | BaseException]:
        """A batch's results before publishing: each job's own failure, else "not encoded"
        (``_publish`` puts the leases in)."""
        return [failed.get(i, ApiError("internal_error", "not encoded")) for i in range(n)]

    def _run_dynamic(self, jobs: list[Job], encoder: DynamicEncoder) -> list[Lease | BaseException]:
        """``_run_batch`` for a dynamic-resolution encoder: every image keeps its own size
        and its own number of tokens; the encoder packs them into one forward."""
        try:
            images, failed = self._images(jobs, encoder)
            results = self._unpublished(len(jobs), failed)
            ok = sorted(images)
            if not ok:
                return results
            start = self._event()
            encoded = encoder.encode_images([images[i] for i in ok])
            self._track(start, len(ok))
        except Exception as e:
            return [self._batch_error(e, "the encoder")] * len(jobs)
        out: dict[int, tuple[torch.Tensor, ImageGrid | None]] = {}
        for i, (feats, (t, h, w)) in zip(ok, encoded, strict=True):
            job = jobs[i]
            f = feats.float().mean(0) if job.pooled else feats
            out[i] = (f.to(job.dtype or encoder.dtype), ImageGrid(t, h, w, int(feats.shape[0])))
        return self._publish(jobs, out, results)

    def _images(
        self, jobs: list[Job], encoder: DynamicEncoder
    ) -> tuple[dict[int, torch.Tensor], dict[int, BaseException]]:
        """Each job's upright RGB ``[3, H, W]`` uint8 on the device (nvJPEG decodes what is
        still encoded, batched), and the failures: undecodable, or a shape the model refuses."""
        failed: dict[int, BaseException] = {}
        images: dict[int, torch.Tensor] = {}
        gpu_idx = [i for i, j in enumerate(jobs) if j.pixels is None]
        if gpu_idx:
            decoded, by_pillow = self._decode_jpegs(jobs, gpu_idx, None, failed)
            for i, x in decoded.items():
                images[i] = orient(x, jobs[i].orientation)
            for i, x in by_pillow.items():
                jobs[i].pixels = x
        for i, job in enumerate(jobs):
            if job.pixels is not None and i not in failed:
                images[i] = self._to_device(job.pixels)
        for i, x in list(images.items()):
            try:
                encoder.grid(int(x.shape[-2]), int(x.shape[-1]))
            except ValueError as e:
                failed[i] = ApiError("invalid_image", f"{jobs[i].label}: {e}")
                del images[i]
        return images, failed

    def _publish(
        self,
        jobs: list[Job],
        out: dict[int, tuple[torch.Tensor, ImageGrid | None]],
        results: list[Lease | BaseException],
    ) -> list[Lease | BaseException]:
        """Publish each job's features (and image grid) into the pool. Per TTL (jobs of one
        request share theirs): one put_many each, so the GPU tier copies the whole group with
        one launch."""
        groups: dict[float | None, list[tuple[int, torch.Tensor, ImageGrid | None]]]
        groups = {}
        for i, (f, grid) in out.items():
            groups.setdefault(jobs[i].ttl_s, []).append((i, f, grid))
        for ttl, members in groups.items():
            idx = [i for i, _, _ in members]
            self._put(idx, [f for _, f, _ in members], ttl, [g for _, _, g in members], results)
        return results

    def _put(
        self,
        idx: list[int],
        features: list[torch.Tensor] | torch.Tensor,
        ttl: float | None,
        grids: list[ImageGrid | None] | None,
        results: list[Lease | BaseException],
    ) -> None:
        """One ``put_many``: ``features`` (a tensor each, or one tensor of rows) become the
        leases of ``jobs[idx]``, in ``results``."""
        assert self.pool is not None
        t0 = time.perf_counter()
        try:
            placed: list[Lease | BaseException] = list(self.pool.put_many(features, ttl, grids))
        except ValueError as e:
            placed = [ApiError("validation_error", str(e))] * len(idx)
        except Exception as e:
            # put_many has released these leases already; the batch's other groups stay
            # valid and are returned (or discarded by the batcher if their request failed).
            placed = [self._batch_error(e, "publishing")] * len(idx)
        per_lease = (time.perf_counter() - t0) / len(idx)
        for i, result in zip(idx, placed, strict=True):
            results[i] = result
            self.metrics.publish_seconds.observe(per_lease)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.encoder is not None
        n = x.shape[0]
        pad = next((b for b in self._buckets if b >= n), n) - n
        if pad:
            x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
        return cast(Encoder, self.encoder).encode(x)[:n]

    def _forward_split(self, x: torch.Tensor) -> list[tuple[int, torch.Tensor | BaseException]]:
        """The encoder's output in chunks of rows: (rows, features or error). On a CUDA
        out-of-memory the batch is encoded again in halves, down to one image, which then
        fails alone (503); the service stays live."""
        n = x.shape[0]
        try:
            return [(n, self._forward(x))]
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            error = self._out_of_memory(e)
        # Retried outside the except clause: its traceback holds the failed forward's tensors.
        log.warning(
            "CUDA out of memory encoding %d image(s); %s", n, "split" if n > 1 else "failed"
        )
        if n == 1:
            return [(1, error)]
        return self._forward_split(x[: n // 2]) + self._forward_split(x[n // 2 :])

    @staticmethod
    def _out_of_memory(e: BaseException) -> ApiError:
        return ApiError(
            "gpu_out_of_memory",
            f"the GPU ran out of memory for this image ({type(e).__name__}); retry later",
            headers=RETRY_AFTER,
        )

    def _batch_error(self, e: Exception, where: str) -> BaseException:
        """What a batch that raised answers, by the error's type and CUDA code (never its
        text alone): out of memory -> 503, the service lives; a sticky CUDA error -> the
        service reports not live (it must restart); anything else fails only this batch."""
        if is_out_of_memory(e):
            log.warning("CUDA out of memory in %s: %s", where, e)
            return self._out_of_memory(e)
        if is_sticky(e):
            self.dead_reason = f"CUDA error {cuda_error_code(e)} in {where}: {e}"
            log.critical("%s; the service reports not live", self.dead_reason)
            return ApiError("cuda_error", self.dead_reason)
        if isinstance(e, PoolError | ApiError):
            return e
        log.error("batch failed in %s: %s: %s", where, type(e).__name__, e, exc_info=e)
        return ApiError("internal_error", f"the batch failed in {where}: {type(e).__name__}: {e}")

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
        self.release_quietly(lease.id)

    def release_quietly(self, lease_id: str) -> None:
        """Give back a lease nobody will read; one that already ended is fine."""
        try:
            if self.pool is not None:
                self.pool.release(lease_id, reason="discarded")
        except PoolError:
            pass

    def _observe_batch(self, stats: BatchStats) -> None:
        if stats.size:
            self.metrics.batch_size.observe(stats.size)
        for w in stats.queue_wait_s:
            self.metrics.queue_seconds.observe(w)
        for stage, took in stats.stages.items():
            self.metrics.stage_seconds.labels(stage).observe(took)
        if stats.skipped:
            self.metrics.images.labels("abandoned").inc(stats.skipped)
