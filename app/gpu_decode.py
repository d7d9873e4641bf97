"""JPEG decode on the GPU (nvJPEG through torchvision), and the resize that follows it.

torchvision is imported lazily: it is optional, and the service runs without it (Pillow decodes
everything on the CPU then). ``preprocess`` is featpool's default preprocessing (for encoders
without a processor config of their own; those use ``app.preprocess.ImageSpec``); it is plain
torch and runs on any device, so its behaviour (EXIF orientation, crop, antialiased resize) is
tested on the CPU against Pillow.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.nn.functional as nnf

from app.preprocess import orient

log = logging.getLogger(__name__)

DecodeFn = Callable[[list[torch.Tensor], torch.device], list[torch.Tensor]]


def centre_square(x: torch.Tensor) -> torch.Tensor:
    h, w = x.shape[-2:]
    side = min(h, w)
    top, left = (h - side) // 2, (w - side) // 2
    return x[..., top : top + side, left : left + side]


def preprocess(
    images: Sequence[torch.Tensor], orientations: Sequence[int], size: int
) -> torch.Tensor:
    """``[3, H, W]`` uint8 images -> ``[N, 3, size, size]`` float in 0..255, rounded as uint8.

    Like ``ImageOps.fit``: orient, crop the centred square, resize it with an antialiased
    bicubic filter. Images of one shape are resized in one call.
    """
    out = torch.empty(len(images), 3, size, size, device=images[0].device if images else None)
    groups: dict[tuple[int, ...], list[int]] = {}
    squares = [centre_square(orient(im, o)) for im, o in zip(images, orientations, strict=True)]
    for i, sq in enumerate(squares):
        groups.setdefault(tuple(sq.shape), []).append(i)
    for shape, idx in groups.items():
        x = torch.stack([squares[i] for i in idx]).float()
        if shape[-1] != size:
            x = nnf.interpolate(
                x, size=(size, size), mode="bicubic", antialias=True, align_corners=False
            )
        x = x.clamp_(0, 255).round_()
        if len(idx) == len(images):
            return x
        out[torch.tensor(idx, device=x.device)] = x
    return out


def _torchvision_decode(datas: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    from torchvision.io import ImageReadMode, decode_jpeg

    out = decode_jpeg(datas, mode=ImageReadMode.RGB, device=device)
    return out if isinstance(out, list) else [out]


class JpegDecoder:
    """Batched nvJPEG. A batch the library refuses is retried image by image, so one bad JPEG
    fails only itself; the caller falls back to Pillow for the images that still fail."""

    def __init__(self, device: torch.device, decode_fn: DecodeFn = _torchvision_decode) -> None:
        self.device = device
        self._decode = decode_fn

    @classmethod
    def create(cls, device: torch.device, mode: Literal["auto", "on", "off"]) -> JpegDecoder | None:
        """The GPU decoder, or None where Pillow decodes (``off``, no CUDA, no torchvision).
        ``on`` insists: no GPU decode is a start-up error."""
        if mode == "off":
            return None
        why = ""
        if device.type != "cuda":
            why = f"the device is {device}"
        else:
            try:
                import torchvision.io  # noqa: F401
            except ImportError as e:
                why = f"torchvision is not importable ({e})"
        if why:
            if mode == "on":
                raise RuntimeError(f"--gpu-decode on (FEATPOOL_GPU_DECODE): {why}")
            log.info("JPEG decode on the CPU with Pillow: %s", why)
            return None
        decoder = cls(device)
        try:
            decoder.warmup()
        except Exception as e:  # e.g. torchvision built without nvJPEG
            if mode == "on":
                raise RuntimeError(f"--gpu-decode on: nvJPEG does not work: {e}") from e
            log.warning("nvJPEG unavailable (%s); JPEG decode on the CPU with Pillow", e)
            return None
        return decoder

    def warmup(self) -> None:
        import io

        import numpy as np
        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(buf, "JPEG")
        data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        self._decode([data, data], self.device)

    def decode(self, datas: list[torch.Tensor]) -> list[torch.Tensor | Exception]:
        """``[3, H, W]`` uint8 tensors on the device, or the exception of each failed image."""
        try:
            return list(self._decode(datas, self.device))
        except RuntimeError as e:
            if len(datas) == 1:
                return [e]
            log.info("nvJPEG refused a batch of %d (%s); decoding one by one", len(datas), e)
        results: list[torch.Tensor | Exception] = []
        for d in datas:
            try:
                results.append(self._decode([d], self.device)[0])
            except RuntimeError as e:
                results.append(e)
        return results
