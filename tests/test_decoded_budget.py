"""Decoded bytes (width x height x channels x bytes per sample, 16-bit counted) bounded per
image and per request, refused before any pixel is decoded (across requests in flight the
admission permit bounds them: tests/test_entrance.py); and the decode's own working memory
kept close to that count."""

from __future__ import annotations

import io
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import skimage.data
from fastapi.testclient import TestClient
from PIL import Image, ImageOps

import app.engine
import app.imaging
from app.imaging import decode, decoded_bytes, inspect
from bench.make_images import png16, upscaled_photo
from tests.conftest import occupancy
from tests.helpers import ROOT

LIMITS: dict[str, Any] = {"max_pixels": 40_000_000, "max_bytes": 64 << 20}


def saved(im: Image.Image, fmt: str = "PNG", **kw: Any) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def photo(side: int = 300) -> Image.Image:
    return Image.fromarray(skimage.data.astronaut()).resize((side, side))


@pytest.mark.parametrize(
    ("name", "data", "per_pixel"),
    [
        ("rgb 8-bit png", saved(photo()), 3),
        ("rgb 8-bit jpeg", saved(photo(), "JPEG"), 3),
        ("rgba png", saved(photo().convert("RGBA")), 4),
        ("grey 8-bit png", saved(photo().convert("L")), 1),
        ("palette png", saved(photo().convert("P")), 3),
        ("1-bit png", saved(photo().convert("1")), 1),
        ("grey 16-bit png", png16(upscaled_photo(300, grey=True)), 2),
        ("rgb 16-bit png", png16(upscaled_photo(300)), 6),
        ("webp: the decoder's four RGBA copies", saved(photo(), "WEBP"), 16),
        ("progressive jpeg: its coefficients too", saved(photo(), "JPEG", progressive=True), 6),
    ],
)
def test_decoded_bytes_from_the_header(name: str, data: bytes, per_pixel: int) -> None:
    h = inspect(data, **LIMITS)
    assert h.decoded_bytes == 300 * 300 * per_pixel, name
    assert decoded_bytes(Image.open(io.BytesIO(data))) == h.decoded_bytes


def test_one_image_over_its_decoded_limit_is_413_before_decode() -> None:
    data = png16(upscaled_photo(300))  # 540,000 decoded bytes, 8-bit RGB would be 270,000
    inspect(data, **LIMITS, max_decoded_bytes=540_000)
    for f in (inspect, lambda d, **kw: decode(d, 32, **kw)):
        with pytest.raises(app.engine.ApiError) as e:
            f(data, **LIMITS, max_decoded_bytes=539_999)
        assert e.value.status == 413 and e.value.type == "image_too_large"
        assert "decodes to 540000 bytes" in e.value.message


PEAK = """
import os, sys, threading
import torch  # imported by the decode's last step: not part of what is measured
from app.imaging import decode, inspect
from bench.bench_memory import rss_mib

def rss():
    return rss_mib(os.getpid()) * 2**20

data = open(sys.argv[1], "rb").read()
limits = dict(max_pixels=10**8, max_bytes=1 << 30)
counted = inspect(data, **limits).decoded_bytes
base, peak, done = rss(), [0], threading.Event()

def watch():  # the resident set, every millisecond (ru_maxrss is the import's high-water mark)
    while not done.wait(0.001):
        peak[0] = max(peak[0], rss())

t = threading.Thread(target=watch)
t.start()
decode(data, 224, **limits)
done.set()
t.join()
print((max(peak[0], rss()) - base) / counted)
"""


@pytest.mark.parametrize(
    ("fmt", "options"),
    [("WEBP", {"quality": 80}), ("JPEG", {"progressive": True, "quality": 90, "subsampling": 0})],
)
def test_the_decode_peaks_near_what_is_counted(
    tmp_path: Path, fmt: str, options: dict[str, Any]
) -> None:
    """The admission budget is only as good as the count: a fresh process's peak resident
    memory for one decode of a 2400 x 2400 photo stays within 1.25x of its decoded bytes (a
    WebP peaked at 5x and a 4:4:4 progressive JPEG at 2x of width x height x 3, an audit
    found). (An 8-bit PNG peaks at ~1.5x: Pillow keeps RGB as 4 bytes a pixel.)"""
    path = tmp_path / "photo"
    path.write_bytes(saved(photo(2400), fmt, **options))
    r = subprocess.run(
        [sys.executable, "-c", PEAK, str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert float(r.stdout) < 1.25, f"{fmt}: peak {float(r.stdout):.2f}x the count"


def _old_decode(data: bytes, size: int) -> np.ndarray:
    """The decode before its memory was cut: float 16-bit scaling, RGB first, then fit."""
    im = Image.open(io.BytesIO(data))
    im.load()
    im = ImageOps.exif_transpose(im)
    if im.mode.startswith("I;16"):
        arr = np.asarray(im, dtype=np.float64)
        im = Image.fromarray((arr / 65535.0 * 255.0).clip(0, 255).astype(np.uint8), "L")
    elif im.mode == "I":
        arr = np.asarray(im, dtype=np.float64)
        hi = max(float(arr.max()), 1.0)
        im = Image.fromarray((arr / hi * 255.0).clip(0, 255).astype(np.uint8), "L")
    rgb = ImageOps.fit(im.convert("RGB"), (size, size), Image.Resampling.BICUBIC)
    return np.asarray(rgb).transpose(2, 0, 1)


def grey32(side: int) -> bytes:
    """A 32-bit integer grey TIFF (Pillow mode I) of a real photo, spread over ~2**24."""
    arr = np.asarray(Image.fromarray(skimage.data.camera()).resize((side, side)), np.int32)
    return saved(Image.fromarray(arr * 65793), "TIFF")


@pytest.mark.parametrize("kind", ["grey16", "rgb16", "grey8", "rgb8", "grey32"])
def test_leaner_decode_gives_the_same_pixels(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(app.imaging, "STRIP_BYTES", 64 << 10)  # several strips
    if kind == "grey32":
        data = grey32(517)
    elif kind.endswith("16"):
        data = png16(upscaled_photo(517, grey=kind == "grey16"))
    else:
        im = Image.fromarray(skimage.data.camera() if kind == "grey8" else skimage.data.coffee())
        data = saved(im)
    want = _old_decode(data, 64)
    got = decode(data, 64, **LIMITS).numpy()
    assert np.array_equal(got, want)


@pytest.mark.parametrize("kind", ["grey16", "grey32"])
def test_deep_grey_is_narrowed_in_strips(kind: str) -> None:
    """16- and 32-bit grey become 8-bit without a whole-image working array: numpy's peak
    during the decode stays near one strip (STRIP_BYTES) and the 8-bit result, not the
    several float64 copies of the image (~130 MB for this 2400 x 2400 image) it once was."""
    side = 2400
    data = png16(upscaled_photo(side, grey=True)) if kind == "grey16" else grey32(side)
    tracemalloc.start()
    try:
        decode(data, 32, **LIMITS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * app.imaging.STRIP_BYTES + side * side, f"{peak / 1e6:.1f} MB"


# ---- through the HTTP stack ------------------------------------------------------------------

GREY = png16(upscaled_photo(200, grey=True))  # 80,000 decoded bytes each
RGB16 = png16(upscaled_photo(200))  # 240,000


def _count_decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = app.engine.decode

    def counting(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(app.engine, "decode", counting)
    return calls


def post(client: TestClient, *images: bytes) -> Any:
    files = [("image", (f"{i}.png", d, "image/png")) for i, d in enumerate(images)]
    return client.post("/v1/encode", files=files)


def test_hostile_request_is_413_before_any_decode(
    make_client: Callable[..., TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's request scaled down: four 16-bit PNGs, each within the pixel cap."""
    client = make_client(max_image_decoded_bytes=200_000, max_request_decoded_bytes=250_000)
    decodes = _count_decodes(monkeypatch)
    r = post(client, GREY, GREY, GREY, GREY)
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["type"] == "payload_too_large" and "320000 bytes" in err["message"]
    assert "--max-request-decoded-bytes" in err["message"]
    r = post(client, GREY, RGB16)  # one image over its own limit
    assert r.status_code == 413 and r.json()["error"]["type"] == "image_too_large"
    assert decodes == []
    assert post(client, GREY, GREY, GREY).status_code == 200  # 240,000: within both
    assert len(decodes) == 3
    assert client.app.state.admission.bytes == 0  # type: ignore[attr-defined]
    metrics = client.get("/metrics").text
    assert 'featpool_rejected_total{reason="payload_too_large"} 1.0' in metrics


def test_decoded_bytes_are_given_back_when_a_decode_fails(
    make_client: Callable[..., TestClient],
) -> None:
    client = make_client()
    truncated = GREY[: len(GREY) // 2] + GREY[-12:]  # header fine, pixels cut short
    r = post(client, GREY, truncated)
    assert r.status_code == 400, r.text
    assert client.app.state.admission.bytes == 0  # type: ignore[attr-defined]
    assert occupancy(client) == (0, 0)
