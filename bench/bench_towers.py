"""Real-size vision towers: featpool's path against transformers' own processor + tower.

For each tower (Qwen2.5-VL-7B's vision tower, SigLIP-So400m/384; real config dimensions,
seeded weights), a checkpoint directory is saved by transformers, then:
  - featpool loads it as ``--encoder hf:<dir>`` does (load time, GPU memory) and encodes
    JPEG bytes through its engine (GPU decode, pre-processing, tower, publish into the pool);
  - transformers: PIL decode, ``AutoImageProcessor`` (its default device: the CPU) and the
    model's own vision path, once with the processor on the CPU and once with
    ``device="cuda"`` (torchvision backend);
same images (real photos from scikit-image upscaled to ~1024 px), same dtype (bf16), same
GPU. Outputs are compared (cosine per image) and the time is split into pre-processing and
tower for both.

    python bench/bench_towers.py --out towers.json [--images 48] [--batch 8]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import io
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps

# Qwen2.5-VL-7B-Instruct's vision_config and preprocessor_config (the published checkpoint's)
QWEN25_7B_VISION = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    out_hidden_size=3584,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
    hidden_act="silu",
    in_chans=3,
    tokens_per_second=2,
)
QWEN25_PRE = dict(min_pixels=3136, max_pixels=12845056)
# google/siglip-so400m-patch14-384's vision_config
SIGLIP_SO400M = dict(
    hidden_size=1152,
    intermediate_size=4304,
    num_hidden_layers=27,
    num_attention_heads=16,
    patch_size=14,
    image_size=384,
)
TINY_TEXT = dict(
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


def photos(count: int, long_side: int, square: bool) -> list[bytes]:
    """Real photos (scikit-image) upscaled to ``long_side`` (bicubic), as JPEG (quality 90)."""
    from skimage import data

    sources = [
        data.astronaut(),
        data.coffee(),
        data.chelsea(),
        data.rocket(),
        data.camera(),
        data.immunohistochemistry(),
        data.hubble_deep_field(),
        data.colorwheel(),
    ]
    out = []
    for i in range(count):
        im = Image.fromarray(sources[i % len(sources)]).convert("RGB")
        if square:  # the centred square: a fixed-size model's processor then only resizes
            side = min(im.size)
            left, top = (im.width - side) // 2, (im.height - side) // 2
            im = im.crop((left, top, left + side, top + side))
        scale = long_side / max(im.size)
        im = im.resize(
            (round(im.width * scale), round(im.height * scale)), Image.Resampling.BICUBIC
        )
        if i >= len(sources):  # vary the pixels: a mirror image per round
            im = ImageOps.mirror(im) if (i // len(sources)) % 2 else ImageOps.flip(im)
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def build_checkpoint(kind: str, directory: Path) -> Path:
    """Seeded weights at the real dimensions, saved by transformers (bf16 safetensors)."""
    import transformers as tf

    torch.manual_seed(0)
    with torch.device("cuda"):
        if kind == "qwen2_5_vl":
            cfg = tf.Qwen2_5_VLConfig(text_config=TINY_TEXT, vision_config=QWEN25_7B_VISION)
            model = tf.Qwen2_5_VLForConditionalGeneration._from_config(cfg, dtype=torch.bfloat16)
            pre = tf.Qwen2VLImageProcessor(**QWEN25_PRE)
        else:
            cfg = tf.SiglipVisionConfig(**SIGLIP_SO400M)
            model = tf.SiglipVisionModel._from_config(cfg, dtype=torch.bfloat16)
            pre = tf.SiglipImageProcessor(size={"height": 384, "width": 384})
    model.save_pretrained(directory)
    pre.save_pretrained(directory)
    del model
    torch.cuda.empty_cache()
    return directory


def transformers_path(kind: str, directory: Path) -> tuple[Any, Callable[..., list[torch.Tensor]]]:
    """transformers' processor and a function: PIL images -> per-image features (bf16)."""
    import transformers as tf

    processor = tf.AutoImageProcessor.from_pretrained(directory, local_files_only=True)
    if kind == "qwen2_5_vl":
        model = tf.AutoModelForImageTextToText.from_pretrained(
            directory, local_files_only=True, dtype=torch.bfloat16
        )
        tower = model.model.visual.cuda().eval()

        def forward(batch: Any) -> list[torch.Tensor]:
            grid = batch["image_grid_thw"].cuda()
            out = tower(batch["pixel_values"].cuda(non_blocking=True), grid_thw=grid)
            merged = out if isinstance(out, torch.Tensor) else out.pooler_output
            return list(merged.split((grid.prod(-1) // 4).tolist()))
    else:
        tower = (
            tf.SiglipVisionModel.from_pretrained(
                directory, local_files_only=True, dtype=torch.bfloat16
            )
            .cuda()
            .eval()
        )

        def forward(batch: Any) -> list[torch.Tensor]:
            px = batch["pixel_values"].cuda(non_blocking=True).to(torch.bfloat16)
            return list(tower(pixel_values=px).last_hidden_state)

    return processor, forward


def pil(data: bytes) -> Image.Image:
    # as transformers.image_utils.load_image: decode, EXIF orientation, RGB
    return ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")


def run_transformers(
    kind: str,
    directory: Path,
    images: list[bytes],
    batch: int,
    *,
    device: str | None,
) -> dict[str, Any]:
    processor, forward = transformers_path(kind, directory)
    kw = {"device": device} if device else {}
    chunks = [images[i : i + batch] for i in range(0, len(images), batch)]
    first: list[torch.Tensor] = []
    pre_s = tower_s = 0.0
    with torch.inference_mode():
        forward(processor(images=[pil(b) for b in chunks[0]], return_tensors="pt", **kw))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for n, chunk in enumerate(chunks):
            a = time.perf_counter()
            inputs = processor(images=[pil(b) for b in chunk], return_tensors="pt", **kw)
            b = time.perf_counter()
            out = forward(inputs)
            torch.cuda.synchronize()
            pre_s += b - a
            tower_s += time.perf_counter() - b
            if n == 0:
                first = [o.float().cpu() for o in out]
        total = time.perf_counter() - t0
    return {
        "images_per_s": len(images) / total,
        "preprocess_s_per_image": pre_s / len(images),
        "tower_s_per_image": tower_s / len(images),
        "first": first,
    }


async def run_featpool(
    directory: Path, images: list[bytes], batch: int, depth: int, tmp: Path
) -> dict[str, Any]:
    from app.engine import Engine
    from app.engine_client import ImageIn
    from app.metrics import Metrics
    from app.settings import Settings

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    mem0 = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    settings = Settings(
        device="cuda",
        encoder=f"hf:{directory}",
        socket_path=tmp / "featpool.sock",
        pool_bytes=2048 << 20,
        slab_bytes=512 << 20,
        max_batch_size=batch,
        max_batch_wait_ms=1.0,
        gpu_decode="on",
        max_images_per_request=batch,
    )
    engine = Engine(settings, Metrics())
    await engine.start()
    start_s = time.perf_counter() - t0
    assert engine.encoder is not None
    enc: Any = engine.encoder
    load = {
        "engine_start_s": start_s,
        "tower_compiled": getattr(enc, "compiled", None),
        "encoder_load_s": getattr(enc, "load_s", None),
        "weights_bytes": getattr(enc, "load_bytes", None)
        or sum(p.numel() * p.element_size() for p in enc.module.parameters()),
        "gpu_memory_after_start_bytes": torch.cuda.memory_allocated() - mem0,
        "gpu_memory_peak_start_bytes": torch.cuda.max_memory_allocated() - mem0,
        "attention": getattr(enc, "attention", "sdpa"),
        "patch_embed_as_gemm": getattr(enc, "patch_gemm", None),
    }
    chunks = [images[i : i + batch] for i in range(0, len(images), batch)]
    first: list[torch.Tensor] = []

    async def one(chunk: list[bytes], keep: bool) -> None:
        leases = await engine.encode([ImageIn(f"img{i}", b) for i, b in enumerate(chunk)], 60.0)
        assert engine.pool is not None
        if keep:
            torch.cuda.synchronize()
            first.extend(engine.pool.read(lease.id).float() for lease in leases)
        for lease in leases:
            engine.release_quietly(lease.id)

    try:
        await one(chunks[0], keep=True)  # warm-up, and the outputs to compare
        torch.cuda.synchronize()
        sem = asyncio.Semaphore(depth)

        async def bounded(chunk: list[bytes]) -> None:
            async with sem:
                await one(chunk, keep=False)

        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        await asyncio.gather(*(bounded(c) for c in chunks))
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() - mem0
        tower_s = (
            _featpool_tower_time(enc, images[:batch]) if hasattr(enc, "encode_images") else None
        )
    finally:
        await engine.stop()
    return {
        "images_per_s": len(images) / total,
        "gpu_memory_peak_serving_bytes": peak,
        "tower_s_per_image": tower_s,
        "first": first,
        **load,
    }


def _featpool_tower_time(enc: Any, images: list[bytes], reps: int = 3) -> float:
    """The dynamic tower alone (images already decoded on the GPU), seconds per image."""
    from torchvision.io import decode_jpeg

    ims = [
        decode_jpeg(torch.frombuffer(bytearray(b), dtype=torch.uint8), device="cuda")
        for b in images
    ]
    enc.encode_images(ims)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        enc.encode_images(ims)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (reps * len(ims))


def cosines(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[float]:
    return [
        float(torch.nn.functional.cosine_similarity(x.flatten(), y.flatten(), dim=0))
        for x, y in zip(a, b, strict=True)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--images", type=int, default=48)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--depth", type=int, default=2, help="featpool requests in flight")
    ap.add_argument("--size", type=int, default=1024, help="long side of the photos")
    ap.add_argument("--towers", default="qwen2_5_vl,siglip")
    args = ap.parse_args()
    results: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    import transformers

    results["transformers"] = transformers.__version__
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        for kind in args.towers.split(","):
            t0 = time.perf_counter()
            directory = build_checkpoint(kind, tmp / kind)
            build_s = time.perf_counter() - t0
            images = photos(args.images, args.size, square=kind == "siglip")
            fp = asyncio.run(run_featpool(directory, images, args.batch, args.depth, tmp))
            rows: dict[str, Any] = {"checkpoint_build_s": build_s, "featpool": fp}
            baselines = [
                ("transformers_cpu_processor", None),
                ("transformers_cuda_processor", "cuda"),
            ]
            for label, device in baselines:
                try:
                    rows[label] = run_transformers(
                        kind, directory, images, args.batch, device=device
                    )
                except Exception as e:  # e.g. a processor without a device argument
                    rows[label] = {"error": repr(e)}
                    continue
                cos = cosines(fp["first"], rows[label]["first"])
                rows[label]["cosine_min_vs_featpool"] = min(cos)
                rows[label]["cosine_mean_vs_featpool"] = statistics.mean(cos)
                rows[label]["featpool_speedup"] = fp["images_per_s"] / rows[label]["images_per_s"]
            for r in rows.values():
                if isinstance(r, dict):
                    r.pop("first", None)
            results[kind] = rows
            print(json.dumps({kind: rows}, indent=1), flush=True)
            gc.collect()
            torch.cuda.empty_cache()
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
