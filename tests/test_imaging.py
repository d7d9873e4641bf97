"""Header validation, and the GPU decode path's plain-torch half (EXIF orientation, crop,
antialiased resize) checked against Pillow on the CPU. The engine's nvJPEG path runs here with
a fake decoder: batching, per-image retry, Pillow fallback, 400 for the bad image alone."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import cast

import numpy as np
import pytest
import torch
import torch.nn.functional as nnf
from fastapi.testclient import TestClient
from PIL import Image, ImageOps

from app.errors import ApiError
from app.gpu_decode import (
    ByteSpans,
    DecodeFn,
    FusedFn,
    JpegDecoder,
    orient,
    preprocess,
    resize_square,
    resize_weights,
    torchscript,
)
from app.imaging import decode, inspect
from tests.conftest import image_bytes, occupancy

LIMITS = {"max_pixels": 10_000_000, "max_bytes": 1 << 24}


def photo(w: int, h: int, seed: int = 0) -> np.ndarray:
    """Smooth gradients plus a little noise: what resize filters are compared on."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    rng = np.random.default_rng(seed)
    img = np.stack([128 + 100 * np.sin(x / 37 + c) * np.cos(y / 23 - c) for c in range(3)], -1)
    return (img + rng.normal(0, 4, img.shape)).clip(0, 255).astype(np.uint8)


def jpeg(arr: np.ndarray, orientation: int = 1, quality: int = 95) -> bytes:
    im = Image.fromarray(arr)
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=quality, exif=exif.tobytes())
    return buf.getvalue()


def upright_decode(datas: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Stands in for torchcodec's nvJPEG: full decode, turned upright by the EXIF orientation."""
    out = []
    for d in datas:
        im = ImageOps.exif_transpose(Image.open(io.BytesIO(d.numpy().tobytes())))
        out.append(
            torch.from_numpy(np.asarray(im.convert("RGB")).copy()).permute(2, 0, 1).to(device)
        )
    return out


def pil_decode(datas: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Stands in for nvJPEG: full decode, no orientation, RGB."""
    out = []
    for d in datas:
        im = Image.open(io.BytesIO(d.numpy().tobytes()))
        im.load()
        out.append(
            torch.from_numpy(np.asarray(im.convert("RGB")).copy()).permute(2, 0, 1).to(device)
        )
    return out


def bogus_huffman(data: bytes) -> bytes:
    """A JPEG whose header parses but whose first Huffman table is impossible (counts sum
    past 256): decoders refuse it only when they decode the pixels."""
    at = data.index(b"\xff\xc4") + 5  # marker, length, class/id, then 16 counts
    return data[:at] + bytes([255] * 16) + data[at + 16 :]


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orient_matches_pillow_exif_transpose(orientation: int) -> None:
    arr = np.random.default_rng(orientation).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    im = Image.fromarray(arr)
    exif = im.getexif()
    exif[0x0112] = orientation
    im.info["exif"] = exif.tobytes()
    want = np.asarray(ImageOps.exif_transpose(im))
    got = orient(torch.from_numpy(arr).permute(2, 0, 1), orientation).permute(1, 2, 0).numpy()
    assert np.array_equal(got, want)


def scripted_preprocess() -> Callable[[list[torch.Tensor], list[int], int], torch.Tensor]:
    """``preprocess`` as TorchScript compiles it (for nvJPEG's one-call decode on the GPU)."""
    return cast(
        Callable[[list[torch.Tensor], list[int], int], torch.Tensor], torchscript(preprocess)
    )


PREPROCESS = pytest.mark.parametrize(
    "pre", [preprocess, scripted_preprocess()], ids=["eager", "script"]
)


@PREPROCESS
@pytest.mark.parametrize("size", [(320, 240), (240, 320), (224, 224), (100, 60)])
def test_preprocess_matches_pillow_fit(
    size: tuple[int, int], pre: Callable[..., torch.Tensor]
) -> None:
    arr = photo(*size)
    want = np.asarray(ImageOps.fit(Image.fromarray(arr), (56, 56), Image.Resampling.BICUBIC))
    got = pre([torch.from_numpy(arr).permute(2, 0, 1)], [1], 56)
    assert got.shape == (1, 3, 56, 56)
    diff = np.abs(got[0].permute(1, 2, 0).numpy() - want.astype(np.float32))
    assert diff.mean() < 1.5 and np.percentile(diff, 99) < 12


@pytest.mark.parametrize("side", [768, 300, 224, 100])
def test_resize_weights_are_torchs_own_filter(side: int) -> None:
    """The matrix ``resize_square`` multiplies by, applied along one axis, is torch's
    antialiased bicubic resize along that axis (up and down), and each row sums to one."""
    w = resize_weights(side, 224, torch.device("cpu"))
    assert w.shape == (224, side)
    assert torch.allclose(w.sum(1), torch.ones(224), atol=1e-5)
    x = torch.from_numpy(photo(side, 40)).permute(2, 0, 1)[None].float()  # [1, 3, 40, side]
    want = nnf.interpolate(x, size=[40, 224], mode="bicubic", antialias=True, align_corners=False)
    assert torch.allclose(x @ w.t(), want, atol=1e-3)


@pytest.mark.parametrize("name", ["chelsea", "coffee", "astronaut", "rocket"])
def test_resize_square_is_torchs_antialiased_bicubic(name: str) -> None:
    """On real photos (scikit-image's), the two matrix products give what torch's own
    ``interpolate`` gives: the same values to 1e-3 on the CPU (float32)."""
    photos = pytest.importorskip("skimage.data", reason="the test photos ship with scikit-image")
    arr = torch.from_numpy(getattr(photos, name)().copy()).permute(2, 0, 1)
    side = min(arr.shape[-2:])
    square = arr[:, :side, :side][None]
    want = nnf.interpolate(
        square.float(), size=[224, 224], mode="bicubic", antialias=True, align_corners=False
    )
    got = resize_square(square, 224)
    assert got.dtype == torch.float32 and got.shape == (1, 3, 224, 224)
    assert (got - want).abs().max() < 1e-3


@PREPROCESS
def test_preprocess_groups_shapes_and_keeps_order(pre: Callable[..., torch.Tensor]) -> None:
    a, b = photo(64, 48, 1), photo(48, 64, 2)
    ims = [torch.from_numpy(x).permute(2, 0, 1) for x in (a, b, a, photo(40, 40, 3))]
    out = pre(ims, [1, 1, 3, 6], 16)
    alone = [preprocess([im], [o], 16)[0] for im, o in zip(ims, [1, 1, 3, 6], strict=True)]
    for got, want in zip(out, alone, strict=True):
        assert torch.equal(got, want)
    assert not torch.equal(out[0], out[2])  # the third one is upside down
    with pytest.raises((ValueError, torch.jit.Error), match="one orientation per image"):
        pre(ims, [1], 16)


def test_inspect_reads_header_only_and_routes() -> None:
    data = jpeg(photo(64, 48), orientation=6)
    h = inspect(data, **LIMITS)
    assert (h.format, h.width, h.height, h.orientation, h.gpu_jpeg) == ("JPEG", 64, 48, 6, True)
    assert not inspect(data[:-200], **LIMITS).gpu_jpeg  # truncated: Pillow decides
    assert not inspect(image_bytes("JPEG", mode="CMYK"), **LIMITS).gpu_jpeg
    assert inspect(image_bytes("JPEG", mode="L"), **LIMITS).gpu_jpeg
    assert not inspect(image_bytes("PNG"), **LIMITS).gpu_jpeg
    for bad, kind in (
        (b"", "empty_image"),
        (b"\xff\xd8\xffgarbage", "invalid_image"),
        (b"GIF89a", "invalid_image"),
    ):
        with pytest.raises(ApiError) as e:
            inspect(bad, **LIMITS)
        assert e.value.type == kind
    with pytest.raises(ApiError) as e:
        inspect(data, max_pixels=100, max_bytes=1 << 20)
    assert e.value.type == "image_too_large"


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_gpu_path_pixels_match_the_pillow_path(orientation: int) -> None:
    data = jpeg(photo(400, 300), orientation)
    want = decode(data, 32, **LIMITS).float()
    h = inspect(data, **LIMITS)
    [raw] = pil_decode([torch.frombuffer(bytearray(data), dtype=torch.uint8)], torch.device("cpu"))
    got = preprocess([raw], [h.orientation], 32)[0]
    assert (got - want).abs().mean() < 3.0  # Pillow decodes at reduced scale (draft)


def test_decoder_retries_one_by_one_when_the_batch_fails() -> None:
    calls: list[int] = []

    def flaky(datas: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        calls.append(len(datas))
        if any(d[-1] != 0xD9 for d in datas):
            raise RuntimeError("nvjpeg: bad data")
        return pil_decode(datas, device)

    good = torch.frombuffer(bytearray(jpeg(photo(20, 20))), dtype=torch.uint8)
    bad = torch.frombuffer(bytearray(b"\xff\xd8\xff" + bytes(50)), dtype=torch.uint8)
    out = JpegDecoder(torch.device("cpu"), flaky).decode([good, bad, good])
    assert calls == [3, 1, 1, 1]
    assert isinstance(out[0], torch.Tensor) and isinstance(out[2], torch.Tensor)
    assert isinstance(out[1], RuntimeError)


def test_bogus_huffman_passes_validation_and_fails_decode() -> None:
    data = bogus_huffman(jpeg(photo(32, 32)))
    assert inspect(data, **LIMITS).gpu_jpeg
    with pytest.raises(ApiError) as e:
        decode(data, 16, **LIMITS)
    assert e.value.type == "invalid_image"


def test_create_falls_back_without_cuda() -> None:
    assert JpegDecoder.create(torch.device("cpu"), "auto") is None
    assert JpegDecoder.create(torch.device("cpu"), "off") is None
    with pytest.raises(RuntimeError, match="gpu-decode on"):
        JpegDecoder.create(torch.device("cpu"), "on")


def in_one_call(decode: DecodeFn, calls: list[int]) -> FusedFn:
    """Stands in for nvJPEG's one-call decode and preprocess: ``decode``, then ``preprocess``
    as TorchScript compiles it."""
    scripted = scripted_preprocess()

    def fused(spans: ByteSpans, orientations: list[int], size: int) -> torch.Tensor:
        calls.append(len(spans.which))
        return scripted(decode(spans.tensors(), torch.device("cpu")), orientations, size)

    return fused


@pytest.mark.parametrize("one_call", [False, True], ids=["per-image", "one-call"])
def test_engine_gpu_decode_path_with_a_fake_nvjpeg(
    make_client: Callable[..., TestClient], one_call: bool
) -> None:
    """The engine's nvJPEG path on the CPU: a JPEG the decoder refuses (and Pillow too) fails
    its own request with a 400; a good JPEG batched with it is encoded; nothing leaks. With
    the one-call decode and preprocess, the refused batch falls back to image by image."""
    c = make_client(max_batch_wait_ms=50.0)
    engine = c.app.state.engine  # type: ignore[attr-defined]
    refused: list[int] = []

    def picky(datas: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        try:
            return pil_decode(datas, device)
        except OSError as e:
            refused.append(len(datas))
            raise RuntimeError(f"nvjpeg: {e}") from None

    fused_calls: list[int] = []
    fused = in_one_call(picky, fused_calls) if one_call else None
    engine.jpeg = JpegDecoder(torch.device("cpu"), picky, fused=fused)
    good = jpeg(photo(96, 64), orientation=6)
    corrupt = bogus_huffman(good)
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        f_bad = ex.submit(
            c.post, "/v1/encode", content=corrupt, headers={"content-type": "image/jpeg"}
        )
        f_good = ex.submit(
            c.post, "/v1/encode", content=good, headers={"content-type": "image/jpeg"}
        )
        bad, ok = f_bad.result(), f_good.result()
    assert ok.status_code == 200, ok.text
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_image", bad.text
    assert refused  # the fake nvJPEG saw it
    assert bool(fused_calls) == one_call
    assert occupancy(c)[1] == 1
    # Same pixels as the Pillow path (up to draft-mode decoding): the orientation was applied.
    lid = ok.json()["items"][0]["lease_id"]
    engine.jpeg = None
    lid2 = c.post("/v1/encode", content=good, headers={"content-type": "image/jpeg"}).json()[
        "items"
    ][0]["lease_id"]
    from safetensors.torch import load

    a, b = (load(c.get(f"/v1/leases/{i}/tensor").content)["features"] for i in (lid, lid2))
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99


def test_one_call_decode_gives_the_per_image_paths_features(
    make_client: Callable[..., TestClient],
) -> None:
    """A batch of JPEGs (EXIF-rotated, of several shapes) decoded and preprocessed in one call
    gives each image the same features, bit for bit, as the per-image path; the one call took
    the whole batch."""
    c = make_client(max_batch_wait_ms=200.0, feature_cache_entries=0)
    engine = c.app.state.engine  # type: ignore[attr-defined]
    files = [
        ("image", (f"{k}.jpg", jpeg(photo(w, h, k), o), "image/jpeg"))
        for k, (w, h, o) in enumerate([(96, 64, 6), (64, 96, 1), (80, 80, 3), (96, 64, 1)])
    ]

    def features(fused: FusedFn | None) -> list[torch.Tensor]:
        engine.jpeg = JpegDecoder(torch.device("cpu"), pil_decode, fused=fused)
        r = c.post("/v1/encode", files=files)
        assert r.status_code == 200, r.text
        assert not any(it["cached"] for it in r.json()["items"])
        from safetensors.torch import load

        return [
            load(c.get(f"/v1/leases/{it['lease_id']}/tensor").content)["features"]
            for it in r.json()["items"]
        ]

    calls: list[int] = []
    one_call, per_image = features(in_one_call(pil_decode, calls)), features(None)
    assert calls == [4]
    for a, b in zip(one_call, per_image, strict=True):
        assert torch.equal(a, b)
