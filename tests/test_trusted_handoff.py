"""The host tier's hand-off against an admitted consumer that misbehaves (right uid, right
token), and against ordinary mistakes: docs/security.md ties each defence to a test here.

Attacks on the FDs use a raw connection (what a hostile process would do); the rest use
FeatureClient. Whatever could crash the test process if a defence were missing (a view used
after its mapping is gone) runs in a child process.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pool import control, featurepool
from pool.backends.host_shm import HostShmBackend
from pool.client import FeatureClient
from pool.control import gen_reached
from pool.errors import HandoffError, LeaseExpired, LeaseReleased, PoolRestarted, StaleLease
from pool.featurepool import FeaturePool
from pool.protocol import PROTOCOL_VERSION, recv_msg, send_msg
from pool.server import HandoffServer
from tests.conftest import FakeClock

ROOT = Path(__file__).resolve().parents[1]
SLAB = 1 << 20


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[FeaturePool, HandoffServer, FakeClock]]:
    clock = FakeClock()
    pool = FeaturePool([HostShmBackend([SLAB, SLAB])], max_leases=8, clock=clock)
    server = HandoffServer(pool, tmp_path / "fp.sock")
    server.start()
    yield pool, server, clock
    server.close()
    pool.close()


def raw_attach(path: Path) -> tuple[socket.socket, dict[str, Any], list[int]]:
    """What a hostile consumer holds after a normal hello: the welcome and its FDs."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(path))
    send_msg(s, {"op": "hello", "version": PROTOCOL_VERSION})
    msg, fds = recv_msg(s, want_fds=True)
    assert msg["op"] == "welcome" and len(fds) == 2 + len(msg["slabs"])
    return s, msg, fds


def close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


# ---- the slabs: read-only FDs, sealed memfds -----------------------------------------------


def test_received_slab_fd_cannot_be_mapped_writable(
    served: tuple[FeaturePool, HandoffServer, FakeClock],
) -> None:
    _, server, _ = served
    s, msg, fds = raw_attach(server.path)
    try:
        slab_fd = fds[2]
        for fd in (fds[0], *fds[2:]):  # the control block and every slab: opened read-only
            assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        with pytest.raises(PermissionError):
            mmap.mmap(slab_fd, msg["slabs"][0]["size"], mmap.MAP_SHARED, mmap.PROT_WRITE)
        with pytest.raises(OSError):
            os.write(slab_fd, b"x")
    finally:
        s.close()
        close_all(fds)


def test_reopening_a_slab_read_write_still_cannot_write_it(
    served: tuple[FeaturePool, HandoffServer, FakeClock],
) -> None:
    """``open("/proc/self/fd/N", O_RDWR)`` hands back a writable FD of a memfd (its inode is
    0777): the F_SEAL_FUTURE_WRITE seal is what refuses writable mappings and writes then."""
    pool, server, _ = served
    t = torch.arange(64, dtype=torch.float32)
    lease = pool.put(t)
    s, msg, fds = raw_attach(server.path)
    try:
        rw = os.open(f"/proc/self/fd/{fds[2]}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):  # EPERM: sealed
                mmap.mmap(rw, msg["slabs"][0]["size"], mmap.MAP_SHARED, mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.pwrite(rw, b"\xff" * 256, lease.extent.offset)  # type: ignore[union-attr]
        finally:
            os.close(rw)
    finally:
        s.close()
        close_all(fds)
    assert torch.equal(pool.read(lease.id), t)


def test_truncating_a_slab_is_refused_and_the_producer_keeps_working(
    served: tuple[FeaturePool, HandoffServer, FakeClock],
) -> None:
    """Shrinking the memfd would make the producer's next copy into it SIGBUS."""
    pool, server, _ = served
    s, _, fds = raw_attach(server.path)
    try:
        for fd in fds[2:]:
            with pytest.raises(OSError):
                os.ftruncate(fd, 0)
            rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
            try:
                for size in (0, 4096, 4 * SLAB):  # neither shrink nor grow
                    with pytest.raises(PermissionError):
                        os.ftruncate(rw, size)
            finally:
                os.close(rw)
            assert os.fstat(fd).st_size == SLAB
    finally:
        s.close()
        close_all(fds)
    for i in range(6):  # fills both slabs' space over time: every copy lands
        t = torch.full((SLAB // 8,), float(i))
        lease = pool.put(t)
        assert lease.tier == "host" and torch.equal(pool.read(lease.id), t)
        pool.release(lease.id)


# ---- the control block: read-only to consumers ---------------------------------------------


def test_control_block_cannot_be_written_by_a_consumer(
    served: tuple[FeaturePool, HandoffServer, FakeClock],
) -> None:
    """Zeroing the epoch in the header would make every later connect fail; writing gen or
    ready words would pass a recycled or unpublished slot off as live."""
    pool, server, _ = served
    lease = pool.put(torch.ones(8))
    s, msg, fds = raw_attach(server.path)
    try:
        ctrl_fd = fds[0]
        size = msg["control_size"]
        with pytest.raises(PermissionError):
            mmap.mmap(ctrl_fd, size, mmap.MAP_SHARED, mmap.PROT_WRITE)
        rw = os.open(f"/proc/self/fd/{ctrl_fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(rw, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.pwrite(rw, b"\0" * 8, 16)  # the epoch
            word = 64 + 16 * lease.slot
            with pytest.raises(PermissionError):
                os.pwrite(rw, b"\0" * 8, word)  # gen and ready
            with pytest.raises(PermissionError):
                os.ftruncate(rw, 0)
        finally:
            os.close(rw)
    finally:
        s.close()
        close_all(fds)
    with FeatureClient.connect(server.path) as client:  # the header is intact
        assert client.epoch == featurepool.epoch_hex(pool.epoch)
        assert client._ctrl is not None
        with pytest.raises(ValueError, match="read-only"):  # the mapping itself is read-only
            client._ctrl.set_ready(lease.slot, 0)
        desc = pool.describe(lease).wire()
        assert torch.equal(client.open(desc), torch.ones(8))
        client.release(desc)


def test_a_release_the_producer_acts_on_at_once_is_not_called_stale(
    served: tuple[FeaturePool, HandoffServer, FakeClock],
) -> None:
    """The producer's reaper (another process) may free the slot as soon as the ack lands,
    before the consumer's next instruction: a lease that was live when it was acked is not
    reported as having already ended (bench/load_test.py hit this under load)."""
    pool, server, _ = served
    lease = pool.put(torch.randn(8))
    desc = pool.describe(lease).wire()
    with FeatureClient.connect(server.path) as client:
        client.open(desc)
        acks = client._acks
        assert acks is not None
        write_ack = acks.set_ack

        def ack_then_reap(slot: int, gen: int) -> None:
            write_ack(slot, gen)
            assert pool.reap() == 1  # the reaper ran right after the ack landed

        acks.set_ack = ack_then_reap  # type: ignore[method-assign]
        client.release(desc)  # no StaleLease: it was live when acked
        assert not client.is_current(desc)
        with pytest.raises(LeaseReleased):
            pool.get(lease.id)


def test_each_consumer_gets_an_ack_block_of_its_own(
    served: tuple[FeaturePool, HandoffServer, FakeClock],
) -> None:
    """A hostile consumer writes its own ack words only: acking a lease that another
    consumer has open does not end it, and its bytes stay."""
    pool, server, _ = served
    t = torch.randn(16, 16)
    lease = pool.put(t)
    desc = pool.describe(lease).wire()
    s, msg, fds = raw_attach(server.path)
    try:
        with FeatureClient.connect(server.path) as reader:
            view = reader.open(desc)
            ack_fd = fds[1]
            hostile = mmap.mmap(ack_fd, msg["ack_size"], mmap.MAP_SHARED)
            words = memoryview(hostile).cast("I")
            for slot in range(msg["nslots"]):  # ack every slot's every plausible generation
                words[2 * slot + 1] = lease.generation
            with pytest.raises(PermissionError):
                os.ftruncate(ack_fd, 0)  # its own block is sealed too
            assert pool.reap() == 0
            assert pool.get(lease.id) is lease  # still live: the reader has it open
            assert torch.equal(view, t)
            reader.release(desc)
            assert pool.reap() == 1  # now every opener acked
            words.release()
            hostile.close()
    finally:
        s.close()
        close_all(fds)


# ---- several consumers, quarantine ---------------------------------------------------------


def test_two_consumers_reading_one_lease_first_ack_does_not_recycle_it(
    served: tuple[FeaturePool, HandoffServer, FakeClock],
) -> None:
    pool, server, _ = served
    t = torch.randn(256, 64)
    lease = pool.put(t)
    desc = pool.describe(lease).wire()
    with (
        FeatureClient.connect(server.path) as a,
        FeatureClient.connect(server.path) as b,
    ):
        va, vb = a.open(desc), b.open(desc)
        a.release(desc)
        assert pool.reap() == 0 and a.is_current(desc)
        others = [pool.put(torch.zeros(256, 64)) for _ in range(4)]  # would reuse its extent
        assert all(o.extent != lease.extent for o in others)  # type: ignore[comparison-overlap]
        assert torch.equal(vb, t) and torch.equal(va, t)
        b.release(desc)
        assert pool.reap() == 1
        with pytest.raises(LeaseReleased):
            pool.get(lease.id)


def test_an_opened_lease_past_its_deadline_is_quarantined_until_its_reader_acks(
    served: tuple[FeaturePool, HandoffServer, FakeClock],
) -> None:
    pool, server, clock = served
    t = torch.randn(SLAB // 4 // 2)  # half a slab
    lease = pool.put(t, ttl_s=5)
    desc = pool.describe(lease).wire()
    with FeatureClient.connect(server.path) as client:
        view = client.open(desc)
        clock.advance(6)
        assert pool.reap() == 1
        with pytest.raises(LeaseExpired):
            pool.get(lease.id)
        assert not client.is_current(desc)  # ended: the consumer can tell
        stats = pool.stats()
        assert stats["quarantined_leases"] == 1 and stats["quarantine"] == {"held": 1}
        assert stats["tiers"][0]["used_bytes"] == lease.extent.size  # type: ignore[union-attr]
        for _ in range(3):  # new leases go elsewhere, never over the quarantined bytes
            other = pool.put(torch.full_like(t, 7.0))
            assert other.extent != lease.extent
            assert other.slot != lease.slot  # nor into its slot (its ack words still count)
        assert torch.equal(view, t)
        with pytest.raises(StaleLease):  # acked anyway: that frees it
            client.release(desc)
        pool.reap()
        assert pool.stats()["quarantined_leases"] == 0
        assert pool.stats()["quarantine"] == {"held": 1, "released": 1}


def test_delete_of_an_opened_lease_quarantines_it_until_the_reader_detaches(
    served: tuple[FeaturePool, HandoffServer, FakeClock],
) -> None:
    pool, server, _ = served
    lease = pool.put(torch.ones(1024))
    desc = pool.describe(lease).wire()
    client = FeatureClient.connect(server.path)
    client.open(desc)
    pool.release(lease.id)  # DELETE /v1/leases/{id}
    with pytest.raises(LeaseReleased):
        pool.get(lease.id)
    assert pool.stats()["quarantined_leases"] == 1
    client.close()  # its connection ends: the server detaches it
    for _ in range(200):
        if pool.stats()["quarantined_leases"] == 0:
            break
        threading.Event().wait(0.01)
    assert pool.stats()["quarantined_leases"] == 0
    assert pool.stats()["tiers"][0]["used_bytes"] == 0


def test_another_consumers_release_ends_the_lease_but_not_its_readers_bytes(
    served: tuple[FeaturePool, HandoffServer, FakeClock],
) -> None:
    """docs/security.md: an admitted consumer that knows a lease's ID can end it with the
    socket's `release`, as a DELETE would; a consumer that has it open keeps reading its own
    bytes (quarantine) while the pool hands out more leases, and then sees it ended."""
    pool, server, _ = served
    lease = pool.put(torch.ones(1024))
    with (
        FeatureClient.connect(server.path) as reader,
        FeatureClient.connect(server.path) as other,
    ):
        desc = pool.describe(lease).wire()
        view = reader.open(desc)
        # the protocol's own request (FeatureClient.release acks instead, as a reader should)
        assert other._request({"op": "release", "lease_id": lease.id})["op"] == "released"
        with pytest.raises(LeaseReleased):
            pool.get(lease.id)
        assert pool.stats()["quarantined_leases"] == 1
        others = [pool.put(torch.full((1024,), 2.0)) for _ in range(3)]
        assert torch.equal(view, torch.ones(1024))
        assert not reader.is_current(desc)
        for o in others:
            pool.release(o.id)


def test_quarantine_ends_at_its_limit_for_a_reader_that_never_acks(tmp_path: Path) -> None:
    clock = FakeClock()
    pool = FeaturePool([HostShmBackend([SLAB])], max_leases=4, quarantine_s=30, clock=clock)
    server = HandoffServer(pool, tmp_path / "fp.sock")
    server.start()
    try:
        lease = pool.put(torch.ones(64), ttl_s=1)
        with FeatureClient.connect(server.path) as client:
            client.open(pool.describe(lease).wire())
            clock.advance(2)
            pool.reap()
            clock.advance(29)
            pool.reap()
            assert pool.stats()["quarantined_leases"] == 1
            clock.advance(2)
            pool.reap()
            assert pool.stats()["quarantined_leases"] == 0
            assert pool.stats()["quarantine"] == {"held": 1, "timed_out": 1}
    finally:
        server.close()
        pool.close()


def test_a_consumer_opening_as_the_lease_ends_is_seen_after_the_gen_word_is_cleared(
    served: tuple[FeaturePool, HandoffServer, FakeClock], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race: a consumer marks ``opened`` just after the reaper decided the lease is done.
    The producer clears ``gen`` first and reads the marks after a fence, so it sees that mark
    and keeps the memory (and the consumer, reading ``gen`` after its mark, sees the clear)."""
    pool, server, _ = served
    lease = pool.put(torch.ones(64))
    desc = pool.describe(lease).wire()
    with FeatureClient.connect(server.path) as client:
        assert client._acks is not None
        acks = client._acks
        real_fence = control.full_fence

        def consumer_marks_now() -> None:  # the consumer's store lands here
            acks.set_opened(lease.slot, lease.generation)
            real_fence()

        monkeypatch.setattr(featurepool, "full_fence", consumer_marks_now)
        pool.release(lease.id)
        assert pool.stats()["quarantined_leases"] == 1
        assert not client.is_current(desc)


# ---- staleness with a forced slot reuse ----------------------------------------------------


def test_forced_slot_reuse_is_current_compares_generations_and_old_acks_do_not_count(
    tmp_path: Path,
) -> None:
    pool = FeaturePool([HostShmBackend([SLAB])], max_leases=1)  # every lease gets slot 0
    server = HandoffServer(pool, tmp_path / "fp.sock")
    server.start()
    try:
        with FeatureClient.connect(server.path) as client:
            old = pool.describe(pool.put(torch.ones(8))).wire()
            client.release(old)
            assert pool.reap() == 1
            new_lease = pool.put(torch.full((8,), 2.0))
            new = pool.describe(new_lease).wire()
            assert new["slot"] == old["slot"] and new["generation"] == old["generation"] + 1
            assert not client.is_current(old)
            assert client.is_current(new)
            with pytest.raises(StaleLease):
                client.open(old)
            with pytest.raises(StaleLease):  # its ack word now says the old generation
                client.release(old)
            assert pool.reap() == 0
            assert pool.get(new_lease.id) is new_lease
            assert torch.equal(client.open(new), torch.full((8,), 2.0))
    finally:
        server.close()
        pool.close()


def test_ready_compares_across_the_32_bit_wrap() -> None:
    top = 2**32 - 1
    assert gen_reached(top, top) and gen_reached(1, top) and gen_reached(2, 1)
    assert not gen_reached(top, 1)  # the last generation before the wrap is not the first after
    assert not gen_reached(0, 1) and not gen_reached(top - 1, top)


# ---- views outlive close and reattach; old epochs ------------------------------------------

_VIEW_SCRIPT = """
import json, sys, torch
from pool.client import FeatureClient
path, desc = sys.argv[1], json.loads(sys.argv[2])
client = FeatureClient.connect(path)
view = client.open(desc)
before = view.clone()
client.close()
after_close = torch.equal(view, before)
client = FeatureClient.connect(path)
old_ptr = view.data_ptr()
client.reattach()
print(json.dumps({"after_close": after_close, "after_reattach": torch.equal(view, before),
                  "sum": float(view.sum()), "ptr_kept": view.data_ptr() == old_ptr}))
client.close()
"""


def test_a_view_outlives_close_and_reattach(
    served: tuple[FeaturePool, HandoffServer, FakeClock],
) -> None:
    """Without the mapping kept alive by its views this child dies of SIGSEGV (close unmaps
    under the tensor) or reads the new pool's bytes (reattach maps at the old address)."""
    pool, server, _ = served
    t = torch.arange(4096, dtype=torch.float32)
    desc = pool.describe(pool.put(t)).wire()
    out = subprocess.run(
        [sys.executable, "-c", _VIEW_SCRIPT, str(server.path), json.dumps(desc)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {
        "after_close": True,
        "after_reattach": True,
        "sum": float(t.sum()),
        "ptr_kept": True,
    }


def test_old_epoch_release_renew_and_is_current_raise_pool_restarted(tmp_path: Path) -> None:
    path = tmp_path / "fp.sock"
    pool = FeaturePool([HostShmBackend([SLAB])], max_leases=4)
    server = HandoffServer(pool, path)
    server.start()
    client = FeatureClient.connect(path)
    try:
        old = pool.describe(pool.put(torch.ones(4))).wire()
        view = client.open(old)
        server.close()
        pool.close()
        pool = FeaturePool([HostShmBackend([SLAB])], max_leases=4)
        server = HandoffServer(pool, path)
        server.start()
        client.reattach()
        new = pool.describe(pool.put(torch.zeros(4))).wire()
        assert new["slot"] == old["slot"] and new["offset"] == old["offset"]
        for call in (client.release, client.renew, client.is_current, client.open):
            with pytest.raises(PoolRestarted):
                call(old)
        assert torch.equal(view, torch.ones(4))  # the old pool's bytes, not the new one's
        assert torch.equal(client.open(new), torch.zeros(4))
    finally:
        client.close()
        server.close()
        pool.close()


# ---- attach failures close each FD once ----------------------------------------------------


def test_attach_failure_closes_each_received_fd_exactly_once(
    served: tuple[FeaturePool, HandoffServer, FakeClock],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A welcome the client cannot map (an unknown transport after a good slab): every FD it
    received is closed, none twice (a second close could hit an FD another thread opened)."""
    pool, _, _ = served
    path = tmp_path / "bad.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def serve_once() -> None:
        conn, _ = listener.accept()
        recv_msg(conn)
        att = pool.attach_consumer("test")
        att.welcome["slabs"][1]["transport"] = "bogus"
        send_msg(conn, att.welcome, att.fds)
        att.close_fds()
        pool.detach_consumer(att.consumer_id)
        conn.recv(1)
        conn.close()

    thread = threading.Thread(target=serve_once)
    thread.start()
    closed: list[int] = []
    real_close = os.close

    me = threading.get_ident()

    def counting_close(fd: int) -> None:
        if threading.get_ident() == me:  # the client's closes, not the server thread's
            closed.append(fd)
        real_close(fd)

    received: list[int] = []
    real_recv_fds = socket.recv_fds

    def recording_recv_fds(*args: Any, **kwargs: Any) -> Any:
        got = real_recv_fds(*args, **kwargs)
        received.extend(got[1])
        return got

    monkeypatch.setattr(os, "close", counting_close)
    monkeypatch.setattr(socket, "recv_fds", recording_recv_fds)
    try:
        with pytest.raises(HandoffError, match="unknown transport"):
            FeatureClient.connect(path)
    finally:
        monkeypatch.undo()
        thread.join(timeout=10)
        listener.close()
    assert len(received) == 4  # control block, ack block, two slabs
    for fd in received:
        assert closed.count(fd) == 1, (fd, closed)
        with pytest.raises(OSError):
            os.fstat(fd)


# ---- a producer that dies before publishing ------------------------------------------------


def test_open_of_a_lease_never_published_times_out_and_holds_nothing(
    served: tuple[FeaturePool, HandoffServer, FakeClock],
) -> None:
    """What a consumer sees when the producer died between the reservation and the copy: the
    ready word never reaches the generation. ``open`` gives up after its timeout."""
    pool, server, _ = served
    t = torch.ones(32)
    lease, _ = pool._reserve(t, t.numel() * 4, 10.0)  # reserved, never published
    desc = pool.describe(lease).wire()
    with FeatureClient.connect(server.path) as client:
        assert client._ctrl is not None
        assert not gen_reached(client._ctrl.ready(lease.slot), lease.generation)
        with pytest.raises(TimeoutError, match=r"not published after 0\.2s"):
            client.open(desc, timeout_s=0.2)
        assert client._acks is not None  # its opened mark was withdrawn
        assert client._acks.acks[lease.slot] == lease.generation
    pool._undo([lease])  # the reservation given back (a reserved lease is nobody's to release)
    assert pool.stats()["quarantined_leases"] == 0


def test_acks_written_just_before_a_disconnect_still_count(
    served: tuple[FeaturePool, HandoffServer, FakeClock],
) -> None:
    """A consumer that releases and closes at once: its ack block goes with its connection, so
    the producer reads that block's acks before dropping it."""
    pool, server, _ = served
    leases = [pool.put(torch.ones(64)) for _ in range(3)]
    with FeatureClient.connect(server.path) as client:
        for lease in leases:
            client.open(pool.describe(lease).wire())
            client.release(pool.describe(lease).wire())
    for _ in range(200):
        if len(pool.leases) == 0:
            break
        threading.Event().wait(0.01)
    assert len(pool.leases) == 0  # no reaper runs in this fixture: the detach reaped them
    assert pool.stats()["released"] == {"ack": 3}


def test_quarantine_is_exported_as_metrics(
    served: tuple[FeaturePool, HandoffServer, FakeClock],
) -> None:
    from prometheus_client import CollectorRegistry

    from app.metrics import PoolCollector

    pool, server, clock = served
    registry = CollectorRegistry()
    registry.register(PoolCollector(pool.stats))
    lease = pool.put(torch.ones(1024), ttl_s=1)
    desc = pool.describe(lease).wire()
    with FeatureClient.connect(server.path) as client:
        client.open(desc)
        clock.advance(2)
        pool.reap()
        sample = registry.get_sample_value
        assert sample("featpool_lease_quarantine_total", {"outcome": "held"}) == 1
        assert sample("featpool_quarantined_leases") == 1
        assert sample("featpool_quarantined_bytes") == 4096
        with pytest.raises(StaleLease):
            client.release(desc)
        pool.reap()
        assert sample("featpool_lease_quarantine_total", {"outcome": "released"}) == 1
        assert sample("featpool_quarantined_leases") == 0


def test_an_open_that_fails_after_marking_the_lease_withdraws_its_mark(
    served: tuple[FeaturePool, HandoffServer, FakeClock],
) -> None:
    """open() marks the lease opened before it builds the view; if building it fails (a CUDA
    out-of-memory on a cross-GPU copy, say) the caller has nothing to release, so the mark
    must go, or the lease's memory stays quarantined for quarantine_s after it ends."""
    pool, server, clock = served
    lease = pool.put(torch.ones(1024), ttl_s=5)
    desc = pool.describe(lease).wire()
    with FeatureClient.connect(server.path) as client:
        where = (desc["tier"], desc["slab"])

        class Failing:
            def __init__(self, inner: Any) -> None:
                self.inner = inner

            def tensor(self, *args: object) -> torch.Tensor:
                raise MemoryError("out of memory building the view")

            def close(self) -> None:
                self.inner.close()

        client._slabs[where] = Failing(client._slabs[where])  # type: ignore[assignment]
        with pytest.raises(MemoryError):
            client.open(desc)
        clock.advance(10)
        pool.reap()  # expired: with the mark left, held in quarantine for 300 s
        s = pool.stats()
        assert s["quarantined_leases"] == 0 and s["leases_active"] == 0
        assert all(t["used_bytes"] == 0 for t in s["tiers"])


def test_open_polls_a_lease_about_to_be_published_without_sleeping(
    served: tuple[FeaturePool, HandoffServer, FakeClock], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ready word lands on the poll after ``open`` starts waiting (the producer's copy
    was still in flight): ``open`` spins that short wait out instead of sleeping, since one
    sleep costs more than the whole hand-off. A lease that stays unpublished is slept on
    (the timeout test above), so a dead producer does not cost a spinning core."""
    import pool.client

    pool_, server, _ = served
    t = torch.ones(32)
    lease, _ = pool_._reserve(t, t.numel() * 4, 10.0)  # reserved, not yet published
    sleeps: list[float] = []
    monkeypatch.setattr(pool.client.time, "sleep", sleeps.append)
    with FeatureClient.connect(server.path) as client:
        assert client._ctrl is not None
        polls = 0
        real_ready = client._ctrl.ready

        def ready(slot: int) -> int:  # published on the second poll
            nonlocal polls
            polls += 1
            return lease.generation if polls >= 2 else real_ready(slot)

        monkeypatch.setattr(client._ctrl, "ready", ready)
        view = client.open(pool_.describe(lease), timeout_s=5.0)
        assert view.shape == (32,) and polls == 2
        assert sleeps == []
    pool_._undo([lease])


def test_a_lease_never_published_is_slept_on_not_spun_on(
    served: tuple[FeaturePool, HandoffServer, FakeClock], monkeypatch: pytest.MonkeyPatch
) -> None:
    import pool.client

    pool_, server, _ = served
    t = torch.ones(32)
    lease, _ = pool_._reserve(t, t.numel() * 4, 10.0)
    sleeps: list[float] = []
    real_sleep = pool.client.time.sleep
    monkeypatch.setattr(pool.client.time, "sleep", lambda s: (sleeps.append(s), real_sleep(s)))
    with FeatureClient.connect(server.path) as client, pytest.raises(TimeoutError):
        client.open(pool_.describe(lease), timeout_s=0.05)
    assert sleeps and set(sleeps) == {0.0001}  # after the spin, 100 us sleeps until the timeout
    pool_._undo([lease])
