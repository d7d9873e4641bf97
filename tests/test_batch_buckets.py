"""The batch sizes the encoder is prepared for (a CUDA graph each): how much of a forward can be
padding, and the engine padding a batch to the next size and handing back only its own rows."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from fastapi.testclient import TestClient

from app.encoders import build_encoder
from app.engine import Engine, batch_buckets
from app.metrics import Metrics
from app.settings import Settings, resolve_batching


@pytest.mark.parametrize("largest", [1, 2, 7, 16, 32, 100, 128, 256, 512])
def test_padding_is_at_most_an_eighth_of_the_largest_batch(largest: int) -> None:
    sizes = batch_buckets(largest)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == largest
    assert len(sizes) <= 8 + largest.bit_length()  # a handful of graphs to capture
    for n in range(1, largest + 1):
        padded = next(b for b in sizes if b >= n)
        assert padded - n < -(-largest // 8), (n, padded)


def test_requests_of_sixteen_fill_a_batch_of_128_without_padding() -> None:
    sizes = batch_buckets(128)
    assert [16 * k for k in range(1, 9)] == [b for b in sizes if b >= 16]


def test_engine_pads_to_the_next_size_and_returns_its_own_rows() -> None:
    encoder = build_encoder("tiny-test", device=torch.device("cpu"))
    seen: list[int] = []
    encode = encoder.encode

    def spy(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.shape[0])
        return encode(x)

    encoder.encode = spy  # type: ignore[method-assign]
    engine = Engine(Settings(max_batch_size=128), Metrics(), encoder=encoder)
    engine.encoder, engine._buckets = encoder, batch_buckets(128)
    s = encoder.image_size
    x = torch.randn(81, 3, s, s)
    out = engine._forward(x[:80])
    assert seen == [80] and out.shape[0] == 80  # a size of its own: no padding
    out = engine._forward(x)
    assert seen[-1] == 96 and out.shape[0] == 81
    assert torch.allclose(out.float(), encode(x).float(), atol=1e-5)


def test_batching_defaults_are_chosen_for_the_device(
    make_client: Callable[..., TestClient],
) -> None:
    """128 on a GPU, 32 on the CPU; the queue admits eight of them. Given values are kept."""
    for cuda, batch in ((True, 128), (False, 32)):
        s = Settings()
        resolve_batching(s, cuda=cuda)
        assert (s.max_batch_size, s.queue_size) == (batch, 8 * batch)
    s = Settings(max_batch_size=7, queue_size=9)
    resolve_batching(s, cuda=True)
    assert (s.max_batch_size, s.queue_size) == (7, 9)
    app = make_client().app  # on the CPU, through the whole app
    engine = app.state.engine  # type: ignore[attr-defined]
    assert engine.batcher.max_batch_size == 32
    assert app.state.admission.max_images == 256  # type: ignore[attr-defined]
