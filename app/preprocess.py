"""Preprocessing as a model's own image processor defines it, in torch on the encoder's device.

The reference is transformers' image processor for the model (its torchvision backend, the
default where torchvision is installed): the same resize rule, filter, antialiasing, crop,
rescale and normalisation, applied to the decoded ``uint8`` image wherever it lies (nvJPEG leaves
it on the GPU; Pillow on the CPU). The pieces are plain functions so that other resize rules
(dynamic resolution) reuse them; ``ImageSpec`` strings them together for the fixed-size rules:

- exact size: ``size = {"height", "width"}`` (SigLIP, ViT);
- shortest edge, then centre crop: ``size = {"shortest_edge"}`` + ``crop_size`` (CLIP, DINOv2);
- each step switched by ``do_resize`` / ``do_center_crop`` / ``do_rescale`` / ``do_normalize``.

What happens before (Pillow decode, EXIF orientation, RGB conversion) is ``app.imaging``'s
``decode_upright`` for the CPU and ``orient`` here for images nvJPEG decoded.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as nnf

log = logging.getLogger(__name__)

# PIL's resampling enum (PIL.Image.Resampling), as preprocessor_config.json stores `resample`.
NEAREST, LANCZOS, BILINEAR, BICUBIC, BOX, HAMMING = 0, 1, 2, 3, 4, 5
_FILTERS = {NEAREST: "nearest", LANCZOS: "lanczos", BILINEAR: "bilinear", BICUBIC: "bicubic"}
# OpenAI CLIP's normalisation, which CLIP towers and the Qwen2-VL processors default to.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def device_index(idx: list[int], device: torch.device) -> torch.Tensor:
    """``idx`` as a long tensor on ``device``, without waiting for the device. A blocking copy
    from the host (``torch.tensor(idx, device=...)``) synchronises its stream, so the thread
    preparing a batch would wait there for the kernels queued before it, which share the GPU
    with the forward. From pageable memory the driver stages the bytes before the call
    returns, so the list may be freed at once. TorchScript-compatible."""
    return torch.tensor(idx, dtype=torch.long).to(device=device, non_blocking=True)


def orient(x: torch.Tensor, orientation: int) -> torch.Tensor:
    """Apply an EXIF orientation to ``[..., H, W]`` as Pillow's ``exif_transpose`` does."""
    if orientation == 2:  # FLIP_LEFT_RIGHT
        return x.flip(-1)
    if orientation == 3:  # ROTATE_180
        return x.flip(-2, -1)
    if orientation == 4:  # FLIP_TOP_BOTTOM
        return x.flip(-2)
    if orientation == 5:  # TRANSPOSE
        return x.transpose(-2, -1)
    if orientation == 6:  # ROTATE_270 (90 degrees clockwise)
        return torch.rot90(x, -1, (-2, -1))
    if orientation == 7:  # TRANSVERSE
        return x.flip(-2, -1).transpose(-2, -1)
    if orientation == 8:  # ROTATE_90 (counter-clockwise)
        return torch.rot90(x, 1, (-2, -1))
    return x


def interpolation(resample: int) -> tuple[str, bool]:
    """A PIL resampling filter -> (``torch.nn.functional.interpolate`` mode, antialias), as
    transformers maps it to torchvision (``pil_torch_interpolation_mapping``) and torchvision
    resizes tensors: antialiasing only for bilinear and bicubic (whose antialiased kernels in
    torch use PIL's coefficients). LANCZOS becomes antialiased bicubic, as transformers'
    torchvision backend does on CUDA. BOX and HAMMING have no tensor implementation there
    either: an error."""
    r = int(resample)
    if r == NEAREST:
        return "nearest-exact", False
    if r == BILINEAR:
        return "bilinear", True
    if r in (BICUBIC, LANCZOS):
        return "bicubic", True
    raise ValueError(
        f"resample={r} (BOX=4, HAMMING=5) has no tensor implementation; featpool supports "
        "NEAREST (0), LANCZOS (1, as bicubic), BILINEAR (2) and BICUBIC (3)"
    )


def shortest_edge_size(height: int, width: int, shortest_edge: int) -> tuple[int, int]:
    """The size after resizing the short side to ``shortest_edge``, the long side truncated
    (transformers' ``get_resize_output_image_size(default_to_square=False)``)."""
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(shortest_edge * long / short)
    return (new_long, shortest_edge) if width <= height else (shortest_edge, new_long)


def resize(x: torch.Tensor, size: tuple[int, int], resample: int) -> torch.Tensor:
    """``[N, C, H, W]`` uint8 -> ``[N, C, *size]`` uint8, as torchvision resizes a uint8 tensor on
    the GPU: interpolate in float32, clamp, round."""
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    mode, antialias = interpolation(resample)
    if mode == "nearest-exact":
        return nnf.interpolate(x, size=size, mode=mode)
    y = nnf.interpolate(x.float(), size=size, mode=mode, align_corners=False, antialias=antialias)
    return y.clamp_(0, 255).round_().to(torch.uint8)


def center_crop(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """The centred ``size`` window of ``[..., H, W]``; an image smaller than the window is first
    padded with zeros around it (transformers' torchvision backend ``center_crop``)."""
    h, w = x.shape[-2:]
    ch, cw = size
    if ch > h or cw > w:
        left, top = max(cw - w, 0) // 2, max(ch - h, 0) // 2
        right, bottom = (max(cw - w, 0) + 1) // 2, (max(ch - h, 0) + 1) // 2
        x = nnf.pad(x, (left, right, top, bottom), value=0)
        h, w = x.shape[-2:]
    top, left = int((h - ch) / 2.0), int((w - cw) / 2.0)
    return x[..., top : top + ch, left : left + cw]


def rescale_normalize(
    x: torch.Tensor,
    rescale: float | None,
    mean: Sequence[float] | None,
    std: Sequence[float] | None,
) -> torch.Tensor:
    """``[N, 3, H, W]`` uint8 -> float32: ``x * rescale``, then ``(x - mean) / std``, fused the
    way transformers fuses them (mean and std divided by the rescale factor)."""
    y = x.to(torch.float32)
    if mean is not None and std is not None:
        m, s = _normalisation(tuple(mean), tuple(std), rescale, x.device)
        return y.sub_(m).div_(s)
    if rescale is not None:
        return y * rescale
    return y


@functools.lru_cache(maxsize=64)
def _normalisation(
    mean: tuple[float, ...], std: tuple[float, ...], rescale: float | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rescale_normalize``'s mean and std as ``[C, 1, 1]`` float32 on ``device``, divided by
    the rescale factor; made once per processor and device rather than per batch (or per
    image, for Qwen's patches). The copy that makes them waits for it, once, so any stream
    may read them after; nothing writes them."""
    m = torch.tensor(mean, dtype=torch.float32)
    s = torch.tensor(std, dtype=torch.float32)
    if rescale is not None:
        m, s = m * (1.0 / rescale), s * (1.0 / rescale)
    return m.view(-1, 1, 1).to(device), s.view(-1, 1, 1).to(device)


@dataclass(frozen=True)
class ImageSpec:
    """One fixed-size preprocessing: orient -> resize -> centre crop -> rescale -> normalise."""

    size: tuple[int, int] | None = None  # exact (height, width)
    shortest_edge: int | None = None  # or: the short side, aspect kept
    resample: int = BILINEAR
    crop: tuple[int, int] | None = None  # centre crop (height, width)
    rescale: float | None = 1 / 255
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    source: str = ""  # where it came from, for logs and errors

    def resized(self, height: int, width: int) -> tuple[int, int]:
        if self.size is not None:
            return self.size
        if self.shortest_edge is not None:
            return shortest_edge_size(height, width, self.shortest_edge)
        return height, width

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        return self.crop if self.crop is not None else self.resized(height, width)

    def fixed_size(self) -> tuple[int, int] | None:
        """The output size whatever the input, or None when it follows the input."""
        return self.crop or self.size

    def describe(self) -> str:
        if self.size is not None:
            rule = f"resize to {self.size[0]}x{self.size[1]}"
        elif self.shortest_edge is not None:
            rule = f"resize the short side to {self.shortest_edge}"
        else:
            rule = "no resize"
        if self.crop is not None:
            rule += f", centre crop {self.crop[0]}x{self.crop[1]}"
        mode, aa = interpolation(self.resample)
        return (
            f"{rule}, {_FILTERS.get(self.resample, self.resample)} (torch {mode}, "
            f"antialias={aa}), rescale={self.rescale}, mean={self.mean}, std={self.std}"
        )

    def apply(self, images: Sequence[torch.Tensor], orientations: Sequence[int]) -> torch.Tensor:
        """``[3, H, W]`` uint8 images (any sizes, all on one device) -> ``[N, 3, h, w]`` float32,
        ready for the model. Images of one shape are processed as one batch."""
        if not images:
            raise ValueError("no images")
        upright = [orient(im, o) for im, o in zip(images, orientations, strict=True)]
        out_sizes = {self.output_size(*im.shape[-2:]) for im in upright}
        if len(out_sizes) != 1:
            raise ValueError(f"images of different output sizes {sorted(out_sizes)}")
        oh, ow = out_sizes.pop()
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, im in enumerate(upright):
            groups.setdefault(tuple(im.shape), []).append(i)
        out: torch.Tensor | None = None
        for shape, idx in groups.items():
            x = torch.stack([upright[i] for i in idx])
            x = resize(x, self.resized(shape[-2], shape[-1]), self.resample)
            if self.crop is not None:
                x = center_crop(x, self.crop)
            y = rescale_normalize(x, self.rescale, self.mean, self.std)
            if len(idx) == len(upright):
                return y
            if out is None:
                out = torch.empty(len(upright), 3, oh, ow, device=y.device)
            out[device_index(idx, y.device)] = y
        assert out is not None
        return out

    @classmethod
    def from_processor(cls, proc: Any, source: str = "") -> ImageSpec:
        """From a transformers image processor's resolved attributes (its class defaults filled
        in for what preprocessor_config.json leaves out). Raises ValueError for a processor
        whose preprocessing is not this fixed chain."""
        name = type(proc).__name__
        if not _is_standard(proc):
            raise ValueError(
                f"{source or name}: {name} preprocesses images in its own way, which featpool "
                "does not reproduce (it supports processors that resize, centre-crop, rescale "
                "and normalise, such as CLIP, SigLIP, ViT and DINOv2)"
            )
        if getattr(proc, "do_pad", None):
            raise ValueError(f"{source or name}: do_pad is not supported")
        size = crop = None
        shortest = None
        if getattr(proc, "do_resize", False):
            s = proc.size
            h, w, se = (
                size_field(s, "height"),
                size_field(s, "width"),
                size_field(s, "shortest_edge"),
            )
            others = [k for k in ("longest_edge", "max_height", "max_width") if size_field(s, k)]
            if others or (se is None and (h is None or w is None)):
                raise ValueError(f"{source or name}: size {dict(s)} is not supported")
            if se is not None:
                shortest = int(se)
            else:
                size = (int(h), int(w))
        if getattr(proc, "do_center_crop", False):
            c = proc.crop_size
            crop = (int(size_field(c, "height")), int(size_field(c, "width")))
        resample = getattr(proc, "resample", None)
        resample = BILINEAR if resample is None else int(resample)
        interpolation(resample)  # unsupported filters fail here, at start-up
        if resample == LANCZOS:
            log.warning(
                "%s: LANCZOS resampling is done as antialiased bicubic (as transformers' "
                "torchvision backend does on CUDA)",
                source or name,
            )
        rescale = float(proc.rescale_factor) if getattr(proc, "do_rescale", False) else None
        mean = std = None
        if getattr(proc, "do_normalize", False):
            mean = three_numbers(proc.image_mean, "image_mean")
            std = three_numbers(proc.image_std, "image_std")
        return cls(size, shortest, resample, crop, rescale, mean, std, source or name)

    @classmethod
    def from_pretrained(
        cls, directory: Path | str, fallback: str | None = None
    ) -> ImageSpec | None:
        """The spec of ``directory/preprocessor_config.json`` (see ``load_image_processor``);
        None when the directory has none."""
        proc = load_image_processor(directory, fallback)
        if proc is None:
            return None
        return cls.from_processor(proc, source=str(Path(directory) / "preprocessor_config.json"))


def load_image_processor(directory: Path | str, fallback: str | None = None) -> Any | None:
    """``directory/preprocessor_config.json`` as transformers reads it (``AutoImageProcessor``,
    offline; its class defaults fill what the file leaves out), or the class named ``fallback``
    where the file names no class and the model type has no processor of its own (a
    vision-tower-only checkpoint). None without such a file; ValueError if transformers cannot
    load it."""
    directory = Path(directory)
    path = directory / "preprocessor_config.json"
    if not path.is_file():
        return None
    transformers = importlib.import_module("transformers")
    try:
        try:
            return transformers.AutoImageProcessor.from_pretrained(directory, local_files_only=True)
        except ValueError:  # "Unrecognized image processor"
            if fallback is None:
                raise
            return getattr(transformers, fallback).from_pretrained(directory, local_files_only=True)
    except Exception as e:  # transformers raises many kinds for a config it cannot read
        raise ValueError(f"{path}: transformers cannot load this image processor: {e}") from e


def size_field(d: Any, key: str) -> Any:
    """A key of a size dict (a dict, or transformers 5's SizeDict)."""
    if isinstance(d, dict):
        return d.get(key)
    return getattr(d, key, None)


def three_numbers(value: Any, what: str) -> tuple[float, float, float]:
    """A per-channel value (``image_mean``, ``image_std``): one number or three, as floats."""
    if isinstance(value, (int, float)):
        value = [value] * 3
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise ValueError(f"{what} must be three numbers, got {value!r}")
    return float(value[0]), float(value[1]), float(value[2])


def _is_standard(proc: Any) -> bool:
    """Whether ``proc`` runs transformers' generic resize -> crop -> rescale -> normalise: its
    class keeps the backend's own ``_preprocess`` (transformers 5), or, for transformers 4,
    is one of the processors known to run that chain."""
    try:
        backends = importlib.import_module("transformers.image_processing_backends")
        generic = [getattr(backends, n, None) for n in ("TorchvisionBackend", "PilBackend")]
        own = getattr(type(proc), "_preprocess", None)
        return any(b is not None and own is getattr(b, "_preprocess", None) for b in generic)
    except ImportError:  # transformers 4: no backends module
        name = type(proc).__name__.removesuffix("Fast")
        return name in {
            "CLIPImageProcessor",
            "SiglipImageProcessor",
            "ViTImageProcessor",
            "BitImageProcessor",
        }
