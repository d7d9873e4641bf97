"""``--http-workers N``: front processes on the public port, the GPU process behind them. The
same API as one process, leases usable by consumers, errors unchanged, and nothing left running
when the server stops."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import image_bytes
from tests.e2e.test_server_and_consumer import CONSUMER
from tests.helpers import ROOT, server_process, wait_until

pytestmark = pytest.mark.e2e


def children_of(pid: int) -> set[int]:
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.add(int(d.name))
    return out


def descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        kids = children_of(todo.pop())
        found |= kids
        todo += kids
    return found


def front_pids(pid: int) -> set[int]:
    return {
        p
        for p in children_of(pid)
        if b"app.front" in Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")
    }


def established_on(port: int, pid: int) -> int:
    """How many established TCP connections on local ``port`` process ``pid`` holds."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "01":
                    inodes.add(f[9])
    held = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            link = os.readlink(fd)
            if link.startswith("socket:[") and link[8:-1] in inodes:
                held += 1
    return held


@pytest.fixture
def fronted(tmp_path: Path) -> Iterator[tuple[str, Path, subprocess.Popen[bytes]]]:
    sock = tmp_path / "featpool.sock"
    args = ("--http-workers", "2", "--max-body-bytes", "200000")
    with server_process(sock, tmp_path / "server.log", *args) as (url, proc):
        yield url, sock, proc


def test_fronts_serve_the_same_api(fronted: tuple[str, Path, subprocess.Popen[bytes]]) -> None:
    url, sock, proc = fronted
    assert len(front_pids(proc.pid)) == 2
    for private in (".jobs", ".http"):  # the channels to the GPU process: this user only
        assert (sock.with_name(sock.name + private).stat().st_mode & 0o777) == 0o600
    r = httpx.post(
        f"{url}/v1/encode",
        files=[
            ("image", ("a.jpg", image_bytes("JPEG", size=(64, 48)), "image/jpeg")),
            ("image", ("b.png", image_bytes("PNG", seed=2), "image/png")),
        ],
    )
    assert r.status_code == 200, r.text
    leases = r.json()["items"]
    assert [x["shape"] for x in leases] == [[17, 64], [17, 64]]

    # Errors keep their status and shape through the front.
    bad = httpx.post(
        f"{url}/v1/encode", content=b"nope" * 10, headers={"content-type": "image/jpeg"}
    )
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_image"
    big = httpx.post(
        f"{url}/v1/encode", content=b"\xff" * 300_000, headers={"content-type": "image/jpeg"}
    )
    assert big.status_code == 413 and big.json()["error"]["type"] == "payload_too_large"
    assert httpx.get(f"{url}/v1/leases/nope").status_code == 404
    for odd in ("/%00", "/x%7f", "/docs%09"):  # no route; forwarding them was a 500
        r = httpx.get(f"{url}{odd}")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found", (odd, r.text)
    assert "/v1/encode" in httpx.get(f"{url}/openapi.json").json()["paths"]

    # A consumer maps them through the hand-off socket as usual.
    done = subprocess.run(
        [sys.executable, "-c", CONSUMER, str(sock), json.dumps(leases)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    deadline = time.monotonic() + 5
    while httpx.get(f"{url}/v1/pool").json()["leases_active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(f"{url}/v1/pool").json()["leases_active"] == 0
    # One /metrics: the GPU process's own series plus the fronts' request counts, summed.
    metrics = httpx.get(f"{url}/metrics").text
    assert 'featpool_leases_released_total{reason="ack"} 2.0' in metrics
    assert 'featpool_http_requests_total{endpoint="/v1/encode",status_class="2xx"} 1.0' in metrics
    # The 400 (not an image, seen at the header) and the 413 were answered by a front: counted once.
    assert 'featpool_http_requests_total{endpoint="/v1/encode",status_class="4xx"} 2.0' in metrics
    assert 'featpool_rejected_total{reason="payload_too_large"} 1.0' in metrics
    assert metrics.count("# TYPE featpool_http_requests_total counter") == 1
    # The one encode job (the 400 and the 413 were refused in a front, at the header and the
    # body size), timed on each side of the job channel: a front's view includes the GPU
    # process's.
    sums = {
        m[0]: float(m[1])
        for m in re.findall(
            r"^(featpool_\w*job_duration_seconds_(?:count|sum)) (\S+)$", metrics, re.M
        )
    }
    assert sums["featpool_job_duration_seconds_count"] == 1
    assert sums["featpool_front_job_duration_seconds_count"] == 1
    assert (
        sums["featpool_front_job_duration_seconds_sum"]
        >= sums["featpool_job_duration_seconds_sum"]
        > 0
    )
    # Each process froze its start-up objects (app/interpreter.py) and counts its collector
    # pauses: the GPU process's own series, and the fronts' summed under their own name.
    log = (sock.parent / "server.log").read_text()
    frozen = [int(n) for n in re.findall(r"gc: (\d+) start-up objects frozen", log)]
    assert len(frozen) == 3 and min(frozen) > 10_000, frozen  # the GPU process, two fronts
    assert "thresholds (10000, 10, 100)" in log
    for name in ("featpool_gc_pause_seconds_total", "featpool_front_gc_pause_seconds_total"):
        assert metrics.count(f"# TYPE {name} counter") == 1
        assert re.search(rf'^{name}{{generation="2"}} ', metrics, re.M), name

    # Content-addressed features through a front: ids and reuse travel on the job channel.
    cat, dog = image_bytes("PNG", seed=5), image_bytes("PNG", seed=6)
    jpeg = {"content-type": "image/png"}
    first = httpx.post(f"{url}/v1/encode?id=cat", content=cat, headers=jpeg).json()["items"][0]
    again = httpx.post(f"{url}/v1/encode", content=cat, headers=jpeg).json()["items"][0]
    assert (first["cached"], again["cached"]) == (False, True)
    assert again["feature_hash"] == first["feature_hash"]
    clash = httpx.post(f"{url}/v1/encode?id=cat", content=dog, headers=jpeg)
    assert clash.status_code == 409 and clash.json()["error"]["type"] == "id_conflict"
    found = httpx.get(f"{url}/v1/features/cat").json()
    assert found["feature_hash"] == first["feature_hash"]
    assert httpx.post(f"{url}/v1/features/cat/lease").json()["cached"] is True


def test_stopping_the_server_stops_the_fronts_and_removes_their_metrics(
    fronted: tuple[str, Path, subprocess.Popen[bytes]],
) -> None:
    _, _, proc = fronted
    fronts = descendants(proc.pid)
    assert fronts
    environ = Path(f"/proc/{next(iter(front_pids(proc.pid)))}/environ").read_bytes()
    metrics_dir = Path(
        dict(v.split(b"=", 1) for v in environ.split(b"\0") if b"=" in v)[
            b"PROMETHEUS_MULTIPROC_DIR"
        ].decode()
    )
    assert metrics_dir.is_dir()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 15
    alive = fronts
    while alive and time.monotonic() < deadline:
        alive = {
            p
            for p in fronts
            if Path(f"/proc/{p}").exists()
            and "Z" not in Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1][:3]
        }
        time.sleep(0.2)
    assert not alive, f"front processes left running: {alive}"
    assert not metrics_dir.exists(), "the fronts' metrics directory was left behind"


def test_the_fronts_open_fds_are_exported(
    fronted: tuple[str, Path, subprocess.Popen[bytes]],
) -> None:
    """Behind fronts the client connections are the fronts' FDs, which the GPU process's
    process_open_fds does not count: the FD alert was blind to them. The live front holding
    the most is exported as featpool_front_open_fds."""
    url, _, proc = fronted
    port = int(url.rsplit(":", 1)[1])

    def exported() -> float:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith("featpool_front_open_fds "):
                return float(line.split()[1])
        return -1.0

    assert wait_until(lambda: exported() > 0, 15)
    idle = exported()
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
    try:
        # two fronts share the 300, by a hash of each connection: not evenly (136 / 164 seen)
        assert wait_until(lambda: sum(established_on(port, p) for p in front_pids(proc.pid)) == 300)
        most = max(established_on(port, p) for p in front_pids(proc.pid))
        assert most >= 100
        assert wait_until(lambda: exported() >= idle + most - 5, 15), (idle, most, exported())
    finally:
        for s in held:
            s.close()


def test_a_start_refused_for_its_port_leaves_no_metrics_directory(tmp_path: Path) -> None:
    """The fronts' metrics directory was made before the port was claimed: every start that
    found its port taken left an empty featpool-front-metrics-* behind in the temp dir."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = subprocess.run(
            [
                *(sys.executable, "-m", "app", "--device", "cpu", "--encoder", "tiny-test"),
                *("--http-workers", "2", "--port", str(port)),
                *("--socket-path", str(tmp_path / "fp.sock")),
            ],
            cwd=ROOT,
            env={**os.environ, "TMPDIR": str(tmp_path)},
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert r.returncode != 0 and "already in use" in r.stderr, r.stderr[-2000:]
    assert not list(tmp_path.glob("featpool-front-metrics-*"))


def test_connections_are_spread_over_the_fronts(
    fronted: tuple[str, Path, subprocess.Popen[bytes]],
) -> None:
    """Each front listens on the port itself (SO_REUSEPORT): the kernel spreads connections by
    hash. With one socket shared by uvicorn's workers, 256 connections landed 108/73/39/36 on
    four fronts."""
    url, _, proc = fronted
    port = int(url.rsplit(":", 1)[1])
    fronts = front_pids(proc.pid)

    async def hold_connections(n: int) -> dict[int, int]:
        clients = [
            httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=1))
            for _ in range(n)
        ]
        try:
            codes = await asyncio.gather(*(c.get("/health/live") for c in clients))
            assert {r.status_code for r in codes} == {200}
            return {p: established_on(port, p) for p in fronts}
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))

    held = asyncio.run(hold_connections(128))
    assert sum(held.values()) == 128, held
    # Binomial(128, 1/2): below 40 on either side has a probability under 1e-5.
    assert min(held.values()) >= 40, held


def test_a_front_that_dies_is_replaced_and_not_left_a_zombie(
    fronted: tuple[str, Path, subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """SIGKILL one front: the GPU process reaps it, logs it, and starts another, so the port
    is served by as many fronts as configured (it was one fewer, silently, the dead one a
    zombie), and requests keep succeeding."""
    url, _, proc = fronted
    before = front_pids(proc.pid)
    assert len(before) == 2
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = front_pids(proc.pid)
        if victim not in children_of(proc.pid) and len(now) == 2:
            break
        time.sleep(0.1)
    now = front_pids(proc.pid)
    assert victim not in children_of(proc.pid), "the killed front was not reaped"
    assert len(now) == 2 and now - before, now
    for _ in range(8):  # whichever front the kernel hands each connection to
        with httpx.Client() as c:
            r = c.post(
                f"{url}/v1/encode",
                content=image_bytes("JPEG", size=(32, 32)),
                headers={"content-type": "image/jpeg"},
            )
            assert r.status_code == 200, r.text
            c.delete(f"{url}/v1/leases/{r.json()['items'][0]['lease_id']}")
    log = (tmp_path / "server.log").read_text()
    assert f"front process {victim} exited" in log


def test_sigterm_answers_what_the_fronts_have_in_flight(tmp_path: Path) -> None:
    """SIGTERM to the GPU process (what Kubernetes sends) with requests waiting in the batcher:
    the fronts are stopped first, each answering its requests through the job channel, which
    closes only after them. Every request gets its 200 (they got 503 "the GPU process went
    away" when the channel closed first)."""
    import concurrent.futures

    sock = tmp_path / "featpool.sock"
    args = ("--http-workers", "2", "--max-batch-size", "64", "--max-batch-wait-ms", "1500")
    with server_process(sock, tmp_path / "server.log", *args) as (url, proc):

        def encode(i: int) -> int:
            r = httpx.post(
                f"{url}/v1/encode",
                content=image_bytes("JPEG", size=(32, 32), seed=i),
                headers={"content-type": "image/jpeg"},
                timeout=60,
            )
            return r.status_code

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(encode, i) for i in range(6)]
            time.sleep(0.5)  # all six wait for their batch (it closes after 1.5 s)
            proc.send_signal(signal.SIGTERM)
            statuses = [f.result() for f in futures]
        assert proc.wait(timeout=60) is not None
    assert statuses == [200] * 6, statuses
    for private in (".jobs", ".http"):  # nothing left behind
        assert not sock.with_name(sock.name + private).exists(), private


def test_a_lease_request_whose_client_hangs_up_leaves_no_lease(tmp_path: Path) -> None:
    """POST /v1/features/{ref}/lease sends no body. Its client hangs up while the GPU process
    (stopped here) has the job: the front cancels the handler and releases the lease when the
    answer comes, at once, not at its TTL of an hour."""
    sock = tmp_path / "featpool.sock"
    with server_process(sock, tmp_path / "server.log", "--http-workers", "1") as (url, proc):
        jpeg = image_bytes("JPEG", size=(32, 32))
        r = httpx.post(
            f"{url}/v1/encode", content=jpeg, headers={"content-type": "image/jpeg"}, timeout=30
        )
        assert r.status_code == 200, r.text
        ref = r.json()["items"][0]["feature_hash"]

        def pool() -> dict[str, Any]:
            return httpx.get(f"{url}/v1/pool", timeout=10).json()  # type: ignore[no-any-return]

        host, port = url.removeprefix("http://").rsplit(":", 1)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(
                f"POST /v1/features/{ref}/lease?ttl_s=3600 HTTP/1.1\r\nHost: x\r\n"
                "Content-Length: 0\r\n\r\n".encode()
            )
            time.sleep(0.5)  # the front has sent the job
            s.close()
            time.sleep(0.5)  # and seen the hang-up
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        # The lease was made (a second one), then given back: one lease left, the encode's.
        assert wait_until(lambda: sum(pool()["created"].values()) == 2, 10), pool()
        assert wait_until(lambda: pool()["leases_active"] == 1, 5), pool()
