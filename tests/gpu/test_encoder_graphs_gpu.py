"""CUDA-graph replay of the encoder: same results as eager, per padded batch size, and outputs
that do not alias the graph's static buffer."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from app.encoders import build_encoder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA"),
]


@pytest.mark.parametrize("preset", ["tiny-test", "vit-b16-224"])
def test_graph_replay_matches_eager(preset: str) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    eager = build_encoder(preset, device=device)
    graphed = build_encoder(preset, device=device)
    graphed.enable_cuda_graphs()  # type: ignore[attr-defined]
    graphed.warmup([1, 4, 8])
    assert sorted(graphed._graphs) == [1, 4, 8]  # type: ignore[attr-defined]
    s = eager.image_size
    for b in (1, 4, 8, 3):  # 3 has no graph: eager path
        x = torch.randn(b, 3, s, s, device=device)
        want = eager.encode(x).float()
        got = graphed.encode(x).float()
        rel = (got - want).norm() / want.norm()
        assert got.shape == want.shape and rel < 2e-2, (b, float(rel))


def test_replays_do_not_alias_earlier_outputs() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    enc = build_encoder("tiny-test", device=device)
    enc.enable_cuda_graphs()  # type: ignore[attr-defined]
    enc.warmup([2])
    s = enc.image_size
    a_in, b_in = torch.randn(2, 3, s, s, device=device), torch.randn(2, 3, s, s, device=device)
    a = enc.encode(a_in)
    a_copy = a.clone()
    enc.encode(b_in)  # a second replay overwrites the static output buffer...
    torch.cuda.synchronize()
    assert torch.equal(a, a_copy)  # ...but not what the first call returned


def photos(size: int, device: torch.device) -> torch.Tensor:
    """Three photos that ship with scikit-image, squashed to ``size`` and scaled to [-1, 1]."""
    from skimage import data

    imgs = [
        torch.from_numpy(f()).permute(2, 0, 1) for f in (data.astronaut, data.coffee, data.chelsea)
    ]
    x = torch.stack(
        [
            torch.nn.functional.interpolate(i[None].float(), (size, size), mode="bilinear")[0]
            for i in imgs
        ]
    )
    return (x / 127.5 - 1).to(device)


def compiled_with_graphs(preset: str, sizes: list[int]) -> tuple[Any, int]:
    """An encoder compiled and captured at ``sizes``, and the dynamo graphs that made."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    enc = build_encoder(preset, device=torch.device("cuda"), compile=True)
    enc.enable_cuda_graphs()  # type: ignore[attr-defined]
    enc.warmup(sizes)
    assert sorted(enc._graphs) == sizes  # type: ignore[attr-defined]
    return enc, counters["stats"]["unique_graphs"]


def test_compile_prepares_more_sizes_than_the_recompile_limit() -> None:
    """The engine prepares 12 sizes at batch 128; dynamo's default recompile limit is 8, past
    which it would silently run the remaining sizes eagerly (and capture those)."""
    _, per_size = compiled_with_graphs("tiny-test", [1])  # graph breaks included
    _, total = compiled_with_graphs("tiny-test", list(range(1, 11)))
    assert per_size >= 1 and total == per_size * 10, (per_size, total)


def test_compiled_forward_captured_as_graphs_matches_eager() -> None:
    """--encoder-compile with CUDA graphs (the engine's default then): replays of the compiled
    ViT-B/16 give the eager encoder's features for real photos."""
    device = torch.device("cuda", torch.cuda.current_device())
    compiled, _ = compiled_with_graphs("vit-b16-224", [3, 8])
    eager = build_encoder("vit-b16-224", device=device)
    x = photos(eager.image_size, device)
    for b in (3, 8):
        batch = x.repeat((b + 2) // 3, 1, 1, 1)[:b]
        want = eager.encode(batch).float()
        got = compiled.encode(batch).float()
        rel = (got - want).norm() / want.norm()
        assert got.shape == want.shape and rel < 2e-2, (b, float(rel))
