"""featpool features as SGLang's precomputed image embeddings.

SGLang's encoder disaggregation (``--encoder-only`` / ``--language-only``) picks its transfer
from a closed list (``--encoder-transfer-backend``: zmq_to_scheduler, zmq_to_tokenizer,
mooncake); nothing can be plugged in from outside. What SGLang does accept from outside is an
image given as its embedding: an ``image_data`` item ``{"format": "precomputed_embedding",
"feature": tensor, ...}`` (with the processor's extra fields, e.g. ``image_grid_thw`` for
Qwen2-VL) next to ``input_ids`` that hold one image placeholder token per feature row. This
module maps a featpool lease to such an item:

    with FeatureClient.connect(socket) as pool, leased_image_item(pool, desc, tokens=n) as item:
        out = engine.generate(input_ids=ids, image_data=[item])   # sglang.Engine

SGLang serialises ``image_data`` to its scheduler, so the features are copied once into the
request (not zero-copy); the lease is released when the ``with`` block ends, after
``generate`` has taken them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from pool.client import FeatureClient, LeaseRef


class FeatureMismatch(ValueError):
    """The lease's features cannot stand for this image in this prompt."""


def image_item(
    features: torch.Tensor,
    *,
    tokens: int | None = None,
    hidden_size: int | None = None,
    image_grid_thw: Sequence[int] | None = None,
) -> dict[str, Any]:
    """SGLang's ``image_data`` item for one image's features ``[T, D]``.

    ``tokens``: how many image placeholder tokens the prompt holds for this image;
    ``hidden_size``: the language model's embedding width. Either that disagrees raises
    FeatureMismatch: SGLang would otherwise splice the wrong number of rows, or fail deep in
    the model. ``image_grid_thw``: the (t, h, w) patch grid, for models that need it
    (Qwen2-VL and successors); ``t * h * w / merge**2`` must equal ``T``, which SGLang checks.
    """
    if features.ndim != 2:
        raise FeatureMismatch(
            f"SGLang takes one image's embeddings as [tokens, hidden], not {list(features.shape)} "
            "(encode without ?pooled=true)"
        )
    if tokens is not None and features.shape[0] != tokens:
        raise FeatureMismatch(
            f"the features have {features.shape[0]} tokens; the prompt has {tokens} image tokens"
        )
    if hidden_size is not None and features.shape[1] != hidden_size:
        raise FeatureMismatch(
            f"the features are {features.shape[1]} wide; the model's embeddings {hidden_size}"
        )
    item: dict[str, Any] = {"format": "precomputed_embedding", "feature": features}
    if image_grid_thw is not None:
        if len(image_grid_thw) != 3:
            raise FeatureMismatch(f"image_grid_thw is (t, h, w), not {list(image_grid_thw)}")
        item["image_grid_thw"] = torch.tensor([list(image_grid_thw)], dtype=torch.int64)
    return item


@contextmanager
def leased_image_item(
    pool: FeatureClient,
    lease: LeaseRef,
    *,
    tokens: int | None = None,
    hidden_size: int | None = None,
    image_grid_thw: Sequence[int] | None = None,
) -> Iterator[dict[str, Any]]:
    """``image_item`` over a featpool lease mapped through ``pool``; the lease is released when
    the block ends (also when it raises). ``lease``: the descriptor featpool answered."""
    view = pool.open(lease)
    try:
        yield image_item(
            view, tokens=tokens, hidden_size=hidden_size, image_grid_thw=image_grid_thw
        )
    finally:
        del view
        pool.release(lease)
