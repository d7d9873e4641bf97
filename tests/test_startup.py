"""Start-up decisions: which tiers, the errors that name the flag to change, and what the GPU
tier tells consumers."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import pytest
import torch

from app.backends import build_backends, resolve_device, split_slabs
from app.engine import Engine
from app.metrics import Metrics
from app.settings import Settings
from pool.backends.host_shm import HostShmBackend
from pool.client import FeatureClient
from pool.errors import CudaUnavailable, SocketInUse
from pool.featurepool import FeaturePool
from tests.helpers import small_settings

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the no-GPU behaviour")


@no_cuda
def test_cuda_vmm_without_a_gpu_names_the_flag(tmp_path: Path) -> None:
    s = Settings(transport="cuda_vmm", socket_path=tmp_path / "s")
    with pytest.raises(CudaUnavailable, match=r"--transport cuda_vmm \(FEATPOOL_TRANSPORT\)"):
        build_backends(s, torch.device("cpu"))


@no_cuda
def test_cuda_device_without_a_gpu_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(CudaUnavailable, match=r"--device cuda:1 \(FEATPOOL_DEVICE\)"):
        resolve_device(Settings(device="cuda:1", socket_path=tmp_path / "s"))


@no_cuda
def test_auto_on_cpu_is_a_host_pool(tmp_path: Path) -> None:
    s = Settings(host_pool_bytes=5 << 20, slab_bytes=2 << 20, socket_path=tmp_path / "s")
    backends, caps = build_backends(s, resolve_device(s))
    try:
        assert [b.transport for b in backends] == ["host_shm"]
        assert backends[0].slab_sizes == [2 << 20, 2 << 20, 2 << 20]  # 6 MiB: rounded up
        assert (caps.transport, caps.cuda, caps.fabric) == ("host_shm", False, False)
    finally:
        for b in backends:
            b.close()


def test_a_second_instance_on_a_served_socket_names_the_flag(tmp_path: Path) -> None:
    """Two services on one machine with the default socket path: the second stops at start-up
    with the flag that gives it a socket of its own, and the first keeps its socket."""
    first, second = (Engine(small_settings(tmp_path), Metrics()) for _ in range(2))

    async def scenario() -> None:
        await first.start()
        try:
            with pytest.raises(SocketInUse, match=r"--socket-path \(FEATPOOL_SOCKET_PATH\)"):
                await second.start()
            await second.stop()
            assert first.server is not None and first.server.path.exists()
        finally:
            await first.stop()

    asyncio.run(scenario())


MiB = 1 << 20


def test_split_slabs_rounds_to_granularity() -> None:
    assert split_slabs(10 * MiB, 4 * MiB) == [4 * MiB, 4 * MiB, 2 * MiB]
    assert split_slabs(1, 4 * MiB) == [2 * MiB]
    assert split_slabs(8 * MiB, 3 * MiB) == [2 * MiB] * 4  # slab rounded down to 2 MiB


class _GpuTierStub(HostShmBackend):
    """A host tier that answers like the GPU tier does in the welcome message."""

    tier = "gpu"

    def device_info(self, *, fabric_handles: bool = False) -> dict[str, Any]:
        info: dict[str, Any] = {"device_index": 0, "fabric": {"available": True}}
        if fabric_handles:
            info["fabric_handles"] = ["aGFuZGxl"]
        return info


def _welcome_from(pool: FeaturePool, sock: Path, token: str | None) -> dict[str, Any]:
    """The welcome a consumer gets from the engine's kind of hand-off server."""
    import os
    import socket

    from pool.protocol import PROTOCOL_VERSION, recv_msg, send_msg
    from pool.server import HandoffServer

    server = HandoffServer(pool, sock, token=token)
    server.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.settimeout(5)
            c.connect(str(sock))
            send_msg(c, {"op": "hello", "version": PROTOCOL_VERSION, "token": token})
            msg, fds = recv_msg(c, want_fds=True)
            for fd in fds:
                os.close(fd)
        return msg
    finally:
        server.close()


@pytest.mark.parametrize(("token", "handles"), [(None, False), ("t0ken", True)])
def test_fabric_handles_only_go_to_token_holders(
    tmp_path: Path, token: str | None, handles: bool
) -> None:
    pool = FeaturePool([_GpuTierStub([2 << 20])])
    try:
        welcome = _welcome_from(pool, tmp_path / "s", token)
        assert welcome["op"] == "welcome"
        assert welcome["cuda"]["device_index"] == 0
        assert ("fabric_handles" in welcome["cuda"]) is handles
    finally:
        pool.close()


def test_no_gpu_tier_means_no_cuda_section(tmp_path: Path) -> None:
    pool = FeaturePool([HostShmBackend([2 << 20])])
    try:
        welcome = _welcome_from(pool, tmp_path / "s", None)
        assert welcome["op"] == "welcome" and "cuda" not in welcome
    finally:
        pool.close()


class _Status:
    available = False
    reason = "FABRIC handles unavailable: no IMEX channel"


def test_gpu_tier_without_fabric_counts_a_fallback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pool.backends import cuda_vmm

    made: list[dict[str, Any]] = []

    def create(device_index: int, **kw: Any) -> _GpuTierStub:
        made.append({"device_index": device_index, **kw})
        stub = _GpuTierStub([2 << 20])
        stub.fabric_status = _Status()  # type: ignore[attr-defined]
        return stub

    monkeypatch.setattr(cuda_vmm.CudaVmmBackend, "create", staticmethod(create))
    s = Settings(socket_path=tmp_path / "s", pool_bytes=64 << 20, host_pool_bytes=2 << 20)
    backends, caps = build_backends(s, torch.device("cuda:0"))
    try:
        assert made == [
            {
                "device_index": 0,
                "pool_bytes": 64 << 20,
                "slab_bytes": s.slab_bytes,
                "fabric": "auto",
            }
        ]
        assert [b.tier for b in backends] == ["gpu", "host"]
        assert caps.transport == "cuda_vmm" and caps.fabric is False
        assert caps.fabric_reason.startswith("FABRIC handles unavailable")
        assert caps.startup_fallbacks == [("fabric_unavailable", "gpu")]
    finally:
        for b in backends:
            b.close()


def test_auto_falls_back_to_host_when_the_gpu_pool_cannot_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pool.backends import cuda_vmm

    def create(device_index: int, **kw: Any) -> None:
        raise CudaUnavailable("no NVIDIA driver found")

    monkeypatch.setattr(cuda_vmm.CudaVmmBackend, "create", staticmethod(create))
    s = Settings(socket_path=tmp_path / "s", host_pool_bytes=2 << 20)
    backends, caps = build_backends(s, torch.device("cuda:0"))
    try:
        assert [b.tier for b in backends] == ["host"]
        assert caps.startup_fallbacks == [("no_cuda", "host")]
    finally:
        for b in backends:
            b.close()
    with pytest.raises(CudaUnavailable, match="--transport cuda_vmm"):
        build_backends(
            Settings(socket_path=tmp_path / "s", transport="cuda_vmm"), torch.device("cuda:0")
        )


def test_settings_travel_to_front_processes_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.front import settings_env

    s = Settings(
        socket_path=tmp_path / "s",
        http_workers=3,
        api_key="k3y",
        max_batch_size=7,
        socket_allowed_uids=[0, 1000],
        fallback="reject",
        log_json=True,
    )
    for name in Settings.model_fields:
        monkeypatch.delenv(f"FEATPOOL_{name.upper()}", raising=False)
    for k, v in settings_env(s).items():
        monkeypatch.setenv(k, v)
    again = Settings()
    assert again.model_dump() == s.model_dump()
    assert again.api_key is not None and again.api_key.get_secret_value() == "k3y"


@no_cuda
@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--transport", "cuda_vmm"], "--transport cuda_vmm"),
        (["--device", "cuda"], "--device cuda"),
        (["--fabric-listen", "0.0.0.0:7070"], "needs --socket-token"),
        (
            ["--fabric-listen", "0.0.0.0:7070", "--socket-token", "t0ken"],
            "--fabric-listen (FEATPOOL_FABRIC_LISTEN) serves the GPU pool to other nodes",
        ),
        # 512 slabs of 2 MiB: more FDs than a consumer's welcome can carry
        (["--slab-bytes", "2097152", "--host-pool-bytes", "1073741824"], "--slab-bytes"),
    ],
)
def test_cli_refuses_impossible_flags_in_one_line(
    tmp_path: Path, flags: list[str], named: str
) -> None:
    import subprocess
    import sys

    from tests.helpers import ROOT

    r = subprocess.run(
        [sys.executable, "-m", "app", *flags, "--socket-path", str(tmp_path / "s")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    assert named in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_second_service_on_a_served_socket_stops_in_one_line_naming_the_flag(
    tmp_path: Path,
) -> None:
    """`make serve` twice on one machine: the second stops before loading anything, with one
    line naming --socket-path, and the first keeps serving its socket."""
    import subprocess
    import sys

    from tests.helpers import ROOT, server_process

    sock = tmp_path / "featpool.sock"
    with server_process(sock, tmp_path / "first.log"):
        r = subprocess.run(
            [sys.executable, "-m", "app", "--device", "cpu", "--socket-path", str(sock)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 1
        assert r.stderr.strip() == (
            f"featpool: another featpool server is serving {sock}; give this one its own: "
            "--socket-path (FEATPOOL_SOCKET_PATH)"
        )
        with FeatureClient.connect(sock) as client:
            assert client.epoch


def test_fabric_listen_must_be_host_and_port(tmp_path: Path) -> None:
    from pydantic import ValidationError

    for bad in ("7070", "host:", ":7070", "host:port", "host:70000"):
        with pytest.raises(ValidationError, match="HOST:PORT"):
            Settings(fabric_listen=bad, socket_path=tmp_path / "s")
    s = Settings(fabric_listen="[::1]:7070", socket_path=tmp_path / "s")
    assert s.fabric_address() == ("::1", 7070)


def _fake_gpu_tier(permitted: bool) -> Any:
    from tests.test_cuda_vmm_fake import make

    be, _ = make(permitted=permitted)
    return be


def test_fabric_listen_without_an_imex_channel_stops_start_up_naming_the_flag(
    tmp_path: Path,
) -> None:
    s = Settings(socket_path=tmp_path / "s", fabric_listen="127.0.0.1:0", socket_token="t0ken")
    eng = Engine(s, Metrics())
    eng.pool = FeaturePool([_fake_gpu_tier(permitted=False)])
    try:
        with pytest.raises(
            CudaUnavailable, match=r"--fabric-listen .*no IMEX channel.*ComputeDomain"
        ):
            eng._start_remote()
        assert eng.fabric_server is None
    finally:
        eng.pool.close()


def test_fabric_listen_serves_remote_consumers_with_the_token(tmp_path: Path) -> None:
    import socket

    from pool.protocol import PROTOCOL_VERSION, recv_msg, send_msg

    s = Settings(socket_path=tmp_path / "s", fabric_listen="127.0.0.1:0", socket_token="t0ken")
    eng = Engine(s, Metrics())
    eng.pool = FeaturePool([_fake_gpu_tier(permitted=True)])
    try:
        eng._start_remote()
        assert eng.fabric_server is not None and eng.fabric_server.port > 0
        eng.metrics.watch_pool(eng.pool.stats)
        for token, op in (("nope", "error"), ("t0ken", "welcome")):
            with socket.create_connection(("127.0.0.1", eng.fabric_server.port), 5) as c:
                send_msg(c, {"op": "hello", "version": PROTOCOL_VERSION, "token": token})
                msg, fds = recv_msg(c)
                assert msg["op"] == op and fds == []
                remote = eng.metrics.registry.get_sample_value("featpool_remote_consumers_attached")
                assert remote == (1.0 if op == "welcome" else 0.0)
        assert msg["remote"] is True and len(msg["slabs"]) == len(
            eng.pool.tiers[0].allocator.slab_sizes
        )
        assert all(len(base64.b64decode(x["fabric_handle"])) == 64 for x in msg["slabs"])
        assert msg["control"]["nslots"] == eng.pool.ctrl.nslots
    finally:
        assert eng.fabric_server is not None
        eng.fabric_server.close()
        eng.pool.close()


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("10.0.3.17", "http://10.0.3.17:8123"),
        ("fd00::17", "http://[fd00::17]:8123"),  # a pod IP of an IPv6 cluster
        ("[fd00::17]", "http://[fd00::17]:8123"),
        ("featpool-0.featpool", "http://featpool-0.featpool:8123"),
    ],
)
def test_the_advertised_http_address(tmp_path: Path, host: str, url: str) -> None:
    s = Settings(advertise_host=host, port=8123, socket_path=tmp_path / "s")
    assert s.advertised_url() == url
    assert Settings(socket_path=tmp_path / "s").advertised_url() is None


@pytest.mark.parametrize("host", ["", "http://10.0.3.17", "10.0.3.17/x", "a b", "u@h"])
def test_an_advertised_host_with_a_scheme_or_a_path_is_refused(tmp_path: Path, host: str) -> None:
    with pytest.raises(ValueError, match="advertise_host must be an IP address or a host name"):
        Settings(advertise_host=host, socket_path=tmp_path / "s")
