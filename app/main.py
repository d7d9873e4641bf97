"""The app factory. Nothing heavy happens at import; the lifespan builds pool -> encoder ->
batcher before the first request and tears them down in reverse."""

from __future__ import annotations

import logging
import platform
import shutil
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
from fastapi import FastAPI

from app import errors
from app.encoders.base import Encoder
from app.engine import Engine
from app.jobs import JobServer, channel_paths
from app.metrics import Metrics
from app.middleware import ServiceMiddleware
from app.routes import encode_router, ops, v1
from app.settings import Settings
from pool.descriptor import LeaseDescriptor

log = logging.getLogger(__name__)


def package_version() -> str:
    try:
        return version("featpool")
    except PackageNotFoundError:
        return "0+unknown"


def create_app(
    settings: Settings | None = None,
    *,
    encoder: Encoder | None = None,
    front_metrics_dir: Path | None = None,
) -> FastAPI:
    """Build the service. ``encoder`` replaces the configured one (tests pass a fake);
    ``front_metrics_dir`` is where HTTP front processes keep their request metrics."""
    settings = settings or Settings()
    metrics = Metrics(front_metrics_dir)
    engine = Engine(settings, metrics, encoder)

    async def encode_images(
        images: Sequence[tuple[str, bytes]],
        ttl_s: float | None,
        pooled: bool,
        dtype: str | None,
        *,
        scope: str = "",
        ids: Sequence[str | None] | None = None,
    ) -> list[LeaseDescriptor]:
        published = await engine.encode_cached(
            images,
            ttl_s,
            pooled=pooled,
            dtype=getattr(torch, dtype) if dtype else None,
            scope=scope,
            ids=ids,
        )
        assert engine.pool is not None
        return [engine.describe_published(p) for p in published]

    # With --http-workers, front processes send encode jobs over this channel.
    jobs = (
        JobServer(channel_paths(settings.socket_path)[0], encode_images, engine.release_quietly)
        if settings.http_workers > 0
        else None
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        assert engine.caps is not None and engine.encoder is not None
        metrics.build_info.labels(
            package_version(),
            torch.__version__,
            torch.version.cuda or "none",
            engine.caps.transport,
            engine.encoder.name,
            str(engine.device),
        ).set(1)
        metrics.watch_feature_index(engine.index.stats)
        metrics.ready.set_function(lambda: float(engine.ready and not engine.dead_reason))
        metrics.queue_depth.set_function(
            lambda: float(engine.batcher.depth if engine.batcher else 0)
        )
        if jobs is not None:
            await jobs.start()
        log_startup(settings, engine)
        try:
            yield
        finally:
            if jobs is not None:
                await jobs.stop()
            await engine.stop()
            if front_metrics_dir is not None:  # made for this run by `python -m app`
                shutil.rmtree(front_metrics_dir, ignore_errors=True)

    app = FastAPI(
        title="featpool",
        version=package_version(),
        lifespan=lifespan,
        description="GPU feature transport: encode images, lease the features, map "
        "them zero-copy from another process.",
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.engine = engine
    app.state.encode_images = encode_images
    errors.install(app)
    app.include_router(encode_router)
    app.include_router(v1)
    app.include_router(ops)
    app.add_middleware(ServiceMiddleware, metrics=metrics, max_body_bytes=settings.max_body_bytes)
    return app


def log_startup(settings: Settings, engine: Engine) -> None:
    """One line: the settings that differ from the defaults, and what the machine can do."""
    defaults = Settings.model_construct()
    changed = {
        k: ("***" if "key" in k or "token" in k else v)
        for k, v in settings.model_dump().items()
        if k != "socket_path" and v != getattr(defaults, k, None)
    }
    caps = engine.caps
    log.info(
        "featpool %s ready: device=%s transport=%s encoder=%s output=%s socket=%s "
        "vmm=%s posix_fd=%s fabric=%s%s python=%s torch=%s non-default settings=%s",
        package_version(),
        engine.device,
        caps.transport if caps else "?",
        engine.encoder.name if engine.encoder else "?",
        list(engine.encoder.output_shape) if engine.encoder else "?",
        settings.socket_path,
        caps.vmm if caps else False,
        caps.posix_fd if caps else False,
        caps.fabric if caps else False,
        f" ({caps.fabric_reason})" if caps and caps.fabric_reason else "",
        platform.python_version(),
        torch.__version__,
        changed,
    )
