"""CUDA-graph replay of the encoder: same results as eager, per padded batch size, and outputs
that do not alias the graph's static buffer."""

from __future__ import annotations

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
