"""The entrance: the EngineClient boundary (fronts load no torch), admission before any decode,
header parsing off the event loop, bounded thread pools, and the permit given back on every
path."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

import app.engine
import app.routes
from app.admission import Admission, BoundedExecutor
from app.engine_client import EncodeOptions, FeatureQuery, ImageIn
from app.errors import ApiError
from app.imaging import inspect
from app.jobs import JobClient, channel_paths
from tests.conftest import image_bytes
from tests.helpers import ROOT, live_server, small_settings, wait_until
from tests.test_faults import JPEG, SlowEncoder, raw_request

# A valid JPEG with 2 MiB of empty COM segments before its frame header: Pillow walks them one
# by one in Python (the 11 MiB version kept the event loop busy for 5.6 s).
HOSTILE_JPEG = JPEG[:2] + b"\xff\xfe\x00\x02" * (1 << 19) + JPEG[2:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- the boundary -----------------------------------------------------------------------------


def test_a_front_process_imports_neither_torch_nor_the_engine(tmp_path: Path) -> None:
    """A front (``python -m app.front``, as ``--http-workers`` starts it) serves encode, lease
    and health requests without ever importing torch, the engine or the pool's torch modules
    (``-X importtime`` lists every module the process imported, whenever it did)."""
    port = free_port()
    env = {
        **os.environ,
        "FEATPOOL_HTTP_WORKERS": "1",
        "FEATPOOL_HOST": "127.0.0.1",
        "FEATPOOL_PORT": str(port),
        "FEATPOOL_SOCKET_PATH": str(tmp_path / "featpool.sock"),
        "PYTHONUNBUFFERED": "1",
    }
    err = tmp_path / "importtime.txt"
    with open(err, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-X", "importtime", "-m", "app.front"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=out,
        )
    url = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            try:
                return httpx.get(f"{url}/health/live", timeout=2).status_code == 503
            except httpx.HTTPError:
                return False

        assert wait_until(up, 60), err.read_text()[-2000:]
        # No GPU process behind it: each request goes through the front's routes, entrance
        # and job client, and ends in 503 not_ready.
        r = httpx.post(f"{url}/v1/encode", content=JPEG, headers={"content-type": "image/jpeg"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "not_ready", r.text
        r = httpx.post(f"{url}/v1/encode", content=b"junk", headers={"content-type": "image/png"})
        assert r.status_code == 400  # the header is read in the front
        for path in ("/v1/leases/" + "0" * 32, "/v1/pool", "/health/ready"):
            assert httpx.get(url + path, timeout=10).status_code == 503
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    modules = {
        line.rsplit("|", 1)[1].strip()
        for line in err.read_text().splitlines()
        if line.startswith("import time:") and "|" in line
    }
    assert "app.routes" in modules and "app.jobs" in modules  # the trace worked
    heavy = {
        m
        for m in modules
        if m.split(".")[0] in ("torch", "safetensors", "transformers")
        or m in ("app.engine", "app.inprocess", "pool.featurepool", "pool.client")
    }
    assert heavy == set()


def test_routes_reach_the_engine_only_through_the_client() -> None:
    """app.routes names no engine, pool or torch module."""
    src = Path(app.routes.__file__).read_text()
    imports = [ln for ln in src.splitlines() if ln.startswith(("import ", "from "))]
    assert not [ln for ln in imports if "engine import" in ln or "torch" in ln]
    assert not [ln for ln in imports if ln.startswith("from pool.") and "descriptor" not in ln]


# ---- admission before work --------------------------------------------------------------------


def test_overload_is_refused_before_any_decode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst against a slow encoder: every 429 comes before its image was decoded (on main
    before the entrance, each was decoded, then refused by the batcher's queue)."""
    slow = SlowEncoder(0.3)
    # The same bytes every time: with the feature index on, repeats would skip decoding.
    settings = small_settings(tmp_path, max_batch_size=1, queue_size=4, feature_cache_entries=0)
    with live_server(settings, encoder=slow) as live:
        engine = live.app.state.engine
        decoded: list[str] = []
        real = engine._decode

        def counting(label: str, data: bytes, size: int) -> Any:
            decoded.append(label)
            return real(label, data, size)

        engine._decode = counting
        statuses: dict[str, int] = {}

        def post(name: str) -> None:
            r = httpx.post(
                f"{live.url}/v1/encode",
                files={"image": (name, JPEG, "image/jpeg")},
                timeout=60,
            )
            statuses[name] = r.status_code
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"]["type"] == "queue_full"
            elif r.status_code == 200:
                httpx.delete(f"{live.url}/v1/leases/{r.json()['items'][0]['lease_id']}")

        threads = [threading.Thread(target=post, args=(f"r{i}.jpg",)) for i in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        refused = {n for n, s in statuses.items() if s == 429}
        ok = {n for n, s in statuses.items() if s == 200}
        assert refused and ok and len(refused) + len(ok) == 24, statuses
        names = {label.split("(")[1].rstrip(")") for label in decoded}
        assert names & refused == set()  # images decoded for requests then refused: 0
        assert names == ok
        metrics = httpx.get(f"{live.url}/metrics").text
        assert f'featpool_admission_images_total{{outcome="refused"}} {len(refused)}.0' in metrics
        assert f'featpool_admission_images_total{{outcome="admitted"}} {len(ok)}.0' in metrics


def test_health_answers_while_a_hostile_header_is_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The header parse runs on the inspector's threads: liveness and other requests are
    answered while it runs. (Held open by a gate so that the test does not depend on timing.)"""
    started, gate = threading.Event(), threading.Event()

    def held_inspect(data: bytes, **kw: Any) -> Any:
        started.set()
        header = inspect(data, **kw)  # the real parse of the hostile bytes
        gate.wait(30)
        return header

    monkeypatch.setattr(app.routes, "inspect", held_inspect)
    with live_server(small_settings(tmp_path)) as live:
        result: dict[str, Any] = {}

        def post() -> None:
            r = httpx.post(
                f"{live.url}/v1/encode",
                content=HOSTILE_JPEG,
                headers={"content-type": "image/jpeg"},
                timeout=60,
            )
            result["status"] = r.status_code

        t = threading.Thread(target=post)
        t.start()
        try:
            assert started.wait(30)
            r = httpx.get(f"{live.url}/health/live", timeout=10)
            assert r.status_code == 200 and r.json() == {"status": "alive"}
            assert httpx.get(f"{live.url}/v1/pool", timeout=10).status_code == 200
            assert "status" not in result  # the hostile request is still being inspected
        finally:
            gate.set()
            t.join(60)
        assert result["status"] == 200  # a valid image after all, only slow to parse


def test_the_content_digest_is_taken_beside_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each upload's SHA-256 (the feature index's key) is taken on the inspector's threads
    with its header, not on the event loop that parses every other request; the engine then
    uses that digest instead of hashing the bytes again."""
    taken: list[tuple[str, bytes]] = []

    def recorded(data: Any) -> bytes:
        digest = hashlib.sha256(data).digest()
        taken.append((threading.current_thread().name, digest))
        return digest

    monkeypatch.setattr(app.routes, "content_digest", recorded, raising=False)
    monkeypatch.setattr(app.engine, "content_digest", recorded)
    with live_server(small_settings(tmp_path)) as live:
        r = httpx.post(
            f"{live.url}/v1/encode",
            content=JPEG,
            headers={"content-type": "image/jpeg"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
    assert taken == [(taken[0][0], hashlib.sha256(JPEG).digest())]  # once, of the upload
    assert taken[0][0].startswith("featpool-inspect")


def test_the_inspector_queue_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With every header thread busy and the queue full, the next request gets 429 at once."""
    gate = threading.Event()
    monkeypatch.setattr(
        app.routes, "inspect", lambda data, **kw: (gate.wait(30), inspect(data, **kw))[1]
    )
    settings = small_settings(tmp_path, decode_workers=1, queue_size=2, feature_cache_entries=0)
    with live_server(settings) as live:
        results: list[int] = []

        def post() -> None:
            r = httpx.post(
                f"{live.url}/v1/encode",
                content=JPEG,
                headers={"content-type": "image/jpeg"},
                timeout=60,
            )
            results.append(r.status_code)

        threads = [threading.Thread(target=post) for _ in range(2)]
        for t in threads:
            t.start()
        inspector = live.app.state.inspector
        assert wait_until(lambda: inspector.pending == 2, 10)
        r = httpx.post(
            f"{live.url}/v1/encode", content=JPEG, headers={"content-type": "image/jpeg"}
        )
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        gate.set()
        for t in threads:
            t.join(60)
        assert sorted(results) == [200, 200]
        assert inspector.pending == 0


# ---- the permit comes back on every path ------------------------------------------------------


def test_permit_is_released_on_success_error_and_hang_up(tmp_path: Path) -> None:
    gate = threading.Event()
    slow = SlowEncoder(0.0, gate)
    settings = small_settings(tmp_path, max_batch_size=1, feature_cache_entries=0)
    with live_server(settings, encoder=slow) as live:
        admission: Admission = live.app.state.admission

        def held() -> tuple[int, int]:
            return admission.images, admission.bytes

        def post(body: bytes) -> httpx.Response:
            return httpx.post(
                f"{live.url}/v1/encode", content=body, headers={"content-type": "image/jpeg"}
            )

        # Errors: unreadable header; header fine but the pixels do not decode.
        assert post(b"\xff\xd8\xff\xe0 not a jpeg").status_code == 400
        assert held() == (0, 0)
        truncated = image_bytes("JPEG", size=(640, 480))[:-2000]
        assert post(truncated).status_code == 400
        assert held() == (0, 0)

        # Held while the work runs, for the images and their decoded bytes; then given back.
        port = int(live.url.rsplit(":", 1)[1])
        socks = []
        for _ in range(3):
            s = raw_request(port, len(JPEG), "image/jpeg")
            s.sendall(JPEG)
            socks.append(s)
        assert slow.started.wait(10)
        assert wait_until(lambda: held() == (3, 3 * 64 * 48 * 3), 10), held()
        metrics = httpx.get(f"{live.url}/metrics").text
        assert "featpool_admission_in_flight_images 3.0" in metrics
        for s in socks:  # the clients hang up: queued and encoding alike
            s.close()
        gate.set()
        assert wait_until(lambda: held() == (0, 0), 10), held()
        assert wait_until(lambda: live.occupancy() == (0, 0), 10)

        r = post(JPEG)  # and after a success
        assert r.status_code == 200
        assert held() == (0, 0)
        metrics = httpx.get(f"{live.url}/metrics").text
        assert "featpool_admission_in_flight_images 0.0" in metrics
        assert "featpool_admission_in_flight_decoded_bytes 0.0" in metrics


def test_the_gpu_process_bounds_all_fronts_together(tmp_path: Path) -> None:
    """Behind fronts, encode jobs take a permit of the GPU process's own Admission: when the
    fronts together bring more than it admits, the job is refused (429) before any decode."""
    settings = small_settings(tmp_path, http_workers=1, queue_size=2, feature_cache_entries=0)
    with live_server(settings) as live:
        engine = live.app.state.engine
        decoded: list[str] = []
        real = engine._decode
        engine._decode = lambda label, data, size: (decoded.append(label), real(label, data, size))[
            1
        ]
        admission: Admission = live.app.state.admission
        jobs_path, _ = channel_paths(settings.socket_path)
        header = inspect(JPEG, max_pixels=10**8, max_bytes=1 << 30)

        async def scenario() -> None:
            client = JobClient(jobs_path)
            try:
                with admission.try_acquire(2):  # other fronts' work holds the room
                    with pytest.raises(ApiError) as e:
                        await client.encode([ImageIn("x", JPEG, header)], EncodeOptions())
                    assert e.value.type == "queue_full"
                    assert e.value.headers == {"Retry-After": "1"}
                assert decoded == []
                [lease] = await client.encode([ImageIn("y", JPEG, header)], EncodeOptions())
                assert (await client.lease(lease.lease_id)).slot == lease.slot
                assert (await client.tensor(lease.lease_id))[:8]  # a safetensors file
                assert (await client.renew(lease.lease_id, 30.0)).ttl_s == 30.0
                assert (await client.pool_info())["leases_active"] == 1
                await client.release(lease.lease_id)
                with pytest.raises(ApiError) as gone:
                    await client.lease(lease.lease_id)
                assert gone.value.status == 410  # the error table's kinds travel the channel
                assert (await client.health()).ready
            finally:
                await client.close()

        asyncio.run(scenario())
        assert decoded == ["y"]
        assert (admission.images, admission.bytes) == (0, 0)


# ---- the parts ---------------------------------------------------------------------------------


def test_admission_bounds() -> None:
    a = Admission(max_images=4, max_bytes=1000)
    p = a.try_acquire(3, 600)
    with pytest.raises(ApiError) as e:
        a.try_acquire(2)
    assert e.value.status == 429 and e.value.headers == {"Retry-After": "1"}
    q = a.try_acquire(1)
    with pytest.raises(ApiError) as e:
        q.grow(500)  # fits alone, not beside p: retry later
    assert e.value.status == 429
    with pytest.raises(ApiError) as e:
        q.grow(1001)  # never fits: 413
    assert e.value.status == 413
    with pytest.raises(ApiError) as e:
        a.try_acquire(5)
    assert e.value.status == 413
    p.release()
    p.release()  # idempotent
    q.grow(900)
    assert (a.images, a.bytes) == (1, 900)
    q.release()
    assert (a.images, a.bytes) == (0, 0)
    with pytest.raises(ApiError):
        a.try_acquire(1, 2000)
    assert (a.images, a.bytes) == (0, 0)  # a refused grow gives the images back too


def test_bounded_executor_counts_a_call_until_its_thread_is_done() -> None:
    gate = threading.Event()

    async def scenario() -> None:
        ex = BoundedExecutor(1, 2, "t")
        first = asyncio.ensure_future(ex.run(gate.wait, 10))
        second = asyncio.ensure_future(ex.run(time.sleep, 0))
        await asyncio.sleep(0.05)
        with pytest.raises(ApiError) as e:
            await ex.run(time.sleep, 0)
        assert e.value.type == "queue_full"
        first.cancel()  # its caller went away; its thread still runs
        await asyncio.sleep(0.05)
        assert ex.pending == 2
        gate.set()
        await second
        for _ in range(100):
            if ex.pending == 0:
                break
            await asyncio.sleep(0.01)
        assert ex.pending == 0
        ex.shutdown()

    asyncio.run(scenario())


def test_a_lease_answered_to_a_front_that_went_away_is_released(tmp_path: Path) -> None:
    """A front's connection closes while the GPU process makes a lease_features lease for it
    (slowed here): the answer cannot be written, and its lease goes back at once, as an encode
    answer's do, instead of living until its TTL of an hour."""
    settings = small_settings(tmp_path, http_workers=1)
    with live_server(settings) as live:
        r = httpx.post(
            f"{live.url}/v1/encode", content=JPEG, headers={"content-type": "image/jpeg"}
        )
        ref = r.json()["items"][0]["feature_hash"]
        gpu = live.app.state.engine_client
        real = gpu.lease_features

        async def slow(q: FeatureQuery, ttl_s: float | None) -> Any:
            await asyncio.sleep(0.5)
            return await real(q, ttl_s)

        gpu.lease_features = slow
        jobs_path, _ = channel_paths(settings.socket_path)

        async def scenario() -> None:
            client = JobClient(jobs_path)
            job = asyncio.create_task(client.lease_features(FeatureQuery("", ref), 3600.0))
            await asyncio.sleep(0.2)  # the job is in the GPU process
            await client.close()  # the front goes away
            with pytest.raises(ApiError):
                await job

        asyncio.run(scenario())
        pool = live.app.state.engine.pool
        assert wait_until(lambda: sum(pool.stats()["created"].values()) == 2, 5)
        assert wait_until(lambda: pool.stats()["leases_active"] == 1, 5), pool.stats()


Start = Callable[[], "asyncio.Task[Any]"]


def cancelled_encode_gives_its_lease_back(
    tmp_path: Path, hang_up: Callable[[JobClient, Start], Awaitable[None]]
) -> None:
    """A front's JobClient, connected to a live server, hands ``hang_up`` a way to start one
    encode (its lease's TTL an hour), which ``hang_up`` cancels as a client's hang-up would:
    the lease must go back at once, not live until its TTL."""
    settings = small_settings(tmp_path, http_workers=1, feature_cache_entries=0)
    with live_server(settings) as live:
        jobs_path, _ = channel_paths(settings.socket_path)
        header = inspect(JPEG, max_pixels=10**8, max_bytes=1 << 30)
        pool = live.app.state.engine.pool

        async def scenario() -> None:
            client = JobClient(jobs_path)
            try:
                assert (await client.health()).ready  # connected
                assert client._conn is not None
                options = EncodeOptions(ttl_s=3600.0)
                await hang_up(
                    client,
                    lambda: asyncio.create_task(
                        client.encode([ImageIn("x", JPEG, header)], options)
                    ),
                )
                await asyncio.sleep(0.5)  # the answer comes, the discard goes out
            finally:
                await client.close()

        asyncio.run(scenario())
        assert sum(pool.stats()["created"].values()) == 1
        assert wait_until(lambda: pool.stats()["leases_active"] == 0, 5), pool.stats()


def test_an_answer_that_comes_as_its_request_is_cancelled_gives_its_leases_back(
    tmp_path: Path,
) -> None:
    """The client hangs up in the very loop turn its answer comes in: the front's read loop has
    handed the answer over, and the request is cancelled before it reads it."""

    async def in_the_answers_turn(client: JobClient, start: Start) -> None:
        request: list[asyncio.Task[Any]] = []

        class Answered:  # the read loop's hold on the request's future
            def __init__(self, fut: asyncio.Future[Any]) -> None:
                self.fut = fut

            def done(self) -> bool:
                return self.fut.done()

            def set_result(self, answer: Any) -> None:
                self.fut.set_result(answer)
                request[0].cancel()  # the hang-up, in the same turn

        class Waiting(dict[int, Any]):
            def pop(self, job: int, default: Any = None) -> Any:
                fut = super().pop(job, default)
                return Answered(fut) if fut is not None else None

        assert client._conn is not None
        client._conn.waiting = Waiting()
        request.append(start())
        with pytest.raises(asyncio.CancelledError):
            await request[0]

    cancelled_encode_gives_its_lease_back(tmp_path, in_the_answers_turn)


def test_a_request_cancelled_while_its_job_drains_gives_its_leases_back(tmp_path: Path) -> None:
    """The client hangs up while the front still waits for its job to drain to the GPU process
    (a large upload, a full socket buffer): the job is on its way and will be answered."""

    async def while_it_drains(client: JobClient, start: Start) -> None:
        assert client._conn is not None
        writer = client._conn.writer
        real_drain, drained = writer.drain, asyncio.Event()

        async def stalled_once() -> None:  # as a full transport buffer would
            await real_drain()
            if not drained.is_set():
                drained.set()
                await asyncio.sleep(3600)

        writer.drain = stalled_once  # type: ignore[method-assign]
        request = start()
        await drained.wait()
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request

    cancelled_encode_gives_its_lease_back(tmp_path, while_it_drains)
