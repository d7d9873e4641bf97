"""Shared by the Qwen2-VL tests (CPU and GPU): tiny random-weight checkpoints saved by
transformers itself, real photos from ``skimage.data`` in the shapes users send, and the
reference features from transformers' own processor and model on the same files."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from tests.hf_models import upright

MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 64  # small, so that large photos take the max_pixels branch

_TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    bos_token_id=0,
    eos_token_id=1,
    rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
)


def build_checkpoint(kind: str, directory: Path, **vision: Any) -> Path:
    """A full ``*ForConditionalGeneration`` (tiny text model) and its image processor, saved
    with ``save_pretrained`` as a user's checkpoint directory is."""
    import transformers as tf

    torch.manual_seed(0)
    if kind == "qwen2_5_vl":
        vc: dict[str, Any] = dict(
            depth=4,
            hidden_size=64,
            intermediate_size=128,
            num_heads=4,
            out_hidden_size=96,
            window_size=56,  # 2x2 merged units per window: several windows per image
            fullatt_block_indexes=[1, 3],
        )
        vc.update(vision)
        model = tf.Qwen2_5_VLForConditionalGeneration(
            tf.Qwen2_5_VLConfig(text_config=_TEXT, vision_config=vc)
        )
    else:
        vc = dict(depth=3, embed_dim=64, hidden_size=96, num_heads=4, mlp_ratio=2)
        vc.update(vision)
        model = tf.Qwen2VLForConditionalGeneration(
            tf.Qwen2VLConfig(text_config=_TEXT, vision_config=vc)
        )
    model.save_pretrained(directory)
    processor_cls = getattr(tf, "Qwen2VLImageProcessor")  # noqa: B009
    try:
        processor = processor_cls(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    except ImportError:  # torchvision missing: its PIL backend writes the same config
        processor = tf.Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    processor.save_pretrained(directory)
    return directory


def _jpeg(arr: np.ndarray, **kw: Any) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=92, **kw)
    return buf.getvalue()


def _png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def photos() -> dict[str, bytes]:
    """Real photos (scikit-image's data set) as the files users upload."""
    from skimage import data

    chelsea = data.chelsea()  # 300x451 RGB
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated: shown upright after a 90 degree clockwise turn
    return {
        "landscape.jpg": _jpeg(data.coffee()),  # 600x400
        "portrait.jpg": _jpeg(data.astronaut()[:, 96:416]),  # 320x512
        "tiny.jpg": _jpeg(np.asarray(Image.fromarray(chelsea).resize((24, 18)))),
        "very_wide.jpg": _jpeg(data.rocket()[200:260]),  # 640x60
        "grayscale.png": _png(Image.fromarray(data.camera())),
        "rgba.png": _png(Image.fromarray(data.logo())),  # 500x500 RGBA
        "exif_rotated.jpg": _jpeg(np.rot90(chelsea, 1).copy(), exif=exif),
    }


def reference(
    directory: Path, files: list[bytes], *, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """transformers' processor + the model's own vision path: per image the merged features
    ``[tokens, out_hidden_size]`` (float32, CPU) and ``grid_thw``."""
    import transformers as tf

    processor = tf.AutoImageProcessor.from_pretrained(directory, local_files_only=True)
    model = tf.AutoModelForImageTextToText.from_pretrained(
        directory, local_files_only=True, dtype=dtype
    )
    model.to(device).eval()
    batch = processor(images=[upright(f) for f in files], return_tensors="pt")
    grid = batch["image_grid_thw"].to(device)
    with torch.no_grad():
        out = model.get_image_features(
            pixel_values=batch["pixel_values"].to(device), image_grid_thw=grid
        )
    feats = getattr(out, "pooler_output", out)
    return [f.float().cpu() for f in feats], grid.tolist()
