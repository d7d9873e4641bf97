"""Pluggable image encoders behind one Protocol.

`build_encoder("vit-b16-224", device=...)` builds a preset ViT (seeded, or from a local
safetensors file); `build_encoder("hf:/models/siglip", device=...)` or
`build_encoder("hf:google/siglip-base-patch16-224", device=...)` loads a Hugging Face vision tower
from a local directory or the local Hugging Face cache (optional extra `hf`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from app.encoders.base import DynamicEncoder, Encoder, ModuleEncoder, default_dtype, is_dynamic
from app.encoders.vit import PRESETS, ViTConfig, ViTEncoder

__all__ = [
    "HF_PREFIX",
    "PRESETS",
    "DynamicEncoder",
    "Encoder",
    "ModuleEncoder",
    "ViTConfig",
    "ViTEncoder",
    "build_encoder",
    "check_encoder_name",
    "default_dtype",
    "is_dynamic",
]

HF_PREFIX = "hf:"
log = logging.getLogger(__name__)


def build_encoder(
    name: str,
    *,
    device: torch.device,
    dtype: torch.dtype | None = None,
    weights: Path | None = None,
    compile: bool = False,
    tower_compile: bool = False,
) -> Encoder | DynamicEncoder:
    """Build the encoder `name`: a preset of `PRESETS`, or `hf:<local dir or cached repo id>`.
    A Qwen2-VL or Qwen2.5-VL checkpoint gives a `DynamicEncoder` (its vision tower, dynamic
    resolution).

    `dtype` defaults to bfloat16 on CUDA and float32 elsewhere. `weights` (presets only) is a
    local safetensors file; without it the weights are seeded, identical in every process.
    `compile` uses torch.compile on CUDA for a fixed-size tower, `tower_compile` for a dynamic
    one's blocks.
    """
    if name.startswith(HF_PREFIX):
        if weights is not None:
            raise ValueError(
                "hf encoders load their weights from their directory; do not pass weights"
            )
        from app.encoders.hf import HFVisionEncoder, resolve_model
        from app.encoders.qwen import QwenVisionEncoder, is_qwen_checkpoint

        directory = resolve_model(name[len(HF_PREFIX) :])
        if is_qwen_checkpoint(directory):
            if compile:
                log.warning(
                    "%s: --encoder-compile is for fixed-size towers (see --tower-compile)", name
                )
            return QwenVisionEncoder(directory, device=device, dtype=dtype, compile=tower_compile)
        return HFVisionEncoder(name[len(HF_PREFIX) :], device=device, dtype=dtype, compile=compile)
    if name not in PRESETS:
        raise _unknown(name)
    return ViTEncoder(name, device=device, dtype=dtype, weights=weights, compile=compile)


def check_encoder_name(name: str) -> None:
    """Fail fast, before anything starts, on a name that cannot be built: an unknown preset, an
    hf: model without the hf extra installed, or one that is neither a local directory nor in
    the local Hugging Face cache."""
    if name.startswith(HF_PREFIX):
        from app.encoders.hf import check_hf_extra, resolve_model

        check_hf_extra()
        resolve_model(name[len(HF_PREFIX) :])
    elif name not in PRESETS:
        raise _unknown(name)


def _unknown(name: str) -> ValueError:
    return ValueError(
        f"unknown encoder {name!r}; valid presets: {', '.join(PRESETS)}, "
        f"or {HF_PREFIX}<local directory or org/name in the Hugging Face cache> for a "
        "Hugging Face vision tower"
    )
