"""``--prepare-threads``: more than one thread decodes and preprocesses batches; every request
still gets its own images' features, and the setting is bounded."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

import pytest
import torch
from fastapi.testclient import TestClient
from pydantic import ValidationError
from safetensors.torch import load

from app.settings import Settings
from tests.conftest import image_bytes

IMAGES = [image_bytes("JPEG", size=(64 + 8 * i, 48 + 4 * i), seed=i) for i in range(6)]


def test_two_prepare_threads_give_each_image_its_own_features(
    make_client: Callable[..., TestClient],
) -> None:
    c = make_client(
        prepare_threads=2, max_batch_size=2, max_batch_wait_ms=20, feature_cache_entries=0
    )

    def encode(data: bytes) -> torch.Tensor:
        r = c.post("/v1/encode", content=data, headers={"content-type": "image/jpeg"})
        assert r.status_code == 200, r.text
        lid = r.json()["items"][0]["lease_id"]
        feats = load(c.get(f"/v1/leases/{lid}/tensor").content)["features"]
        assert c.delete(f"/v1/leases/{lid}").status_code == 204
        return feats

    alone = [encode(d) for d in IMAGES]
    picks = [i % len(IMAGES) for i in range(36)]
    with concurrent.futures.ThreadPoolExecutor(12) as ex:
        got = list(ex.map(lambda i: encode(IMAGES[i]), picks))
    for i, feats in zip(picks, got, strict=True):
        assert torch.allclose(feats, alone[i], atol=1e-4), i
    assert c.app.state.engine.batcher.prepare_threads == 2  # type: ignore[attr-defined]


@pytest.mark.parametrize("n", [0, 9])
def test_prepare_threads_out_of_range_is_refused(n: int) -> None:
    with pytest.raises(ValidationError, match="prepare_threads"):
        Settings(prepare_threads=n)
