"""A ViT image encoder in plain torch, with presets of real model shapes.

Weights are seeded (every process builds the same ones) or loaded from a local safetensors file.
The presets reproduce the shapes and the compute of the models they are named after, not their
exact architectures: all use learned absolute position embeddings and full attention (Qwen2.5-VL
uses 2D RoPE and windowed attention in most layers, so this tower does somewhat more work).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import safetensors.torch
import torch
import torch.nn.functional as nnf
from torch import nn

from app.encoders.base import ModuleEncoder, default_dtype, resolve_device

SEED = 20261202
INIT_STD = 0.02
LN_EPS = 1e-6
# ImageNet statistics, as ViT-B/16 (timm/torchvision) and CLIP-like towers are commonly trained.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)

Activation = Literal["gelu", "gelu_tanh", "swiglu"]


@dataclass(frozen=True)
class ViTConfig:
    patch_size: int
    image_size: int
    dim: int
    depth: int
    heads: int
    mlp_dim: int
    cls_token: bool = False
    act: Activation = "gelu"
    # 2x2 patch merging to this width (Qwen2-VL style); None keeps one token per patch.
    merge_dim: int | None = None
    mean: tuple[float, float, float] = HALF
    std: tuple[float, float, float] = HALF

    def __post_init__(self) -> None:
        if self.image_size < self.patch_size:
            raise ValueError("image_size must be at least patch_size")
        if self.dim % self.heads:
            raise ValueError("dim must be a multiple of heads")
        if self.merge_dim is not None and (self.cls_token or self.grid % 2):
            raise ValueError("2x2 merging needs an even patch grid and no CLS token")

    @property
    def grid(self) -> int:
        # Like SigLIP at 384/14, pixels past the last whole patch are dropped by the conv.
        return self.image_size // self.patch_size

    @property
    def num_tokens(self) -> int:
        """Tokens inside the transformer (patches, plus CLS)."""
        return self.grid**2 + int(self.cls_token)

    @property
    def output_shape(self) -> tuple[int, int]:
        if self.merge_dim is not None:
            return (self.grid // 2) ** 2, self.merge_dim
        return self.num_tokens, self.dim


PRESETS: dict[str, ViTConfig] = {
    "vit-b16-224": ViTConfig(
        patch_size=16,
        image_size=224,
        dim=768,
        depth=12,
        heads=12,
        mlp_dim=3072,
        cls_token=True,
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
    ),
    "siglip-so400m-384": ViTConfig(
        patch_size=14, image_size=384, dim=1152, depth=27, heads=16, mlp_dim=4304, act="gelu_tanh"
    ),
    "qwen25vl-1036": ViTConfig(
        patch_size=14,
        image_size=1036,
        dim=1280,
        depth=32,
        heads=16,
        mlp_dim=3420,
        act="swiglu",
        merge_dim=3584,
        mean=CLIP_MEAN,
        std=CLIP_STD,
    ),
    "tiny-test": ViTConfig(
        patch_size=8, image_size=32, dim=64, depth=2, heads=4, mlp_dim=128, cls_token=True
    ),
}


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = nnf.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        proj: torch.Tensor = self.proj(out.transpose(1, 2).reshape(b, n, d))
        return proj


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, act: Activation) -> None:
        super().__init__()
        self.act = act
        self.fc1 = nn.Linear(dim, 2 * hidden if act == "swiglu" else hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.act == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = nnf.silu(gate) * up
        else:
            h = nnf.gelu(h, approximate="tanh" if self.act == "gelu_tanh" else "none")
        out: torch.Tensor = self.fc2(h)
        return out


class Block(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim, eps=LN_EPS)
        self.attn = Attention(cfg.dim, cfg.heads)
        self.norm2 = nn.LayerNorm(cfg.dim, eps=LN_EPS)
        self.mlp = Mlp(cfg.dim, cfg.mlp_dim, cfg.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class PatchMerger(nn.Module):
    """Qwen2-VL style: concatenate each 2x2 group of neighbouring patches, then an MLP."""

    def __init__(self, dim: int, grid: int, out_dim: int) -> None:
        super().__init__()
        self.grid = grid
        self.fc1 = nn.Linear(4 * dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, d = x.shape
        g = self.grid // 2
        # Row-major patch tokens [B, (2g)*(2g), D] -> [B, g*g, 4D], each row one 2x2 window.
        x = x.view(b, g, 2, g, 2, d).permute(0, 1, 3, 2, 4, 5).reshape(b, g * g, 4 * d)
        out: torch.Tensor = self.fc2(nnf.gelu(self.fc1(x)))
        return out


class VisionTransformer(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Conv2d(3, cfg.dim, cfg.patch_size, stride=cfg.patch_size)
        self.cls_token = nn.Parameter(torch.empty(1, 1, cfg.dim)) if cfg.cls_token else None
        self.pos_embed = nn.Parameter(torch.empty(1, cfg.num_tokens, cfg.dim))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.dim, eps=LN_EPS)
        self.merger = (
            PatchMerger(cfg.dim, cfg.grid, cfg.merge_dim) if cfg.merge_dim is not None else None
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(pixels).flatten(2).transpose(1, 2)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos_embed
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.norm(x)
        return self.merger(out) if self.merger is not None else out


def _seeded_init_(model: nn.Module, seed: int) -> None:
    """Fill every tensor from a generator seeded by (seed, tensor name).

    Tensors are drawn on the CPU in float32 one at a time, so the result does not depend on the
    device, the dtype or the order of construction, and peak host memory is one tensor.
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name and leaf == "weight":
                p.fill_(1.0)
            elif leaf == "bias":
                p.zero_()
            else:
                gen = torch.Generator().manual_seed(seed ^ zlib.crc32(name.encode()))
                # Clamped normal: as trunc_normal_ in effect, several times faster on big towers.
                t = torch.empty(p.shape, dtype=torch.float32).normal_(generator=gen)
                p.copy_(t.clamp_(-2.0, 2.0).mul_(INIT_STD))


def _load_state(path: Path, model: nn.Module, preset: str) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ValueError(f"encoder weights {path}: no such file")
    state: dict[str, torch.Tensor] = safetensors.torch.load_file(str(path), device="cpu")
    expected = model.state_dict()
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(
            f"encoder weights {path} do not match preset {preset}: "
            f"missing keys {_preview(missing)}, unexpected keys {_preview(unexpected)}"
        )
    wrong = [
        f"{k} {list(state[k].shape)} != {list(v.shape)}"
        for k, v in expected.items()
        if state[k].shape != v.shape
    ]
    if wrong:
        raise ValueError(
            f"encoder weights {path} do not match preset {preset}: wrong shapes {_preview(wrong)}"
        )
    return state


def _preview(items: list[str], limit: int = 8) -> str:
    more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return "[" + ", ".join(items[:limit]) + "]" + more


class ViTEncoder(ModuleEncoder):
    """A preset ViT behind the `Encoder` protocol."""

    module: VisionTransformer

    def __init__(
        self,
        preset: str,
        *,
        device: torch.device | str,
        dtype: torch.dtype | None = None,
        weights: Path | None = None,
        compile: bool = False,
        seed: int = SEED,
    ) -> None:
        if preset not in PRESETS:
            raise ValueError(
                f"unknown encoder preset {preset!r}; valid presets: {', '.join(PRESETS)}"
            )
        cfg = PRESETS[preset]
        self.name = preset
        self.config = cfg
        self.image_size = cfg.image_size
        self.mean = cfg.mean
        self.std = cfg.std
        self.output_shape = cfg.output_shape
        self.device = resolve_device(device)
        self.dtype = dtype if dtype is not None else default_dtype(self.device)
        if not self.dtype.is_floating_point:
            raise ValueError(f"encoder dtype must be a float type, got {self.dtype}")

        # Built on meta first: nothing is allocated until the real weights are known.
        with torch.device("meta"):
            model = VisionTransformer(cfg)
        if weights is not None:
            state = _load_state(Path(weights), model, preset)
            model.load_state_dict(state, strict=True, assign=True)
            model.to(device=self.device, dtype=self.dtype)
        elif self.device.type == "meta":
            model.to(dtype=self.dtype)
        else:
            model.to(dtype=self.dtype).to_empty(device=self.device)
            _seeded_init_(model, seed)
        model.eval().requires_grad_(False)
        self.module = model
        self._forward = model
        self._maybe_compile(compile)

    def save_weights(self, path: Path | str) -> None:
        """Write the weights as safetensors, in the encoder's dtype."""
        if self.device.type == "meta":
            raise ValueError("an encoder built on the meta device has no weights to save")
        state = {k: v.detach().contiguous().cpu() for k, v in self.module.state_dict().items()}
        safetensors.torch.save_file(state, str(path), metadata={"featpool_preset": self.name})
