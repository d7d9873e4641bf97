"""Qwen2-VL / Qwen2.5-VL through the HTTP API, against transformers' own processor and model.

Tiny random-weight checkpoints are saved by transformers, served by featpool (``hf:<dir>``),
and every lease's tensor is compared with the model's own vision path on the same files.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load

from app.encoders import build_encoder
from app.encoders.qwen import QwenPreprocessor, smart_resize
from tests.helpers import live_server, small_settings
from tests.hf_models import cosine
from tests.qwen_reference import build_checkpoint, photos, reference

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def _encode(url: str, files: dict[str, bytes], **params: str) -> httpx.Response:
    parts = [("image", (name, data)) for name, data in files.items()]
    return httpx.post(f"{url}/v1/encode", files=parts, params=params, timeout=60)


def _tensor(url: str, lease_id: str) -> torch.Tensor:
    r = httpx.get(f"{url}/v1/leases/{lease_id}/tensor", timeout=30)
    assert r.status_code == 200, r.text
    return load(r.content)["features"]


def test_http_features_equal_transformers(checkpoint: Path, tmp_path: Path) -> None:
    files = photos()
    want, grids = reference(checkpoint, list(files.values()))
    out_dim = json.loads((checkpoint / "config.json").read_text())["vision_config"]
    width = out_dim.get("out_hidden_size") or out_dim["hidden_size"]
    settings = small_settings(tmp_path, encoder=f"hf:{checkpoint}")
    with live_server(settings) as live:
        r = _encode(live.url, files)
        assert r.status_code == 200, r.text
        items = r.json()["items"]
        assert len(items) == len(files)
        tokens = set()
        for name, item, ref, grid in zip(files, items, want, grids, strict=True):
            assert item["grid_thw"] == grid, name
            t, h, w = grid
            assert item["tokens"] == t * h * w // 4 == ref.shape[0], name
            assert item["shape"] == [item["tokens"], width], name
            got = _tensor(live.url, item["lease_id"])
            assert got.dtype == torch.float32
            assert cosine(got, ref) >= 0.999, (name, cosine(got, ref))
            tokens.add(item["tokens"])
        assert len(tokens) >= 4  # the photos really give different token counts
        # a lease is a GET away as well, with the same grid
        one = httpx.get(f"{live.url}/v1/leases/{items[0]['lease_id']}", timeout=10).json()
        assert one["grid_thw"] == grids[0] and one["tokens"] == items[0]["tokens"]
        # a repeat upload is a copy of the resident features, grid and all
        name, data = next(iter(files.items()))
        again = _encode(live.url, {name: data}).json()["items"][0]
        assert again["cached"] is True and again["feature_hash"] == items[0]["feature_hash"]
        assert again["grid_thw"] == grids[0] and again["tokens"] == items[0]["tokens"]
        assert torch.equal(
            _tensor(live.url, again["lease_id"]), _tensor(live.url, items[0]["lease_id"])
        )


def test_pooled_keeps_the_grid_and_a_refused_shape_leaks_nothing(
    checkpoint: Path, tmp_path: Path
) -> None:
    files = photos()
    settings = small_settings(tmp_path, encoder=f"hf:{checkpoint}")
    with live_server(settings) as live:
        r = _encode(live.url, {"landscape.jpg": files["landscape.jpg"]}, pooled="true")
        assert r.status_code == 200, r.text
        item = r.json()["items"][0]
        full = _encode(live.url, {"landscape.jpg": files["landscape.jpg"]}).json()["items"][0]
        assert item["grid_thw"] == full["grid_thw"] and item["tokens"] == full["tokens"]
        assert item["shape"] == full["shape"][1:]
        pooled = _tensor(live.url, item["lease_id"])
        torch.testing.assert_close(pooled, _tensor(live.url, full["lease_id"]).mean(0))
        for lease in (item, full):
            httpx.delete(f"{live.url}/v1/leases/{lease['lease_id']}", timeout=10)
        # Qwen2-VL refuses an aspect ratio above 200: a clear 400, and the request's other
        # image is not left behind in the pool.
        from io import BytesIO

        from PIL import Image
        from skimage import data

        buf = BytesIO()
        Image.fromarray(data.coffee()[200:201]).save(buf, "PNG")  # 600x1
        r = _encode(live.url, {"ok.jpg": files["tiny.jpg"], "sliver.png": buf.getvalue()})
        assert r.status_code == 400, r.text
        assert "aspect ratio" in r.json()["error"]["message"]
        assert live.occupancy() == (0, 0)


def test_only_the_vision_tower_is_loaded(checkpoint: Path) -> None:
    enc = build_encoder(f"hf:{checkpoint}", device=torch.device("cpu"))
    names = {n for n, _ in enc.module.named_parameters()}  # type: ignore[union-attr]
    assert names and not any("embed_tokens" in n or "lm_head" in n for n in names)
    assert any(n.startswith("merger.") for n in names)
    # the patch embedding runs as a GEMM: the Conv3d it replaces gives the same
    embed = enc.module.patch_embed  # type: ignore[union-attr]
    assert enc.patch_gemm  # type: ignore[union-attr]
    x = torch.randn(10, 3 * 2 * 14 * 14)
    want = embed.proj(x.view(-1, 3, 2, 14, 14)).view(10, -1)
    torch.testing.assert_close(embed(x), want, rtol=1e-4, atol=1e-5)


def test_smart_resize_matches_the_processor() -> None:
    tf = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    pre = QwenPreprocessor(min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
    for h, w in [(1, 1), (25, 4000), (480, 640), (1080, 1920), (4000, 3000), (27, 29)]:
        assert smart_resize(h, w, pre) == tf.smart_resize(
            h, w, factor=28, min_pixels=pre.min_pixels, max_pixels=pre.max_pixels
        )


def test_missing_tower_weights_is_a_clear_error(checkpoint: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "no-visual"
    broken.mkdir()
    for f in ("config.json", "preprocessor_config.json"):
        (broken / f).write_text((checkpoint / f).read_text())
    weights = load_file(checkpoint / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "visual" not in k}, broken / "model.safetensors")
    with pytest.raises(ValueError, match="no vision tower tensors"):
        build_encoder(f"hf:{broken}", device=torch.device("cpu"))


def test_packed_varlen_attention_equals_sdpa(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attention featpool uses on CUDA (torch's varlen kernel through transformers'
    attention interface) gets the packed boundaries of every image (and every window on 2.5);
    off CUDA its per-segment path must give what transformers' sdpa gives."""
    from transformers import AttentionInterface

    from app.encoders import qwen
    from tests.hf_models import upright

    images = [
        torch.from_numpy(np.array(upright(b).convert("RGB"))).permute(2, 0, 1).contiguous()
        for b in photos().values()
    ]
    plain = qwen.QwenVisionEncoder(checkpoint, device="cpu", attention="sdpa")
    packed = qwen.QwenVisionEncoder(checkpoint, device="cpu", attention=qwen.VARLEN_ATTENTION)
    calls: list[int] = []
    inner = AttentionInterface._global_mapping[qwen.VARLEN_ATTENTION]

    def spy(*args: object, **kwargs: object) -> object:
        cu = kwargs.get("cu_seq_lens_q")
        assert isinstance(cu, torch.Tensor)
        calls.append(len(cu) - 1)
        return inner(*args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, qwen.VARLEN_ATTENTION, spy)
    want = plain.encode_images(images)
    got = packed.encode_images(images)
    assert calls and min(calls) >= len(images)  # one call per layer, every image in it
    for (a, ga), (b, gb) in zip(got, want, strict=True):
        assert ga == gb
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_language_model_shards_are_never_read(checkpoint: Path, tmp_path: Path) -> None:
    """A sharded checkpoint (as the published 7B ones are): the shards that hold no tower
    tensor are not even opened, so featpool serves with them destroyed."""
    import transformers as tf

    sharded = tmp_path / "sharded"
    model = tf.AutoModelForImageTextToText.from_pretrained(checkpoint, local_files_only=True)
    model.save_pretrained(sharded, max_shard_size="200KB")
    for f in ("preprocessor_config.json",):
        (sharded / f).write_text((checkpoint / f).read_text())
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    tower = {shard for name, shard in index.items() if ".visual." in f".{name}"}
    others = set(index.values()) - tower
    assert others, "the test needs shards without tower tensors"
    for shard in others:
        (sharded / shard).write_bytes(b"not safetensors")
    enc = build_encoder(f"hf:{sharded}", device=torch.device("cpu"))
    want = build_encoder(f"hf:{checkpoint}", device=torch.device("cpu"))
    for (n, a), (_, b) in zip(
        enc.module.state_dict().items(),  # type: ignore[union-attr]
        want.module.state_dict().items(),  # type: ignore[union-attr]
        strict=True,
    ):
        assert torch.equal(a, b), n
