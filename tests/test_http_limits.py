"""What the HTTP server answers itself, as a user runs it (``python -m app``): malformed
requests, an over-long URL or header block, and bodies that stall, all in the JSON error
shape; a stalled body is answered 408 and its connection closed at the timeout."""

from __future__ import annotations

import json
import resource
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from app.http_protocol import http_protocol
from bench.bench_memory import rss_mib
from tests.conftest import image_bytes
from tests.helpers import server_process, small_settings, wait_until

MiB = 1 << 20


def started(tmp: Path, *args: str) -> Iterator[tuple[str, int, int]]:
    with server_process(tmp / "featpool.sock", tmp / "server.log", *args) as (url, proc):
        yield url, int(url.rsplit(":", 1)[1]), proc.pid


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, int]]:
    yield from started(tmp_path_factory.mktemp("http-limits"), "--body-timeout-s", "1.5")


@pytest.fixture(scope="module")
def fronts_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, int]]:
    """The same, with HTTP served by two front processes (the GPU default's shape)."""
    yield from started(tmp_path_factory.mktemp("http-limits-fronts"), "--http-workers", "2")


def exchange(port: int, data: bytes, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes; read the answer until the server closes: (status, headers, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def json_error(body: bytes) -> dict[str, str]:
    err = json.loads(body)["error"]
    assert set(err) == {"type", "message"}
    return err  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("name", "request_bytes", "status", "kind"),
    [
        (
            "content-length -1",
            b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n"
            b"Content-Length: -1\r\n\r\n",
            400,
            "invalid_request",
        ),
        (
            "content-length not a number",
            b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
            400,
            "invalid_request",
        ),
        ("broken request line", b"GARBAGE\r\n\r\n", 400, "invalid_request"),
        (
            "space in a header name",
            b"GET /health/live HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n",
            400,
            "invalid_request",
        ),
        (
            "bad chunk size",
            b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n"
            b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
            400,
            "invalid_request",
        ),
        (
            "url over 8 KiB",
            b"GET /v1/pool?" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
            414,
            "uri_too_long",
        ),
        (
            "url of 1 MiB",
            b"GET /v1/leases/" + b"a" * MiB + b" HTTP/1.1\r\nHost: x\r\n\r\n",
            414,
            "uri_too_long",
        ),
        (
            "headers over 64 KiB",
            b"GET /health/live HTTP/1.1\r\nHost: x\r\n"
            + b"".join(b"X-%d: %s\r\n" % (i, b"v" * 1000) for i in range(80))
            + b"\r\n",
            431,
            "headers_too_large",
        ),
    ],
)
def test_what_the_server_answers_itself_is_json(
    server: tuple[str, int, int], name: str, request_bytes: bytes, status: int, kind: str
) -> None:
    url, port, _ = server
    got, headers, body = exchange(port, request_bytes)
    assert got == status, (name, body)
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"
    assert json_error(body)["type"] == kind
    assert httpx.get(f"{url}/health/live", timeout=10).status_code == 200


def test_limits_leave_normal_requests_alone(server: tuple[str, int, int]) -> None:
    url, _, _ = server
    r = httpx.get(f"{url}/v1/pool?" + "a" * 4000, headers={f"x-{i}": "v" * 500 for i in range(40)})
    assert r.status_code == 200


def test_stalled_bodies_are_answered_408_closed_and_their_memory_freed(
    server: tuple[str, int, int],
) -> None:
    """40 uploads that send half their body (4 MiB) and stall: each gets a JSON 408 and its
    connection closed once the body has sent nothing for --body-timeout-s (1.5 s here), and
    what they had sent no longer holds the server's memory."""
    url, port, pid = server
    half = image_bytes("PNG", size=(1500, 1500))[: 4 * MiB]
    timeouts = body_timeouts(url)
    before = rss_mib(pid)
    socks = []
    for _ in range(40):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(
            b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
            b"Content-Length: %d\r\n\r\n" % (2 * len(half))
        )
        s.sendall(half)
        socks.append(s)
    sent = time.monotonic()
    time.sleep(0.5)
    during = rss_mib(pid)
    answers = []
    for s in socks:
        out = b""
        while chunk := s.recv(65536):  # the server closes the connection after its answer
            out += chunk
        s.close()
        answers.append(out)
    waited = time.monotonic() - sent
    for out in answers:
        head, _, body = out.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), out[:200]
        err = json_error(body)
        assert err["type"] == "body_timeout" and "1.5 s" in err["message"]
    assert waited < 20  # answered at the timeout, not held open indefinitely
    assert during - before > 80  # the half bodies were held while they stalled
    wait_until(lambda: rss_mib(pid) - before < (during - before) / 4, 5)
    assert rss_mib(pid) - before < (during - before) / 4, (before, during, rss_mib(pid))
    assert body_timeouts(url) == timeouts + 40
    assert httpx.get(f"{url}/health/live", timeout=10).status_code == 200


def body_timeouts(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    line = 'featpool_rejected_total{reason="body_timeout"} '
    return next((float(m[len(line) :]) for m in metrics.splitlines() if m.startswith(line)), 0.0)


def trickle_body(port: int, body: bytes, piece: int, every_s: float) -> tuple[bytes, float]:
    """POST ``body`` to /v1/encode ``piece`` bytes every ``every_s`` (never silent for the
    body timeout) until the server answers, for 15 s at most: (the answer, seconds taken)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        start = time.monotonic()
        s.sendall(
            b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        s.settimeout(every_s)
        for i in range(0, len(body), piece):
            if time.monotonic() - start > 15:
                break  # still not answered: the recv below times out and fails the test
            try:
                s.sendall(body[i : i + piece])
                if s.recv(1, socket.MSG_PEEK):
                    break  # answered
            except TimeoutError:
                continue
            except OSError:  # closed under us: the answer is already there
                break
        s.settimeout(10)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except ConnectionResetError:  # a piece that crossed the server's close: after its answer
            assert out, "reset before any answer"
        return out, time.monotonic() - start


def test_a_body_trickled_below_the_minimum_rate_is_answered_408(
    server: tuple[str, int, int],
) -> None:
    """A body trickled a few bytes at a time, never silent for --body-timeout-s, held its
    connection (and an FD) for as long as the client liked: enough of them exhaust the FDs.
    Past the timeout (1.5 s here) a body must now average --min-body-bytes-per-s (1024 by
    default) over the time spent waiting for it; an upload at 8 KiB/s is untouched."""
    url, port, _ = server
    jpeg = image_bytes("JPEG", size=(320, 240))
    timeouts = body_timeouts(url)
    out, took = trickle_body(port, b"\xff" * 100_000, piece=8, every_s=0.25)
    assert out.startswith(b"HTTP/1.1 408"), out[:200]
    err = json_error(out.partition(b"\r\n\r\n")[2])
    assert err["type"] == "body_timeout" and "slower than 1024 bytes/s" in err["message"], err
    assert 1.2 < took < 6, took
    assert body_timeouts(url) == timeouts + 1
    out, took = trickle_body(port, jpeg, piece=2048, every_s=0.25)
    assert out.startswith(b"HTTP/1.1 200"), out[:300]
    assert took > 1.5  # slower than the grace, above the rate


@pytest.mark.parametrize("trickle", [False, True], ids=["silent", "trickling headers"])
def test_a_connection_without_its_headers_in_time_is_closed(
    server: tuple[str, int, int], trickle: bool
) -> None:
    """Connections that send nothing, or their headers a few bytes at a time, each held an FD
    for as long as they liked (50 of each were still open after 70 s): now the request line
    and headers must arrive within --body-timeout-s (1.5 s here), or 408 and closed."""
    _, port, _ = server
    head = b"GET /health/live HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        start = time.monotonic()
        if trickle:
            s.settimeout(0.3)
            for i in range(len(head)):
                try:
                    s.sendall(head[i : i + 1])
                except OSError:  # closed under us: the answer is already there
                    break
                try:
                    if s.recv(1, socket.MSG_PEEK):
                        break
                except TimeoutError:
                    continue
            s.settimeout(10)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        took = time.monotonic() - start
    assert out.startswith(b"HTTP/1.1 408"), out[:200]
    assert json_error(out.partition(b"\r\n\r\n")[2])["type"] == "body_timeout"
    assert 1.2 < took < 6, took


def responses(data: bytes) -> list[tuple[int, bytes]]:
    """The HTTP/1.1 responses in ``data``, in order: (status, body), framed by Content-Length."""
    out = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
        n = int(headers["content-length"])
        out.append((int(lines[0].split()[1]), rest[:n]))
        data = rest[n:]
    return out


@pytest.mark.parametrize("where", ["server", "fronts_server"])
@pytest.mark.parametrize("wanted", ["encode", "health", "two"])
def test_a_request_pipelined_before_a_malformed_one_gets_its_own_answer_first(
    request: pytest.FixtureRequest, where: str, wanted: str
) -> None:
    """HTTP/1.1 answers pipelined requests in order. A well-formed request followed on the
    same connection by a malformed one used to get the malformed one's 400 as its answer (sent
    at once, before its own), and its own answer was dropped with the connection: an encode
    then kept its lease until the TTL, and the client never learnt its id."""
    url, port, _ = request.getfixturevalue(where)
    if wanted == "encode":
        body = image_bytes()
        first = (
            b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
    else:
        first = b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n" * (2 if wanted == "two" else 1)
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(first + b"GARBAGE\r\n\r\n")
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    got = responses(out)
    oks = [200] * (2 if wanted == "two" else 1)
    assert [status for status, _ in got] == [*oks, 400], out[:400]
    assert json_error(got[-1][1])["type"] == "invalid_request"
    if wanted == "encode":
        (item,) = json.loads(got[0][1])["items"]
        lease = httpx.get(f"{url}/v1/leases/{item['lease_id']}", timeout=10)
        assert lease.status_code == 200  # the client holds it, and can give it back
        assert httpx.delete(f"{url}/v1/leases/{item['lease_id']}", timeout=10).status_code == 204


@pytest.mark.parametrize("where", ["server", "fronts_server"])
def test_a_deep_pipeline_is_answered_in_order_then_refused_and_closed(
    request: pytest.FixtureRequest, where: str
) -> None:
    """200 requests pipelined at once (a few KB on the wire): each queued one is a parsed
    request held in memory, and uvicorn parsed a socket buffer's worth more after every
    answer (an audit held ~2 GB this way). At most MAX_PIPELINED wait behind the one being
    answered: those are answered in order, then one 429 and the connection is closed."""
    from app.http_protocol import MAX_PIPELINED

    _, port, _ = request.getfixturevalue(where)
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n" * 200)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    got = responses(out)
    statuses = [status for status, _ in got]
    assert statuses[-1] == 429 and json_error(got[-1][1])["type"] == "queue_full"
    assert set(statuses[:-1]) == {200} and MAX_PIPELINED < len(statuses) - 1 < 200, statuses


@pytest.mark.parametrize("where", ["server", "fronts_server"])
def test_probes_answer_head_without_a_body(where: str, request: pytest.FixtureRequest) -> None:
    """Load balancers and uptime checkers probe with HEAD: 200 and the GET's headers, no body."""
    url, port, _ = request.getfixturevalue(where)
    for path in ("/health/live", "/health/ready", "/metrics"):
        status, headers, body = exchange(
            port, b"HEAD %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % path.encode()
        )
        got = httpx.get(url + path, timeout=10)
        assert (status, body) == (got.status_code, b"") and got.status_code == 200, path
        assert headers["content-type"] == got.headers["content-type"], path


def test_the_open_files_limit_is_raised_to_the_hard_one(tmp_path: Path) -> None:
    """Each connection holds an FD: started at a soft limit of 512 under a higher hard one (as
    container runtimes often start a process), the server and its fronts run at the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 512:
        pytest.skip(f"the hard limit ({hard}) leaves nothing to raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
    try:
        server = started(tmp_path, "--http-workers", "1")
        _, _, pid = next(server)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        assert children, "no front process"
        for p in [pid, *map(int, children)]:
            line = next(
                x for x in Path(f"/proc/{p}/limits").read_text().splitlines() if "open files" in x
            )
            assert line.split()[3] == line.split()[4] != "512", line
    finally:
        server.close()


@pytest.mark.parametrize("loop", ["auto", "asyncio"])  # uvloop where installed, and asyncio's
def test_an_answer_the_client_does_not_take_is_dropped(tmp_path: Path, loop: str) -> None:
    """A client that asks for a large answer (a tensor of megabytes) and reads none of it held
    that answer in the server for as long as it liked, on each of as many connections as it
    opened. While an answer waits above the transport's high-water mark, each
    --body-timeout-s (1 s here) the client must now take --min-body-bytes-per-s worth of it,
    else the connection is aborted; a client reading at 4 MiB/s gets the whole answer."""
    size = 24 * MiB  # well beyond what the kernel's socket buffers take on loopback

    async def big(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"\0" * size})

    settings = small_settings(tmp_path, body_timeout_s=1.0)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        big, http=http_protocol(settings), lifespan="off", log_level="error", loop=loop
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started, 10)

    def read_all(s: socket.socket, every_s: float = 0.0) -> int:
        got = 0
        try:
            while chunk := s.recv(1 << 20 if not every_s else 64 << 10):
                got += len(chunk)
                if every_s:
                    time.sleep(every_s)
                if got >= size:
                    break
        except ConnectionResetError:
            pass
        return got

    try:
        idle = []
        for _ in range(4):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            idle.append(s)
        reader = socket.create_connection(("127.0.0.1", port), timeout=10)
        reader.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        started_reading = time.monotonic()
        assert read_all(reader, every_s=1 / 64) >= size  # 4 MiB/s: slow, but taking it
        assert time.monotonic() - started_reading > 3  # several timeout periods went by
        for s in idle:
            assert read_all(s) < size  # aborted with most of its answer never sent
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
