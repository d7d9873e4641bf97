"""Hugging Face vision towers (SigLIP, CLIP, ...) loaded from a local directory.

`transformers` is the optional extra `hf`; it is imported only when such an encoder is built.
Nothing is downloaded: every load passes `local_files_only=True`.
"""

from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from app.encoders.base import ModuleEncoder, default_dtype, resolve_device

log = logging.getLogger(__name__)

# model_type -> (vision tower class, default mean, default std). A full SigLIP/CLIP checkpoint
# (vision + text) loads its vision tower through the same class.
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_HALF = (0.5, 0.5, 0.5)
_TOWERS: dict[str, tuple[str, tuple[float, float, float], tuple[float, float, float]]] = {
    "siglip": ("SiglipVisionModel", _HALF, _HALF),
    "siglip_vision_model": ("SiglipVisionModel", _HALF, _HALF),
    "clip": ("CLIPVisionModel", _CLIP_MEAN, _CLIP_STD),
    "clip_vision_model": ("CLIPVisionModel", _CLIP_MEAN, _CLIP_STD),
}


def _import_transformers() -> ModuleType:
    try:
        return importlib.import_module("transformers")
    except ImportError as e:
        raise ImportError(
            "Hugging Face encoders need the optional 'transformers' dependency: "
            "pip install 'featpool[hf]'"
        ) from e


def _triple(value: Any, what: str) -> tuple[float, float, float]:
    if isinstance(value, (int, float)):
        value = [value] * 3
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise ValueError(f"{what} must be three numbers, got {value!r}")
    return float(value[0]), float(value[1]), float(value[2])


def _preprocessor_size(pre: dict[str, Any]) -> int | None:
    for key in ("crop_size", "size"):
        v = pre.get(key)
        if isinstance(v, int):
            return v
        if isinstance(v, dict):
            if "height" in v and v.get("width", v["height"]) == v["height"]:
                return int(v["height"])
            if "shortest_edge" in v:
                return int(v["shortest_edge"])
    return None


class HFVisionEncoder(ModuleEncoder):
    """A local Hugging Face vision tower; its output is `last_hidden_state`."""

    def __init__(
        self,
        directory: Path | str,
        *,
        device: torch.device | str,
        dtype: torch.dtype | None = None,
        compile: bool = False,
    ) -> None:
        directory = Path(directory)
        if not (directory / "config.json").is_file():
            raise ValueError(
                f"hf encoder: {directory} is not a local model directory "
                "(no config.json); nothing is downloaded"
            )
        transformers = _import_transformers()
        self.device = resolve_device(device)
        if self.device.type == "meta":
            raise ValueError("hf encoders cannot be built on the meta device")
        self.dtype = dtype if dtype is not None else default_dtype(self.device)
        self.name = f"hf:{directory}"

        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
        model_type = str(config.model_type)
        vision_config = getattr(config, "vision_config", None) or config
        if model_type in _TOWERS:
            cls_name, mean, std = _TOWERS[model_type]
            model = getattr(transformers, cls_name).from_pretrained(
                directory, local_files_only=True
            )
        else:
            mean, std = _HALF, _HALF
            model = transformers.AutoModel.from_pretrained(directory, local_files_only=True)
            model = getattr(model, "vision_model", model)
            log.warning(
                "hf encoder %s: model type %r is not a known vision tower; using "
                "AutoModel and its last_hidden_state",
                directory,
                model_type,
            )

        pre_path = directory / "preprocessor_config.json"
        pre: dict[str, Any] = json.loads(pre_path.read_text()) if pre_path.is_file() else {}
        self.mean = _triple(pre.get("image_mean", mean), "image_mean")
        self.std = _triple(pre.get("image_std", std), "image_std")
        # The position embeddings fix the model's size; the preprocessor only fills a gap.
        size = getattr(vision_config, "image_size", None)
        pre_size = _preprocessor_size(pre)
        if isinstance(size, (list, tuple)):
            size = size[0] if size[0] == size[-1] else None
        if size is None:
            size = pre_size
        elif pre_size is not None and pre_size != size:
            log.warning(
                "hf encoder %s: preprocessor size %s differs from the model's %s; "
                "using the model's",
                directory,
                pre_size,
                size,
            )
        if not isinstance(size, int):
            raise ValueError(
                f"hf encoder {directory}: cannot tell the square input size from "
                "config.json or preprocessor_config.json"
            )
        self.image_size = size

        model.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        self.module = model
        self._forward = self._last_hidden_state
        # One probe forward tells the token count of any tower (CLS or not, pooling or not).
        with torch.inference_mode():
            probe = self._forward(
                torch.zeros(1, 3, size, size, device=self.device, dtype=self.dtype)
            )
        if probe.dim() != 3:
            raise ValueError(
                f"hf encoder {directory}: last_hidden_state has shape "
                f"{list(probe.shape)}, expected [B, tokens, dim]"
            )
        self.output_shape = (int(probe.shape[1]), int(probe.shape[2]))
        self._maybe_compile(compile)

    def _last_hidden_state(self, pixels: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.module(pixel_values=pixels).last_hidden_state
        return out
