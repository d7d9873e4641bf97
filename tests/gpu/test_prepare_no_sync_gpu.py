"""On the GPU: preparing a batch of photos of several shapes does not wait for the device.

Images of one shape are resized together and scattered into their rows; the row indices go
to the device without a blocking copy from the host, which synchronises the stream: the thread
preparing batch N+1 would wait there for kernels that share the GPU with batch N's forward
(the normalisation constants are made once, by the first call, and reused). torch's sync debug
mode makes every synchronising call an error, so each test fails with
``torch.tensor(..., device=...)`` in those places."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from app.gpu_decode import preprocess
from app.preprocess import BICUBIC, ImageSpec
from tests.hf_models import photos, upright
from tests.test_imaging import scripted_preprocess

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA"),
]


@contextmanager
def no_sync() -> Iterator[None]:
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def mixed_shapes() -> list[torch.Tensor]:
    """Files that ship in scikit-image, of five shapes (landscape, portrait, square), as
    ``[3, H, W]`` uint8 on CUDA."""
    out = []
    for name in ("landscape.jpg", "large.jpg", "landscape.png", "portrait-gray.png", "gray.png"):
        rgb = upright(photos()[name]).convert("RGB")
        out.append(torch.from_numpy(np.asarray(rgb)).permute(2, 0, 1).cuda())
    assert len({tuple(x.shape) for x in out}) == len(out)
    return out


def test_the_sync_debug_mode_catches_a_blocking_copy() -> None:
    """What the tests below rely on: the copy they replace is an error in this mode."""
    with no_sync(), pytest.raises(RuntimeError, match="synchronizing"):
        torch.tensor([0, 1], device="cuda")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "script"])
def test_default_preprocess_of_mixed_shapes_does_not_sync(compiled: bool) -> None:
    pre = scripted_preprocess() if compiled else preprocess  # compiled: as the one-call decode
    images = mixed_shapes()
    orientations = [1, 6, 1, 3, 8]
    alone = zip(images, orientations, strict=True)
    want = torch.stack([preprocess([im], [o], 224)[0] for im, o in alone])
    for _ in range(3):  # compiled: the first calls profile and optimise the graph
        pre(images, orientations, 224)
    torch.cuda.synchronize()
    with no_sync():
        got = pre(images, orientations, 224)
    assert torch.equal(got, want)


def test_model_preprocessing_of_mixed_shapes_does_not_sync() -> None:
    """A CLIP-style processor: shortest edge, centre crop, rescale and normalise."""
    spec = ImageSpec(
        shortest_edge=224,
        resample=BICUBIC,
        crop=(224, 224),
        mean=(0.48145466, 0.4578275, 0.40821073),
        std=(0.26862954, 0.26130258, 0.27577711),
    )
    images = mixed_shapes()
    orientations = [1, 1, 6, 1, 1]
    want = torch.cat([spec.apply([im], [o]) for im, o in zip(images, orientations, strict=True)])
    torch.cuda.synchronize()
    with no_sync():
        got = spec.apply(images, orientations)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
