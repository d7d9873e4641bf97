"""Pluggable image encoders behind one Protocol.

`build_encoder("vit-b16-224", device=...)` builds a preset ViT (seeded, or from a local
safetensors file); `build_encoder("hf:/models/siglip", device=...)` loads a Hugging Face vision
tower from a local directory (optional extra `hf`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from app.encoders.base import Encoder, ModuleEncoder, default_dtype
from app.encoders.vit import PRESETS, ViTConfig, ViTEncoder

__all__ = [
    "HF_PREFIX",
    "PRESETS",
    "Encoder",
    "ModuleEncoder",
    "ViTConfig",
    "ViTEncoder",
    "build_encoder",
    "default_dtype",
]

HF_PREFIX = "hf:"


def build_encoder(
    name: str,
    *,
    device: torch.device,
    dtype: torch.dtype | None = None,
    weights: Path | None = None,
    compile: bool = False,
) -> Encoder:
    """Build the encoder `name`: a preset of `PRESETS`, or `hf:<local dir>`.

    `dtype` defaults to bfloat16 on CUDA and float32 elsewhere. `weights` (presets only) is a
    local safetensors file; without it the weights are seeded, identical in every process.
    `compile` uses torch.compile on CUDA.
    """
    if name.startswith(HF_PREFIX):
        if weights is not None:
            raise ValueError(
                "hf encoders load their weights from their directory; do not pass weights"
            )
        from app.encoders.hf import HFVisionEncoder

        return HFVisionEncoder(name[len(HF_PREFIX) :], device=device, dtype=dtype, compile=compile)
    if name not in PRESETS:
        raise ValueError(
            f"unknown encoder {name!r}; valid presets: {', '.join(PRESETS)}, "
            f"or {HF_PREFIX}<local directory> for a Hugging Face vision tower"
        )
    return ViTEncoder(name, device=device, dtype=dtype, weights=weights, compile=compile)
