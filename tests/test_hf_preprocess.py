"""Hugging Face towers served through the HTTP API give the features transformers gives: each
lease equals the model's own image processor + vision tower on the same file (float32, CPU,
cosine >= 0.999), for tiny random checkpoints saved by transformers (SigLIP: exact size; CLIP:
shortest edge + centre crop; bicubic and bilinear) and real photos of many shapes. Models are
named by directory or, as people type them, by repo id from the local Hugging Face cache."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from PIL import Image

from app.encoders import build_encoder, check_encoder_name
from app.imaging import decode, decode_upright
from app.preprocess import (
    BICUBIC,
    BILINEAR,
    ImageSpec,
    center_crop,
    interpolation,
    resize,
    shortest_edge_size,
)
from bench.appserver import AppServer
from tests.helpers import ROOT, live_server, small_settings
from tests.hf_models import (
    CHECKPOINTS,
    Checkpoint,
    cosine,
    encode_all,
    photos,
    reference,
    save_checkpoint,
    save_to_hub_cache,
    transformers_composites_alpha,
    translucent_png,
    upright,
)

transformers = pytest.importorskip(
    "transformers", reason="optional extra 'hf' (transformers) is not installed"
)
pytest.importorskip("skimage", reason="the test photos ship with scikit-image")

CPU = torch.device("cpu")
LIMITS = {"max_pixels": 40_000_000, "max_bytes": 1 << 24}


@pytest.fixture(scope="module")
def files() -> dict[str, bytes]:
    out = photos()
    if transformers_composites_alpha():
        out["translucent.png"] = translucent_png()
    return out


@pytest.mark.parametrize("ck", CHECKPOINTS, ids=lambda c: c.id)
def test_leases_equal_transformers(tmp_path: Path, files: dict[str, bytes], ck: Checkpoint) -> None:
    model = save_checkpoint(ck, tmp_path / "model")
    with live_server(small_settings(tmp_path, encoder=f"hf:{model}", max_batch_size=16)) as live:
        got = encode_all(live.url, files)
    want = reference(model, [upright(d) for d in files.values()])
    assert want.shape[1:] == (196 + (ck.kind == "clip"), 64)
    cos = {n: round(cosine(g, w), 5) for n, g, w in zip(files, got, want, strict=True)}
    print(json.dumps({"checkpoint": ck.id, "cosine": cos, "before": before(model, files, want)}))
    assert all(c >= 0.999 for c in cos.values()), cos

    # The comparison sees what matters: the stored (not upright) pixels, which a processor fed
    # straight from Image.open() would see, give other features.
    exif = [n for n in files if n.startswith("exif")]
    stored = reference(model, [Image.open(io.BytesIO(files[n])) for n in exif])
    for n, s in zip(exif, stored, strict=True):
        assert cosine(got[list(files).index(n)], s) < 0.99, n


def before(model: Path, files: dict[str, bytes], want: torch.Tensor) -> dict[str, float]:
    """The baseline for docs/benchmarks.md: featpool's default preprocessing (centre square,
    bicubic), which served these checkpoints before they had their own."""
    enc = build_encoder(f"hf:{model}", device=CPU)
    x = torch.stack([decode(d, enc.image_size, **LIMITS) for d in files.values()]).float() / 255
    x = (x - torch.tensor(enc.mean).view(1, 3, 1, 1)) / torch.tensor(enc.std).view(1, 3, 1, 1)
    got = enc.encode(x)
    return {n: round(cosine(g, w), 4) for n, g, w in zip(files, got, want, strict=True)}


def test_transformers_own_file_loading_applies_exif(
    tmp_path: Path, files: dict[str, bytes]
) -> None:
    """What featpool matches: transformers' processor given the file itself loads it upright."""
    model = save_checkpoint(CHECKPOINTS[0], tmp_path / "model")
    path = tmp_path / "exif6.jpg"
    path.write_bytes(files["exif6.jpg"])
    by_path = reference(model, [str(path)])  # type: ignore[list-item]
    assert cosine(by_path[0], reference(model, [upright(files["exif6.jpg"])])[0]) > 0.9999


# ---- the pieces, against transformers' own processor ------------------------------------------


@pytest.mark.parametrize("ck", CHECKPOINTS, ids=lambda c: c.id)
def test_spec_pixels_equal_the_processor(
    tmp_path: Path, files: dict[str, bytes], ck: Checkpoint
) -> None:
    model = save_checkpoint(ck, tmp_path)
    spec = ImageSpec.from_pretrained(model)
    assert spec is not None and spec.resample == ck.resample
    proc = transformers.AutoImageProcessor.from_pretrained(model, local_files_only=True)
    for name, data in files.items():
        mine = spec.apply([decode_upright(data, **LIMITS)], [1])
        theirs = proc(images=[upright(data)], return_tensors="pt")["pixel_values"]
        assert mine.shape == theirs.shape == (1, 3, 224, 224), name
        # Within one uint8 level after normalising: rounding between passes differs (PIL)
        one_level = 1 / 255 / min(spec.std or (1.0,))
        diff = (mine - theirs).abs()
        assert diff.mean() < 0.25 * one_level and diff.max() <= 48 * one_level, name


def test_shortest_edge_truncates_the_long_side() -> None:
    assert shortest_edge_size(427, 640, 224) == (224, 335)  # 224 * 640 / 427 = 335.7
    assert shortest_edge_size(660, 550, 224) == (268, 224)
    assert shortest_edge_size(300, 300, 224) == (224, 224)


def test_center_crop_pads_a_small_image_as_transformers() -> None:
    x = torch.arange(2 * 3, dtype=torch.uint8).view(1, 1, 2, 3) + 1
    out = center_crop(x, (4, 6))
    assert out.shape == (1, 1, 4, 6)
    assert out[0, 0, 1:3, 1:4].tolist() == x[0, 0].tolist()  # left pad (6-3)//2 = 1
    assert out.sum() == x.sum()
    y = torch.arange(5 * 5, dtype=torch.uint8).view(1, 1, 5, 5)
    assert center_crop(y, (2, 2))[0, 0].tolist() == [[6, 7], [11, 12]]  # int(3 / 2) = 1


def test_filters_map_as_transformers_maps_them() -> None:
    assert interpolation(BILINEAR) == ("bilinear", True)
    assert interpolation(BICUBIC) == ("bicubic", True)
    assert interpolation(0) == ("nearest-exact", False)
    assert interpolation(1) == ("bicubic", True)  # LANCZOS on CUDA in transformers
    with pytest.raises(ValueError, match="BOX"):
        interpolation(4)
    x = torch.full((1, 3, 10, 10), 7, dtype=torch.uint8)
    assert resize(x, (10, 10), BICUBIC) is x
    assert resize(x, (5, 20), BICUBIC).dtype == torch.uint8


def test_unsupported_processor_is_a_startup_error(tmp_path: Path) -> None:
    save_checkpoint(CHECKPOINTS[0], tmp_path)
    transformers.SiglipImageProcessor(size={"shortest_edge": 224}).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="follows the input"):
        build_encoder(f"hf:{tmp_path}", device=CPU)
    transformers.SiglipImageProcessor(size={"height": 256, "width": 256}).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"gives 256x256 images but the model takes 224x224"):
        build_encoder(f"hf:{tmp_path}", device=CPU)
    transformers.SiglipImageProcessor(resample=4).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="BOX"):
        build_encoder(f"hf:{tmp_path}", device=CPU)
    # A processor with steps of its own (ConvNeXt's crop_pct) is refused, not approximated.
    transformers.ConvNextImageProcessor(size={"shortest_edge": 224}).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"ConvNextImageProcessor.*in its own way"):
        build_encoder(f"hf:{tmp_path}", device=CPU)
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="transformers cannot load this image processor"):
        build_encoder(f"hf:{tmp_path}", device=CPU)


# ---- model names as people type them ------------------------------------------------------------


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    from huggingface_hub import constants

    cache = tmp_path / "hf-home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    yield cache


def test_repo_id_resolves_through_the_hub_cache(tmp_path: Path, hub_cache: Path) -> None:
    from huggingface_hub import scan_cache_dir

    snapshot = save_to_hub_cache(
        CHECKPOINTS[0], hub_cache, "featpool-test/tiny-siglip", tmp_path / "m"
    )
    assert [r.repo_id for r in scan_cache_dir(hub_cache).repos] == ["featpool-test/tiny-siglip"]
    enc = build_encoder("hf:featpool-test/tiny-siglip", device=CPU)
    assert enc.name == "hf:featpool-test/tiny-siglip"
    assert enc.preprocess_spec is not None and enc.preprocess_spec.source.startswith(str(snapshot))
    commit = snapshot.name
    assert build_encoder(f"hf:featpool-test/tiny-siglip@{commit}", device=CPU).output_shape == (
        196,
        64,
    )


def test_model_missing_from_the_cache_names_where_it_looked(hub_cache: Path) -> None:
    for name in ("hf:google/not-in-this-cache", "hf:google/not-in-this-cache@v2"):
        with pytest.raises(ValueError, match=rf"not in the Hugging Face cache {hub_cache}"):
            check_encoder_name(name)
    with pytest.raises(ValueError, match="not a local model directory"):
        check_encoder_name(f"hf:{hub_cache / 'no-such-dir'}")


def test_server_resolves_a_cached_repo_id_from_hf_home(
    tmp_path: Path, files: dict[str, bytes]
) -> None:
    """As a user runs it: `python -m app --encoder hf:org/name` with HF_HOME set; no network."""
    home = tmp_path / "hf-home"
    save_to_hub_cache(CHECKPOINTS[2], home / "hub", "featpool-test/tiny-clip", tmp_path / "m")
    env = {
        "HF_HOME": str(home),
        "HF_HUB_OFFLINE": "1",
        "FEATPOOL_SOCKET_PATH": str(tmp_path / "s.sock"),
        "FEATPOOL_HOST_POOL_BYTES": str(16 << 20),
    }
    env.pop("HF_HUB_CACHE", None)
    os_env = {k: v for k, v in os.environ.items() if k != "HF_HUB_CACHE"}
    os_env.update(env)
    one = {"exif6.jpg": files["exif6.jpg"]}
    server = AppServer(
        ["--device", "cpu", "--encoder", "hf:featpool-test/tiny-clip"],
        tmp_path / "server.log",
        env=os_env,
        start_timeout_s=120,
    )
    try:
        got = encode_all(server.url, one)
    finally:
        server.close()
    want = reference(tmp_path / "m", [upright(one["exif6.jpg"])])
    assert cosine(got[0], want[0]) >= 0.999

    missing = subprocess.run(
        [sys.executable, "-m", "app", "--device", "cpu", "--encoder", "hf:featpool-test/absent"],
        cwd=ROOT,
        env=os_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert missing.returncode != 0
    assert f"not in the Hugging Face cache {home / 'hub'}" in missing.stderr, missing.stderr
    assert "Traceback" not in missing.stderr
