"""Image validation and CPU decode with Pillow: bytes in, a ``[3, S, S]`` uint8 tensor out.

Everything a hostile or broken upload can do is turned into an ApiError here: not an image,
truncated, a decompression bomb, an unsupported format, more decoded bytes than allowed.
Orientation (EXIF), grayscale, CMYK, palette, 16-bit and alpha are converted the way users
expect: upright RGB, alpha composited on white. An MPO (what many phone cameras write: a JPEG
followed by more pictures) is its first picture.

Decoded bytes are what the decoder will hold, known from the header alone: width x height x
channels x bytes per sample (2 for 16-bit files). They are bounded per image here, and per
request and across requests by the engine (app/budget.py), before any pixel is decoded. The
decode keeps its own working copies few (no copy where nothing changes, 16-bit reduced in
integers, grayscale resized before it becomes RGB), so memory follows the count.
"""

from __future__ import annotations

import io
import struct
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict, cast

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from app.errors import ApiError

if TYPE_CHECKING:  # imported when a decode needs it (_chw): front processes parse headers only
    import torch

    from app.settings import Settings

FORMATS = {
    "JPEG": "image/jpeg",
    "PNG": "image/png",
    "WEBP": "image/webp",
    "GIF": "image/gif",
    "BMP": "image/bmp",
    "TIFF": "image/tiff",
    "MPO": "image/jpeg",  # a JPEG with more pictures after the first; the first is used
}
ACCEPTED_CONTENT_TYPES = {*FORMATS.values(), "application/octet-stream", ""}
NAMES = "JPEG (and MPO), PNG, WebP, GIF, BMP or TIFF"
EXIF_ORIENTATION = 0x0112
# An image's bytes: an upload's, or behind front processes a view of the job arena
# (app/job_arena.py) or of a job frame's payload.
ImageData = bytes | memoryview
MAX_JPEG_SCANS = 100
STRIP_BYTES = 4 << 20  # working copies of a 16-bit image are made this much at a time


class ImageLimits(TypedDict):
    """The per-image limits that ``inspect``, ``decode`` and ``decode_upright`` take."""

    max_pixels: int
    max_bytes: int
    max_decoded_bytes: int | None


def image_limits(s: Settings) -> ImageLimits:
    """The settings' per-image limits (``--max-image-pixels``, ``--max-image-bytes``,
    ``--max-image-decoded-bytes``), as keyword arguments."""
    return ImageLimits(
        max_pixels=s.max_image_pixels,
        max_bytes=s.max_image_bytes,
        max_decoded_bytes=s.max_image_decoded_bytes,
    )


def media_type(content_type: str | None) -> str:
    """The media type of a Content-Type header, without parameters; case-insensitive (RFC 9110
    8.3.1), so lowercased."""
    return (content_type or "").split(";")[0].strip().lower()


def check_content_type(content_type: str | None, what: str = "body") -> None:
    ct = media_type(content_type)
    if ct not in ACCEPTED_CONTENT_TYPES:
        raise ApiError(
            "unsupported_media_type",
            f"{what} has content type {ct!r}; send one of "
            f"{', '.join(sorted(set(FORMATS.values())))}",
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
    decoded_bytes: int  # width x height x channels x bytes per sample


def decoded_bytes(im: Image.Image) -> int:
    """What decoding ``im`` yields, from its header: width x height x channels x bytes per
    sample. A palette counts as the RGB(A) it becomes; a 16-bit file as 2 bytes per sample
    even where Pillow keeps 8 of them (16-bit RGB PNG); 1-bit as a byte. Where the decoder
    itself holds more than that, its peak: a WebP 16 bytes a pixel (Pillow decodes it through
    libwebp's animation decoder: an RGBA canvas, the previous frame's, a copy of the frame and
    the image; measured ~15), a progressive JPEG twice its pixels (libjpeg keeps every
    coefficient of the whole image until the last scan)."""
    w, h = im.size
    if im.format == "WEBP":
        return w * h * 16
    mode = im.mode
    if mode == "P":
        channels = 4 if "transparency" in im.info else 3
    elif mode == "PA":
        channels = 4
    else:
        channels = Image.getmodebands(mode)
    if mode in ("I", "F"):
        sample = 4
    elif mode.startswith("I;16"):
        sample = 2
    else:
        # The raw mode the decoder reads ("RGB;16B" for a 16-bit RGB PNG): an opened file's.
        tile = getattr(im, "tile", None)
        raw = tile[0].args if tile else None
        sample = 2 if isinstance(raw, str) and ";16" in raw else 1
    return w * h * channels * sample * (2 if _progressive(im) else 1)


def _progressive(im: Image.Image) -> bool:
    return im.format in ("JPEG", "MPO") and bool(im.info.get("progressive"))


def request_decoded_bytes(headers: Sequence[Header], limit: int) -> int:
    """The decoded bytes of a request's images, or 413 if they are more than ``limit``."""
    total = sum(h.decoded_bytes for h in headers)
    if total > limit:
        raise ApiError(
            "payload_too_large",
            f"the request's {len(headers)} image(s) decode to {total} bytes; the limit is "
            f"{limit} (--max-request-decoded-bytes)",
        )
    return total


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
        raise ApiError("invalid_image", f"{label} is not a recognised image ({NAMES})") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ApiError("image_too_large", f"{label}: {e}") from None
    except (OSError, SyntaxError, ValueError, EOFError, KeyError, struct.error) as e:
        # truncated data, corrupt headers or EXIF...
        raise ApiError("invalid_image", f"{label} could not be decoded: {e}") from None


def _open(
    data: ImageData, *, max_pixels: int, max_bytes: int, max_decoded_bytes: int | None, label: str
) -> Image.Image:
    """Parse the header only and apply the limits: type, bytes, pixels, decoded bytes."""
    if not data:
        raise ApiError("empty_image", f"{label} is empty")
    if len(data) > max_bytes:
        raise ApiError("image_too_large", f"{label} is {len(data)} bytes; the limit is {max_bytes}")
    im = Image.open(io.BytesIO(data))
    if im.format not in FORMATS:
        raise ApiError("unsupported_media_type", f"{label} is {im.format}; send {NAMES}")
    if _progressive(im):
        # Every scan of a progressive JPEG is decoded over the whole image: a few KB of repeated
        # scans cost seconds of CPU each (a baseline JPEG's repeated scan fails at once, so
        # only progressive ones are counted: no cost for the usual photo). 0xFF 0xDA is a
        # start-of-scan marker wherever it is (entropy-coded data stuffs every 0xFF), an EXIF
        # thumbnail's scans included.
        scans = (data if isinstance(data, bytes) else bytes(data)).count(b"\xff\xda")
        if scans > MAX_JPEG_SCANS:
            raise ApiError(
                "invalid_image",
                f"{label} has {scans} scans; more than {MAX_JPEG_SCANS} are refused (a "
                "progressive JPEG has about 10)",
            )
    w, h = im.size
    if w <= 0 or h <= 0:
        raise ApiError("invalid_image", f"{label} has no pixels ({w}x{h})")
    if w * h > max_pixels:
        raise ApiError(
            "image_too_large", f"{label} is {w}x{h} = {w * h} pixels; the limit is {max_pixels}"
        )
    if max_decoded_bytes is not None and (n := decoded_bytes(im)) > max_decoded_bytes:
        raise ApiError(
            "image_too_large",
            f"{label} ({w}x{h} {im.mode}) decodes to {n} bytes; the limit is "
            f"{max_decoded_bytes} (--max-image-decoded-bytes)",
        )
    return im


def inspect(
    data: ImageData,
    *,
    max_pixels: int,
    max_bytes: int,
    max_decoded_bytes: int | None = None,
    label: str = "image",
) -> Header:
    """Validate without decoding pixels (tens of microseconds): the same errors as decode()."""
    with _image_errors(label):
        im = _open(
            data,
            max_pixels=max_pixels,
            max_bytes=max_bytes,
            max_decoded_bytes=max_decoded_bytes,
            label=label,
        )
        jpeg = im.format in ("JPEG", "MPO")
        orientation = int(im.getexif().get(EXIF_ORIENTATION, 1)) if jpeg else 1
        if orientation not in range(1, 9):
            orientation = 1  # as Pillow's exif_transpose: an unknown value changes nothing
        # A JPEG without its EOI marker is routed to Pillow, which refuses it as truncated;
        # nvJPEG could return it half-grey instead. CMYK/YCCK stay with Pillow too, and so does
        # an MPO (nvJPEG is given one picture per buffer).
        gpu = (
            im.format == "JPEG"
            and im.mode in ("RGB", "L")
            and bytes(data).rstrip(b"\0\r\n ")[-2:] == b"\xff\xd9"
        )
        return Header(
            str(im.format), im.size[0], im.size[1], im.mode, orientation, gpu, decoded_bytes(im)
        )


def decode(
    data: ImageData,
    size: int,
    *,
    max_pixels: int,
    max_bytes: int,
    max_decoded_bytes: int | None = None,
    label: str = "image",
) -> torch.Tensor:
    """Decode, orient, convert to RGB, resize the short side to ``size`` and centre-crop."""
    with _image_errors(label):
        im = _open(
            data,
            max_pixels=max_pixels,
            max_bytes=max_bytes,
            max_decoded_bytes=max_decoded_bytes,
            label=label,
        )
        if im.format in ("JPEG", "MPO"):
            im.draft("RGB", (size * 2, size * 2))  # decode at reduced scale: much faster
        im.load()
        ImageOps.exif_transpose(im, in_place=True)  # no copy when it is upright already
        im = _to_8bit(im)
        if im.mode == "L":
            # Each channel is resized alone, so resizing grey and then making it RGB gives the
            # same pixels as the other way round, with a third of the memory at full size.
            rgb = ImageOps.fit(im, (size, size), Image.Resampling.BICUBIC).convert("RGB")
        else:
            rgb = ImageOps.fit(_to_rgb(im), (size, size), Image.Resampling.BICUBIC)
    return _chw(rgb)


def decode_upright(
    data: ImageData,
    *,
    max_pixels: int,
    max_bytes: int,
    max_decoded_bytes: int | None = None,
    label: str = "image",
) -> torch.Tensor:
    """Decode at full size to ``[3, H, W]`` uint8, as transformers turns a file into the image
    its processor sees: EXIF orientation applied (``transformers.image_utils.load_image``), then
    ``convert_to_rgb``. What follows (resize, crop, ...) is the model's ``app.preprocess``."""
    with _image_errors(label):
        im = _open(
            data,
            max_pixels=max_pixels,
            max_bytes=max_bytes,
            max_decoded_bytes=max_decoded_bytes,
            label=label,
        )
        im.load()
        ImageOps.exif_transpose(im, in_place=True)  # no copy when it is upright already
        rgb = to_rgb_as_transformers(im)
        del im
    return _chw(rgb)


def _chw(rgb: Image.Image) -> torch.Tensor:
    """``[3, H, W]`` uint8. torch is imported here, not at the top: front processes import
    this module for ``inspect`` and must not load torch."""
    import torch

    arr = np.array(rgb, dtype=np.uint8)  # one copy, writable: torch takes it as it is
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()


def to_rgb_as_transformers(im: Image.Image) -> Image.Image:
    """transformers' ``convert_to_rgb`` (5.2x): transparency composited onto white, everything
    else through Pillow's ``convert("RGB")`` (which saturates 16-bit values at 255, unlike
    ``_to_8bit`` below; matching the model's processor wins here)."""
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return im if im.mode == "RGB" else im.convert("RGB")  # convert() would copy an RGB image


def _to_8bit(im: Image.Image) -> Image.Image:
    """16-bit and 32-bit integer grey as 8-bit grey: 16-bit scaled by 255/65535 (exactly
    ``v // 257``, in integers), 32-bit by its maximum. In strips of about STRIP_BYTES: a
    whole-image array would be several copies of the image (a float64 one: 8 bytes a pixel,
    twice what the decoded-bytes budget counts for 32-bit grey)."""
    if im.mode.startswith("I;16"):
        w, h = im.size
        out = np.empty((h, w), np.uint8)
        for top, bottom in _strips(w, h, 2):
            strip = np.asarray(im.crop((0, top, w, bottom)), dtype=np.uint16)
            out[top:bottom] = strip // 257
        return Image.fromarray(out, "L")
    if im.mode == "I":
        w, h = im.size
        _, brightest = cast(tuple[int, int], im.getextrema())  # one band: (min, max), in C
        hi = max(1.0, float(brightest))
        out = np.empty((h, w), np.uint8)
        for top, bottom in _strips(w, h, 8):
            strip = np.asarray(im.crop((0, top, w, bottom)), dtype=np.float64)
            out[top:bottom] = (strip / hi * 255.0).clip(0, 255).astype(np.uint8)
        return Image.fromarray(out, "L")
    return im


def _strips(width: int, height: int, sample_bytes: int) -> list[tuple[int, int]]:
    """Row ranges of about STRIP_BYTES of ``sample_bytes`` samples each."""
    rows = max(1, STRIP_BYTES // (sample_bytes * width))
    return [(top, min(height, top + rows)) for top in range(0, height, rows)]


def _to_rgb(im: Image.Image) -> Image.Image:
    if im.mode == "RGB":
        return im  # convert() would copy it
    if im.mode == "P" and "transparency" in im.info:
        im = im.convert("RGBA")
    if im.mode in ("RGBA", "LA", "PA"):
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return im.convert("RGB")
