"""The hand-off servers as an attack surface (docs/security.md, "The hand-off servers"): each
test is an attack that the named defence stops, on the Unix socket and on the TCP (FABRIC)
server alike. The TCP server runs on the fake CUDA driver of test_cuda_vmm_fake."""

from __future__ import annotations

import array
import json
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import pool.server as pool_server
from app.metrics import Metrics
from pool.backends.host_shm import HostShmBackend
from pool.client import FeatureClient
from pool.errors import HandoffError
from pool.featurepool import Attachment, FeaturePool
from pool.protocol import (
    MAX_FRAME,
    MAX_HELLO_FRAME,
    PROTOCOL_VERSION,
    encode_frame,
    recv_msg,
    send_msg,
)
from pool.server import FabricHandoffServer, HandoffServer, Limits
from tests.helpers import wait_until
from tests.test_cuda_vmm_fake import FakeDriver, assert_nothing_left, make

MiB = 1 << 20
TOKEN = "s3cret-token"
KINDS = ["unix", "tcp"]


@dataclass
class Served:
    kind: str
    pool: FeaturePool
    server: HandoffServer
    hello: dict[str, Any]
    drv: FakeDriver | None = None
    welcomes: list[dict[str, Any]] = field(default_factory=list)  # calls of attach_consumer

    def connect(self) -> socket.socket:
        if isinstance(self.server, FabricHandoffServer):
            s = socket.create_connection(("127.0.0.1", self.server.port), timeout=10)
        else:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(10)
            s.connect(str(self.server.path))
        return s

    def attach(self) -> socket.socket:
        """A consumer that does everything right: connect, hello, welcome."""
        s = self.connect()
        send_msg(s, self.hello)
        msg, fds = recv_msg(s, want_fds=self.kind == "unix")
        for fd in fds:
            os.close(fd)
        assert msg["op"] == "welcome", msg
        return s

    def refused(self, reason: str) -> int:
        return int(self.pool.stats()["handoff_refused"].get(self.kind, {}).get(reason, 0))


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[[str, Limits], Served]]:
    made: list[Served] = []

    def start(kind: str, limits: Limits) -> Served:
        served: Served
        if kind == "unix":
            pool = FeaturePool([HostShmBackend([MiB])], max_leases=8)
            server = HandoffServer(pool, tmp_path / "s.sock", limits=limits)
            served = Served(kind, pool, server, {"op": "hello", "version": PROTOCOL_VERSION})
        else:
            be, drv = make(permitted=True)
            pool = FeaturePool([be], max_leases=8)
            be.enable_remote(pool.ctrl.nslots)
            server = FabricHandoffServer(pool, "127.0.0.1", 0, token=TOKEN, limits=limits)
            hello = {"op": "hello", "version": PROTOCOL_VERSION, "token": TOKEN}
            served = Served(kind, pool, server, hello, drv)
        real = pool.attach_consumer

        def counted(peer: str = "", **kw: Any) -> Attachment:
            served.welcomes.append(kw)
            return real(peer, **kw)

        pool.attach_consumer = counted  # type: ignore[method-assign]
        server.start()
        made.append(served)
        return served

    yield start
    for s in made:
        s.server.close()
        s.pool.close()
        if s.drv is not None:
            assert_nothing_left(s.drv)


def read_refusal(s: socket.socket) -> dict[str, Any]:
    """The error frame a refused connection gets, then the end of the connection."""
    s.settimeout(10)
    msg, fds = recv_msg(s)
    assert msg["op"] == "error" and fds == [], msg
    assert s.recv(1) == b""
    return msg


# ---- no thread per connection; silent connections do not lock consumers out ----------------


@pytest.mark.parametrize("kind", KINDS)
def test_300_silent_connections_cost_no_thread_and_do_not_lock_out_a_consumer(
    serve: Callable[[str, Limits], Served], kind: str
) -> None:
    s = serve(kind, Limits(auth_timeout_s=60, max_connections=64))
    threads = threading.active_count()
    silent = [s.connect() for _ in range(300)]
    try:
        # The server took them all in (the newest 64 are open, the rest displaced) on its one
        # loop thread: no thread per connection.
        assert wait_until(lambda: s.refused("evicted") == 300 - 64, 20), s.pool.stats()
        assert s.server.connections == 64
        assert threading.active_count() <= threads
        # A consumer attaches now, not when the silent ones' 60 s run out.
        t0 = time.monotonic()
        consumer = s.attach()
        assert time.monotonic() - t0 < 5
        assert s.pool.stats()["consumers_attached"] == 1
        assert s.refused("evicted") == 300 - 64 + 1  # it displaced the oldest silent one
        assert len(s.welcomes) == 1  # nothing of the pool went to a silent connection
        assert read_refusal(silent[0])["type"] == "too_many_connections"
        consumer.close()
        assert wait_until(lambda: s.pool.stats()["consumers_attached"] == 0, 5)
    finally:
        for c in silent:
            c.close()


# ---- authentication timeout -----------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_connection_that_never_authenticates_is_closed_after_the_timeout(
    serve: Callable[[str, Limits], Served], kind: str
) -> None:
    s = serve(kind, Limits(auth_timeout_s=0.3))
    metrics = Metrics()
    metrics.watch_pool(s.pool.stats)
    t0 = time.monotonic()
    silent = s.connect()
    slow = s.connect()
    # Slowloris: a hello announced, then trickled one byte every 50 ms. The deadline runs from
    # the connection, not from the last byte, so trickling does not keep it open.
    slow.sendall(struct.pack(">I", 200))
    closed = False
    while time.monotonic() - t0 < 8 and not closed:
        try:
            slow.send(b" ")
        except OSError:  # the server closed it before this byte: broken pipe or reset
            closed = True
            break
        closed = bool(select.select([slow], [], [], 0.05)[0])
    assert closed, "the trickling connection was not closed"
    assert read_refusal(silent)["type"] == "auth_timeout"
    assert time.monotonic() - t0 < 8  # 0.3 s and scheduling; without the deadline: never
    assert s.refused("auth_timeout") == 2
    assert s.welcomes == []
    sample = metrics.registry.get_sample_value(
        "featpool_handoff_refused_total", {"server": kind, "reason": "auth_timeout"}
    )
    assert sample == 2.0
    silent.close()
    slow.close()
    s.attach().close()  # the server serves on


# ---- bounded hello --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_large_frame_before_authentication_is_refused_without_reading_it(
    serve: Callable[[str, Limits], Served], kind: str
) -> None:
    s = serve(kind, Limits(auth_timeout_s=60))
    c = s.connect()
    # 1 MiB announced (the limit after authentication), 1 KiB of it sent: the answer comes at
    # once, so the server did not wait for (or buffer) the rest.
    c.sendall(struct.pack(">I", MAX_FRAME) + b"{" * 1024)
    refusal = read_refusal(c)
    c.close()
    assert refusal["type"] == "protocol_error"
    assert f"exceeds {MAX_HELLO_FRAME}" in refusal["message"]
    assert s.refused("hello_too_large") == 1 and s.welcomes == []

    # A hello of exactly MAX_HELLO_FRAME bytes is fine ...
    body = json.dumps(s.hello).encode()
    body = body[:-1] + b" " * (MAX_HELLO_FRAME - len(body)) + b"}"
    assert len(body) == MAX_HELLO_FRAME
    c = s.connect()
    c.sendall(struct.pack(">I", len(body)) + body)
    msg, fds = recv_msg(c, want_fds=kind == "unix")
    for fd in fds:
        os.close(fd)
    assert msg["op"] == "welcome"
    # ... and once authenticated, frames up to MAX_FRAME are read (JSON padded with spaces) ...
    body = json.dumps({"op": "lookup", "lease_id": "0" * 32}).encode()
    body = body[:-1] + b" " * (MAX_FRAME - len(body)) + b"}"
    c.sendall(struct.pack(">I", len(body)) + body)
    reply, _ = recv_msg(c)
    assert reply["type"] == "lease_not_found"
    # ... and one byte more is refused as soon as it is announced, and the connection closed.
    c.sendall(struct.pack(">I", MAX_FRAME + 1) + b"{" * 1024)
    refusal = read_refusal(c)
    assert refusal["type"] == "protocol_error" and f"exceeds {MAX_FRAME}" in refusal["message"]
    assert s.refused("protocol_error") == 1
    c.close()


# ---- connection cap -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_connections_beyond_the_cap_are_refused_and_counted(
    serve: Callable[[str, Limits], Served], kind: str
) -> None:
    s = serve(kind, Limits(max_connections=3))
    consumers = [s.attach() for _ in range(3)]
    try:
        extra = s.connect()
        try:
            send_msg(extra, s.hello)  # a valid hello changes nothing: there is no room
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused and closed already; the answer waits to be read
        refusal = read_refusal(extra)
        extra.close()
        assert refusal["type"] == "too_many_connections"
        assert "--socket-max-connections" in refusal["message"]
        if kind == "unix":  # what a consumer sees
            with pytest.raises(HandoffError, match="socket-max-connections"):
                FeatureClient.connect(s.server.path)
        assert s.refused("too_many_connections") == (2 if kind == "unix" else 1)
        assert len(s.welcomes) == 3 and s.pool.stats()["consumers_attached"] == 3
        consumers.pop().close()  # room again once a consumer leaves
        assert wait_until(lambda: s.pool.stats()["consumers_attached"] == 2, 5)
        consumers.append(s.attach())
    finally:
        for c in consumers:
            c.close()


# ---- the token before anything of the pool --------------------------------------------------


def test_tcp_token_is_checked_before_any_fabric_handle_is_sent(
    serve: Callable[[str, Limits], Served],
) -> None:
    s = serve("tcp", Limits())
    assert s.drv is not None
    exports = s.drv.names().count("export_fabric")
    for hello in (
        {"op": "hello", "version": PROTOCOL_VERSION},
        {"op": "hello", "version": PROTOCOL_VERSION, "token": "wrong"},
        {"op": "hello", "version": PROTOCOL_VERSION, "token": TOKEN[:-1]},
        {"op": "hello", "version": PROTOCOL_VERSION, "token": [TOKEN]},
        {"op": "hello", "version": PROTOCOL_VERSION, "token": "\ud800"},  # a lone surrogate
        {"op": "lookup", "lease_id": "x", "token": TOKEN},  # not a hello
    ):
        c = s.connect()
        send_msg(c, hello)
        c.settimeout(10)
        data = b""
        while chunk := c.recv(65536):
            data += chunk
        c.close()
        assert b"fabric_handle" not in data and b"error" in data
    assert s.welcomes == []
    assert s.drv.names().count("export_fabric") == exports  # no slab handle exported yet
    assert s.refused("bad_token") == 5 and s.refused("bad_hello") == 1
    assert s.pool.stats()["remote_consumers_attached"] == 0
    c = s.attach()  # with the token: the handles
    assert s.welcomes == [{"remote": True}]
    c.close()


# ---- descriptors a peer sends ---------------------------------------------------------------


@pytest.mark.parametrize("authenticated", [False, True])
def test_descriptors_a_peer_sends_are_closed_by_the_server(
    serve: Callable[[str, Limits], Served], authenticated: bool
) -> None:
    """Consumers send no FDs; a peer that attaches some (200 copies of a pipe's write end: more
    than the server has ancillary room for) must not leave one open in the server: once the
    test closes its own copy, the pipe reads end-of-file."""
    s = serve("unix", Limits())
    c = s.attach() if authenticated else s.connect()
    r, w = os.pipe()
    try:
        msg = {"op": "lookup", "lease_id": "x"} if authenticated else s.hello
        body = json.dumps(msg).encode()
        c.sendmsg(
            [struct.pack(">I", len(body)) + body],
            [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [w] * 200))],
        )
        os.close(w)
        w = -1
        reply, fds = recv_msg(c, want_fds=True)
        for fd in fds:
            os.close(fd)
        assert reply["op"] == ("error" if authenticated else "welcome")
        assert select.select([r], [], [], 5)[0], "a received FD is still open in the server"
        assert os.read(r, 1) == b""
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
        c.close()


def test_a_peer_that_does_not_read_its_answers_gets_no_more_read(
    serve: Callable[[str, Limits], Served],
) -> None:
    """20,000 pipelined requests (1.4 MB; 2.2 MB of answers), none read for a while: the server
    holds one pending answer and stops reading the connection (the sender blocks), instead of
    buffering every request and answer; then every answer arrives, in order."""
    s = serve("unix", Limits())
    c = s.attach()
    ids = [f"{i:032x}" for i in range(20_000)]
    data = b"".join(encode_frame({"op": "lookup", "lease_id": i}) for i in ids)
    sender = threading.Thread(target=c.sendall, args=(data,), daemon=True)
    sender.start()
    time.sleep(1.0)
    assert sender.is_alive(), "the server read every request while its answers piled up"
    (conn,) = s.server._conns
    assert len(conn.out) < 200 and len(conn.inbuf) < 2 * 65536  # one answer, one read
    for i in ids:
        reply, _ = recv_msg(c)
        assert reply["type"] == "lease_not_found" and i in reply["message"]
    sender.join(10)
    assert not sender.is_alive()
    c.close()


def test_the_welcome_fds_are_closed_once_on_every_path(
    serve: Callable[[str, Limits], Served],
) -> None:
    """The server owns the FDs of each welcome: after consumers that attach and leave, peers
    that say hello and hang up before reading the answer, and refused peers, the process holds
    no more FDs than before."""
    s = serve("unix", Limits(auth_timeout_s=0.2))
    s.attach().close()
    assert wait_until(lambda: s.pool.stats()["consumers_attached"] == 0, 5)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(30):
        s.attach().close()
        c = s.connect()
        send_msg(c, s.hello)
        c.close()  # gone before the welcome is read, or even sent
        c = s.connect()
        c.sendall(struct.pack(">I", MAX_FRAME))
        c.close()
    assert wait_until(lambda: s.server.connections == 0, 10)
    assert wait_until(lambda: len(os.listdir("/proc/self/fd")) <= before, 5), (
        len(os.listdir("/proc/self/fd")),
        before,
    )
    assert s.pool.stats()["consumers_attached"] == 0


SERVER_WITH_FEW_FDS = """
import json, os, resource, sys
from pool.backends.host_shm import HostShmBackend
from pool.featurepool import Attachment, FeaturePool
from pool.server import HandoffServer, Limits
pool = FeaturePool([HostShmBackend([1 << 20])])
server = HandoffServer(pool, sys.argv[1], limits=Limits(auth_timeout_s=0.5))
server.start()
fds = len(os.listdir("/proc/self/fd"))
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (fds + 16, hard))
print("ready", flush=True)
sys.stdin.readline()
print(json.dumps(pool.stats()["handoff_refused"]), flush=True)
server.close()
"""


def test_a_server_out_of_descriptors_pauses_accepting_and_recovers(tmp_path: Path) -> None:
    """A connection flood past the process's FD limit: accept fails with EMFILE. The server
    counts it, pauses accepting instead of spinning or dying, and serves again once the silent
    connections have timed out."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    path = tmp_path / "s.sock"
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER_WITH_FEW_FDS, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    silent: list[socket.socket] = []
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        for _ in range(40):  # more than the 16 FDs the server has left; they wait in the backlog
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.settimeout(10)
            c.connect(str(path))
            silent.append(c)
        time.sleep(0.2)
        cpu = proc_cpu_seconds(proc.pid)
        time.sleep(0.5)
        assert proc_cpu_seconds(proc.pid) - cpu < 0.1, "the server spins on EMFILE"
        # The silent ones time out (0.5 s) and free FDs; the backlog drains; a consumer attaches.
        for c in silent:
            assert read_refusal(c)["type"] == "auth_timeout"
        with FeatureClient.connect(path) as client:
            assert client.epoch
        proc.stdin.write("stats\n")
        proc.stdin.flush()
        refused = json.loads(proc.stdout.readline())["unix"]
        assert refused["fd_limit"] >= 1 and refused["auth_timeout"] == 40
    finally:
        for c in silent:
            c.close()
        proc.kill()
        proc.wait(10)


def proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_refused_peers_are_counted_and_take_no_connection_slot(tmp_path: Path) -> None:
    """uid/gid checked at accept: a refused peer never occupies a slot, and is counted."""
    pool = FeaturePool([HostShmBackend([MiB])])
    server = HandoffServer(
        pool, tmp_path / "s.sock", allowed_uids=[os.getuid() + 4242], limits=Limits(1, 1)
    )
    server.start()
    try:
        for _ in range(5):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                c.settimeout(10)
                c.connect(str(server.path))
                assert read_refusal(c)["type"] == "peer_rejected"
        assert pool.stats()["handoff_refused"] == {"unix": {"peer_not_allowed": 5}}
        assert server.connections == 0
    finally:
        server.close()
        pool.close()


def test_a_refused_peer_does_not_displace_a_pending_consumer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """uid/gid are checked before the connection cap: at the cap, a peer of a foreign uid is
    refused without displacing the allowed consumer that has not said hello yet (checked the
    other way round, every refused peer would evict one)."""
    pool = FeaturePool([HostShmBackend([MiB])])
    server = HandoffServer(
        pool, tmp_path / "s.sock", limits=Limits(auth_timeout_s=60, max_connections=1)
    )
    server.start()
    try:
        pending = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        pending.settimeout(10)
        pending.connect(str(server.path))
        assert wait_until(lambda: server.connections == 1, 5)
        real = pool_server.peer_credentials
        monkeypatch.setattr(
            pool_server, "peer_credentials", lambda s: (*real(s)[:1], os.getuid() + 4242, 4242)
        )
        for _ in range(3):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                c.settimeout(10)
                c.connect(str(server.path))
                assert read_refusal(c)["type"] == "peer_rejected"
        send_msg(pending, {"op": "hello", "version": PROTOCOL_VERSION})
        welcome, fds = recv_msg(pending, want_fds=True)
        for fd in fds:
            os.close(fd)
        assert welcome["op"] == "welcome"
        assert pool.stats()["handoff_refused"] == {"unix": {"peer_not_allowed": 3}}
        pending.close()
    finally:
        server.close()
        pool.close()


def test_the_server_lives_through_its_connections_and_a_lease_round_trip(
    serve: Callable[[str, Limits], Served],
) -> None:
    """After all of the above kinds of abuse on one server, a real consumer still works."""
    s = serve("unix", Limits(auth_timeout_s=1.0, max_connections=32))
    junk = [s.connect() for _ in range(20)]
    junk[0].sendall(struct.pack(">I", MAX_FRAME))  # refused at once
    junk[1].sendall(b"\x00\x00\x00\x05hello")  # not JSON: refused at once
    junk[2].sendall(b"\x00\x00")  # half a header: closed at the deadline, like the silent ones
    refusals = {"hello_too_large": 1, "bad_hello": 1, "auth_timeout": 18}
    assert wait_until(lambda: s.pool.stats()["handoff_refused"] == {"unix": refusals}, 10)
    assert s.server.connections == 0
    lease = s.pool.put(torch.arange(6.0))
    with FeatureClient.connect(s.server.path) as client:
        assert torch.equal(client.open(s.pool.describe(lease)), torch.arange(6.0))
        client.release(lease.id)
    for c in junk:
        c.close()


def test_security_md_names_only_tests_that_exist() -> None:
    """Each test docs/security.md cites for the hand-off servers is one of this module's."""
    import re

    from tests.helpers import ROOT

    doc = (ROOT / "docs" / "security.md").read_text()
    section = doc.split("## The hand-off servers as an attack surface")[1].split("\n## ")[0]
    cited = set(re.findall(r"`::(test_\w+)", section))
    assert len(cited) >= 9
    missing = {name for name in cited if name not in globals()}
    assert missing == set()
