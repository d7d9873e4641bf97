"""Fuzzing both interfaces.

HTTP: schemathesis generates requests from the service's own OpenAPI document (positive and
negative data) and sends them to a real uvicorn server on a loopback port. Never a 5xx;
responses conform to the document (status codes, content types, JSON schemas); real lease IDs
and real images are mixed in so that the lease routes and the encoder are exercised too; and
once the leases that were created are released, occupancy is back to zero.

Hand-off socket: hypothesis-generated raw frames (random bytes, random JSON, huge lengths, FDs
attached to a request, half-closed sockets), before and after ``hello``. The server survives
every one, leaks no FD, and a normal client still attaches and reads a lease afterwards.
"""

from __future__ import annotations

import array
import hmac
import json
import os
import socket
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from app.main import create_app
from pool.backends.host_shm import HostShmBackend
from pool.client import FeatureClient
from pool.featurepool import FeaturePool
from pool.protocol import MAX_FRAME, PROTOCOL_VERSION, recv_msg, send_msg
from pool.server import HandoffServer
from tests.conftest import image_bytes
from tests.helpers import Live, live_server, small_settings, wait_until

JPEG = image_bytes("JPEG", size=(48, 32))


def openapi_document() -> dict[str, Any]:
    doc = create_app(small_settings(Path("/nonexistent"))).openapi()
    content = doc["paths"]["/v1/encode"]["post"]["requestBody"]["content"]
    # Narrowed for the fuzzer: a few parts at most, and JPEG alone for raw bodies.
    content["multipart/form-data"]["schema"]["properties"]["image"]["maxItems"] = 4
    for raw in [ct for ct in content if ct not in ("multipart/form-data", "image/jpeg")]:
        del content[raw]
    return doc


schema = schemathesis.openapi.from_dict(openapi_document())
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("fuzz")
    with live_server(small_settings(tmp, max_images_per_request=4)) as srv:
        yield srv


@pytest.fixture(scope="module")
def created(live: Live) -> Iterator[set[str]]:
    """Lease IDs handed out during the fuzz; all released at the end, then occupancy is 0."""
    ids: set[str] = set()
    yield ids
    for lid in ids:
        assert httpx.delete(f"{live.url}/v1/leases/{lid}").status_code in (204, 410)
    assert wait_until(lambda: live.occupancy() == (0, 0), 5), live.occupancy()


@schema.given(real_lease=st.booleans(), real_image=st.booleans())
@schema.parametrize()
@settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_openapi_fuzz(
    case: Any, live: Live, created: set[str], real_lease: bool, real_image: bool
) -> None:
    path = case.operation.path
    if real_lease and "lease_id" in (case.path_parameters or {}):
        r = httpx.post(
            f"{live.url}/v1/encode", content=JPEG, headers={"content-type": "image/jpeg"}
        )
        assert r.status_code == 200, r.text
        lid = r.json()["items"][0]["lease_id"]
        created.add(lid)
        case.path_parameters["lease_id"] = lid
    if real_image and path == "/v1/encode" and case.media_type == "image/jpeg":
        case.body = JPEG
    response = case.call(base_url=live.url, timeout=30)
    case.validate_response(response, checks=CHECKS)
    assert response.status_code < 500, response.text
    ctype = response.headers.get("content-type") or [""]  # schemathesis: name -> values
    if response.status_code >= 400 and ctype[0].startswith("application/json"):
        err = response.json()["error"]
        assert err["type"] and err["message"]
    if path == "/v1/encode" and response.status_code == 200:
        created.update(item["lease_id"] for item in response.json()["items"])


def test_deeply_nested_json_body_is_a_4xx(live: Live) -> None:
    r = httpx.post(
        f"{live.url}/v1/leases/x/renew",
        content=b"[" * 200_000,
        headers={"content-type": "application/json"},
    )
    assert 400 <= r.status_code < 500, r.text


# ---- the hand-off socket --------------------------------------------------------------------


@pytest.fixture(scope="module")
def handoff(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[FeaturePool, HandoffServer]]:
    pool = FeaturePool([HostShmBackend([1 << 20])], max_leases=16)
    server = HandoffServer(pool, tmp_path_factory.mktemp("hs") / "s.sock", token="t0k3n")
    server.start()
    yield pool, server
    server.close()
    pool.close()


def frame(body: bytes, length: int | None = None) -> bytes:
    return struct.pack(">I", len(body) if length is None else length) + body


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
messages = st.one_of(
    json_values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries(
        {"op": st.sampled_from(["hello", "lookup", "renew", "release", "x"])},
        optional={
            "version": json_values,
            "token": json_values,
            "lease_id": json_values,
            "ttl_s": json_values,
            "pid": json_values,
        },
    ).map(lambda d: json.dumps(d).encode()),
    st.binary(max_size=64),
    st.just(b"[" * 100_000),
    st.just(b'{"op": "hello", "version": 1, "token": "\\u00e9\\u0000"}'),
)
frames = st.one_of(
    messages.map(frame),
    st.tuples(messages, st.integers(0, 2**32 - 1)).map(lambda t: frame(t[0], t[1])),
    st.binary(max_size=8),  # a truncated header or a few stray bytes
    st.just(frame(b"", MAX_FRAME + 1)),
)


def open_fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def connect(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(str(path))
    return s


def hello(s: socket.socket) -> None:
    send_msg(s, {"op": "hello", "version": PROTOCOL_VERSION, "token": "t0k3n"})
    msg, fds = recv_msg(s, want_fds=True)
    for fd in fds:
        os.close(fd)
    assert msg["op"] == "welcome"


@given(
    after_hello=st.booleans(),
    payload=st.lists(frames, min_size=1, max_size=3),
    with_fds=st.booleans(),
    half_close=st.booleans(),
)
@settings(
    max_examples=120,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
def test_raw_frames_never_hurt_the_server(
    handoff: tuple[FeaturePool, HandoffServer],
    after_hello: bool,
    payload: list[bytes],
    with_fds: bool,
    half_close: bool,
) -> None:
    pool, server = handoff
    s = connect(server.path)
    try:
        if after_hello:
            hello(s)
        data = b"".join(payload)
        if with_fds:  # SCM_RIGHTS on a request: the server must neither use nor keep them
            r, w = os.pipe()
            try:
                s.sendmsg(
                    [data[:1] or b"\0"],
                    [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r, w]))],
                )
            finally:
                os.close(r)
                os.close(w)
            data = data[1:]
        try:
            s.sendall(data)
            if half_close:
                s.shutdown(socket.SHUT_WR)
            s.settimeout(0.2)
            while s.recv(65536):  # read answers until the server closes or goes quiet
                pass
        except (TimeoutError, ConnectionError, OSError):
            pass
    finally:
        s.close()
    # The server is alive: a normal client attaches, reads and releases a lease.
    lease = pool.put(torch.arange(4.0))
    with FeatureClient.connect(server.path, token="t0k3n") as c:
        assert torch.equal(c.open(pool.describe(lease)), torch.arange(4.0))
        assert c.lookup(lease.id)["lease_id"] == lease.id
    pool.release(lease.id)


def test_fuzzing_leaked_no_fd_and_no_consumer(handoff: tuple[FeaturePool, HandoffServer]) -> None:
    """Runs after the fuzz (same module fixture): server threads let go of every connection
    and every FD that arrived with a request."""
    pool, server = handoff
    assert wait_until(lambda: pool.stats()["consumers_attached"] == 0, 5)
    before = open_fd_count()
    for _ in range(20):
        s = connect(server.path)
        hello(s)
        r, w = os.pipe()
        s.sendmsg(
            [frame(b'{"op": "lookup", "lease_id": "00000000000000000000000000000000"}')],
            [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r, w]))],
        )
        os.close(r)
        os.close(w)
        reply, _ = recv_msg(s)
        assert reply["type"] == "lease_not_found"
        s.close()
    assert wait_until(lambda: pool.stats()["consumers_attached"] == 0, 5)
    assert wait_until(lambda: open_fd_count() <= before, 5), (open_fd_count(), before)
    assert pool.stats()["leases_active"] == 0


def test_non_ascii_token_is_refused_not_crashed(
    handoff: tuple[FeaturePool, HandoffServer], caplog: pytest.LogCaptureFixture
) -> None:
    _, server = handoff
    s = connect(server.path)
    send_msg(s, {"op": "hello", "version": PROTOCOL_VERSION, "token": "t0k3né"})
    reply, _ = recv_msg(s)
    s.close()
    assert reply["type"] == "peer_rejected"
    assert "hand-off connection failed" not in caplog.text


def test_deeply_nested_frame_is_a_protocol_error(
    handoff: tuple[FeaturePool, HandoffServer],
) -> None:
    _, server = handoff
    s = connect(server.path)
    hello(s)  # after authentication, where frames up to 1 MiB are read
    s.sendall(frame(b"[" * 500_000))
    reply, _ = recv_msg(s)
    s.close()
    assert reply["op"] == "error" and reply["type"] == "protocol_error"


# ---- security claims of docs/security.md that no other test covers ----------------------------

ROOT = Path(__file__).resolve().parents[1]
UNSAFE = ("pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib")


def test_no_pickle_marshal_eval_or_exec_in_app_and_pool() -> None:
    import ast

    found = []
    for path in sorted([*ROOT.joinpath("app").rglob("*.py"), *ROOT.joinpath("pool").rglob("*.py")]):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            if any(n in UNSAFE for n in names):
                found.append(f"{path}:{node.lineno} imports {names}")
            if isinstance(node, ast.Call):
                f = node.func
                name = (
                    f.id
                    if isinstance(f, ast.Name)
                    else f.attr
                    if isinstance(f, ast.Attribute)
                    else ""
                )
                if (isinstance(f, ast.Name) and name in ("eval", "exec", "__import__")) or (
                    name in ("load", "loads")
                    and isinstance(f, ast.Attribute)
                    and isinstance(f.value, ast.Name)
                    and f.value.id in UNSAFE
                ):
                    found.append(f"{path}:{node.lineno} calls {name}")
                # torch.load unpickles unless weights_only=True
                if (
                    name == "load"
                    and isinstance(f, ast.Attribute)
                    and isinstance(f.value, ast.Name)
                    and f.value.id == "torch"
                    and not any(
                        k.arg == "weights_only"
                        and isinstance(k.value, ast.Constant)
                        and k.value.value is True
                        for k in node.keywords
                    )
                ):
                    found.append(f"{path}:{node.lineno} calls torch.load without weights_only")
    assert not found, found


def test_api_key_guards_every_v1_route(tmp_path: Path) -> None:
    """Every /v1 operation in the OpenAPI document answers 401 without the key, with a wrong
    key, with a key of another length and with a non-ASCII one; with the key it gets past."""
    from fastapi.testclient import TestClient

    app = create_app(small_settings(tmp_path, api_key="s3cr3t-key"))
    with TestClient(app) as c:
        ops = [
            (m.upper(), p)
            for p, item in c.get("/openapi.json").json()["paths"].items()
            for m in item
            if p.startswith("/v1")
        ]
        assert len(ops) >= 6
        for method, path in ops:
            url = path.replace("{lease_id}", "0" * 32)
            for auth in (
                None,
                "Bearer wrong-key!",
                "Bearer s",
                "s3cr3t-key",
                "Bearer s3cr3t-kéy".encode(),
                "bearer s3cr3t-key",
            ):
                headers: dict[str, str | bytes] = {"content-type": "image/jpeg"}
                if auth is not None:
                    headers["authorization"] = auth
                r = c.request(method, url, headers=headers, content=JPEG)
                assert r.status_code == 401, (method, path, auth, r.status_code)
                assert r.json()["error"]["type"] == "unauthorized"
            r = c.request(
                method,
                url,
                content=JPEG,
                headers={"content-type": "image/jpeg", "authorization": "Bearer s3cr3t-key"},
            )
            assert r.status_code != 401, (method, path)
        for path in ("/health/live", "/health/ready", "/metrics"):
            assert c.get(path).status_code == 200
        # clean up the leases the authorised encode calls made
        assert app.state.engine.pool is not None
        for lease in list(app.state.engine.pool.leases):
            app.state.engine.pool.release(lease.id)


def test_secrets_are_compared_by_compare_digest_with_every_key(
    monkeypatch: pytest.MonkeyPatch,
    make_client: Callable[..., TestClient],
    handoff: tuple[FeaturePool, HandoffServer],
) -> None:
    """Constant time, as a behaviour: every API key and the socket token go through
    ``hmac.compare_digest`` (a spy that answers for it decides who gets in), and a request is
    compared with every key, matched or not, so that the time taken does not say which key
    matched or how far a guess got. A plain ``==`` anywhere fails this."""
    seen: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((bytes(a), bytes(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    c = make_client(api_keys=["k1", "k2", "k3"])
    for header, status in (("Bearer k1", 200), ("Bearer k3", 200), ("Bearer nope", 401)):
        seen.clear()
        assert c.get("/v1/pool", headers={"authorization": header}).status_code == status
        assert seen == [(header.encode(), f"Bearer {k}".encode()) for k in ("k1", "k2", "k3")]
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: False)  # it alone decides
    assert c.get("/v1/pool", headers={"authorization": "Bearer k1"}).status_code == 401

    _, server = handoff
    monkeypatch.setattr(hmac, "compare_digest", spy)
    seen.clear()
    with FeatureClient.connect(server.path, token="t0k3n") as fc:
        assert fc.epoch
    assert (b"t0k3n", b"t0k3n") in seen
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: False)
    from pool.errors import PeerRejected

    with pytest.raises(PeerRejected):
        FeatureClient.connect(server.path, token="t0k3n")


def test_socket_token_variants_are_refused(handoff: tuple[FeaturePool, HandoffServer]) -> None:
    from pool.errors import PeerRejected

    _, server = handoff
    for token in (None, "", "t0k3", "t0k3n ", "T0K3N", "t0k3n\x00", "t0k3né"):
        with pytest.raises(PeerRejected):
            FeatureClient.connect(server.path, token=token)
    for token in (["t0k3n"], 123, {"t": "t0k3n"}):  # not even a string
        s = connect(server.path)
        send_msg(s, {"op": "hello", "version": PROTOCOL_VERSION, "token": token})
        reply, fds = recv_msg(s, want_fds=True)
        s.close()
        assert reply["type"] == "peer_rejected" and fds == []
    with FeatureClient.connect(server.path, token="t0k3n") as c:
        assert c.epoch
