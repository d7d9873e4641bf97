"""Encoders on the CPU: shapes (big presets on the meta device), seeding, weights, batching."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from app.encoders import PRESETS, Encoder, ViTEncoder, build_encoder, check_encoder_name

CPU = torch.device("cpu")
META = torch.device("meta")

EXPECTED_SHAPES = {
    "vit-b16-224": (224, (197, 768)),
    "siglip-so400m-384": (384, (729, 1152)),
    "qwen25vl-1036": (1036, (1369, 3584)),
    "tiny-test": (32, (17, 64)),
}


def _pixels(encoder: Encoder, batch: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    s = encoder.image_size
    return torch.randn(batch, 3, s, s, generator=gen).to(encoder.device)


def test_presets_are_the_expected_ones() -> None:
    assert set(PRESETS) == set(EXPECTED_SHAPES)


@pytest.mark.parametrize("name", sorted(EXPECTED_SHAPES))
def test_preset_output_shape_on_meta(name: str) -> None:
    size, shape = EXPECTED_SHAPES[name]
    enc = build_encoder(name, device=META)
    assert isinstance(enc, Encoder)
    assert enc.image_size == size
    assert enc.output_shape == shape
    assert enc.dtype == torch.float32
    out = enc.encode(torch.empty(3, 3, size, size, device=META))
    assert tuple(out.shape) == (3, *shape)
    assert out.device.type == "meta"


def test_meta_build_respects_dtype() -> None:
    enc = build_encoder("qwen25vl-1036", device=META, dtype=torch.bfloat16)
    assert enc.dtype == torch.bfloat16
    out = enc.encode(torch.empty(1, 3, 1036, 1036, device=META))
    assert out.dtype == torch.bfloat16


def test_tiny_forward_shape_and_values() -> None:
    enc = build_encoder("tiny-test", device=CPU)
    assert enc.device == CPU
    out = enc.encode(_pixels(enc, 4))
    assert out.shape == (4, 17, 64)
    assert out.dtype == torch.float32
    assert out.device == CPU
    assert torch.isfinite(out).all()
    assert out.is_inference()


def test_seeded_weights_are_deterministic() -> None:
    a = build_encoder("tiny-test", device=CPU)
    b = build_encoder("tiny-test", device=CPU)
    assert isinstance(a, ViTEncoder) and isinstance(b, ViTEncoder)
    sa, sb = a.module.state_dict(), b.module.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    x = _pixels(a, 2)
    assert torch.equal(a.encode(x), b.encode(x))


def test_different_seed_gives_different_weights() -> None:
    a = ViTEncoder("tiny-test", device=CPU)
    b = ViTEncoder("tiny-test", device=CPU, seed=1)
    assert not torch.equal(a.module.pos_embed, b.module.pos_embed)


def test_save_load_round_trip(tmp_path: Path) -> None:
    a = ViTEncoder("tiny-test", device=CPU, seed=7)
    path = tmp_path / "tiny.safetensors"
    a.save_weights(path)
    b = build_encoder("tiny-test", device=CPU, weights=path)
    x = _pixels(a, 3)
    assert torch.equal(a.encode(x), b.encode(x))
    # Not the default seed, so the weights really came from the file.
    assert not torch.equal(b.encode(x), build_encoder("tiny-test", device=CPU).encode(x))


def test_load_casts_to_requested_dtype(tmp_path: Path) -> None:
    path = tmp_path / "tiny.safetensors"
    ViTEncoder("tiny-test", device=CPU).save_weights(path)
    enc = build_encoder("tiny-test", device=CPU, weights=path, dtype=torch.bfloat16)
    assert isinstance(enc, ViTEncoder)
    assert all(p.dtype == torch.bfloat16 for p in enc.module.parameters())
    assert enc.encode(_pixels(enc, 1)).dtype == torch.bfloat16


def test_weights_with_wrong_key_raise_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "tiny.safetensors"
    ViTEncoder("tiny-test", device=CPU).save_weights(path)
    state = safetensors.torch.load_file(str(path))
    state["pos_embedding"] = state.pop("pos_embed")
    bad = tmp_path / "bad.safetensors"
    safetensors.torch.save_file(state, str(bad))
    with pytest.raises(
        ValueError,
        match=r"missing keys \[pos_embed\].*unexpected keys "
        r"\[pos_embedding\]",
    ):
        build_encoder("tiny-test", device=CPU, weights=bad)


def test_weights_of_another_preset_raise(tmp_path: Path) -> None:
    path = tmp_path / "tiny.safetensors"
    state = {
        k: v.clone() for k, v in ViTEncoder("tiny-test", device=CPU).module.state_dict().items()
    }
    state["pos_embed"] = torch.zeros(1, 5, 64)
    safetensors.torch.save_file(state, str(path))
    with pytest.raises(
        ValueError,
        match=r"wrong shapes \[pos_embed \[1, 5, 64\] != "
        r"\[1, 17, 64\]\]",
    ):
        build_encoder("tiny-test", device=CPU, weights=path)


def test_missing_weights_file_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        build_encoder("tiny-test", device=CPU, weights=tmp_path / "nope.safetensors")


def test_batch_independence() -> None:
    enc = build_encoder("tiny-test", device=CPU)
    x = _pixels(enc, 5)
    batch = enc.encode(x)
    for i in range(5):
        torch.testing.assert_close(enc.encode(x[i : i + 1])[0], batch[i], rtol=1e-5, atol=1e-5)


def test_patch_merge_uses_2x2_neighbourhoods() -> None:
    # Changing one patch changes exactly the merged token of the 2x2 window holding it.
    from app.encoders.vit import PatchMerger

    torch.manual_seed(0)
    merger = PatchMerger(dim=4, grid=4, out_dim=6)
    x = torch.randn(1, 16, 4)
    y = merger(x)
    assert y.shape == (1, 4, 6)
    for patch in range(16):
        row, col = divmod(patch, 4)
        x2 = x.clone()
        x2[0, patch] += 1.0
        changed = (merger(x2) != y).any(dim=-1)[0].nonzero().flatten().tolist()
        assert changed == [row // 2 * 2 + col // 2], patch


def test_dtype_handling() -> None:
    enc = build_encoder("tiny-test", device=CPU, dtype=torch.bfloat16)
    assert enc.dtype == torch.bfloat16
    x = _pixels(enc, 2)
    # Any float input dtype is accepted and cast inside.
    for in_dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        out = enc.encode(x.to(in_dtype))
        assert out.dtype == torch.bfloat16
    ref = build_encoder("tiny-test", device=CPU).encode(x)
    torch.testing.assert_close(enc.encode(x).float(), ref, rtol=0.05, atol=0.05)


def test_bad_inputs_are_rejected() -> None:
    enc = build_encoder("tiny-test", device=CPU)
    with pytest.raises(ValueError, match=r"expects \[B, 3, 32, 32\]"):
        enc.encode(torch.zeros(1, 3, 16, 16))
    with pytest.raises(ValueError, match=r"expects \[B, 3, 32, 32\]"):
        enc.encode(torch.zeros(3, 32, 32))
    with pytest.raises(TypeError, match="normalised floats"):
        enc.encode(torch.zeros(1, 3, 32, 32, dtype=torch.uint8))
    with pytest.raises(ValueError, match="runs on cpu"):
        enc.encode(torch.zeros(1, 3, 32, 32, device=META))


def test_non_float_dtype_rejected() -> None:
    with pytest.raises(ValueError, match="float type"):
        build_encoder("tiny-test", device=CPU, dtype=torch.int8)


def test_warmup_runs() -> None:
    enc = build_encoder("tiny-test", device=CPU)
    enc.warmup([1, 3])


def test_compile_flag_is_ignored_off_cuda() -> None:
    enc = build_encoder("tiny-test", device=CPU, compile=True)
    assert isinstance(enc, ViTEncoder)
    assert enc._forward is enc.module


def test_unknown_preset_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown encoder 'vit-h'.*vit-b16-224.*tiny-test"):
        build_encoder("vit-h", device=CPU)


def test_hf_directory_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a local model directory"):
        build_encoder(f"hf:{tmp_path / 'missing'}", device=CPU)


def test_hf_rejects_weights_argument(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="do not pass weights"):
        build_encoder(f"hf:{tmp_path}", device=CPU, weights=tmp_path / "w.safetensors")


# Hugging Face towers: a tiny random model saved to a temp dir, nothing downloaded.

TINY_HF = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": 32,
    "patch_size": 8,
}


@pytest.mark.parametrize(("kind", "tokens"), [("siglip", 16), ("clip", 17)])
def test_hf_tiny_vision_tower_matches_transformers(tmp_path: Path, kind: str, tokens: int) -> None:
    transformers = pytest.importorskip(
        "transformers", reason="optional extra 'hf' (transformers) is not installed"
    )
    torch.manual_seed(0)
    if kind == "siglip":
        model = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**TINY_HF))
    else:
        model = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**TINY_HF))
    model.eval()
    model.save_pretrained(tmp_path)
    mean, std = [0.4, 0.5, 0.6], [0.2, 0.25, 0.3]
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_mean": mean,
                "image_std": std,
                "size": {"height": 32, "width": 32},
                "crop_size": {"height": 32, "width": 32},  # CLIP's processor crops by default
            }
        )
    )

    enc = build_encoder(f"hf:{tmp_path}", device=CPU)
    assert isinstance(enc, Encoder)
    assert enc.image_size == 32
    assert enc.output_shape == (tokens, 32)
    assert enc.mean == tuple(mean) and enc.std == tuple(std)
    assert enc.dtype == torch.float32

    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    out = enc.encode(x)
    with torch.no_grad():
        ref = model(pixel_values=x).last_hidden_state
    assert out.shape == (3, tokens, 32)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

    half = build_encoder(f"hf:{tmp_path}", device=CPU, dtype=torch.bfloat16)
    assert half.encode(x).dtype == torch.bfloat16


def test_hf_defaults_without_preprocessor_config(tmp_path: Path) -> None:
    transformers = pytest.importorskip(
        "transformers", reason="optional extra 'hf' (transformers) is not installed"
    )
    transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**TINY_HF)).save_pretrained(
        tmp_path
    )
    enc = build_encoder(f"hf:{tmp_path}", device=CPU)
    assert enc.mean == (0.5, 0.5, 0.5) and enc.std == (0.5, 0.5, 0.5)
    assert enc.image_size == 32


@pytest.mark.parametrize("missing", ["transformers", "huggingface_hub"])
@pytest.mark.parametrize("ref", ["org/name", "."])
def test_hf_encoder_without_the_extra_is_a_one_line_error(
    monkeypatch: pytest.MonkeyPatch, missing: str, ref: str
) -> None:
    """`python -m app` prints check_encoder_name's ValueError in one line and exits; without the
    hf extra an hf: name must give that, naming the extra, not an ImportError traceback."""
    monkeypatch.setitem(sys.modules, missing, None)  # what an absent package imports as
    with pytest.raises(ValueError, match=r"pip install '\.\[hf\]'"):
        check_encoder_name(f"hf:{ref}")
