"""HTTP front processes (``--http-workers N``): each serves the same routes as the GPU process
(encode, leases, pool, health) with ``app.jobs.JobClient`` as their EngineClient: it parses
uploads, takes its admission permit, parses headers, and sends the images to the GPU process over
the job channel (their bytes through shared memory, ``--job-arena-bytes``: app/job_arena.py).
What is left (/metrics, the OpenAPI document) is forwarded to the GPU process's own HTTP server
on a Unix socket. A front imports neither torch nor the engine. One port, N processes: the GPU
process's interpreter is left to batching, launching and publishing.

Run by ``python -m app`` when ``--http-workers`` is above zero; not meant to be started alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import uvicorn
from fastapi import FastAPI, Request, Response

from app import errors, logs
from app.admission import entrance_state
from app.errors import ApiError
from app.http_protocol import http_protocol
from app.interpreter import GcClock, tune_collector
from app.jobs import JobClient, channel_paths
from app.metrics import HttpMetrics
from app.middleware import ServiceMiddleware
from app.routes import encode_router, ops, v1
from app.settings import Settings, resolve_batching

log = logging.getLogger(__name__)

# Hop-by-hop and length headers are the proxy's own business.
_SKIP = {
    "host",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "content-encoding",
    "upgrade",
    "te",
    "trailer",
    "proxy-connection",
}


def settings_env(settings: Settings) -> dict[str, str]:
    """The settings as FEATPOOL_* variables, so a child process builds the same Settings."""
    out = {}
    for name, dumped in settings.model_dump(mode="json").items():
        if dumped is None:
            continue
        field = getattr(settings, name)
        value = field.get_secret_value() if hasattr(field, "get_secret_value") else dumped
        out[f"FEATPOOL_{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    return out


OPEN_FDS_EVERY_S = 5.0


async def count_open_fds(metrics: HttpMetrics) -> None:
    """This front's open file descriptors, every few seconds, for the FD alert."""
    while True:
        with contextlib.suppress(OSError):
            metrics.front_open_fds.set(len(os.listdir("/proc/self/fd")))
        await asyncio.sleep(OPEN_FDS_EVERY_S)


def create_front_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    jobs_path, core_http = channel_paths(settings.socket_path)
    # Request metrics in prometheus_client's multiprocess files (PROMETHEUS_MULTIPROC_DIR, set
    # by the GPU process), which the GPU process's /metrics adds up.
    metrics = HttpMetrics(None)
    jobs = JobClient(jobs_path, settings.job_arena_bytes, metrics)
    core = httpx.AsyncClient(
        transport=httpx.AsyncHTTPTransport(uds=str(core_http)),
        base_url="http://featpool-gpu",
        timeout=60.0,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gc_clock = GcClock(metrics.front_gc_pause)
        gc_clock.install()
        # A front is a process of its own (python -m app.front).
        frozen = tune_collector(settings.gc_freeze, settings.gc_thresholds)
        log.info("front %d: gc: %d start-up objects frozen", os.getpid(), frozen)
        counting = asyncio.get_running_loop().create_task(count_open_fds(metrics))
        try:
            yield
        finally:
            counting.cancel()
            gc_clock.remove()
            app.state.inspector.shutdown()
            await jobs.close()
            await core.aclose()

    # The GPU process serves the OpenAPI document and the docs; forwarded like /metrics.
    app = FastAPI(lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.engine_client = jobs  # every engine call goes over the job channel
    # The GPU process resolves the batching defaults and hands them down; a front started on
    # its own serves a GPU process (fronts exist for one), so it assumes a GPU.
    resolve_batching(settings, cuda=True)
    entrance_state(app, settings)
    errors.install(app)
    app.include_router(encode_router)
    app.include_router(v1)
    app.include_router(ops)

    @app.api_route(
        "/{path:path}",
        methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"],
        include_in_schema=False,
    )
    async def forward(request: Request, path: str) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _SKIP}
        try:
            r = await core.request(
                request.method,
                "/" + path,
                params=request.query_params,
                headers=headers,
                content=await request.body(),
            )
        except httpx.TransportError as e:
            raise ApiError("not_ready", f"the GPU process is not reachable ({e})") from e
        except httpx.InvalidURL:  # a control character in the path: no route has one
            raise ApiError("not_found", f"no route for {request.url.path[:200]!r}") from None
        return Response(
            r.content,
            status_code=r.status_code,
            headers={
                k: v
                for k, v in r.headers.items()
                if k.lower() not in _SKIP and k.lower() != "x-request-id"
            },
        )

    app.add_middleware(
        ServiceMiddleware,
        metrics=app.state.metrics,
        max_body_bytes=settings.max_body_bytes,
        body_timeout_s=settings.body_timeout_s,
        min_body_bytes_per_s=settings.min_body_bytes_per_s,
    )
    return app


def listen_shared(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` that every front binds (SO_REUSEPORT): the kernel
    spreads new connections over the fronts by a hash of the connection. One socket shared by
    uvicorn's workers lets whichever process is first to accept take the connection instead:
    256 keep-alive connections landed 108 / 73 / 39 / 36 on four fronts, and the busiest one
    set the pace."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host.strip("[]"), port))
    except BaseException:
        sock.close()
        raise
    return sock


def main() -> None:
    """One front: its own listening socket on the shared port, one uvicorn server."""
    settings = Settings()
    logs.setup(settings.log_level, settings.log_json)
    sock = listen_shared(settings.host, settings.port)
    sock.listen(2048)
    config = uvicorn.Config(
        "app.front:create_front_app",
        factory=True,
        http=http_protocol(settings),
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=10,
    )
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    if os.environ.get("FEATPOOL_HTTP_WORKERS", "0") in ("", "0"):
        sys.exit("app.front is started by 'python -m app --http-workers N'")
    main()
