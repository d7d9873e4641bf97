"""The lease descriptor is one type (pool.descriptor.LeaseDescriptor): HTTP, the hand-off socket,
the client and docs/protocol.md all carry exactly its fields."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from pool.client import FeatureClient
from pool.descriptor import LeaseDescriptor
from tests.conftest import image_bytes

FIELDS = set(LeaseDescriptor.model_fields)
DOCS = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"


def test_http_socket_and_openapi_use_the_one_descriptor(
    make_client: Callable[..., TestClient],
) -> None:
    c = make_client()
    r = c.post("/v1/encode", files={"image": ("a.jpg", image_bytes(), "image/jpeg")})
    assert r.status_code == 200, r.text
    item = r.json()["items"][0]
    assert set(item) == FIELDS
    got = c.get(f"/v1/leases/{item['lease_id']}").json()
    assert set(got) == FIELDS and got["slot"] == item["slot"]
    renewed = c.post(f"/v1/leases/{item['lease_id']}/renew", json={"ttl_s": 30}).json()
    assert set(renewed) == FIELDS and renewed["ttl_s"] == 30

    socket_path = c.app.state.settings.socket_path  # type: ignore[attr-defined]
    with FeatureClient.connect(socket_path) as fc:
        looked_up = fc.lookup(item["lease_id"])
        assert set(looked_up) == FIELDS
        assert LeaseDescriptor.parse(looked_up).generation == item["generation"]
        fc.release(LeaseDescriptor.parse(item))  # the model itself is accepted too

    schemas = c.get("/openapi.json").json()["components"]["schemas"]
    assert set(schemas["LeaseDescriptor"]["properties"]) == FIELDS
    assert "LeaseOut" not in schemas
    for name, prop in schemas["LeaseDescriptor"]["properties"].items():
        assert prop.get("description"), f"{name} has no description in the OpenAPI document"


def test_docs_table_lists_exactly_the_fields() -> None:
    text = DOCS.read_text()
    section = text[text.index("## 4. Leases") : text.index("### Reading a lease")]
    documented: set[str] = set()
    for row in section.splitlines():
        if row.startswith("| `"):
            documented.update(re.findall(r"`(\w+)`", row.split("|")[1]))
    assert documented == FIELDS


def test_client_parses_descriptors_through_the_model(
    make_client: Callable[..., TestClient],
) -> None:
    c = make_client()
    r = c.post("/v1/encode", files={"image": ("a.jpg", image_bytes(), "image/jpeg")})
    item = r.json()["items"][0]
    socket_path = c.app.state.settings.socket_path  # type: ignore[attr-defined]
    with FeatureClient.connect(socket_path) as fc:
        # A newer producer may add fields: an older consumer ignores them.
        t = fc.open({**item, "content_hash": "ab" * 32})
        assert list(t.shape) == item["shape"]
        # A malformed descriptor is refused before anything is read or acked.
        with pytest.raises(ValidationError, match="slot"):
            fc.release({k: v for k, v in item.items() if k != "slot"})
        with pytest.raises(ValidationError, match="generation"):
            fc.release({**item, "generation": "seven"})
        assert fc.is_current(item)
        fc.release(item)


@pytest.mark.parametrize("dynamic", [False, True])
def test_wire_is_the_json_dump_and_a_copy(dynamic: bool) -> None:
    """``wire`` copies the fields instead of calling pydantic's dump (on every hand-off's path);
    it must stay exactly ``model_dump(mode="json")``, and changing it must not change the
    (frozen) descriptor."""
    d = LeaseDescriptor(
        lease_id="ab" * 16,
        epoch="cd" * 8,
        state="ready",
        tier="gpu",
        transport="cuda_vmm",
        slab=1,
        offset=256,
        nbytes=2 * 197 * 768,
        shape=[197, 768],
        dtype="bfloat16",
        grid_thw=[1, 28, 28] if dynamic else None,
        tokens=196 if dynamic else None,
        slot=3,
        generation=7,
        created_at=1.5,
        expires_at=31.5,
        ttl_s=30.0,
        feature_hash="ef" * 32,
        cached=False,
    )
    wire = d.wire()
    assert wire == d.model_dump(mode="json") and list(wire) == list(d.model_dump(mode="json"))
    assert LeaseDescriptor.model_validate(wire) == d
    wire["shape"].append(1)
    if dynamic:
        wire["grid_thw"][0] = 9
    assert d.shape == [197, 768] and d.grid_thw == ([1, 28, 28] if dynamic else None)
