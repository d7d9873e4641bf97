"""The socket directory's index (pool.discovery): what a server publishes, what a consumer finds,
and that entries of dead servers are ignored and collected. Servers here are real processes
where it matters (a SIGKILLed process is what leaves a stale entry behind)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pool import discovery
from pool.backends.host_shm import HostShmBackend
from pool.client import FeatureClient
from pool.discovery import NoFeatpool
from pool.featurepool import FeaturePool
from pool.server import HandoffServer
from tests.conftest import image_bytes
from tests.helpers import ROOT, server_process

GPU_A = "GPU-1f6e2c9a-0b1d-4e55-9a43-7c1d2e3f4a5b"
GPU_B = "GPU-8a3c0d11-22e4-4f60-b7a8-0c9d8e7f6a5b"

# A server that publishes an entry (and listens on its socket) and then waits to be killed.
PUBLISHER = """
import socket, sys, time
from pathlib import Path
from pool import discovery
from pool.backends.host_shm import HostShmBackend
from pool.client import FeatureClient
path = Path(sys.argv[1])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(str(path)); s.listen(1)
entry = discovery.publish(path, gpu_uuid=sys.argv[2], device="cpu", transport="host_shm")
print("published", flush=True)
time.sleep(600)
"""


def start_publisher(sock: Path, uuid: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER, str(sock), uuid],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "published"
    return proc


def kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def test_published_entry_is_found_with_what_the_server_said(tmp_path: Path) -> None:
    sock = tmp_path / "fp-featpool-abc.sock"
    with discovery.publish(sock, gpu_uuid=GPU_A.lower(), device="cuda", transport="cuda_vmm"):
        path = tmp_path / "fp-featpool-abc.sock.json"
        data = json.loads(path.read_text())
        assert data["featpool_index"] == 1 and data["socket"] == sock.name
        assert data["pid"] == os.getpid()
        assert oct(path.stat().st_mode & 0o777) == "0o640"
        (entry,) = discovery.entries(tmp_path)
        assert entry.socket == sock
        assert entry.gpu_uuid == GPU_A  # one spelling: nvidia-smi's
        assert (entry.device, entry.transport, entry.instance) == ("cuda", "cuda_vmm", sock.stem)
        assert entry.http is None  # not advertised
        # torch writes the UUID without the prefix; upper case from other tools: all match.
        for asked in (GPU_A, GPU_A.upper(), GPU_A.removeprefix("GPU-")):
            assert discovery.find(tmp_path, gpu_uuid=asked).socket == sock
        assert discovery.find(tmp_path).socket == sock  # the only one
    assert not path.exists()  # removed at shutdown
    assert discovery.entries(tmp_path) == []
    with pytest.raises(NoFeatpool, match="no featpool in"):
        discovery.find(tmp_path)


def test_socket_resolves_against_the_directory_the_reader_mounts(tmp_path: Path) -> None:
    """A consumer pod mounts the node directory somewhere else: the entry names a file in the
    directory, not the server's path."""
    node_dir = tmp_path / "node"
    node_dir.mkdir()
    consumer_view = tmp_path / "consumer-mount"
    consumer_view.symlink_to(node_dir)
    with discovery.publish(node_dir / "a.sock", gpu_uuid=GPU_A, device="cpu", transport="x"):
        assert discovery.find(consumer_view, gpu_uuid=GPU_A).socket == consumer_view / "a.sock"


def test_one_featpool_per_gpu_and_the_newest_of_a_gpu_wins(tmp_path: Path) -> None:
    a = discovery.publish(tmp_path / "a.sock", gpu_uuid=GPU_A, device="cpu", transport="x")
    b = discovery.publish(tmp_path / "b.sock", gpu_uuid=GPU_B, device="cpu", transport="x")
    try:
        assert discovery.find(tmp_path, gpu_uuid=GPU_A).instance == "a"
        assert discovery.find(tmp_path, gpu_uuid=GPU_B).instance == "b"
        with pytest.raises(NoFeatpool, match="2 featpools of different GPUs"):
            discovery.find(tmp_path)
        with pytest.raises(NoFeatpool, match=r"no live featpool for GPU-0000.*a \(GPU-1f6e"):
            discovery.find(tmp_path, gpu_uuid="GPU-0000")
        time.sleep(0.01)
        # A rolling update on a shared GPU: the new pod's entry appears beside the old one.
        a2 = discovery.publish(tmp_path / "a2.sock", gpu_uuid=GPU_A, device="cpu", transport="x")
        assert discovery.find(tmp_path, gpu_uuid=GPU_A).instance == "a2"
        a2.close()
        assert discovery.find(tmp_path, gpu_uuid=GPU_A).instance == "a"
    finally:
        a.close()
        b.close()


def test_entries_of_killed_servers_are_ignored_then_collected(tmp_path: Path) -> None:
    dead_sock = tmp_path / "dead.sock"
    dead = start_publisher(dead_sock, GPU_A)
    live = start_publisher(tmp_path / "live.sock", GPU_B)
    try:
        assert {e.instance for e in discovery.entries(tmp_path)} == {"dead", "live"}
        kill(dead)  # SIGKILL: no clean-up ran; its entry and socket file stay behind
        assert (tmp_path / "dead.sock.json").exists() and dead_sock.exists()
        assert [e.instance for e in discovery.entries(tmp_path)] == ["live"]
        with pytest.raises(NoFeatpool, match=r"no live featpool for GPU-1f6e.*live there: live"):
            discovery.find(tmp_path, gpu_uuid=GPU_A)

        # The next server to publish removes the stale entry and its dead socket, not others.
        with discovery.publish(tmp_path / "new.sock", gpu_uuid=GPU_A, device="cpu", transport="x"):
            assert not (tmp_path / "dead.sock.json").exists() and not dead_sock.exists()
            assert (tmp_path / "live.sock.json").exists()
            assert discovery.find(tmp_path, gpu_uuid=GPU_A).instance == "new"
    finally:
        for proc in (live, dead):
            if proc.poll() is None:
                kill(proc)


def test_a_live_socket_of_a_stale_entry_is_left_alone(tmp_path: Path) -> None:
    """A stale entry whose socket someone listens on again (a restarted server that has not
    published yet) loses its entry but keeps its socket."""
    sock = tmp_path / "x.sock"
    dead = start_publisher(sock, GPU_A)
    kill(dead)
    sock.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock))
    listener.listen(1)
    try:
        assert discovery.collect_stale(tmp_path) == [tmp_path / "x.sock.json"]
        assert sock.exists()
    finally:
        listener.close()


def test_a_restarting_server_between_bind_and_listen_keeps_its_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server restarts under its old name while another server collects the old instance's
    stale entry. Between the restart's bind and its listen, a connect to the socket is refused
    as if nobody served it; the collector must not remove it (the restart holds the lock)."""
    sock = tmp_path / "x.sock"
    kill(start_publisher(sock, GPU_A))  # leaves x.sock.json and a dead x.sock
    pool = FeaturePool([HostShmBackend([4096])])
    real_listen = socket.socket.listen
    collected: list[Path] = []

    def listen(self: socket.socket, *args: int) -> None:
        if self.getsockname() == str(sock) and not collected:
            collected.extend(discovery.collect_stale(tmp_path))
        real_listen(self, *args)

    monkeypatch.setattr(socket.socket, "listen", listen)
    server = HandoffServer(pool, sock)
    server.start()
    monkeypatch.undo()
    try:
        assert collected == [tmp_path / "x.sock.json"]  # the entry went, the socket stayed
        with FeatureClient.connect(sock) as client:
            assert client.epoch
    finally:
        server.close()
        pool.close()
    assert os.listdir(tmp_path) == []


def test_half_written_and_foreign_files_are_not_entries(tmp_path: Path) -> None:
    # What publish() writes before its rename: a hidden temporary name, never read.
    (tmp_path / ".a.sock.json.123.tmp").write_text('{"featpool_index": 1, "socket": "a.so')
    (tmp_path / "notes.json").write_text('{"hello": 1}')
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "evil.sock.json").write_text(
        json.dumps({"featpool_index": 1, "socket": "../../etc/x", "started_at": 1.0})
    )
    assert discovery.entries(tmp_path) == []  # unlocked too: as good as dead
    assert discovery.entries(tmp_path / "missing") == []


def test_a_live_entry_with_a_malformed_field_is_skipped_not_fatal(tmp_path: Path) -> None:
    """A locked (live-looking) entry whose gpu_uuid is a number raised AttributeError out of
    entries() and find(): one bad file broke discovery for every consumer of the directory."""
    import fcntl

    good = discovery.publish(tmp_path / "good.sock", gpu_uuid=GPU_A, device="cpu", transport="x")
    bad = tmp_path / "zz.sock.json"
    bad.write_text(
        json.dumps({"featpool_index": 1, "socket": "zz.sock", "gpu_uuid": 7, "started_at": 1e12})
    )
    fd = os.open(bad, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as its server would hold it
        assert [e.socket.name for e in discovery.entries(tmp_path)] == ["good.sock"]
        assert discovery.find(tmp_path, gpu_uuid=GPU_A).socket.name == "good.sock"
    finally:
        os.close(fd)
        good.close()


def test_an_entry_never_names_a_socket_outside_its_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="socket must be a file name"):
        discovery.Entry.parse(tmp_path / "e.json", {"socket": "../x.sock", "started_at": 1.0})


def test_cuda_index_needs_a_visible_device(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: tests/gpu covers the index lookup")
    with pytest.raises(NoFeatpool, match="CUDA device 0 is not visible to this process"):
        discovery.find(tmp_path, cuda_index=0)
    with pytest.raises(ValueError, match="not both"):
        discovery.find(tmp_path, gpu_uuid=GPU_A, cuda_index=0)


def test_default_directory_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FEATPOOL_SOCKET_DIR", raising=False)
    assert discovery.socket_dir() == Path("/run/featpool")
    monkeypatch.setenv("FEATPOOL_SOCKET_DIR", str(tmp_path))
    with discovery.publish(tmp_path / "a.sock", gpu_uuid=GPU_A, device="cpu", transport="x"):
        assert discovery.find(gpu_uuid=GPU_A).socket == tmp_path / "a.sock"


def test_an_entry_planted_by_another_uid_is_refused_when_asked(tmp_path: Path) -> None:
    """The attack: a member of the socket directory's group adds an entry for the same GPU,
    newer than the real one, pointing at a socket of its own. Without ``owner_uids`` a consumer
    follows it (newest wins); with the service's uid it keeps to the real featpool."""
    real_uid, attacker_uid = os.getuid(), 4242
    if real_uid != 0:
        pytest.skip("making a file owned by another uid needs root")
    with discovery.publish(tmp_path / "real.sock", gpu_uuid=GPU_A, device="cpu", transport="x"):
        time.sleep(0.01)
        # The attacker's own "server": a listening socket, a locked entry, both its files.
        planted = discovery.publish(
            tmp_path / "evil.sock", gpu_uuid=GPU_A, device="cpu", transport="x"
        )
        try:
            os.chown(tmp_path / "evil.sock.json", attacker_uid, -1)
            assert discovery.find(tmp_path, gpu_uuid=GPU_A).instance == "evil"
            found = discovery.find(tmp_path, gpu_uuid=GPU_A, owner_uids=[real_uid])
            assert (found.instance, found.owner_uid) == ("real", real_uid)
            with pytest.raises(NoFeatpool, match="no live featpool"):
                discovery.find(tmp_path, gpu_uuid=GPU_A, owner_uids=[12345])
        finally:
            planted.close()


def test_the_entry_names_the_http_api_whose_leases_its_socket_maps(tmp_path: Path) -> None:
    """A service started with --advertise-host publishes its HTTP address in its entry: a
    consumer that finds its GPU's socket leases by hash at that address and maps the lease
    through that socket (two servers behind one balanced address could not promise that)."""
    import httpx

    sock = tmp_path / "fp-a.sock"
    args = ("--gpu-uuid", GPU_A, "--advertise-host", "127.0.0.1")
    with server_process(sock, tmp_path / "server.log", *args) as (url, _):
        entry = discovery.find(tmp_path, gpu_uuid=GPU_A)
        assert entry.socket == sock and entry.http == url
        r = httpx.post(
            f"{entry.http}/v1/encode",
            content=image_bytes("JPEG", size=(40, 30), seed=7),
            headers={"content-type": "image/jpeg"},
        )
        ref = r.json()["items"][0]["feature_hash"]
        lease = httpx.post(f"{entry.http}/v1/features/{ref}/lease").json()
        with FeatureClient.for_gpu(tmp_path, gpu_uuid=GPU_A) as client:
            features = client.open(lease)
            assert features.shape == tuple(lease["shape"])
            client.release(lease["lease_id"])
