"""featpool_sglang: a featpool lease as SGLang's precomputed-embedding image item, mapped from a
real server's pool (host tier), with its checks and the lease's release."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load

from featpool_sglang.adapter import FeatureMismatch, image_item, leased_image_item
from pool.client import FeatureClient
from tests.conftest import image_bytes
from tests.helpers import wait_until


def test_lease_becomes_an_sglang_image_item(make_client: Callable[..., TestClient]) -> None:
    c = make_client()
    desc = c.post(
        "/v1/encode", content=image_bytes("PNG", seed=4), headers={"content-type": "image/png"}
    ).json()["items"][0]
    expected = load(c.get(f"/v1/leases/{desc['lease_id']}/tensor").content)["features"]
    tokens, hidden = desc["shape"]
    sock = c.app.state.settings.socket_path  # type: ignore[attr-defined]
    with FeatureClient.connect(sock) as pool:
        with leased_image_item(
            pool, desc, tokens=tokens, hidden_size=hidden, image_grid_thw=(1, 4, 4)
        ) as item:
            assert item["format"] == "precomputed_embedding"
            assert torch.equal(item["feature"], expected)
            assert item["image_grid_thw"].tolist() == [[1, 4, 4]]
        # Released when the block ends: the producer recycles it.
        assert wait_until(lambda: c.get(f"/v1/leases/{desc['lease_id']}").status_code == 410)

        # A prompt with another number of image tokens is refused, and the lease still ends.
        again = c.post(
            "/v1/encode", content=image_bytes("PNG", seed=5), headers={"content-type": "image/png"}
        ).json()["items"][0]
        with (
            pytest.raises(FeatureMismatch, match="image tokens"),
            leased_image_item(pool, again, tokens=tokens + 1),
        ):
            pass
        assert wait_until(lambda: c.get(f"/v1/leases/{again['lease_id']}").status_code == 410)


def test_image_item_checks() -> None:
    feats = torch.zeros(5, 8)
    assert image_item(feats)["feature"] is feats  # no copy
    with pytest.raises(FeatureMismatch, match="wide"):
        image_item(feats, hidden_size=16)
    with pytest.raises(FeatureMismatch, match=r"\[tokens, hidden\]"):
        image_item(torch.zeros(8))  # pooled features
    with pytest.raises(FeatureMismatch, match="t, h, w"):
        image_item(feats, image_grid_thw=(2, 2))
