"""Hugging Face vision towers (SigLIP, CLIP, ...) from a local directory or the local Hugging Face
cache (`hf:google/siglip-base-patch16-224`), preprocessed as their own image processor says.

`transformers` is the optional extra `hf`; it is imported only when such an encoder is built.
Nothing is downloaded: every load passes `local_files_only=True`.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from types import ModuleType

import torch

from app.encoders.base import ModuleEncoder, default_dtype, resolve_device
from app.preprocess import CLIP_MEAN, CLIP_STD, ImageSpec, three_numbers

log = logging.getLogger(__name__)

# model_type -> (vision tower class, default mean, default std). A full SigLIP/CLIP checkpoint
# (vision + text) loads its vision tower through the same class. _PROCESSORS: the image
# processor class of a tower-only checkpoint whose preprocessor_config.json names none.
_HALF = (0.5, 0.5, 0.5)
_TOWERS: dict[str, tuple[str, tuple[float, float, float], tuple[float, float, float]]] = {
    "siglip": ("SiglipVisionModel", _HALF, _HALF),
    "siglip_vision_model": ("SiglipVisionModel", _HALF, _HALF),
    "clip": ("CLIPVisionModel", CLIP_MEAN, CLIP_STD),
    "clip_vision_model": ("CLIPVisionModel", CLIP_MEAN, CLIP_STD),
}


_PROCESSORS = {"siglip": "SiglipImageProcessor", "clip": "CLIPImageProcessor"}


NEEDS_HF_EXTRA = (
    "Hugging Face encoders (hf:...) need the optional extra 'hf' (transformers and "
    "huggingface_hub): pip install '.[hf]' in a checkout"
)


def import_transformers() -> ModuleType:
    try:
        return importlib.import_module("transformers")
    except ImportError as e:
        raise ImportError(f"{NEEDS_HF_EXTRA} ({e})") from e


def check_hf_extra() -> None:
    """ValueError (which start-up prints in one line) where the extra is not installed."""
    for module in ("transformers", "huggingface_hub"):
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ValueError(f"{NEEDS_HF_EXTRA} ({e})") from None


def hub_cache() -> str:
    """The Hugging Face hub cache huggingface_hub reads (HF_HUB_CACHE, else HF_HOME/hub)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def resolve_model(ref: str) -> Path:
    """``ref`` as people type it -> a local model directory: a directory path, or a Hugging Face
    repo id (``org/name``, optionally ``@revision``) already in the local cache. Nothing is
    downloaded; a model that is in neither place is a ValueError naming where it looked."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    repo, _, revision = ref.partition("@")
    pathlike = ref.startswith(("/", ".", "~")) or repo.count("/") > 1
    if pathlike or not repo:
        raise ValueError(f"hf encoder: {ref} is not a local model directory; nothing is downloaded")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo, revision=revision or None, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError) as e:
        raise ValueError(
            f"hf encoder: {ref!r} is not a local directory ({path.resolve()}) and not in the "
            f"Hugging Face cache {hub_cache()} (set by HF_HUB_CACHE or HF_HOME): {e}. Nothing is "
            f"downloaded at run time; fetch it first, e.g. `hf download {repo}`"
        ) from None


class HFVisionEncoder(ModuleEncoder):
    """A Hugging Face vision tower; its output is `last_hidden_state`.

    `model` is a local directory or a repo id in the local Hugging Face cache. With a
    `preprocessor_config.json`, `preprocess_spec` is that processor's preprocessing (the engine
    applies it); without one, featpool's default (centre square, bicubic) and the tower type's
    usual mean and std.
    """

    def __init__(
        self,
        model: Path | str,
        *,
        device: torch.device | str,
        dtype: torch.dtype | None = None,
        compile: bool = False,
    ) -> None:
        directory = resolve_model(str(model))
        if not (directory / "config.json").is_file():
            raise ValueError(
                f"hf encoder: {directory} is not a local model directory "
                "(no config.json); nothing is downloaded"
            )
        transformers = import_transformers()
        self.device = resolve_device(device)
        if self.device.type == "meta":
            raise ValueError("hf encoders cannot be built on the meta device")
        self.dtype = dtype if dtype is not None else default_dtype(self.device)
        self.name = f"hf:{model}"

        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
        model_type = str(config.model_type)
        vision_config = getattr(config, "vision_config", None) or config
        if model_type in _TOWERS:
            cls_name, mean, std = _TOWERS[model_type]
            tower = getattr(transformers, cls_name).from_pretrained(
                directory, local_files_only=True
            )
        else:
            mean, std = _HALF, _HALF
            tower = transformers.AutoModel.from_pretrained(directory, local_files_only=True)
            tower = getattr(tower, "vision_model", tower)
            log.warning(
                "hf encoder %s: model type %r is not a known vision tower; using "
                "AutoModel and its last_hidden_state",
                directory,
                model_type,
            )

        # The position embeddings fix the model's input size.
        size = getattr(vision_config, "image_size", None)
        if isinstance(size, (list, tuple)):
            size = size[0] if size[0] == size[-1] else None
        spec = ImageSpec.from_pretrained(
            directory, fallback=_PROCESSORS.get(model_type.removesuffix("_vision_model"))
        )
        if spec is not None:
            out = spec.fixed_size()
            if out is None or out[0] != out[1]:
                raise ValueError(
                    f"hf encoder {model}: {spec.source} gives images of size "
                    f"{'that follows the input' if out is None else f'{out[0]}x{out[1]}'}; "
                    "featpool serves fixed-size square towers"
                )
            if size is not None and out[0] != size:
                raise ValueError(
                    f"hf encoder {model}: {spec.source} gives {out[0]}x{out[1]} images but the "
                    f"model takes {size}x{size} (config.json image_size)"
                )
            size = out[0]
            mean = three_numbers(spec.mean or 0.0, "image_mean")
            std = three_numbers(spec.std or 1.0, "image_std")
            log.info(
                "hf encoder %s: preprocessing from %s: %s", model, spec.source, spec.describe()
            )
        else:
            log.info(
                "hf encoder %s: no preprocessor_config.json; featpool's default preprocessing "
                "(centre square, bicubic, mean %s, std %s)",
                model,
                mean,
                std,
            )
        if not isinstance(size, int):
            raise ValueError(
                f"hf encoder {model}: cannot tell the square input size from "
                "config.json or preprocessor_config.json"
            )
        self.preprocess_spec = spec
        self.mean = three_numbers(mean, "image_mean")
        self.std = three_numbers(std, "image_std")
        self.image_size = size

        tower.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        self.module = tower
        self._forward = self._last_hidden_state
        # One probe forward tells the token count of any tower (CLS or not, pooling or not).
        with torch.inference_mode():
            probe = self._forward(
                torch.zeros(1, 3, size, size, device=self.device, dtype=self.dtype)
            )
        if probe.dim() != 3:
            raise ValueError(
                f"hf encoder {model}: last_hidden_state has shape "
                f"{list(probe.shape)}, expected [B, tokens, dim]"
            )
        self.output_shape = (int(probe.shape[1]), int(probe.shape[2]))
        self._maybe_compile(compile)

    def _last_hidden_state(self, pixels: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.module(pixel_values=pixels).last_hidden_state
        return out
