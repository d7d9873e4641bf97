"""Pluggable image encoders behind one Protocol.

`build_encoder("vit-b16-224", device=...)` builds a preset ViT (seeded, or from a local
safetensors file); `build_encoder("hf:/models/siglip", device=...)` or
`build_encoder("hf:google/siglip-base-patch16-224", device=...)` loads a Hugging Face vision tower
from a local directory or the local Hugging Face cache (optional extra `hf`).
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
    "check_encoder_name",
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
    """Build the encoder `name`: a preset of `PRESETS`, or `hf:<local dir or cached repo id>`.

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
        raise _unknown(name)
    return ViTEncoder(name, device=device, dtype=dtype, weights=weights, compile=compile)


def check_encoder_name(name: str) -> None:
    """Fail fast, before anything starts, on a name that cannot be built: an unknown preset, or
    an hf: model that is neither a local directory nor in the local Hugging Face cache."""
    if name.startswith(HF_PREFIX):
        from app.encoders.hf import resolve_model

        resolve_model(name[len(HF_PREFIX) :])
    elif name not in PRESETS:
        raise _unknown(name)


def _unknown(name: str) -> ValueError:
    return ValueError(
        f"unknown encoder {name!r}; valid presets: {', '.join(PRESETS)}, "
        f"or {HF_PREFIX}<local directory or org/name in the Hugging Face cache> for a "
        "Hugging Face vision tower"
    )
