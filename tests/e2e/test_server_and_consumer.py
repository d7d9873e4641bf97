"""End to end, as a user runs it: the real server process (``python -m app``, uvicorn on a
loopback port), real JPEG and PNG uploads over HTTP, and a separate consumer process that maps
the features with FeatureClient."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load

from tests.conftest import image_bytes
from tests.helpers import ROOT, server_process

pytestmark = pytest.mark.e2e


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    sock = tmp_path / "featpool.sock"
    with server_process(sock, tmp_path / "server.log") as (url, _):
        yield url, sock


CONSUMER = """
import json, sys, hashlib
from pool.client import FeatureClient
leases = json.loads(sys.argv[2])
out = []
with FeatureClient.connect(sys.argv[1]) as client:
    for lease in leases:
        t = client.open(lease)
        digest = hashlib.sha256(t.contiguous().view(-1).numpy().tobytes()).hexdigest()
        out.append({"shape": list(t.shape), "dtype": str(t.dtype), "sha256": digest})
        client.release(lease)
print(json.dumps(out))
"""


def test_upload_then_consume_in_another_process(server: tuple[str, Path]) -> None:
    url, sock = server
    jpeg, png = image_bytes("JPEG", size=(320, 240)), image_bytes("PNG", size=(64, 128), seed=3)
    r = httpx.post(
        f"{url}/v1/encode",
        files=[
            ("image", ("cat.jpg", jpeg, "image/jpeg")),
            ("image", ("dog.png", png, "image/png")),
        ],
    )
    assert r.status_code == 200, r.text
    leases = r.json()["items"]
    assert len(leases) == 2 and all(x["transport"] == "host_shm" for x in leases)

    expected = []
    for lease in leases:
        t = load(httpx.get(f"{url}/v1/leases/{lease['lease_id']}/tensor").content)["features"]
        import hashlib

        expected.append(hashlib.sha256(t.contiguous().view(-1).numpy().tobytes()).hexdigest())
        assert list(t.shape) == lease["shape"]

    pool = httpx.get(f"{url}/v1/pool").json()
    assert pool["leases_active"] == 2 and pool["tiers"][0]["used_bytes"] > 0

    # A separate consumer process (one lease by descriptor, one by ID alone).
    done = subprocess.run(
        [sys.executable, "-c", CONSUMER, str(sock), json.dumps([leases[0], leases[1]["lease_id"]])],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert [g["sha256"] for g in got] == expected
    assert got[0]["shape"] == leases[0]["shape"]

    # The consumer's acks return the memory.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        pool = httpx.get(f"{url}/v1/pool").json()
        if pool["leases_active"] == 0:
            break
        time.sleep(0.05)
    assert pool["leases_active"] == 0 and pool["tiers"][0]["used_bytes"] == 0
    metrics = httpx.get(f"{url}/metrics").text
    assert 'featpool_leases_released_total{reason="ack"} 2.0' in metrics


def test_consumer_killed_holding_leases_they_expire(server: tuple[str, Path]) -> None:
    url, sock = server
    r = httpx.post(
        f"{url}/v1/encode?ttl_s=8",
        content=image_bytes("JPEG"),
        headers={"content-type": "image/jpeg"},
    )
    lease = r.json()["items"][0]
    code = (
        "import sys, os, signal, json; from pool.client import FeatureClient\n"
        "c = FeatureClient.connect(sys.argv[1]); c.open(json.loads(sys.argv[2]))\n"
        "print('holding', flush=True); os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(sock), json.dumps(lease)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == -9 and "holding" in done.stdout
    assert httpx.get(f"{url}/v1/pool").json()["leases_active"] == 1  # still held...
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # ...until its deadline passes
        pool = httpx.get(f"{url}/v1/pool").json()
        if pool["leases_active"] == 0:
            break
        time.sleep(0.2)
    assert pool["leases_active"] == 0 and pool["tiers"][0]["used_bytes"] == 0
    assert pool["consumers_attached"] == 0
    assert httpx.get(f"{url}/v1/leases/{lease['lease_id']}").status_code == 410


def test_handoff_limits_from_the_command_line(tmp_path: Path) -> None:
    """--socket-auth-timeout-s and --socket-max-connections as a user sets them: a silent
    connection is closed at the deadline, a connection past the cap displaces it, a consumer
    still attaches, and /metrics counts each refusal by reason."""
    import socket

    from pool.client import FeatureClient
    from pool.protocol import recv_msg

    sock = tmp_path / "featpool.sock"
    args = ("--socket-auth-timeout-s", "0.5", "--socket-max-connections", "2")
    with server_process(sock, tmp_path / "server.log", *args) as (url, _):
        silent = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(3)]
        t0 = time.monotonic()
        for s in silent:
            s.settimeout(10)
            s.connect(str(sock))
        kinds = [recv_msg(s)[0]["type"] for s in silent]
        assert kinds == ["too_many_connections", "auth_timeout", "auth_timeout"]
        assert time.monotonic() - t0 < 5
        for s in silent:
            s.close()
        with FeatureClient.connect(sock) as client:
            assert client.epoch == httpx.get(f"{url}/v1/pool").json()["epoch"]
        text = httpx.get(f"{url}/metrics").text
        assert 'featpool_handoff_refused_total{reason="auth_timeout",server="unix"} 2.0' in text
        assert 'featpool_handoff_refused_total{reason="evicted",server="unix"} 1.0' in text
        pool = httpx.get(f"{url}/v1/pool").json()
        assert pool["handoff_refused"] == {"unix": {"auth_timeout": 2, "evicted": 1}}
