"""On the GPU: Hugging Face towers served through the HTTP API in bfloat16, JPEGs decoded by
nvJPEG and preprocessed on the device, equal transformers' own processor (its torchvision
backend, on the GPU) + vision tower in bfloat16 on the same files: cosine >= 0.99."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.helpers import live_server, small_settings
from tests.hf_models import (
    CHECKPOINTS,
    Checkpoint,
    cosine,
    encode_all,
    photos,
    reference,
    save_checkpoint,
    transformers_composites_alpha,
    translucent_png,
    upright,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA"),
]


@pytest.mark.parametrize("ck", CHECKPOINTS, ids=lambda c: c.id)
def test_leases_equal_transformers_bf16_on_cuda(tmp_path: Path, ck: Checkpoint) -> None:
    import transformers

    files = photos()
    if transformers_composites_alpha():
        files["translucent.png"] = translucent_png()
    model = save_checkpoint(ck, tmp_path / "model")
    settings = small_settings(
        tmp_path,
        device="cuda",
        encoder=f"hf:{model}",
        gpu_decode="on",  # the JPEGs are decoded by nvJPEG, preprocessed on the GPU
        pool_bytes=64 << 20,
        max_batch_size=16,
    )
    with live_server(settings) as live:
        got = encode_all(live.url, files)
    proc = transformers.AutoImageProcessor.from_pretrained(model, local_files_only=True)
    want = reference(
        model, [upright(d) for d in files.values()], device="cuda", dtype=torch.bfloat16
    )
    cos = {n: round(cosine(g, w), 5) for n, g, w in zip(files, got, want, strict=True)}
    line = {"checkpoint": ck.id, "processor": type(proc).__name__, "cosine": cos}
    print(json.dumps(line))
    out = os.environ.get("OUT")
    if out:
        with open(Path(out) / "hf_preprocess_gpu.jsonl", "a") as f:
            f.write(json.dumps({**line, "transformers": transformers.__version__}) + "\n")
    assert all(c >= 0.99 for c in cos.values()), cos
