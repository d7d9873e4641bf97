"""Several featpools on one node, as the chart runs them: each server is started with exactly the
environment the kubelet would give its pod (the chart rendered by Helm, envFrom, downward-API pod
name, ``$(POD_NAME)`` expanded), all sharing one socket directory as pods share the node's
hostPath. A consumer finds each by its GPU through the index and maps that server's features.

What differs from a node, on purpose: this machine has no GPU, so the servers run on the CPU
(host tier) and each is given a made-up GPU UUID (``FEATPOOL_GPU_UUID``, the CPU-mode identity;
on CUDA the server publishes its device's own UUID); and pods have network namespaces of their
own, so here each server gets its own loopback port instead of 0.0.0.0:8000."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load

from bench.appserver import AppServer
from pool import discovery
from pool.client import FeatureClient
from pool.errors import PoolError
from tests.conftest import image_bytes
from tests.k8s import container_env, render

pytestmark = pytest.mark.e2e

GPU_0 = "GPU-5d2b6f0e-1c3a-4b7e-9f10-2a3b4c5d6e70"
GPU_1 = "GPU-5d2b6f0e-1c3a-4b7e-9f10-2a3b4c5d6e71"


def values(socket_dir: Path) -> dict[str, Any]:
    return {
        "image": {"repository": "registry.example.com/featpool"},
        # The node directory, as the pods mount it.
        "socket": {"volume": "hostPath", "hostPath": "/run/featpool", "mountPath": str(socket_dir)},
        "config": {
            "device": "cpu",
            "encoder": "tiny-test",
            "http_workers": 0,
            "host_pool_bytes": 16 << 20,
            "slab_bytes": 4 << 20,
            "log_json": False,
        },
    }


class Pod:
    def __init__(self, docs: list[dict[str, Any]], name: str, gpu: str, log: Path) -> None:
        self.name = name
        self.env = container_env(docs, pod_name=name)
        # Only what the chart sets: nothing of this test's own FEATPOOL_* environment leaks in.
        base = {k: v for k, v in os.environ.items() if not k.startswith("FEATPOOL_")}
        env = {**base, **self.env, "FEATPOOL_GPU_UUID": gpu}
        self.server = AppServer(["--host", "127.0.0.1"], log, env=env, start_timeout_s=90)
        self.url = self.server.url

    def encode(self, seed: int) -> dict[str, Any]:
        r = httpx.post(
            f"{self.url}/v1/encode",
            files=[("image", ("x.png", image_bytes("PNG", size=(48, 40), seed=seed), "image/png"))],
            timeout=60,
        )
        assert r.status_code == 200, r.text
        item: dict[str, Any] = r.json()["items"][0]
        return item

    def tensor_sha(self, lease_id: str) -> str:
        t = load(httpx.get(f"{self.url}/v1/leases/{lease_id}/tensor", timeout=30).content)
        return sha(t["features"])


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).numpy().tobytes()).hexdigest()


@pytest.fixture
def node() -> Iterator[tuple[Path, list[dict[str, Any]], list[Pod]]]:
    # A short path: a Unix socket's path has at most 107 bytes, and pod names are long (on a
    # node: /run/featpool/ and a pod name of at most 63 characters).
    socket_dir = Path(tempfile.mkdtemp(prefix="fp-node-"))
    pods: list[Pod] = []
    try:
        yield socket_dir, render(values(socket_dir)), pods
    finally:
        for pod in pods:
            pod.server.close()
        shutil.rmtree(socket_dir, ignore_errors=True)


def test_two_pods_on_one_node_both_serve_and_consumers_find_each_by_gpu(
    node: tuple[Path, list[dict[str, Any]], list[Pod]], tmp_path: Path
) -> None:
    socket_dir, docs, pods = node
    a = Pod(docs, "fp-featpool-6d8f7b9c4-abcde", GPU_0, tmp_path / "a.log")
    pods.append(a)
    b = Pod(docs, "fp-featpool-6d8f7b9c4-fghij", GPU_1, tmp_path / "b.log")
    pods.append(b)

    # The rendered environment gave each pod its own socket in the shared directory.
    assert a.env["FEATPOOL_SOCKET_PATH"] == f"{socket_dir}/fp-featpool-6d8f7b9c4-abcde.sock"
    assert b.env["FEATPOOL_SOCKET_PATH"] == f"{socket_dir}/fp-featpool-6d8f7b9c4-fghij.sock"
    names = sorted(p.name for p in socket_dir.iterdir() if not p.name.endswith(".lock"))
    assert names == [
        "fp-featpool-6d8f7b9c4-abcde.sock",
        "fp-featpool-6d8f7b9c4-abcde.sock.json",
        "fp-featpool-6d8f7b9c4-fghij.sock",
        "fp-featpool-6d8f7b9c4-fghij.sock.json",
    ]

    lease_a, lease_b = a.encode(seed=1), b.encode(seed=2)
    for pod, lease, gpu in ((a, lease_a, GPU_0), (b, lease_b, GPU_1)):
        assert lease["transport"] == "host_shm"
        with FeatureClient.for_gpu(socket_dir, gpu_uuid=gpu) as client:
            assert client.address == pod.env["FEATPOOL_SOCKET_PATH"]
            assert sha(client.open(lease)) == pod.tensor_sha(lease["lease_id"])
            client.release(lease)
    # A lease belongs to the featpool that made it: the other GPU's featpool refuses it (its
    # pool epoch differs) instead of mapping something else.
    lease_a2 = a.encode(seed=3)
    with (
        FeatureClient.for_gpu(socket_dir, gpu_uuid=GPU_1) as client,
        pytest.raises(PoolError, match="is from pool epoch"),
    ):
        client.open(lease_a2)


def test_rolling_update_new_pod_beside_the_old_then_consumers_follow(
    node: tuple[Path, list[dict[str, Any]], list[Pod]], tmp_path: Path
) -> None:
    """The surge pod of a rolling update starts while the old pod still serves (same GPU where
    the GPU is shared; a new GPU otherwise): no collision, and a consumer that resolves again
    gets the new pod. A pod killed without clean-up leaves an entry that nobody follows."""
    socket_dir, docs, pods = node
    old = Pod(docs, "fp-featpool-5c7d8e9f0-aaaaa", GPU_0, tmp_path / "old.log")
    pods.append(old)
    other = Pod(docs, "fp-featpool-5c7d8e9f0-bbbbb", GPU_1, tmp_path / "other.log")
    pods.append(other)
    held = old.encode(seed=4)
    consumer = FeatureClient.for_gpu(socket_dir, gpu_uuid=GPU_0)
    try:
        expected = sha(consumer.open(held).clone())

        new = Pod(docs, "fp-featpool-7e8f9a0b1-ccccc", GPU_0, tmp_path / "new.log")
        pods.append(new)
        assert discovery.find(socket_dir, gpu_uuid=GPU_0).instance == new.name
        # The old pod drains: its entry goes first, and the consumer's mapping stays readable
        # until it lets go.
        # (uvicorn re-raises SIGTERM after its graceful shutdown: -15 is a clean exit.)
        assert old.server.close() in (0, -signal.SIGTERM)
        assert not (socket_dir / f"{old.name}.sock.json").exists()
        assert not (socket_dir / f"{old.name}.sock").exists()
        assert sha(consumer.open(held)) == expected
    finally:
        consumer.close()

    with FeatureClient.for_gpu(socket_dir, gpu_uuid=GPU_0) as moved:
        lease = new.encode(seed=5)
        assert moved.address.endswith(f"{new.name}.sock")
        assert sha(moved.open(lease)) == new.tensor_sha(lease["lease_id"])
        moved.release(lease)

    # The new pod dies hard (OOM kill, node trouble): its entry stays on disk but is not live.
    new.server.proc.send_signal(signal.SIGKILL)
    new.server.proc.wait(timeout=30)
    assert (socket_dir / f"{new.name}.sock.json").exists()
    with pytest.raises(discovery.NoFeatpool, match=f"live there: {other.name}"):
        FeatureClient.for_gpu(socket_dir, gpu_uuid=GPU_0)
    assert discovery.find(socket_dir, gpu_uuid=GPU_1).instance == other.name


def test_model_cache_volume_serves_a_hub_model_offline(tmp_path: Path) -> None:
    """`modelCache`: the chart mounts the claim and sets HF_HOME into it; a model put there by
    `hf download` (the hub cache layout) loads by its repo id, offline, in a server started with
    the rendered environment."""
    from tests.hf_models import CHECKPOINTS, save_to_hub_cache

    models = Path(tempfile.mkdtemp(prefix="fp-models-"))
    socket_dir = Path(tempfile.mkdtemp(prefix="fp-node-"))
    pod: Pod | None = None
    try:
        chart_values = values(socket_dir)
        chart_values["modelCache"] = {"enabled": True, "mountPath": str(models)}
        chart_values["config"]["encoder"] = "hf:acme/tiny-siglip"
        docs = render(chart_values)
        env = container_env(docs, pod_name="p")
        assert env["HF_HOME"] == f"{models}/huggingface" and env["HF_HUB_OFFLINE"] == "1"
        save_to_hub_cache(
            CHECKPOINTS[0], models / "huggingface" / "hub", "acme/tiny-siglip", tmp_path / "ck"
        )
        pod = Pod(docs, "fp-featpool-5d6e7f-cache", GPU_0, tmp_path / "cache.log")
        lease = pod.encode(seed=6)
        assert lease["shape"] == [196, 64]  # the tiny SigLIP tower: 14x14 patches, width 64
    finally:
        if pod is not None:
            pod.server.close()
        shutil.rmtree(socket_dir, ignore_errors=True)
        shutil.rmtree(models, ignore_errors=True)
