"""Image validation and CPU decode with Pillow: bytes in, a ``[3, S, S]`` uint8 tensor out.

Everything a hostile or broken upload can do is turned into an ApiError here: not an image,
truncated, a decompression bomb, an unsupported format. Orientation (EXIF), grayscale, CMYK,
palette, 16-bit and alpha are converted the way users expect: upright RGB, alpha composited on
white.
"""

from __future__ import annotations

import io
import struct
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageMode, ImageOps, UnidentifiedImageError

from app.errors import ApiError

if TYPE_CHECKING:  # imported when a decode needs it (_chw): front processes parse headers only
    import torch

FORMATS = {
    "JPEG": "image/jpeg",
    "PNG": "image/png",
    "WEBP": "image/webp",
    "GIF": "image/gif",
    "BMP": "image/bmp",
    "TIFF": "image/tiff",
}
ACCEPTED_CONTENT_TYPES = {*FORMATS.values(), "application/octet-stream", ""}
EXIF_ORIENTATION = 0x0112


def check_content_type(content_type: str | None, what: str = "body") -> None:
    ct = (content_type or "").split(";")[0].strip().lower()
    if ct not in ACCEPTED_CONTENT_TYPES:
        raise ApiError(
            "unsupported_media_type",
            f"{what} has content type {ct!r}; send one of {', '.join(sorted(FORMATS.values()))}",
        )


@dataclass(frozen=True)
class Header:
    """What a header parse tells, before any pixel is decoded."""

    format: str
    width: int
    height: int
    mode: str
    orientation: int  # EXIF orientation, 1 (upright) to 8
    gpu_jpeg: bool  # a JPEG nvJPEG can take: RGB or grayscale, ending in EOI

    @property
    def decoded_bytes(self) -> int:
        """Bytes of the decoded pixels: width x height x channels x bytes per sample."""
        mode = ImageMode.getmode(self.mode)
        sample = int(mode.typestr[-1]) if mode.typestr[-1].isdigit() else 1
        return self.width * self.height * len(mode.bands) * sample


@contextmanager
def _image_errors(label: str) -> Iterator[None]:
    """Everything Pillow raises on hostile or broken bytes, as ApiErrors."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield
    except ApiError:
        raise
    except UnidentifiedImageError:
        raise ApiError(
            "invalid_image",
            f"{label} is not a recognised image (JPEG, PNG, WebP, GIF, BMP or TIFF)",
        ) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ApiError("image_too_large", f"{label}: {e}") from None
    except (OSError, SyntaxError, ValueError, EOFError, KeyError, struct.error) as e:
        # truncated data, corrupt headers or EXIF...
        raise ApiError("invalid_image", f"{label} could not be decoded: {e}") from None


def _open(data: bytes, *, max_pixels: int, max_bytes: int, label: str) -> Image.Image:
    """Parse the header only and apply the limits: type, bytes, pixels."""
    if not data:
        raise ApiError("empty_image", f"{label} is empty")
    if len(data) > max_bytes:
        raise ApiError("image_too_large", f"{label} is {len(data)} bytes; the limit is {max_bytes}")
    im = Image.open(io.BytesIO(data))
    if im.format not in FORMATS:
        raise ApiError(
            "unsupported_media_type",
            f"{label} is {im.format}; send JPEG, PNG, WebP, GIF, BMP or TIFF",
        )
    w, h = im.size
    if w <= 0 or h <= 0:
        raise ApiError("invalid_image", f"{label} has no pixels ({w}x{h})")
    if w * h > max_pixels:
        raise ApiError(
            "image_too_large", f"{label} is {w}x{h} = {w * h} pixels; the limit is {max_pixels}"
        )
    return im


def inspect(data: bytes, *, max_pixels: int, max_bytes: int, label: str = "image") -> Header:
    """Validate without decoding pixels (tens of microseconds): the same errors as decode()."""
    with _image_errors(label):
        im = _open(data, max_pixels=max_pixels, max_bytes=max_bytes, label=label)
        orientation = int(im.getexif().get(EXIF_ORIENTATION, 1)) if im.format == "JPEG" else 1
        if orientation not in range(1, 9):
            orientation = 1  # as Pillow's exif_transpose: an unknown value changes nothing
        # A JPEG without its EOI marker is routed to Pillow, which refuses it as truncated;
        # nvJPEG could return it half-grey instead. CMYK/YCCK stay with Pillow too.
        gpu = (
            im.format == "JPEG"
            and im.mode in ("RGB", "L")
            and data.rstrip(b"\0\r\n ")[-2:] == b"\xff\xd9"
        )
        return Header(str(im.format), im.size[0], im.size[1], im.mode, orientation, gpu)


def decode(
    data: bytes, size: int, *, max_pixels: int, max_bytes: int, label: str = "image"
) -> torch.Tensor:
    """Decode, orient, convert to RGB, resize the short side to ``size`` and centre-crop."""
    with _image_errors(label):
        im = _open(data, max_pixels=max_pixels, max_bytes=max_bytes, label=label)
        if im.format == "JPEG":
            im.draft("RGB", (size * 2, size * 2))  # decode at reduced scale: much faster
        im.load()
        rgb = _to_rgb(ImageOps.exif_transpose(im))
        rgb = ImageOps.fit(rgb, (size, size), Image.Resampling.BICUBIC)
    return _chw(rgb)


def decode_upright(
    data: bytes, *, max_pixels: int, max_bytes: int, label: str = "image"
) -> torch.Tensor:
    """Decode at full size to ``[3, H, W]`` uint8, as transformers turns a file into the image
    its processor sees: EXIF orientation applied (``transformers.image_utils.load_image``), then
    ``convert_to_rgb``. What follows (resize, crop, ...) is the model's ``app.preprocess``."""
    with _image_errors(label):
        im = _open(data, max_pixels=max_pixels, max_bytes=max_bytes, label=label)
        im.load()
        rgb = to_rgb_as_transformers(ImageOps.exif_transpose(im))
    return _chw(rgb)


def _chw(rgb: Image.Image) -> torch.Tensor:
    """``[3, H, W]`` uint8. torch is imported here, not at the top: front processes import
    this module for ``inspect`` and must not load torch."""
    import torch

    arr = np.asarray(rgb, dtype=np.uint8)
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).contiguous()


def to_rgb_as_transformers(im: Image.Image) -> Image.Image:
    """transformers' ``convert_to_rgb`` (5.2x): transparency composited onto white, everything
    else through Pillow's ``convert("RGB")`` (which saturates 16-bit values at 255, unlike
    ``_to_rgb`` below; matching the model's processor wins here)."""
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return im.convert("RGB")


def _to_rgb(im: Image.Image) -> Image.Image:
    if im.mode in ("I;16", "I;16B", "I;16L", "I"):
        arr = np.asarray(im, dtype=np.float64)
        hi = 65535.0 if im.mode.startswith("I;16") else max(float(arr.max()), 1.0)
        im = Image.fromarray((arr / hi * 255.0).clip(0, 255).astype(np.uint8), "L")
    if im.mode == "P" and "transparency" in im.info:
        im = im.convert("RGBA")
    if im.mode in ("RGBA", "LA", "PA"):
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return im.convert("RGB")
