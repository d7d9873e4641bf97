"""MPO JPEGs (what many phone cameras write) are their first picture; a lease deadline too
short to use is a 422 naming the minimum."""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest
import skimage.data
import torch
from fastapi.testclient import TestClient
from PIL import Image
from safetensors.torch import load

from app.imaging import decode, inspect
from pool.descriptor import MIN_TTL_S
from pool.featurepool import FeaturePool
from tests.conftest import occupancy

LIMITS = {"max_pixels": 40_000_000, "max_bytes": 64 << 20}


def mpo() -> tuple[bytes, bytes]:
    """An MPO of two real photos, and the first photo alone as a JPEG (same encoder)."""
    first = Image.fromarray(skimage.data.astronaut())
    second = Image.fromarray(skimage.data.coffee())
    buf = io.BytesIO()
    first.save(buf, format="MPO", save_all=True, append_images=[second], quality=90)
    alone = io.BytesIO()
    first.save(alone, format="JPEG", quality=90)
    return buf.getvalue(), alone.getvalue()


def test_mpo_is_decoded_as_its_first_picture() -> None:
    data, first = mpo()
    im = Image.open(io.BytesIO(data))
    assert im.format == "MPO" and getattr(im, "n_frames", 1) == 2
    h = inspect(data, **LIMITS)
    assert (h.format, h.width, h.height) == ("MPO", 512, 512)
    assert not h.gpu_jpeg  # nvJPEG is given one picture per buffer: Pillow decodes an MPO
    assert torch.equal(decode(data, 64, **LIMITS), decode(first, 64, **LIMITS))


def test_mpo_upload_is_encoded(make_client: Callable[..., TestClient]) -> None:
    client = make_client()
    data, first = mpo()
    r = client.post("/v1/encode", content=data, headers={"content-type": "image/jpeg"})
    assert r.status_code == 200, r.text
    want = client.post("/v1/encode", content=first, headers={"content-type": "image/jpeg"})
    a, b = (x.json()["items"][0]["lease_id"] for x in (r, want))
    ta, tb = (load(client.get(f"/v1/leases/{i}/tensor").content)["features"] for i in (a, b))
    assert torch.equal(ta, tb)
    for i in (a, b):
        client.delete(f"/v1/leases/{i}")
    assert occupancy(client) == (0, 0)


@pytest.mark.parametrize("ttl", ["1e-300", "0.009", "0"])
def test_unusably_short_ttl_is_422(make_client: Callable[..., TestClient], ttl: str) -> None:
    client = make_client()
    jpeg = mpo()[1]
    r = client.post(f"/v1/encode?ttl_s={ttl}", content=jpeg, headers={"content-type": "image/jpeg"})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["type"] == "validation_error" and str(MIN_TTL_S) in r.text
    ok = client.post(
        f"/v1/encode?ttl_s={MIN_TTL_S}", content=jpeg, headers={"content-type": "image/jpeg"}
    )
    assert ok.status_code == 200
    lid = client.post("/v1/encode", content=jpeg, headers={"content-type": "image/jpeg"}).json()[
        "items"
    ][0]["lease_id"]
    r = client.post(f"/v1/leases/{lid}/renew", json={"ttl_s": 1e-300})
    assert r.status_code == 422
    client.delete(f"/v1/leases/{lid}")


def test_pool_refuses_a_ttl_below_the_minimum() -> None:
    pool = FeaturePool([], max_leases=4)
    try:
        with pytest.raises(ValueError, match="at least"):
            pool.put(torch.ones(2), ttl_s=1e-300)
        assert pool.put(torch.ones(2), ttl_s=MIN_TTL_S).ttl_s == MIN_TTL_S
    finally:
        pool.close()
