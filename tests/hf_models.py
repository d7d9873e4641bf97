"""Tiny random-weight Hugging Face checkpoints saved by transformers itself, real photos from
scikit-image's package data written as the files users send, and the reference features
(transformers' own image processor + vision tower) that featpool's leases must equal."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from safetensors.torch import load

EXIF_ORIENTATION = 0x0112

# What changes the result: the resize rule and the filter. Weights and sizes small enough for
# the CPU, with real patch grids (224 px, 16 px patches: 196 tokens).
TOWER = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": 224,
    "patch_size": 16,
}


@dataclass(frozen=True)
class Checkpoint:
    kind: str  # siglip | clip
    rule: str  # exact | shortest_edge
    resample: int  # PIL enum: 2 bilinear, 3 bicubic

    @property
    def id(self) -> str:
        return f"{self.kind}-{self.rule}-{ {2: 'bilinear', 3: 'bicubic'}[self.resample] }"


CHECKPOINTS = [
    Checkpoint("siglip", "exact", 3),
    Checkpoint("siglip", "exact", 2),
    Checkpoint("clip", "shortest_edge", 3),
    Checkpoint("clip", "shortest_edge", 2),
]


def save_checkpoint(ck: Checkpoint, directory: Path, seed: int = 0) -> Path:
    """``save_pretrained`` of a random tower and its image processor into ``directory``."""
    transformers = pytest.importorskip(
        "transformers", reason="optional extra 'hf' (transformers) is not installed"
    )
    torch.manual_seed(seed)
    if ck.kind == "siglip":
        model = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**TOWER))
        proc_cls = transformers.SiglipImageProcessor
    else:
        model = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**TOWER))
        proc_cls = transformers.CLIPImageProcessor
    kwargs: dict[str, Any] = {"resample": ck.resample}
    if ck.rule == "exact":
        kwargs["size"] = {"height": 224, "width": 224}
    else:  # CLIP's rule with a short side larger than the crop, as DINOv2's 256 -> 224
        kwargs["size"] = {"shortest_edge": 256 if ck.resample == 2 else 224}
        kwargs["crop_size"] = {"height": 224, "width": 224}
        kwargs["do_center_crop"] = True
    model.eval().save_pretrained(directory)
    proc_cls(**kwargs).save_pretrained(directory)
    return directory


# ---- real photos, as files ---------------------------------------------------------------------


def _skimage_file(name: str) -> bytes:
    skimage_data = pytest.importorskip("skimage.data")
    return (Path(skimage_data.__file__).parent / name).read_bytes()


def _jpeg(im: Image.Image, orientation: int = 1, quality: int = 92) -> bytes:
    exif = Image.Exif()
    if orientation != 1:
        exif[EXIF_ORIENTATION] = orientation
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=quality, exif=exif.tobytes())
    return buf.getvalue()


def photos() -> dict[str, bytes]:
    """Files users send: the package's own files where they have the shape wanted, else a
    JPEG written by Pillow from one of its photos."""
    coffee = Image.open(io.BytesIO(_skimage_file("coffee.png"))).convert("RGB")  # 600x400
    chelsea = Image.open(io.BytesIO(_skimage_file("chelsea.png"))).convert("RGB")  # 451x300
    motorcycle = Image.open(io.BytesIO(_skimage_file("motorcycle_left.png"))).convert("RGB")
    return {
        "landscape.jpg": _skimage_file("rocket.jpg"),  # 640x427 JPEG
        "large.jpg": _skimage_file("hubble_deep_field.jpg"),  # 1000x872 JPEG
        "landscape.png": _skimage_file("coffee.png"),  # 600x400
        "portrait-gray.png": _skimage_file("cell.png"),  # 550x660 grayscale
        "gray.png": _skimage_file("camera.png"),  # 512x512 grayscale
        "rgba.png": _skimage_file("logo.png"),  # 500x500 RGBA
        "tiny.jpg": _jpeg(chelsea.resize((45, 30), Image.Resampling.LANCZOS)),
        "very-wide.jpg": _jpeg(motorcycle.crop((0, 220, 741, 280))),  # 741x60
        # Stored landscape, tagged "rotate 90 clockwise" (6) / "anticlockwise" (8): upright
        # they are portrait.
        "exif6.jpg": _jpeg(coffee, orientation=6),
        "exif8.jpg": _jpeg(coffee.transpose(Image.Transpose.ROTATE_90), orientation=8),
    }


def upright(data: bytes) -> Image.Image:
    """The image transformers' own loader gives its processor for this file
    (``transformers.image_utils.load_image`` applies the EXIF orientation)."""
    return ImageOps.exif_transpose(Image.open(io.BytesIO(data)))


def reference(
    directory: Path,
    images: list[Image.Image],
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """transformers' processor (AutoImageProcessor: torchvision backend where torchvision is
    installed, else PIL) and vision tower: ``[N, tokens, dim]`` float32 on the CPU."""
    import transformers

    proc = transformers.AutoImageProcessor.from_pretrained(directory, local_files_only=True)
    cls = (
        transformers.SiglipVisionModel
        if json.loads((directory / "config.json").read_text())["model_type"].startswith("siglip")
        else transformers.CLIPVisionModel
    )
    model = cls.from_pretrained(directory, local_files_only=True).to(device, dtype).eval()
    kwargs = {"device": device} if getattr(proc, "backend", "") == "torchvision" else {}
    pixels = proc(images=images, return_tensors="pt", **kwargs)["pixel_values"]
    with torch.no_grad():
        out = model(pixel_values=pixels.to(device, dtype)).last_hidden_state
    return out.float().cpu()


def lease_tensors(client: Any, base: str, items: list[dict[str, Any]]) -> list[torch.Tensor]:
    """Each lease's features through GET /v1/leases/{id}/tensor (safetensors bytes)."""
    out = []
    for item in items:
        r = client.get(f"{base}/v1/leases/{item['lease_id']}/tensor")
        assert r.status_code == 200, r.text
        out.append(next(iter(load(r.content).values())).float())
    return out


def encode_all(url: str, files: dict[str, bytes]) -> list[torch.Tensor]:
    """POST every file in one request; each lease's features, in order."""
    import httpx

    with httpx.Client(timeout=120) as c:
        r = c.post(
            f"{url}/v1/encode",
            files=[
                ("image", (n, data, "image/jpeg" if n.endswith(".jpg") else "image/png"))
                for n, data in files.items()
            ],
        )
        assert r.status_code == 200, r.text
        items = r.json()["items"]
        assert len(items) == len(files)
        return lease_tensors(c, url, items)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


def save_to_hub_cache(ck: Checkpoint, cache: Path, repo_id: str, tmp: Path) -> Path:
    """The checkpoint as ``hf download`` leaves it in the hub cache: ``models--org--name`` with
    content-addressed ``blobs/``, ``snapshots/<commit>/`` of symlinks and ``refs/main``."""
    import hashlib

    from huggingface_hub.file_download import repo_folder_name

    saved = save_checkpoint(ck, tmp)
    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    commit = hashlib.sha1(repo_id.encode()).hexdigest()  # a commit hash is 40 hex digits
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(saved.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(Path("../..") / "blobs" / blob.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def translucent_png() -> bytes:
    """A real photo with real transparency: the astronaut, its alpha the camera photo."""
    rgb = Image.open(io.BytesIO(_skimage_file("astronaut.png"))).convert("RGB")
    alpha = Image.open(io.BytesIO(_skimage_file("camera.png"))).convert("L")
    rgb.putalpha(alpha)
    buf = io.BytesIO()
    rgb.save(buf, "PNG")
    return buf.getvalue()


def transformers_composites_alpha() -> bool:
    """transformers >= 5.2x composites transparency onto white in ``convert_to_rgb``, as
    featpool does; earlier versions dropped the alpha channel."""
    from transformers.image_transforms import convert_to_rgb

    out = np.asarray(convert_to_rgb(Image.new("RGBA", (1, 1), (0, 0, 0, 0))))
    return bool(out.reshape(-1)[0] == 255)
