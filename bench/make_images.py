"""Photo-like JPEGs for the benchmarks: smooth gradients, texture and sensor noise, so that
they compress like photos (about 200 KB at 1024x768, quality 90), not like flat colours.

    python bench/make_images.py --out /tmp/imgs --count 64
"""

from __future__ import annotations

import argparse
import io
import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image


def photo_jpeg(
    seed: int, width: int = 1024, height: int = 768, quality: int = 90, noise: float = 4.0
) -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.empty((height, width, 3), np.float32)
    for c in range(3):
        fx, fy = rng.uniform(0.002, 0.01, 2)
        px, py = rng.uniform(0, 6.3, 2)
        img[..., c] = (
            110
            + 80 * np.sin(x * fx + px) * np.cos(y * fy + py)
            + 40 * (x / width) * rng.uniform(-1, 1)
        )
    # texture: a few octaves of blurred noise, then fine per-pixel noise
    for scale in (64, 16, 4):
        small = rng.normal(0, 1, (height // scale + 2, width // scale + 2, 3)).astype(np.float32)
        tex = (
            np.asarray(
                Image.fromarray(((small * 40) + 128).clip(0, 255).astype(np.uint8)).resize(
                    (width, height), Image.Resampling.BICUBIC
                ),
                np.float32,
            )
            - 128
        )
        img += tex * (scale / 64 + 0.25)
    img += rng.normal(0, noise, img.shape).astype(np.float32)
    buf = io.BytesIO()
    Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def upscaled_photo(side: int, grey: bool = False) -> np.ndarray:
    """scikit-image's astronaut photo, upscaled (nearest) to side x side, as 16-bit samples."""
    import skimage.data

    photo = skimage.data.astronaut()
    idx = np.arange(side) * photo.shape[0] // side
    big = photo[idx][:, idx].astype(np.uint16) * 257
    return big.mean(-1).astype(np.uint16) if grey else big


def png16(arr: np.ndarray) -> bytes:
    """A 16-bit PNG (grey or RGB) of ``arr``, written here because Pillow writes 16 bits only
    for grey. Each row is filtered 'up' when it repeats the one above, else 'sub', so an
    upscaled photo compresses to little (as a hostile client would send it)."""
    h, w = arr.shape[:2]
    channels = 1 if arr.ndim == 2 else arr.shape[2]
    bpp = 2 * channels
    rows = np.frombuffer(arr.astype(">u2").tobytes(), np.uint8).reshape(h, w * bpp)
    sub = rows.copy()
    sub[:, bpp:] = rows[:, bpp:] - rows[:, :-bpp]
    up = np.zeros_like(rows)
    up[1:] = rows[1:] - rows[:-1]
    repeat = np.zeros(h, bool)
    repeat[1:] = (rows[1:] == rows[:-1]).all(1)
    body = np.concatenate(
        [np.where(repeat, 2, 1).astype(np.uint8)[:, None], np.where(repeat[:, None], up, sub)],
        axis=1,
    )

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data)
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    color = {1: 0, 3: 2, 4: 6}[channels]
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, color, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(body.tobytes(), 6))
        + chunk(b"IEND", b"")
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--count", type=int, default=64)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--height", type=int, default=768)
    ap.add_argument("--quality", type=int, default=90)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = []
    for i in range(args.count):
        data = photo_jpeg(i, args.width, args.height, args.quality)
        (args.out / f"img{i:04d}.jpg").write_bytes(data)
        sizes.append(len(data))
    print(
        f"{args.count} JPEGs {args.width}x{args.height} q{args.quality} in {args.out}: "
        f"mean {np.mean(sizes) / 1e3:.0f} KB (min {min(sizes) / 1e3:.0f}, "
        f"max {max(sizes) / 1e3:.0f})"
    )


if __name__ == "__main__":
    main()
