"""Per-request options of POST /v1/encode: ``pooled`` (mean over tokens) and ``dtype``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load

from tests.conftest import image_bytes, occupancy

JPEG = image_bytes("JPEG")
HEADERS = {"content-type": "image/jpeg"}


def features(c: TestClient, lease: dict[str, object]) -> torch.Tensor:
    t: torch.Tensor = load(c.get(f"/v1/leases/{lease['lease_id']}/tensor").content)["features"]
    return t


def test_pooled_is_the_mean_over_tokens(make_client: Callable[..., TestClient]) -> None:
    c = make_client()
    full = c.post("/v1/encode", content=JPEG, headers=HEADERS).json()["items"][0]
    pooled = c.post("/v1/encode?pooled=true", content=JPEG, headers=HEADERS).json()["items"][0]
    assert full["shape"] == [17, 64] and pooled["shape"] == [64]
    assert pooled["nbytes"] == 64 * 4
    assert torch.allclose(features(c, pooled), features(c, full).mean(0), atol=1e-5)


@pytest.mark.parametrize(("dtype", "size"), [("float32", 4), ("bfloat16", 2), ("float16", 2)])
def test_dtype_is_cast_before_publishing(
    make_client: Callable[..., TestClient], dtype: str, size: int
) -> None:
    c = make_client()
    ref = c.post("/v1/encode", content=JPEG, headers=HEADERS).json()["items"][0]
    r = c.post(
        f"/v1/encode?dtype={dtype}&pooled=1", files=[("image", ("a.jpg", JPEG, "image/jpeg"))] * 2
    )
    assert r.status_code == 200, r.text
    for item in r.json()["items"]:
        assert item["dtype"] == dtype and item["shape"] == [64] and item["nbytes"] == 64 * size
        got = features(c, item)
        assert got.dtype == getattr(torch, dtype)
        assert torch.allclose(got.float(), features(c, ref).mean(0), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("query", ["dtype=int8", "dtype=float64", "pooled=maybe", "dtype="])
def test_bad_options_are_a_422_and_leak_nothing(
    make_client: Callable[..., TestClient], query: str
) -> None:
    c = make_client()
    r = c.post(f"/v1/encode?{query}", content=JPEG, headers=HEADERS)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["type"] == "validation_error"
    assert occupancy(c) == (0, 0)


def test_options_are_in_the_openapi_document(make_client: Callable[..., TestClient]) -> None:
    doc = make_client().get("/openapi.json").json()
    params = {p["name"] for p in doc["paths"]["/v1/encode"]["post"]["parameters"]}
    assert {"ttl_s", "pooled", "dtype"} <= params


def test_requests_with_different_options_share_a_batch(
    make_client: Callable[..., TestClient],
) -> None:
    """Requests with different options land in one batch; the engine publishes each group of
    rows (same form, dtype and TTL) as one tensor of rows. Each request still gets its own
    image's features in the form, dtype and TTL it asked for."""
    import concurrent.futures

    c = make_client(max_batch_wait_ms=500.0, max_batch_size=8, feature_cache_entries=0)
    images = [image_bytes("JPEG", seed=k) for k in range(5)]
    queries = ["", "pooled=1", "pooled=1&dtype=bfloat16", "ttl_s=30", ""]
    with concurrent.futures.ThreadPoolExecutor(len(images)) as ex:
        futs = [
            ex.submit(c.post, f"/v1/encode?{q}", content=img, headers=HEADERS)
            for q, img in zip(queries, images, strict=True)
        ]
        answers = [f.result() for f in futs]
    batches = c.get("/metrics").text
    assert "featpool_batch_size_count 1.0" in batches, "the five requests did not share a batch"
    refs = [
        features(c, c.post("/v1/encode", content=img, headers=HEADERS).json()["items"][0])
        for img in images
    ]
    want = [
        ([17, 64], "float32", refs[0]),
        ([64], "float32", refs[1].mean(0)),
        ([64], "bfloat16", refs[2].mean(0)),
        ([17, 64], "float32", refs[3]),
        ([17, 64], "float32", refs[4]),  # in one group of rows with the first request's
    ]
    for r, (shape, dtype, ref) in zip(answers, want, strict=True):
        assert r.status_code == 200, r.text
        item = r.json()["items"][0]
        assert item["shape"] == shape and item["dtype"] == dtype
        assert torch.allclose(features(c, item).float(), ref, atol=2e-2, rtol=2e-2)
    assert answers[3].json()["items"][0]["ttl_s"] == 30
    assert not torch.allclose(refs[0], refs[4], atol=2e-2, rtol=2e-2)  # rows not mixed up
