"""Faults: clients that go away mid-upload or mid-batch, a producer killed with SIGKILL under a
consumer, and a short run of the load test. Each must leave nothing behind: occupancy back to
zero, no active lease, and the service (or its successor) still answering.

(A consumer killed while holding leases is in tests/e2e/test_server_and_consumer.py.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from app.encoders import build_encoder
from app.engine_client import ImageIn
from app.main import create_app
from pool.client import FeatureClient
from pool.errors import PoolRestarted
from pool.leases import Lease
from tests.conftest import image_bytes
from tests.helpers import ROOT, live_server, server_process, small_settings, wait_until

JPEG = image_bytes("JPEG", size=(64, 48))


class SlowEncoder:
    """The tiny encoder, but each batch takes ``delay_s`` (or, with ``gate``, waits until the
    test opens it): requests pile up in the queue."""

    def __init__(self, delay_s: float, gate: threading.Event | None = None) -> None:
        self.inner = build_encoder("tiny-test", device=torch.device("cpu"))
        self.delay_s = delay_s
        self.gate = gate
        self.started = threading.Event()
        for name in ("name", "image_size", "mean", "std", "output_shape", "dtype", "device"):
            setattr(self, name, getattr(self.inner, name))

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        self.started.set()
        if self.gate is not None:
            self.gate.wait(10)
        else:
            time.sleep(self.delay_s)
        return self.inner.encode(pixels)

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        self.inner.warmup(batch_sizes)


def multipart_head(boundary: str, filename: str = "a.jpg") -> bytes:
    return (
        f'--{boundary}\r\nContent-Disposition: form-data; name="image"; '
        f'filename="{filename}"\r\nContent-Type: image/jpeg\r\n\r\n'
    ).encode()


def raw_request(port: int, body_len: int, ctype: str) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(
        (
            f"POST /v1/encode HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {body_len}\r\n\r\n"
        ).encode()
    )
    return s


# ---- clients that go away ---------------------------------------------------------------------


def test_client_disconnecting_mid_upload_leaks_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with live_server(small_settings(tmp_path)) as live:
        port = int(live.url.rsplit(":", 1)[1])
        body = multipart_head("bNd") + JPEG + b"\r\n--bNd--\r\n"
        for cut in (0, 10, len(body) // 3, len(body) - 5):
            # multipart, cut anywhere in the body; then a raw image body cut short
            s = raw_request(port, len(body), "multipart/form-data; boundary=bNd")
            s.sendall(body[:cut])
            s.close()
            s = raw_request(port, len(JPEG), "image/jpeg")
            s.sendall(JPEG[:cut])
            s.shutdown(socket.SHUT_WR)  # half-close, then go away
            s.close()
        # many parts, the connection dropped in the middle of the tenth
        s = raw_request(port, 64 * len(body), "multipart/form-data; boundary=bNd")
        s.sendall(
            b"".join(multipart_head("bNd", f"{i}.jpg") + JPEG + b"\r\n" for i in range(9))
            + multipart_head("bNd")
            + JPEG[:100]
        )
        s.close()
        engine = live.app.state.engine
        assert wait_until(lambda: engine.batcher.depth == 0)
        time.sleep(0.2)  # let the server notice every disconnect
        assert live.occupancy() == (0, 0)
        r = httpx.post(
            f"{live.url}/v1/encode",
            content=JPEG,
            headers={"content-type": "image/jpeg"},
            timeout=10,
        )
        assert r.status_code == 200
        assert (
            httpx.delete(f"{live.url}/v1/leases/{r.json()['items'][0]['lease_id']}").status_code
            == 204
        )
        assert live.occupancy() == (0, 0)
        metrics = httpx.get(f"{live.url}/metrics").text
        assert 'featpool_images_total{outcome="encoded"} 1.0' in metrics
        # A client that hangs up is not a server error: no 5xx counted, no bug logged.
        assert 'status_class="5xx"' not in metrics
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("prepare_threads", [1, 2])
def test_requests_cancelled_while_queued_or_encoding_leak_nothing(
    tmp_path: Path, prepare_threads: int
) -> None:
    """Cancel requests in the engine (as a dropped connection does to its handler task): those
    still queued or prepared are skipped, those whose batch is running have their leases
    released; with two prepare threads as with one."""
    gate = threading.Event()  # the first batch encodes until the cancels are in
    slow = SlowEncoder(0.0, gate)
    # A batch closes when it has two images (not sooner, at any decode order): the first is
    # tasks 0 and 1, sent before the others.
    settings = small_settings(
        tmp_path,
        max_batch_size=2,
        max_batch_wait_ms=500.0,
        queue_size=64,
        prepare_threads=prepare_threads,
    )
    app = create_app(settings, encoder=slow)
    engine = app.state.engine

    def request() -> asyncio.Task[list[Lease]]:
        return asyncio.create_task(engine.encode([ImageIn("i", JPEG)], None))

    async def scenario() -> tuple[list[Any], dict[str, Any]]:
        await engine.start()
        try:
            tasks = [request(), request()]
            assert await asyncio.to_thread(slow.started.wait, 10)  # the first batch is encoding
            tasks += [request() for _ in range(6)]
            await asyncio.sleep(0.05)
            for t in tasks[1:]:  # tasks[0] and [1]'s batch runs; the rest are queued or prepared
                t.cancel()
            await asyncio.sleep(0.05)  # the cancelled handlers drop their queued items
            gate.set()
            done = await asyncio.gather(*tasks, return_exceptions=True)
            for _ in range(200):  # every batch has ended; their orphan leases are released
                if not engine.batcher._running and engine.pool.stats()["leases_active"] <= 1:
                    break
                await asyncio.sleep(0.01)
            stats = engine.pool.stats()
            for lease in done:
                if not isinstance(lease, BaseException):
                    for lz in lease:
                        engine.pool.release(lz.id)
            return done, stats
        finally:
            await engine.stop()

    done, stats = asyncio.run(scenario())
    assert not isinstance(done[0], BaseException) and len(done[0]) == 1
    assert all(isinstance(d, asyncio.CancelledError) for d in done[1:])
    assert stats["leases_active"] == 1  # only the request that was not cancelled
    assert stats["created"].get("host", 0) <= 2  # the queued six were never encoded


def test_client_hanging_up_while_queued_leaks_nothing(tmp_path: Path) -> None:
    """Over real HTTP: requests whose clients hang up while their images wait behind a slow
    batch must not leave leases behind (not even until their TTL)."""
    slow = SlowEncoder(0.5)
    with live_server(
        small_settings(tmp_path, max_batch_size=1, queue_size=64), encoder=slow
    ) as live:
        port = int(live.url.rsplit(":", 1)[1])
        socks = []
        for _ in range(4):
            s = raw_request(port, len(JPEG), "image/jpeg")
            s.sendall(JPEG)
            socks.append(s)
        assert slow.started.wait(5)
        time.sleep(0.1)
        for s in socks:
            s.close()
        engine = live.app.state.engine
        assert wait_until(lambda: engine.batcher.depth == 0, 10)
        # Whatever was encoded for a client that left is released at once, not at its TTL.
        assert wait_until(lambda: live.occupancy() == (0, 0), 5), live.occupancy()


# ---- the producer dies -------------------------------------------------------------------------


def test_producer_sigkill_consumer_keeps_data_and_reattaches(tmp_path: Path) -> None:
    sock, log = tmp_path / "featpool.sock", tmp_path / "server.log"
    with server_process(sock, log) as (url, proc):
        r = httpx.post(f"{url}/v1/encode", content=JPEG, headers={"content-type": "image/jpeg"})
        assert r.status_code == 200
        old = r.json()["items"][0]
        client = FeatureClient.connect(sock)
        try:
            view = client.open(old)
            before = view.clone()
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            assert proc.returncode == -signal.SIGKILL
            # The producer is gone; the consumer's mapping of its memfd slab is not.
            assert torch.equal(view, before)
            assert float(view.float().abs().sum()) > 0
            with pytest.raises(PoolRestarted):
                client.lookup(old["lease_id"])
            assert sock.exists()  # SIGKILL left the socket file behind
            with server_process(sock, log) as (url2, _):
                new = httpx.post(
                    f"{url2}/v1/encode", content=JPEG, headers={"content-type": "image/jpeg"}
                ).json()["items"][0]
                assert new["epoch"] != old["epoch"]
                client.reattach()
                assert client.epoch == new["epoch"]
                with pytest.raises(PoolRestarted, match="epoch"):
                    client.open(old)
                fresh = client.open(new)
                assert torch.allclose(fresh, before)  # same image, same features
                client.release(new)
                assert wait_until(
                    lambda: httpx.get(f"{url2}/v1/pool").json()["leases_active"] == 0, 5
                )
                assert torch.equal(view, before)  # the old mapping still outlives it all
        finally:
            client.close()


# ---- a short load test ---------------------------------------------------------------------------


def test_short_load_test_sees_429s_and_leaks_nothing(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    r = subprocess.run(
        [
            sys.executable,
            "bench/load_test.py",
            "--duration",
            "8",
            "--clients",
            "24",
            "--queue-size",
            "4",
            "--json",
            str(out),
            "--socket-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["status_counts"].get("200", 0) > 0
    assert res["status_counts"].get("429", 0) > 0  # overload is turned away, not queued
    assert not [s for s in res["status_counts"] if s.startswith("5")]
    assert res["final_occupancy"] == {"used_bytes": 0, "leases_active": 0}
    assert res["max_queue_depth"] <= 4
    # about one a second, fewer on a saturated machine: enough for the RSS check's thirds
    assert res["samples"] >= 3
