"""Helpers shared by the tests that run a real server: small settings, a server in a thread of
this process (``live_server``) or in a process of its own (``server_process``)."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from app.encoders.base import Encoder
from app.main import create_app
from app.settings import Settings
from bench.appserver import AppServer

ROOT = Path(__file__).resolve().parents[1]


def small_settings(tmp: Path, **overrides: Any) -> Settings:
    base: dict[str, Any] = dict(
        encoder="tiny-test",
        device="cpu",
        socket_path=tmp / "featpool.sock",
        host_pool_bytes=8 << 20,
        slab_bytes=4 << 20,
        inline_max_bytes=1 << 20,
        max_batch_wait_ms=2.0,
        reap_interval_s=0.01,
        decode_workers=2,
    )
    base.update(overrides)
    return Settings(**base)


@dataclass
class Live:
    url: str
    app: FastAPI

    def occupancy(self) -> tuple[int, int]:
        p = httpx.get(f"{self.url}/v1/pool", timeout=10).json()
        used = sum(t["used_bytes"] for t in p["tiers"]) + p["inline"]["used_bytes"]
        return used, int(p["leases_active"])


@contextmanager
def live_server(settings: Settings, *, encoder: Encoder | None = None) -> Iterator[Live]:
    """The app under uvicorn on 127.0.0.1 (ephemeral port), in a thread of this process."""
    app = create_app(settings, encoder=encoder)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = int(sock.getsockname()[1])
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: server.started or not thread.is_alive(), 30)
        assert server.started, "uvicorn did not start"
        yield Live(f"http://127.0.0.1:{port}", app)
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()


def wait_until(pred: Callable[[], object], timeout_s: float = 10.0, every_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(every_s)
    return bool(pred())


@contextmanager
def server_process(
    sock: Path, log: Path, *args: str
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``python -m app`` (tiny encoder, CPU) on a loopback port; its log goes to ``log``."""
    server = AppServer(
        ["--device", "cpu", "--encoder", "tiny-test", "--reap-interval-s", "0.01", *args],
        log,
        env={"FEATPOOL_SOCKET_PATH": str(sock), "FEATPOOL_HOST_POOL_BYTES": "16777216"},
        start_timeout_s=60,
    )
    try:
        yield server.url, server.proc
    finally:
        server.close()
