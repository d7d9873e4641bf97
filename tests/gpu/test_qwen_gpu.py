"""Qwen2-VL / Qwen2.5-VL on CUDA through the HTTP API, in bfloat16, against transformers'
processor (its torchvision backend where installed) and the model's own vision path."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load

from tests.helpers import live_server, small_settings
from tests.hf_models import cosine
from tests.qwen_reference import build_checkpoint, photos, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA"),
]


@pytest.mark.parametrize(
    ("kind", "compiled"), [("qwen2_vl", True), ("qwen2_5_vl", True), ("qwen2_5_vl", False)]
)
def test_http_features_equal_transformers_bf16(kind: str, compiled: bool, tmp_path: Path) -> None:
    """Compiled blocks (``--tower-compile``, the default) and eager ones alike."""
    pytest.importorskip("transformers")
    checkpoint = build_checkpoint(kind, tmp_path / kind)
    files = photos()
    want, grids = reference(checkpoint, list(files.values()), device="cuda", dtype=torch.bfloat16)
    settings = small_settings(
        tmp_path,
        encoder=f"hf:{checkpoint}",
        device="cuda",
        pool_bytes=64 << 20,
        slab_bytes=32 << 20,
        gpu_decode="auto",
        tower_compile=compiled,
    )
    with live_server(settings) as live:
        parts = [("image", (name, data)) for name, data in files.items()]
        r = httpx.post(f"{live.url}/v1/encode", files=parts, timeout=60)
        assert r.status_code == 200, r.text
        items = r.json()["items"]
        for name, item, ref, grid in zip(files, items, want, grids, strict=True):
            assert item["grid_thw"] == grid and item["tokens"] == ref.shape[0], name
            assert item["dtype"] == "bfloat16"
            got = httpx.get(f"{live.url}/v1/leases/{item['lease_id']}/tensor", timeout=30)
            feats = load(got.content)["features"].float()
            c = cosine(feats, ref)
            print(
                f"{kind} compiled={compiled} {name}: grid {grid} cosine {c:.5f} tier {item['tier']}"
            )
            assert c >= 0.99, (name, c)
