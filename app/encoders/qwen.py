"""Qwen2-VL and Qwen2.5-VL vision towers from a local checkpoint, with dynamic resolution.

Only the tower is built and only its tensors are read from the safetensors shards (the language
model is never loaded). Pre-processing is the model's own image processor
(``Qwen2VLImageProcessor``) redone with torch ops on the encoder's device: ``smart_resize`` to
a multiple of ``patch_size * merge_size`` within ``[min_pixels, max_pixels]``, antialiased
resize rounded to uint8 as torchvision does, rescale and normalise, then 14-pixel patches, the
image repeated over ``temporal_patch_size`` frames, in the 2x2-merge order the tower expects.
Images of different sizes go through the tower together, packed: their patches are
concatenated and ``grid_thw`` tells the tower's own varlen attention where each image ends.
The output of an image is the merger's embeddings, ``[t*h*w / merge**2, out_hidden_size]``.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as nnf
from torch import nn

from app.encoders.base import default_dtype, resolve_device
from app.preprocess import (
    BICUBIC,
    CLIP_MEAN,
    CLIP_STD,
    interpolation,
    load_image_processor,
    rescale_normalize,
    resize,
    size_field,
    three_numbers,
)

log = logging.getLogger(__name__)

# config.json model_type -> (module, vision tower class) in transformers
TOWERS: dict[str, tuple[str, str]] = {
    "qwen2_vl": (
        "transformers.models.qwen2_vl.modeling_qwen2_vl",
        "Qwen2VisionTransformerPretrainedModel",
    ),
    "qwen2_5_vl": (
        "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
        "Qwen2_5_VisionTransformerPretrainedModel",
    ),
}
# Where the tower's tensors live in a full checkpoint: transformers 5 saves "model.visual.*",
# the published Qwen checkpoints (and transformers 4) "visual.*".
WEIGHT_PREFIXES = ("model.visual.", "visual.")
VARLEN_ATTENTION = "featpool_flash_varlen"


@dataclass(frozen=True)
class QwenPreprocessor:
    """What defines a Qwen2-VL image input: the fields of its ``Qwen2VLImageProcessor``
    (defaults: that processor's)."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True
    do_resize: bool = True
    resample: int = BICUBIC  # PIL's code, as preprocessor_config.json stores it

    @classmethod
    def from_processor(cls, proc: Any) -> QwenPreprocessor:
        """From the processor transformers loads for the checkpoint (``load_image_processor``:
        the file's values, the class defaults for what it leaves out)."""
        name = type(proc).__name__
        if not name.startswith("Qwen2VLImageProcessor"):
            raise ValueError(
                f"the checkpoint's image processor is {name}, not Qwen2VLImageProcessor; "
                "featpool reproduces only that one for Qwen2-VL towers"
            )
        d = cls()
        size = getattr(proc, "size", None) or {}
        min_px = size_field(size, "shortest_edge") or getattr(proc, "min_pixels", None)
        max_px = size_field(size, "longest_edge") or getattr(proc, "max_pixels", None)
        resample = int(getattr(proc, "resample", None) or d.resample)
        interpolation(resample)  # refuses filters without a tensor implementation
        return cls(
            min_pixels=int(min_px or d.min_pixels),
            max_pixels=int(max_px or d.max_pixels),
            patch_size=int(getattr(proc, "patch_size", None) or d.patch_size),
            temporal_patch_size=int(
                getattr(proc, "temporal_patch_size", None) or d.temporal_patch_size
            ),
            merge_size=int(getattr(proc, "merge_size", None) or d.merge_size),
            mean=three_numbers(getattr(proc, "image_mean", None) or d.mean, "image_mean"),
            std=three_numbers(getattr(proc, "image_std", None) or d.std, "image_std"),
            rescale_factor=float(getattr(proc, "rescale_factor", None) or d.rescale_factor),
            do_rescale=bool(getattr(proc, "do_rescale", True)),
            do_normalize=bool(getattr(proc, "do_normalize", True)),
            do_resize=bool(getattr(proc, "do_resize", True)),
            resample=resample,
        )

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def smart_resize(height: int, width: int, pre: QwenPreprocessor) -> tuple[int, int]:
    """The processor's rule: both sides multiples of ``factor``, the area within
    ``[min_pixels, max_pixels]``, the aspect ratio kept as closely as that allows."""
    factor = pre.factor
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"the aspect ratio of a {width}x{height} image exceeds 200, which Qwen2-VL refuses"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > pre.max_pixels:
        beta = math.sqrt((height * width) / pre.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < pre.min_pixels:
        beta = math.sqrt(pre.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def patchify(
    image: torch.Tensor, pre: QwenPreprocessor
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``[3, H, W]`` uint8 (upright RGB, any device) -> (``[h*w, 3*T*p*p]`` float32 patches,
    ``(1, h, w)``), exactly as ``Qwen2VLImageProcessor`` makes them: resize (uint8, as
    torchvision), rescale and normalise (``app.preprocess``), then the patch layout."""
    x = image.unsqueeze(0)
    if pre.do_resize:
        x = resize(x, smart_resize(int(x.shape[-2]), int(x.shape[-1]), pre), pre.resample)
    c, m, p, t = 3, pre.merge_size, pre.patch_size, pre.temporal_patch_size
    h_px, w_px = x.shape[-2:]
    if h_px % pre.factor or w_px % pre.factor:
        raise ValueError(f"image of {w_px}x{h_px} is not a multiple of {pre.factor} pixels")
    x = rescale_normalize(
        x,
        pre.rescale_factor if pre.do_rescale else None,
        pre.mean if pre.do_normalize else None,
        pre.std if pre.do_normalize else None,
    )[0]
    gh, gw = h_px // p, w_px // p
    x = x.reshape(c, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    # [gh/m, gw/m, m, m, C, p, p]: repeat over time inside each patch (C, T, p, p)
    x = x.unsqueeze(5).expand(-1, -1, -1, -1, -1, t, -1, -1)
    return x.reshape(gh * gw, c * t * p * p), (1, gh, gw)


def _varlen_attention(  # noqa: PLR0917 (transformers' attention interface)
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over torch's fused varlen kernel
    (``torch.nn.attention.varlen.varlen_attn``): one launch for every packed image or window,
    where transformers' ``sdpa`` path runs one attention call per image or window. Called as
    ``flash_attention_2`` is: ``[1, heads, seq, dim]`` in, ``[1, seq, heads, dim]`` out, the
    packed boundaries in ``cu_seq_lens_q``. Off CUDA it runs sdpa per segment (as transformers'
    own loop does), so the wiring is tested on the CPU."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.pop("cu_seq_lens_q", None)
    max_len = kwargs.pop("max_length_q", None)
    for k in ("cu_seq_lens_k", "max_length_k"):
        kwargs.pop(k, None)
    if cu is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.device.type != "cuda":
        lengths = (cu[1:] - cu[:-1]).tolist()
        segments = zip(*(torch.split(x, lengths, dim=2) for x in (query, key, value)), strict=True)
        parts = [
            sdpa_attention_forward(module, q, k, v, None, scaling=scaling, **kwargs)[0]
            for q, k, v in segments
        ]
        return torch.cat(parts, dim=1), None
    from torch.nn.attention.varlen import varlen_attn

    # [1, heads, seq, dim] -> [seq, heads, dim]
    q_, k_, v_ = (x.squeeze(0).transpose(0, 1) for x in (query, key, value))
    if max_len is None:
        max_len = int((cu[1:] - cu[:-1]).max())
    bounds = cu.to(torch.int32)
    out = varlen_attn(q_, k_, v_, bounds, bounds, int(max_len), int(max_len), scale=scaling)
    assert isinstance(out, torch.Tensor)  # (no aux requested)
    return out.unsqueeze(0), None


def varlen_attention_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        importlib.import_module("torch.nn.attention.varlen")
    except ImportError:
        return False
    return True


def _register_varlen_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTENTION, _varlen_attention)


def patch_embed_as_gemm(tower: nn.Module) -> bool:
    """Run the tower's patch embedding, a Conv3d whose stride equals its kernel, as the GEMM it
    is over the flattened patches (same weights, viewed ``[D, C*T*p*p]``). transformers offers
    the same as ``fusion_config={"patch_embeddings": True}``; cuDNN's Conv3d for this shape is
    slow in bf16 on some versions. Returns whether it applied."""
    embed = getattr(tower, "patch_embed", None)
    proj = getattr(embed, "proj", None)
    if not (
        isinstance(proj, nn.Conv3d)
        and proj.stride == proj.kernel_size
        and proj.padding == (0, 0, 0)
        and proj.dilation == (1, 1, 1)
        and proj.groups == 1
    ):
        return False
    assert embed is not None
    volume = proj.in_channels * math.prod(proj.kernel_size)
    weight = proj.weight.view(proj.out_channels, volume)
    bias = proj.bias

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        return nnf.linear(hidden_states.view(-1, volume).to(weight.dtype), weight, bias)

    embed.forward = forward
    return True


def _tower_tensors(directory: Path) -> tuple[dict[str, list[str]], str]:
    """{shard file: [tensor names of the tower]} and the prefix they carry, from the
    safetensors index (or the headers of the shards): no tensor is read here."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    else:
        weight_map = {}
        for path in sorted(directory.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                weight_map.update(dict.fromkeys(f.keys(), path.name))
    if not weight_map:
        raise ValueError(f"{directory}: no safetensors weights (model*.safetensors)")
    for prefix in WEIGHT_PREFIXES:
        files: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            if name.startswith(prefix):
                files.setdefault(shard, []).append(name)
        if files:
            return files, prefix
    raise ValueError(
        f"{directory}: no vision tower tensors (names starting with "
        f"{' or '.join(WEIGHT_PREFIXES)}) in its safetensors weights"
    )


class QwenVisionEncoder:
    """A Qwen2-VL / Qwen2.5-VL vision tower behind featpool's dynamic-resolution interface:
    ``encode_images(list of [3, H, W] uint8)`` -> per image ``[tokens, out_hidden_size]``."""

    dynamic = True

    def __init__(
        self,
        directory: Path | str,
        *,
        device: torch.device | str,
        dtype: torch.dtype | None = None,
        attention: str | None = None,
        compile: bool = False,
    ) -> None:
        from app.encoders.hf import import_transformers

        t0 = time.perf_counter()
        directory = Path(directory)
        transformers = import_transformers()
        self.device = resolve_device(device)
        self.dtype = dtype if dtype is not None else default_dtype(self.device)
        self.name = f"hf:{directory}"
        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
        model_type = str(config.model_type)
        if model_type not in TOWERS:
            raise ValueError(f"{directory}: model type {model_type!r} is not a Qwen2-VL model")
        vision_config = config.vision_config
        proc = load_image_processor(directory)
        if proc is None:
            log.warning("%s: no preprocessor_config.json; using Qwen2-VL's defaults", directory)
        self.pre = QwenPreprocessor.from_processor(proc) if proc else QwenPreprocessor()
        if self.pre.patch_size != vision_config.patch_size or (
            self.pre.merge_size != vision_config.spatial_merge_size
        ):
            raise ValueError(
                f"{directory}: preprocessor patch/merge size ({self.pre.patch_size}, "
                f"{self.pre.merge_size}) differ from the vision config's "
                f"({vision_config.patch_size}, {vision_config.spatial_merge_size})"
            )
        if attention is None:
            attention = VARLEN_ATTENTION if varlen_attention_available(self.device) else "sdpa"
        self.attention = attention
        module_name, cls_name = TOWERS[model_type]
        cls = getattr(importlib.import_module(module_name), cls_name)
        with torch.device(self.device):
            model = cls._from_config(
                vision_config,
                dtype=self.dtype,
                attn_implementation="sdpa" if attention == VARLEN_ATTENTION else attention,
            )
        if attention == VARLEN_ATTENTION:
            # Set after construction: transformers checks a "flash" name at construction by
            # importing a flash-attn package; at run time it only looks the name up.
            _register_varlen_attention()
            model.config._attn_implementation = attention
        self.load_bytes = self._load_weights(model, directory)
        model.eval().requires_grad_(False)
        self.patch_gemm = patch_embed_as_gemm(model)
        # Eager, each block is a dozen elementwise kernels in float32 (RMSNorm, rotary, SiLU)
        # around its GEMMs; compiled, they fuse (36 -> 15 ms per 1024 px image for the 7B
        # tower on an H200). Dynamic shapes: one graph for every token count.
        self.compiled = compile and self.device.type == "cuda"
        if self.compiled:
            for block in cast(Sequence[nn.Module], model.blocks):
                block.compile(dynamic=True)
        self.module: nn.Module = model
        self.merge_unit = self.pre.merge_size**2
        # Qwen2-VL names the merged width hidden_size, Qwen2.5-VL out_hidden_size
        self.out_dim = int(
            getattr(vision_config, "out_hidden_size", 0) or vision_config.hidden_size
        )
        # The fixed-size Encoder attributes, for code that reads them (metrics, /v1/pool).
        self.mean, self.std = self.pre.mean, self.pre.std
        self.image_size = 0
        self.output_shape = (0, self.out_dim)
        self.load_s = time.perf_counter() - t0
        log.info(
            "%s: %s vision tower (%.0f MB of weights, %s attention) loaded in %.2f s",
            self.name,
            model_type,
            self.load_bytes / 1e6,
            attention,
            self.load_s,
        )

    def _load_weights(self, model: nn.Module, directory: Path) -> int:
        """Copy the tower's tensors into the model one at a time (peak memory: the tower plus
        one tensor), reading only the shards that hold them. Returns the bytes loaded."""
        from safetensors import safe_open

        files, prefix = _tower_tensors(directory)
        targets = model.state_dict()
        missing, unexpected, loaded = set(targets), [], 0
        dev = str(self.device) if self.device.type == "cuda" else "cpu"
        with torch.no_grad():
            for shard, names in files.items():
                with safe_open(str(directory / shard), framework="pt", device=dev) as f:
                    for name in names:
                        key = name[len(prefix) :]
                        target = targets.get(key)
                        if target is None:
                            unexpected.append(key)
                            continue
                        src = f.get_tensor(name)
                        if src.shape != target.shape:
                            raise ValueError(
                                f"{directory}: {name} has shape {list(src.shape)}, the "
                                f"vision config gives {list(target.shape)}"
                            )
                        target.copy_(src)
                        missing.discard(key)
                        loaded += target.numel() * target.element_size()
                        del src
        if missing or unexpected:
            raise ValueError(
                f"{directory}: the vision tower's tensors do not match its config: "
                f"missing {sorted(missing)[:5]}, unexpected {unexpected[:5]}"
            )
        return loaded

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) in patches for an upright image of ``height`` x ``width`` pixels."""
        h, w = smart_resize(height, width, self.pre) if self.pre.do_resize else (height, width)
        return 1, h // self.pre.patch_size, w // self.pre.patch_size

    def encode_images(
        self, images: Sequence[torch.Tensor]
    ) -> list[tuple[torch.Tensor, tuple[int, int, int]]]:
        """Upright RGB ``[3, H, W]`` uint8 images on the device -> per image (features
        ``[tokens, out_hidden_size]`` in ``dtype``, grid ``(t, h, w)``), in one packed forward."""
        if not images:
            return []
        patches, grids = [], []
        for im in images:
            if im.dim() != 3 or im.shape[0] != 3:
                raise ValueError(f"expected [3, H, W] images, got {list(im.shape)}")
            x, g = patchify(im.to(self.device), self.pre)
            patches.append(x)
            grids.append(g)
        grid_thw = torch.tensor(grids, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            out = self.module(torch.cat(patches), grid_thw=grid_thw)
        merged = out if isinstance(out, torch.Tensor) else out.pooler_output
        sizes = [t * h * w // self.merge_unit for t, h, w in grids]
        return list(zip(merged.to(self.dtype).split(sizes), grids, strict=True))

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        # Several windows per image and more than one image: a compiled tower then traces the
        # general case here (not one specialised to a single window or image) and does not
        # compile again while serving.
        side = self.pre.factor * 16
        im = torch.zeros(3, side, side, dtype=torch.uint8, device=self.device)
        for b in sorted({max(2, b) for b in batch_sizes})[:2]:
            self.encode_images([im] * b)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def is_qwen_checkpoint(directory: Path) -> bool:
    config = directory / "config.json"
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text()).get("model_type") in TOWERS
    except (OSError, ValueError):
        return False
