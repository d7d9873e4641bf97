"""Discovery on a real GPU: a CUDA server publishes its device's own UUID (the one nvidia-smi and
NVIDIA_VISIBLE_DEVICES name), a configured UUID that is not that device stops start-up, and a
consumer finds the server by its CUDA index and maps the GPU tier on that device."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from app.main import published_gpu_uuid
from pool import discovery
from pool.client import FeatureClient
from tests.conftest import image_bytes
from tests.helpers import live_server, small_settings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA"),
]


def test_cuda_index_maps_to_the_uuid_nvidia_smi_reports() -> None:
    uuid = discovery.cuda_uuid(0)
    assert uuid.startswith("GPU-") and len(uuid) == 40
    if shutil.which("nvidia-smi"):
        listed = subprocess.run(
            ["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert uuid in [discovery.normalize_uuid(u) for u in listed]


def test_server_publishes_its_device_uuid_and_refuses_another(tmp_path: Path) -> None:
    device = torch.device("cuda:0")
    actual = discovery.cuda_uuid(0)
    assert published_gpu_uuid(small_settings(tmp_path), device) == actual
    assert published_gpu_uuid(small_settings(tmp_path, gpu_uuid=actual.lower()), device) == actual
    with pytest.raises(RuntimeError, match="is not the GPU this server runs on"):
        published_gpu_uuid(small_settings(tmp_path, gpu_uuid="GPU-00000000-dead"), device)


def test_consumer_finds_the_server_by_cuda_index(tmp_path: Path) -> None:
    import httpx

    settings = small_settings(
        tmp_path, device="cuda", transport="cuda_vmm", pool_bytes=64 << 20, slab_bytes=32 << 20
    )
    with live_server(settings) as live:
        (entry,) = discovery.entries(tmp_path)
        assert entry.gpu_uuid == discovery.cuda_uuid(0) and entry.transport == "cuda_vmm"
        r = httpx.post(
            f"{live.url}/v1/encode",
            files=[("image", ("a.png", image_bytes("PNG", size=(40, 30)), "image/png"))],
            timeout=60,
        )
        assert r.status_code == 200, r.text
        lease = r.json()["items"][0]
        assert lease["transport"] == "cuda_vmm"
        with FeatureClient.for_gpu(tmp_path, cuda_index=0) as client:
            t = client.open(lease)
            assert t.device == torch.device("cuda:0") and list(t.shape) == lease["shape"]
            client.release(lease)
