"""A corpus of hostile and odd uploads, made here: truncated files, corrupt headers, huge
declared dimensions in tiny headers, decompression bombs, 16-bit, CMYK, alpha, animated, zero
bytes, random bytes, too many parts, polyglots. Each gets its exact answer: 2xx for images a
user may legitimately send, a clear 4xx otherwise, never a 5xx; and the pool is empty again
once the test has released what it was given."""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import skimage.data
from fastapi.testclient import TestClient
from PIL import Image

from app.main import create_app
from tests.conftest import image_bytes, occupancy
from tests.helpers import small_settings

MAX_PIXELS = 4_000_000


# ---- crafting --------------------------------------------------------------------------------


def png_chunk(kind: bytes, data: bytes, *, crc: int | None = None) -> bytes:
    crc = zlib.crc32(kind + data) if crc is None else crc
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc & 0xFFFFFFFF)


def png(
    width: int, height: int, idat: bytes, *, depth: int = 8, color: int = 2, bad_crc: bool = False
) -> bytes:
    """A PNG with the given IHDR and IDAT, built by hand (no encoder would write a lie)."""
    ihdr = struct.pack(">IIBBBBB", width, height, depth, color, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr, crc=0 if bad_crc else None)
        + png_chunk(b"IDAT", idat)
        + png_chunk(b"IEND", b"")
    )


def zlib_bomb_png(side: int) -> bytes:
    """A side x side grayscale PNG of zeros: a few KB that inflate to side*side bytes."""
    raw = bytes(side + 1) * side  # a filter byte (0) and `side` zero pixels per row
    return png(side, side, zlib.compress(raw, 9), color=0)


def gif_with_screen(width: int, height: int) -> bytes:
    """A one-pixel GIF whose logical screen and image descriptor claim width x height."""
    head = b"GIF89a" + struct.pack("<HHBBB", width, height, 0x80, 0, 0) + b"\0\0\0\xff\xff\xff"
    desc = b"," + struct.pack("<HHHHB", 0, 0, width, height, 0)
    return head + desc + b"\x02\x02\x44\x01\x00" + b";"


def jpeg_with_sof_dims(width: int, height: int) -> bytes:
    """A real JPEG whose SOF0 marker is rewritten to claim other dimensions."""
    data = bytearray(image_bytes("JPEG", size=(16, 16)))
    i = data.index(b"\xff\xc0")
    struct.pack_into(">HH", data, i + 5, height, width)
    return bytes(data)


def animated(fmt: str) -> bytes:
    frames = [Image.fromarray(np.full((32, 48, 3), v, np.uint8)) for v in (0, 128, 255)]
    buf = io.BytesIO()
    frames[0].save(buf, fmt, save_all=True, append_images=frames[1:], duration=50, loop=0)
    return buf.getvalue()


def sixteen_bit_png() -> bytes:
    arr = (np.arange(64 * 48, dtype=np.uint16).reshape(48, 64) * 21).astype(np.uint16)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")  # mode I;16
    return buf.getvalue()


def palette_with_transparency() -> bytes:
    im = Image.new("P", (40, 40), 1)
    im.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    buf = io.BytesIO()
    im.save(buf, "PNG", transparency=0)
    return buf.getvalue()


def exif_jpeg(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return image_bytes("JPEG", size=(40, 30), exif=exif.tobytes())


JPEG = image_bytes("JPEG", size=(64, 48))
PNG = image_bytes("PNG", size=(64, 48))
RNG = np.random.default_rng(8)

# (name, body, expected status, expected error type or None for success)
CORPUS: list[tuple[str, bytes, int, str | None]] = [
    ("zero bytes", b"", 400, "empty_image"),
    ("one byte", b"\xff", 400, "invalid_image"),
    ("random bytes", RNG.bytes(4096), 400, "invalid_image"),
    ("jpeg magic then random", b"\xff\xd8\xff\xe0" + RNG.bytes(2000), 400, "invalid_image"),
    ("png magic then random", b"\x89PNG\r\n\x1a\n" + RNG.bytes(2000), 400, "invalid_image"),
    ("truncated jpeg, header only", JPEG[:200], 400, "invalid_image"),
    ("truncated jpeg, 90%", JPEG[: len(JPEG) * 9 // 10], 400, "invalid_image"),
    ("truncated png, header only", PNG[:40], 400, "invalid_image"),
    ("truncated png, half", PNG[: len(PNG) // 2], 400, "invalid_image"),
    (
        "png with a bad IHDR crc",
        png(8, 8, zlib.compress(bytes(9 * 8 * 3 + 8)), bad_crc=True),
        400,
        "invalid_image",
    ),
    (
        "png claiming 100000x100000 in 60 bytes",
        png(100_000, 100_000, zlib.compress(b"\0")),
        413,
        "image_too_large",
    ),
    ("png claiming 2^31-1 x 1", png(2**31 - 1, 1, zlib.compress(b"\0")), 413, "image_too_large"),
    ("png claiming 0x0", png(0, 0, zlib.compress(b"\0")), 400, "invalid_image"),
    (
        "png within the pixel limit, IDAT far too short",
        png(1500, 1500, zlib.compress(b"\0" * 9)),
        400,
        "invalid_image",
    ),
    (
        "png with a bogus bit depth",
        png(8, 8, zlib.compress(bytes(100)), depth=7),
        400,
        "invalid_image",
    ),
    ("gif claiming 65535x65535", gif_with_screen(65535, 65535), 413, "image_too_large"),
    ("jpeg SOF claiming 65000x65000", jpeg_with_sof_dims(65000, 65000), 413, "image_too_large"),
    ("jpeg SOF claiming 0 width", jpeg_with_sof_dims(0, 16), 400, "invalid_image"),
    ("zlib bomb over the pixel limit (3000x3000)", zlib_bomb_png(3000), 413, "image_too_large"),
    ("zlib bomb just under the pixel limit (1900x1900)", zlib_bomb_png(1900), 200, None),
    ("16-bit grayscale png", sixteen_bit_png(), 200, None),
    ("cmyk jpeg", image_bytes("JPEG", mode="CMYK"), 200, None),
    ("rgba png", image_bytes("PNG", mode="RGBA"), 200, None),
    ("la png", image_bytes("PNG", mode="LA"), 200, None),
    ("palette png with transparency", palette_with_transparency(), 200, None),
    ("animated gif", animated("GIF"), 200, None),
    ("animated webp", animated("WEBP"), 200, None),
    ("bmp", image_bytes("BMP"), 200, None),
    ("tiff", image_bytes("TIFF"), 200, None),
    ("exif orientation 6", exif_jpeg(6), 200, None),
    ("exif orientation 99 (invalid)", exif_jpeg(99), 200, None),
    ("ppm (a format we do not take)", image_bytes("PPM"), 415, "unsupported_media_type"),
    (
        "svg",
        b'<svg xmlns="http://www.w3.org/2000/svg" width="9e9" height="9e9"/>',
        400,
        "invalid_image",
    ),
    (
        "polyglot: jpeg with a zip and html appended",
        JPEG + b"PK\x03\x04" + RNG.bytes(200) + b"<script>alert(1)</script>",
        200,
        None,
    ),
    (
        "polyglot: gif header that is also javascript",
        b"GIF89a/*\x01\x00\x01\x00\x00\x00\x00*/=alert(1);" + RNG.bytes(64),
        400,
        "invalid_image",
    ),
]


def _pixel_flood() -> bytes:
    buf = io.BytesIO()
    Image.new("1", (20_000, 20_000)).save(buf, "PNG")  # 4e8 pixels in ~50 KB
    return buf.getvalue()


CORPUS.append(("1-bit 20000x20000 pixel flood", _pixel_flood(), 413, "image_too_large"))


def _progressive(repeat_last_scan: int = 1) -> bytes:
    """A real photo as a progressive JPEG; its last scan repeated: each repeat costs a pass
    over the whole image in the decoder for a few bytes on the wire (a scan bomb)."""
    buf = io.BytesIO()
    Image.fromarray(skimage.data.astronaut()).save(buf, "JPEG", progressive=True, quality=90)
    data = buf.getvalue()
    last, end = data.rindex(b"\xff\xda"), data.rindex(b"\xff\xd9")
    return data[:last] + data[last:end] * repeat_last_scan + data[end:]


CORPUS.append(("progressive jpeg", _progressive(), 200, None))
CORPUS.append(("progressive jpeg, last scan 400 times", _progressive(400), 400, "invalid_image"))


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    tmp: Path = tmp_path_factory.mktemp("hostile")
    s = small_settings(tmp, max_image_pixels=MAX_PIXELS, max_images_per_request=8)
    with TestClient(create_app(s)) as c:
        yield c
        assert occupancy(c) == (0, 0)  # everything the module was given, it gave back


def release(c: TestClient, body: dict[str, object]) -> None:
    for item in body.get("items", []):  # type: ignore[attr-defined]
        assert c.delete(f"/v1/leases/{item['lease_id']}").status_code == 204


def check(c: TestClient, r: Any, status: int, kind: str | None) -> None:
    assert r.status_code < 500, r.text
    assert r.status_code == status, r.text
    body = r.json()
    if kind is None:
        assert len(body["items"]) >= 1
        release(c, body)
    else:
        assert body["error"]["type"] == kind and body["error"]["message"], body
    assert occupancy(c) == (0, 0)


@pytest.mark.parametrize(("name", "data", "status", "kind"), CORPUS, ids=[c[0] for c in CORPUS])
def test_raw_body(
    client: TestClient, name: str, data: bytes, status: int, kind: str | None
) -> None:
    r = client.post(
        "/v1/encode", content=data, headers={"content-type": "application/octet-stream"}
    )
    check(client, r, status, kind)


@pytest.mark.parametrize(
    ("name", "data", "status", "kind"), CORPUS[::3], ids=[c[0] for c in CORPUS[::3]]
)
def test_as_multipart_part_next_to_a_good_image(
    client: TestClient, name: str, data: bytes, status: int, kind: str | None
) -> None:
    """All or nothing: a bad part fails the request, and the good image's lease goes too."""
    r = client.post(
        "/v1/encode",
        files=[("image", ("good.jpg", JPEG, "image/jpeg")), ("image", (name, data, "image/png"))],
    )
    check(client, r, status, kind)
    if kind is None:
        return
    assert name in r.json()["error"]["message"] or "#1" in r.json()["error"]["message"]


def multipart(parts: list[tuple[str, str | None, bytes]], boundary: str = "xYzZy") -> bytes:
    out = b""
    for name, filename, data in parts:
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += (
            (
                f"--{boundary}\r\nContent-Disposition: {disp}\r\nContent-Type: image/jpeg\r\n\r\n"
            ).encode()
            + data
            + b"\r\n"
        )
    return out + f"--{boundary}--\r\n".encode()


MP = "multipart/form-data; boundary=xYzZy"
small = image_bytes("JPEG", size=(8, 8))

MULTIPART_CASES: list[tuple[str, bytes, str, int, str | None]] = [
    (
        "9 image parts, limit 8",
        multipart([("image", f"{i}.jpg", small) for i in range(9)]),
        MP,
        413,
        "too_many_images",
    ),
    (
        "8 image parts, the limit",
        multipart([("image", f"{i}.jpg", small) for i in range(8)]),
        MP,
        200,
        None,
    ),
    ("1000 tiny text fields", multipart([("f", None, b"x")] * 1000), MP, 400, "invalid_request"),
    # the bound itself: 32 text fields, plus one per image the request may carry (an id each)
    (
        "an image and 40 text fields (32 + 8 images' ids), the limit",
        multipart([("image", "a.jpg", small), *[("f", None, b"x")] * 40]),
        MP,
        200,
        None,
    ),
    (
        "an image and 41 text fields",
        multipart([("image", "a.jpg", small), *[("f", None, b"x")] * 41]),
        MP,
        400,
        "invalid_request",
    ),
    (
        "unterminated multipart body",
        multipart([("image", "a.jpg", small)])[:-20],
        MP,
        422,
        "validation_error",
    ),
    (
        "multipart without a boundary",
        multipart([("image", "a.jpg", small)]),
        "multipart/form-data",
        400,
        "invalid_request",
    ),
    (
        "wrong boundary",
        multipart([("image", "a.jpg", small)], boundary="other"),
        MP,
        400,
        "invalid_request",
    ),
    (
        "image part as a field, not a file",
        multipart([("image", None, small)]),
        MP,
        400,
        "invalid_request",
    ),
    (
        "filename with path traversal and NULs",
        multipart([("image", "../../etc/passwd\x00.jpg", small)]),
        MP,
        200,
        None,
    ),
]


@pytest.mark.parametrize("case", MULTIPART_CASES, ids=[c[0] for c in MULTIPART_CASES])
def test_malformed_multipart(
    client: TestClient, case: tuple[str, bytes, str, int, str | None]
) -> None:
    _, body, ctype, status, kind = case
    r = client.post("/v1/encode", content=body, headers={"content-type": ctype})
    check(client, r, status, kind)


def test_rejections_are_counted_as_rejected_images(client: TestClient) -> None:
    """A header that cannot be read is refused at the entrance, before the engine."""

    def rejected() -> float:
        for line in client.get("/metrics").text.splitlines():
            if line.startswith('featpool_admission_images_total{outcome="invalid"}'):
                return float(line.split()[-1])
        return 0.0

    before = rejected()
    r = client.post(
        "/v1/encode", content=b"\x89PNG\r\n\x1a\n", headers={"content-type": "image/png"}
    )
    assert r.status_code == 400
    assert rejected() == before + 1


def test_corpus_helpers_make_what_they_claim(monkeypatch: pytest.MonkeyPatch) -> None:
    """The crafted files are what their names say (else the corpus would test nothing)."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    assert Image.open(io.BytesIO(png(100_000, 100_000, b""))).size == (100_000, 100_000)
    assert Image.open(io.BytesIO(gif_with_screen(65535, 65535))).size == (65535, 65535)
    assert Image.open(io.BytesIO(jpeg_with_sof_dims(65000, 65000))).size == (65000, 65000)
    assert len(zlib_bomb_png(3000)) < 20_000 and MAX_PIXELS < 3000 * 3000
    assert Image.open(io.BytesIO(sixteen_bit_png())).mode == "I;16"
    assert Image.open(io.BytesIO(image_bytes("JPEG", mode="CMYK"))).mode == "CMYK"
    for fmt in ("GIF", "WEBP"):
        im = Image.open(io.BytesIO(animated(fmt)))
        assert getattr(im, "is_animated", False) and im.n_frames == 3
