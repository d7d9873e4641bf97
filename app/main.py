"""The app factory. Nothing heavy happens at import; the lifespan builds encoder -> pool ->
batcher before the first request and tears them down in reverse."""

from __future__ import annotations

import asyncio
import gc
import logging
import platform
import shutil
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
from fastapi import FastAPI

from app import errors
from app.admission import entrance_state
from app.encoders.base import Encoder
from app.engine import Engine
from app.inprocess import InProcessEngineClient
from app.interpreter import GcClock, tune_collector
from app.jobs import JobServer, channel_paths
from app.metrics import Metrics
from app.middleware import ServiceMiddleware
from app.routes import encode_router, metrics_router, ops, v1
from app.settings import Settings
from pool import discovery

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
    tune_gc: bool = False,
    stop_fronts: Callable[[], None] | None = None,
) -> FastAPI:
    """Build the service. ``encoder`` replaces the configured one (tests pass a fake);
    ``front_metrics_dir`` is where HTTP front processes keep their request metrics;
    ``stop_fronts`` (blocking) stops them, each answering what it has in flight, when this
    process is asked to stop: before the job channel closes, which would fail those jobs;
    ``tune_gc``: once started, apply ``gc_freeze`` and ``gc_thresholds`` to the process
    (``python -m app`` owns the process; tests that build many apps in one do not)."""
    settings = settings or Settings()
    metrics = Metrics(front_metrics_dir)
    engine = Engine(settings, metrics, encoder)

    client = InProcessEngineClient(engine)

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
            engine.decoder_name,
        ).set(1)
        metrics.watch_feature_index(engine.index.stats)
        metrics.ready.set_function(lambda: float(engine.ready and not engine.dead_reason))
        metrics.queue_depth.set_function(
            lambda: float(engine.batcher.depth if engine.batcher else 0)
        )
        try:
            # The socket directory's index: consumers find this server by its GPU from now on.
            entry = discovery.publish(
                settings.socket_path,
                gpu_uuid=published_gpu_uuid(settings, engine.device),
                device=engine.device.type,
                transport=engine.caps.transport,
                http=settings.advertised_url(),
            )
        except BaseException:
            await engine.stop()
            raise
        metrics.admitted_images.set_function(lambda: float(app.state.admission.images))
        metrics.admitted_bytes.set_function(lambda: float(app.state.admission.bytes))
        # With --http-workers, front processes send their engine calls over this channel;
        # encode jobs take a permit of the same Admission as this process's own routes.
        jobs = (
            JobServer(
                channel_paths(settings.socket_path)[0],
                client,
                app.state.admission,
                metrics.job_seconds,
            )
            if settings.http_workers > 0
            else None
        )
        if jobs is not None:
            await jobs.start()
        gc_clock = GcClock(metrics.gc_pause)
        gc_clock.install()
        if tune_gc:
            frozen = tune_collector(settings.gc_freeze, settings.gc_thresholds)
            log.info("gc: %d start-up objects frozen, thresholds %s", frozen, gc.get_threshold())
        log_startup(settings, engine)
        try:
            yield
        finally:
            gc_clock.remove()
            entry.close()  # first: new consumers go to another server while this one drains
            if stop_fronts is not None:  # they drain through the job channel, still open
                await asyncio.to_thread(stop_fronts)
            if jobs is not None:
                await jobs.stop()
            await engine.stop()
            app.state.inspector.shutdown()
            if front_metrics_dir is not None:  # made for this run by `python -m app`
                shutil.rmtree(front_metrics_dir, ignore_errors=True)

    app = FastAPI(
        title="featpool",
        version=package_version(),
        lifespan=lifespan,
        description="GPU feature transport: encode images, lease the features, map "
        "them zero-copy from another process.",
    )
    entrance_state(app, settings)
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.engine = engine  # for tests and start-up logs; routes use engine_client only
    app.state.engine_client = client
    errors.install(app)
    app.include_router(encode_router)
    app.include_router(v1)
    app.include_router(ops)
    app.include_router(metrics_router)
    app.add_middleware(
        ServiceMiddleware,
        metrics=metrics,
        max_body_bytes=settings.max_body_bytes,
        body_timeout_s=settings.body_timeout_s,
        min_body_bytes_per_s=settings.min_body_bytes_per_s,
    )
    return app


def published_gpu_uuid(settings: Settings, device: torch.device) -> str | None:
    """The GPU this server announces: the CUDA device's own UUID, or on CPU the configured
    ``gpu_uuid`` (a host-tier server has no GPU of its own; tests use a made-up one)."""
    if device.type != "cuda":
        return settings.gpu_uuid
    actual = discovery.normalize_uuid(str(torch.cuda.get_device_properties(device).uuid))
    if settings.gpu_uuid and discovery.normalize_uuid(settings.gpu_uuid) != actual:
        raise RuntimeError(
            f"--gpu-uuid {settings.gpu_uuid} (FEATPOOL_GPU_UUID) is not the GPU this server "
            f"runs on ({device}: {actual}); drop it or fix it"
        )
    return actual


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
        list(getattr(engine.encoder, "output_shape", ())) or "?",
        settings.socket_path,
        caps.vmm if caps else False,
        caps.posix_fd if caps else False,
        caps.fabric if caps else False,
        f" ({caps.fabric_reason})" if caps and caps.fabric_reason else "",
        platform.python_version(),
        torch.__version__,
        changed,
    )
