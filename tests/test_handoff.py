"""The hand-off socket and FeatureClient against a real server, in this process and in others."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pool.backends.host_shm import HostShmBackend
from pool.client import FeatureClient
from pool.errors import HandoffError, PeerRejected, PoolRestarted, StaleLease
from pool.featurepool import FeaturePool
from pool.protocol import MAX_FDS, PROTOCOL_VERSION, recv_msg, send_msg
from pool.server import HandoffServer

MiB = 1 << 20


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[FeaturePool, HandoffServer]]:
    pool = FeaturePool([HostShmBackend([MiB, MiB])], max_leases=16)
    server = HandoffServer(pool, tmp_path / "s.sock")
    server.start()
    yield pool, server
    server.close()
    pool.close()


def test_open_is_zero_copy_and_read_only(served: tuple[FeaturePool, HandoffServer]) -> None:
    pool, server = served
    x = torch.randn(4, 8)
    lease = pool.put(x)
    with FeatureClient.connect(server.path) as c:
        t = c.open(pool.describe(lease))
        assert torch.equal(t, x)
        # Zero-copy: the producer overwrites the slab and the consumer's view changes with it.
        pool.tier("host").backend.view(lease.extent, torch.float32, (4, 8)).fill_(7)  # type: ignore[arg-type]
        assert bool((t == 7).all())
        assert c.is_current(lease.id) is True


def test_write_through_consumer_view_faults(served: tuple[FeaturePool, HandoffServer]) -> None:
    pool, server = served
    lease = pool.put(torch.zeros(4))
    code = (
        "import sys, torch; from pool.client import FeatureClient\n"
        f"c = FeatureClient.connect({str(server.path)!r})\n"
        f"t = c.open({lease.id!r})\n"
        "print('mapped', flush=True)\n"
        "t.fill_(1)\n"
        "print('WROTE', flush=True)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "mapped" in r.stdout and "WROTE" not in r.stdout
    assert r.returncode == -11  # SIGSEGV: the mapping is PROT_READ
    assert torch.equal(pool.read(lease.id), torch.zeros(4))


def test_release_acks_and_pool_recycles(served: tuple[FeaturePool, HandoffServer]) -> None:
    pool, server = served
    leases = [pool.put(torch.full((100,), float(i))) for i in range(5)]
    with FeatureClient.connect(server.path) as c:
        for i, lease in enumerate(leases):
            assert float(c.open(lease.id)[0]) == i
            c.release(lease.id)
        pool.reap()
        assert pool.stats()["tiers"][0]["used_bytes"] == 0
        assert pool.stats()["released"] == {"ack": 5}


@pytest.mark.parametrize("end", ["delete", "expiry"])
def test_release_by_id_of_an_ended_lease_still_acks(
    served: tuple[FeaturePool, HandoffServer], end: str
) -> None:
    """The README's pattern, ``open(id)`` then ``release(id)``, for a lease that ended while it
    was open (a DELETE, or its deadline): the lookup of the id fails, so the ack was never
    written and the memory stayed quarantined until the client hung up. Now the ack lands
    (the client remembers what it opened), then StaleLease says the lease had ended."""
    pool, server = served
    lease = pool.put(torch.full((100,), 3.0), ttl_s=0.2 if end == "expiry" else 60)
    with FeatureClient.connect(server.path) as c:
        assert float(c.open(lease.id)[0]) == 3.0
        if end == "delete":
            pool.release(lease.id)
        else:
            time.sleep(0.3)
            pool.reap()
        assert pool.stats()["quarantined_leases"] == 1  # held for our open view
        with pytest.raises(StaleLease):
            c.release(lease.id)
        pool.reap()
        assert pool.stats()["quarantined_leases"] == 0
        assert pool.stats()["tiers"][0]["used_bytes"] == 0


def test_stale_generation_is_detected(served: tuple[FeaturePool, HandoffServer]) -> None:
    pool, server = served
    old = pool.put(torch.ones(4))
    desc = pool.describe(old)
    pool.release(old.id)
    new = pool.put(torch.zeros(4))  # may reuse memory; never the same (slot, generation)
    with FeatureClient.connect(server.path) as c:
        with pytest.raises(StaleLease):
            c.open(desc)
        assert c.is_current(desc) is False
        assert torch.equal(c.open(new.id), torch.zeros(4))


def test_consumers_attached_is_counted(served: tuple[FeaturePool, HandoffServer]) -> None:
    pool, server = served
    with FeatureClient.connect(server.path), FeatureClient.connect(server.path):
        assert pool.stats()["consumers_attached"] == 2
    for _ in range(100):
        if pool.stats()["consumers_attached"] == 0:
            break
        import time

        time.sleep(0.01)
    assert pool.stats()["consumers_attached"] == 0


def test_peer_outside_allowlist_is_refused(tmp_path: Path) -> None:
    pool = FeaturePool([HostShmBackend([MiB])])
    server = HandoffServer(pool, tmp_path / "s.sock", allowed_uids=[os.getuid() + 4242])
    server.start()
    try:
        with pytest.raises(PeerRejected, match="not allowed"):
            FeatureClient.connect(server.path)
        assert pool.stats()["consumers_attached"] == 0
        assert pool.stats()["handoff_refused"] == {"unix": {"peer_not_allowed": 1}}
    finally:
        server.close()
        pool.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a peer as another user")
def test_peer_of_another_uid_is_refused() -> None:
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="featpool-peer-"))
    os.chmod(d, 0o755)
    pool = FeaturePool([HostShmBackend([MiB])])
    server = HandoffServer(pool, d / "s.sock")
    server.start()
    os.chmod(server.path, 0o666)  # let 'nobody' reach the socket: the allowlist must stop it
    code = (
        # Import as root (nobody cannot read this interpreter's files), then drop to nobody.
        "import os, sys\n"
        "from pool.client import FeatureClient\n"
        "from pool.errors import PeerRejected\n"
        "os.setgid(65534); os.setuid(65534)\n"
        f"try:\n    FeatureClient.connect({str(server.path)!r})\n"
        "except PeerRejected as e:\n    print('REJECTED', e)\n"
    )
    try:
        r = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=Path(__file__).parent.parent,
        )
        assert "REJECTED" in r.stdout and "uid 65534" in r.stdout, r.stderr
        assert pool.stats()["consumers_attached"] == 0
    finally:
        server.close()
        pool.close()
        shutil.rmtree(d)


# A process of another uid that took the socket's name first: it accepts connections and
# prints what each sent (a consumer's hello carries the token), then exits.
SQUATTER = """
import os, socket, sys
os.setgid(65534); os.setuid(65534)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sys.argv[1]); s.listen(4); s.settimeout(20)
print("listening", flush=True)
for _ in range(int(sys.argv[2])):
    c, _ = s.accept(); c.settimeout(2)
    try:
        print(repr(c.recv(4096)), flush=True)
    except OSError:
        print(repr(b""), flush=True)
    c.close()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the squatter as nobody")
def test_a_consumer_with_server_uids_sends_nothing_to_a_squatter() -> None:
    """A process of another uid took the socket's name (a group-writable directory, before the
    service started). A consumer told the service's uids (``server_uids``, or ``owner_uids``
    through discovery, where the entry is the service's own) refuses it before its hello: the
    squatter gets nothing, and so not the token. Without the check it gets the token."""
    import shutil
    import tempfile

    from pool import discovery
    from pool.errors import UntrustedProducer

    d = Path(tempfile.mkdtemp(prefix="featpool-squat-"))
    os.chmod(d, 0o777)
    path = d / "s.sock"
    squatter = subprocess.Popen(
        [sys.executable, "-c", SQUATTER, str(path), "3"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    try:
        assert squatter.stdout is not None and squatter.stdout.readline() == "listening\n"
        mine = [os.getuid()]
        with pytest.raises(UntrustedProducer, match="uid 65534"):
            FeatureClient.connect(path, token="s3cret", server_uids=mine, timeout_s=2)
        gpu = "GPU-00000000-0000-0000-0000-00000000000a"
        with (
            discovery.publish(path, gpu_uuid=gpu, device="cpu", transport="host_shm"),
            pytest.raises(UntrustedProducer, match="uid 65534"),
        ):
            FeatureClient.for_gpu(d, gpu_uuid=gpu, owner_uids=mine, token="s3cret")
        with pytest.raises((HandoffError, OSError)):  # believed: it reads the hello, says nothing
            FeatureClient.connect(path, token="s3cret", timeout_s=2)
        out, _ = squatter.communicate(timeout=30)
        got = out.splitlines()
        assert got[:2] == ["b''", "b''"], got  # the checked consumers sent nothing
        assert "s3cret" in got[2]  # the unchecked one sent its token
    finally:
        squatter.kill()
        shutil.rmtree(d, ignore_errors=True)


def test_server_uids_accept_the_service_and_are_only_for_unix_sockets(
    served: tuple[FeaturePool, HandoffServer],
) -> None:
    _, server = served
    with FeatureClient.connect(server.path, server_uids=[os.getuid()]) as client:
        assert client.epoch
    with pytest.raises(ValueError, match="server_uids"):
        FeatureClient("tcp://127.0.0.1:1", token="t", server_uids=[0])


def test_token_is_required_when_set(tmp_path: Path) -> None:
    pool = FeaturePool([HostShmBackend([MiB])])
    server = HandoffServer(pool, tmp_path / "s.sock", token="s3cret")
    server.start()
    try:
        with pytest.raises(PeerRejected, match="token"):
            FeatureClient.connect(server.path)
        with pytest.raises(PeerRejected):
            FeatureClient.connect(server.path, token="wrong")
        with FeatureClient.connect(server.path, token="s3cret") as c:
            assert c.epoch
    finally:
        server.close()
        pool.close()


def test_socket_file_mode_is_0660(served: tuple[FeaturePool, HandoffServer]) -> None:
    _, server = served
    assert (server.path.stat().st_mode & 0o777) == 0o660


def test_malformed_messages_never_kill_the_server(
    served: tuple[FeaturePool, HandoffServer],
) -> None:
    pool, server = served
    garbage = [
        b"\x00\x00\x00\x05hello",  # not JSON
        b"\xff\xff\xff\xff",  # absurd length
        b"\x00\x00\x00\x02[]",  # JSON, not an object
        struct.pack(">I", 13) + b'{"op": "xyz"}',  # first message must be hello
        b"\x00\x00",  # truncated header, then EOF
    ]
    for payload in garbage:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(str(server.path))
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        data = s.recv(65536)
        s.close()
        assert data == b"" or b"protocol_error" in data
    # After a hello, unknown ops and bad arguments get errors and the connection lives on.
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(server.path))
    send_msg(s, {"op": "hello", "version": PROTOCOL_VERSION})
    _, fds = recv_msg(s, want_fds=True)
    for fd in fds:
        os.close(fd)
    for bad in (
        {"op": "frobnicate"},
        {"op": "lookup"},
        {"op": "renew", "lease_id": 5},
        {"op": "lookup", "lease_id": "nope"},
    ):
        send_msg(s, bad)
        reply, _ = recv_msg(s)
        assert reply["op"] == "error"
    s.close()
    lease = pool.put(torch.ones(3))
    with FeatureClient.connect(server.path) as c:
        assert torch.equal(c.open(lease.id), torch.ones(3))


def test_producer_restart_is_detected_and_reattach_works(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    pool = FeaturePool([HostShmBackend([MiB])])
    server = HandoffServer(pool, path)
    server.start()
    lease = pool.put(torch.ones(3))
    desc = pool.describe(lease)
    client = FeatureClient.connect(path)
    held = client.open(desc)
    server.close()
    pool.close()
    # The consumer's mapping outlives the producer.
    assert torch.equal(held, torch.ones(3))

    pool2 = FeaturePool([HostShmBackend([MiB])])
    server2 = HandoffServer(pool2, path)
    server2.start()
    try:
        with pytest.raises(PoolRestarted):
            client.lookup(lease.id)
        client.reattach()
        with pytest.raises(PoolRestarted, match="epoch"):
            client.open(desc)
        new = pool2.put(torch.zeros(2))
        assert torch.equal(client.open(new.id), torch.zeros(2))
    finally:
        client.close()
        server2.close()
        pool2.close()


def test_second_server_on_a_live_socket_is_refused(
    served: tuple[FeaturePool, HandoffServer],
) -> None:
    pool, server = served
    second = HandoffServer(pool, server.path)
    with pytest.raises(HandoffError, match="another featpool server"):
        second.start()
    second.close()  # as the engine's stop() does after a failed start: the file is not its own
    assert server.path.exists()
    with FeatureClient.connect(server.path) as c:
        assert c.epoch


def test_inline_leases_are_released_over_the_socket(tmp_path: Path) -> None:
    pool = FeaturePool([HostShmBackend([4096])])
    server = HandoffServer(pool, tmp_path / "s.sock")
    server.start()
    try:
        lease = pool.put(torch.zeros(4096))  # larger than the slab: inline
        assert lease.tier == "inline"
        with FeatureClient.connect(server.path) as c:
            with pytest.raises(Exception, match="inline"):
                c.open(lease.id)
            c.release(lease.id)
        assert pool.stats()["leases_active"] == 0
    finally:
        server.close()
        pool.close()


def test_leases_of_different_shapes_carry_their_grid(
    served: tuple[FeaturePool, HandoffServer],
) -> None:
    """Dynamic-resolution features: each image its own lease of its own shape, and the
    consumer learns each one's grid over the socket (lookup) as HTTP clients do."""
    from pool.leases import ImageGrid

    pool, server = served
    feats = [torch.randn(6, 8), torch.randn(15, 8), torch.randn(8)]
    grids = [ImageGrid(1, 4, 6, 6), ImageGrid(1, 6, 10, 15), None]
    leases = pool.put_many(feats, None, grids)
    with FeatureClient.connect(server.path) as c:
        for lease, x, grid in zip(leases, feats, grids, strict=True):
            assert not isinstance(lease, Exception)
            desc = c.lookup(lease.id)
            assert desc["shape"] == list(x.shape)
            assert desc["grid_thw"] == ([grid.t, grid.h, grid.w] if grid else None)
            assert desc["tokens"] == (grid.tokens if grid else None)
            assert torch.equal(c.open(desc), x)
            c.release(desc)
    with pytest.raises(ValueError, match="grids"):
        pool.put_many(feats, None, grids[:2])


def test_a_pool_whose_welcome_would_not_fit_in_one_message_does_not_start(
    tmp_path: Path,
) -> None:
    """A consumer's welcome carries the control block, its ack block and one FD per slab in one
    message (at most MAX_FDS): with 248 slabs a consumer attaches and reads; with 249 the pool
    refuses to start, instead of starting and then dropping every consumer's connection."""
    fits = MAX_FDS - 2
    with pytest.raises(HandoffError, match="--slab-bytes"):
        FeaturePool([HostShmBackend([4096] * (fits + 1))], max_leases=4)
    pool = FeaturePool([HostShmBackend([4096] * fits)], max_leases=4)
    server = HandoffServer(pool, tmp_path / "s.sock")
    server.start()
    try:
        lease = pool.put(torch.arange(8, dtype=torch.float32))
        with FeatureClient.connect(server.path) as client:
            assert torch.equal(client.open(lease.id), torch.arange(8, dtype=torch.float32))
            client.release(lease.id)
    finally:
        server.close()
        pool.close()


@pytest.mark.parametrize(
    "hello",
    [
        b'{"op": "hello", "version": 2.0}',  # a float is not the version
        b'{"op": "hello", "version": true}',
        b'{"op": "hello", "version": 2, "x": NaN}',  # not JSON
        '{"op": "hello", "version": 2}'.encode("utf-16"),  # JSON is UTF-8 here
    ],
)
def test_a_hello_that_is_not_the_protocols_json_is_refused(
    served: tuple[FeaturePool, HandoffServer], hello: bytes
) -> None:
    """The frame body is UTF-8 JSON (docs/protocol.md 1) and the version an integer: Python's
    json would otherwise read UTF-16, NaN, and take 2.0 or true for 2."""
    _, server = served
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(str(server.path))
    s.sendall(struct.pack(">I", len(hello)) + hello)
    reply, fds = recv_msg(s, want_fds=True) if hello.startswith(b"{") else ({}, [])
    if not hello.startswith(b"{"):  # not even a frame the server can answer: it hangs up
        s.shutdown(socket.SHUT_WR)
        data = s.recv(65536)
        assert data == b"" or b"protocol_error" in data
    else:
        assert reply["op"] == "error" and reply["type"] == "protocol_error" and fds == []
    s.close()


def test_fds_lost_in_transit_are_an_error_and_none_is_kept() -> None:
    """A reader that gets MSG_CTRUNC (more FDs came than it had room for: the kernel closed the
    rest) has a broken set: the client closes what it got and says so."""
    import array

    ours, theirs = socket.socketpair()
    r, w = os.pipe()
    try:
        before = len(os.listdir("/proc/self/fd"))
        body = b'{"op": "welcome"}'
        rights = array.array("i", [r] * (MAX_FDS + 2))
        ours.sendmsg(
            [struct.pack(">I", len(body)) + body], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)]
        )
        with pytest.raises(HandoffError, match="lost"):
            recv_msg(theirs, want_fds=True)
        assert len(os.listdir("/proc/self/fd")) == before
    finally:
        for fd in (r, w):
            os.close(fd)
        ours.close()
        theirs.close()


def test_a_timed_out_request_does_not_leave_its_answer_for_the_next_one(
    served: tuple[FeaturePool, HandoffServer],
) -> None:
    """A lookup that times out (the producer busy past the client's timeout) leaves its answer
    on the connection: read as the next request's answer, open(B) returned A's bytes. The
    client drops that connection instead; reattach() gets a clean one."""
    pool, server = served
    a, b = pool.put(torch.full((4,), 1.0)), pool.put(torch.full((4,), 2.0))
    with FeatureClient.connect(server.path, timeout_s=0.3) as client:
        # the producer holds its lock longer than the client waits
        with pool._lock, pytest.raises(TimeoutError):
            client.lookup(a.id)
        time.sleep(0.2)  # the late answer arrives
        # Said as it is: the connection was dropped (not "closed; connect again").
        with pytest.raises(HandoffError, match=r"dropped after a failed 'lookup'.*reattach"):
            client.open(b.id)
        client.reattach()
        assert torch.equal(client.open(b.id), torch.full((4,), 2.0))
        client.release(b.id)


def test_close_after_a_bug_killed_the_loop_still_cleans_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The loop logs and ends on a bug of its own; close() must still remove the socket file
    (it asserted the loop's wake-up socket was there, and raised before cleaning up)."""

    class Buggy(HandoffServer):
        def _admit(self, sock: socket.socket) -> None:  # type: ignore[override]
            raise ValueError("a bug")

    pool = FeaturePool([HostShmBackend([1 << 20])], max_leases=4)
    server = Buggy(pool, tmp_path / "s.sock")
    server.start()
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(server.path))
            thread = server._thread
            assert thread is not None
            thread.join(5)
            assert not thread.is_alive()
        assert "the hand-off loop failed" in caplog.text
        server.close()
        assert not server.path.exists()
    finally:
        pool.close()


def _stale_socket(path: Path) -> None:
    """A socket file nobody listens on, as a crashed server leaves it."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()


def _reachable(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def test_two_servers_clearing_one_stale_socket_leave_no_orphan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two servers start on a path a crashed one left. The second starts right when the first
    has found the leftover and is about to remove it. Whichever starts must be reachable: the
    first must not remove the second's fresh socket as the leftover (no server may end up
    listening on a name nobody can reach)."""
    path = tmp_path / "s.sock"
    _stale_socket(path)
    pool = FeaturePool([HostShmBackend([4096])])
    first, second = HandoffServer(pool, path), HandoffServer(pool, path)
    started: list[HandoffServer] = []
    errors: list[Exception] = []
    real_unlink = Path.unlink

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if self == path and not started and not errors:  # the first's removal of the leftover
            try:
                second.start()
                started.append(second)
            except HandoffError as e:
                errors.append(e)
        real_unlink(self, missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    try:
        first.start()
        started.append(first)
        monkeypatch.undo()
        assert errors and "another featpool server" in str(errors[0])
        assert started == [first] and _reachable(path)
    finally:
        monkeypatch.undo()
        for s in (second, first):
            s.close()
        pool.close()


def test_server_starting_while_another_closes_stays_reachable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server closes (its listening socket gone, its file not yet removed) while another
    starts on the same path: the closing one must not remove the newcomer's socket file."""
    path = tmp_path / "s.sock"
    pool = FeaturePool([HostShmBackend([4096])])
    old, new = HandoffServer(pool, path), HandoffServer(pool, path)
    old.start()
    real_cleanup = HandoffServer._cleanup
    outcome: list[str] = []

    def cleanup(self: HandoffServer) -> None:
        if self is old and not outcome:
            try:
                new.start()
                outcome.append("started")
            except HandoffError:
                outcome.append("refused")
        real_cleanup(self)

    monkeypatch.setattr(HandoffServer, "_cleanup", cleanup)
    try:
        old.close()
        monkeypatch.undo()
        if outcome == ["refused"]:  # refused while the old one still held the path: retry
            new.start()
        assert _reachable(path)
        with FeatureClient.connect(path) as c:
            assert c.epoch
    finally:
        monkeypatch.undo()
        new.close()
        pool.close()
    assert not path.exists()


def test_attach_racing_close_leaks_no_ack_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool closes while a consumer's welcome is being built: the attach fails, and the ack
    block and FDs made for it are closed (close() could not see them yet)."""
    from pool import featurepool
    from pool.control import AckBlock
    from pool.errors import PoolError

    pool = FeaturePool([HostShmBackend([4096])])
    backend = pool.tiers[0].backend
    made: list[AckBlock] = []
    real_create = AckBlock.create.__func__  # type: ignore[attr-defined]
    real_fds = backend.consumer_fds

    def create(cls: type[AckBlock], nslots: int) -> AckBlock:
        made.append(real_create(cls, nslots))
        return made[-1]

    def fds_then_close() -> list[int]:
        fds = real_fds()
        pool.close()  # another thread's close, landing mid-attach
        return fds

    monkeypatch.setattr(featurepool.AckBlock, "create", classmethod(create))
    monkeypatch.setattr(backend, "consumer_fds", fds_then_close)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(PoolError, match="closed"):
        pool.attach_consumer("racer")
    assert len(made) == 1 and made[0].fd == -1  # closed
    assert not pool._consumers
    assert len(os.listdir("/proc/self/fd")) <= before


def test_closed_server_leaves_no_files_and_a_crashed_ones_lock_is_taken_over(
    tmp_path: Path,
) -> None:
    """close() removes the socket and its lock file; a server that died holding the lock (the
    kernel dropped its flock, its files stayed) is replaced by the next one on that path."""
    path = tmp_path / "s.sock"
    pool = FeaturePool([HostShmBackend([4096])])
    server = HandoffServer(pool, path)
    server.start()
    lock = tmp_path / "s.sock.lock"
    assert lock.exists()
    server.close()
    assert sorted(os.listdir(tmp_path)) == []
    _stale_socket(path)
    lock.touch()  # what a SIGKILLed server leaves: both files, no lock held
    again = HandoffServer(pool, path)
    again.start()
    try:
        assert _reachable(path)
    finally:
        again.close()
        pool.close()
    assert sorted(os.listdir(tmp_path)) == []


def test_lock_taken_on_a_removed_lock_file_is_taken_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server opens the lock file just as the previous server removes it (close) and a third
    makes a new one: its flock then holds a file no longer at the name. It must lock the file
    that is there, or the third would take the path too."""
    from pool import socket_file

    path = tmp_path / "s.sock"
    lock = tmp_path / "s.sock.lock"
    pool = FeaturePool([HostShmBackend([4096])])
    real_flock = socket_file.fcntl.flock
    calls = []

    def flock(fd: int, op: int) -> None:
        calls.append(fd)
        if len(calls) == 1:  # between our open and our flock: the file is replaced
            lock.unlink()
            lock.touch()
        real_flock(fd, op)

    monkeypatch.setattr(socket_file.fcntl, "flock", flock)
    first = HandoffServer(pool, path)
    first.start()
    monkeypatch.undo()
    second = HandoffServer(pool, path)
    try:
        assert len(calls) == 2  # it retried
        with pytest.raises(HandoffError, match="another featpool server"):
            second.start()
        assert _reachable(path)
    finally:
        second.close()
        first.close()
        pool.close()
