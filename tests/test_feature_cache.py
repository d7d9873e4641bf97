"""Content-addressed features (app/featindex.py): the feature hash, reuse without a forward pass
on a repeat upload or a lookup by hash or id, the bound and its evictions, residency, metrics,
and scoping by API key tested as an attack."""

from __future__ import annotations

import hashlib
import io
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load

from tests.conftest import image_bytes, occupancy
from tests.helpers import live_server, small_settings

CAT = image_bytes("JPEG", size=(40, 30), seed=1)
DOG = image_bytes("JPEG", size=(40, 30), seed=2)
OWL = image_bytes("PNG", size=(24, 24), seed=3)


def upload(c: TestClient, data: bytes, query: str = "", **headers: str) -> Any:
    return c.post(
        f"/v1/encode{query}", content=data, headers={"content-type": "image/jpeg", **headers}
    )


def features(c: TestClient, lease_id: str, **headers: str) -> torch.Tensor:
    r = c.get(f"/v1/leases/{lease_id}/tensor", headers=headers)
    assert r.status_code == 200, r.text
    return load(r.content)["features"]


def metric(c: TestClient, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(c.get("/metrics").text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


def encoded(c: TestClient) -> float:
    return metric(c, "featpool_images_total", outcome="encoded")


def test_hash_is_sha256_of_identity_and_bytes(make_client: Callable[..., TestClient]) -> None:
    c = make_client()
    item = upload(c, CAT).json()["items"][0]
    enc = c.app.state.engine.encoder  # type: ignore[attr-defined]
    identity = {
        "encoder": enc.name,
        "weights": "",
        "image_size": enc.image_size,
        "mean": list(enc.mean),
        "std": list(enc.std),
        "output_shape": list(enc.output_shape),
        "preprocess": "",  # the tiny encoder has no processor configuration of its own
        "encoder_dtype": "float32",
        "dtype": "float32",
        "pooled": False,
    }
    ident = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).digest()
    content = hashlib.sha256(CAT).digest()
    assert item["feature_hash"] == hashlib.sha256(ident + content).hexdigest()
    assert item["cached"] is False
    # Another dtype or pooling is another identity: other features, another hash.
    other = upload(c, CAT, "?dtype=bfloat16").json()["items"][0]
    pooled = upload(c, CAT, "?pooled=true").json()["items"][0]
    assert len({item["feature_hash"], other["feature_hash"], pooled["feature_hash"]}) == 3
    assert other["cached"] is False and pooled["cached"] is False


def test_repeat_upload_reuses_features_without_encoding(
    make_client: Callable[..., TestClient],
) -> None:
    c = make_client()
    first = upload(c, CAT).json()["items"][0]
    assert encoded(c) == 1
    second = upload(c, CAT).json()["items"][0]
    assert second["cached"] is True
    assert second["feature_hash"] == first["feature_hash"]
    assert second["lease_id"] != first["lease_id"]
    assert second["offset"] != first["offset"] or second["slab"] != first["slab"]  # its own copy
    assert encoded(c) == 1  # no forward pass for the repeat
    assert torch.equal(features(c, first["lease_id"]), features(c, second["lease_id"]))
    assert metric(c, "featpool_feature_cache_lookups_total", result="hit") == 1
    assert metric(c, "featpool_feature_cache_lookups_total", result="miss") == 1
    # Each lease ends on its own: releasing the first leaves the second readable, and the
    # features stay resident through it.
    expected = features(c, first["lease_id"])
    assert c.delete(f"/v1/leases/{first['lease_id']}").status_code == 204
    assert torch.equal(features(c, second["lease_id"]), expected)
    third = upload(c, CAT).json()["items"][0]
    assert third["cached"] is True and encoded(c) == 1


def test_a_mixed_request_encodes_only_the_new_images(
    make_client: Callable[..., TestClient],
) -> None:
    c = make_client()
    upload(c, CAT)
    files = [("image", ("a.jpg", d, "image/jpeg")) for d in (DOG, CAT, DOG)]
    items = c.post("/v1/encode", files=files).json()["items"]
    assert [i["cached"] for i in items] == [False, True, False]
    assert encoded(c) == 3
    # All or nothing: a bad image in the request gives back the hit's copy as well.
    before = occupancy(c)
    bad = [
        ("image", ("a.jpg", CAT, "image/jpeg")),
        ("image", ("b.jpg", b"\xff\xd8\xffjunk", "image/jpeg")),
    ]
    assert c.post("/v1/encode", files=bad).status_code == 400
    assert occupancy(c) == before


def test_lookup_by_hash_and_by_id(make_client: Callable[..., TestClient]) -> None:
    c = make_client()
    item = upload(c, CAT, "?id=cat-1").json()["items"][0]
    digest = item["feature_hash"]
    for ref in (digest, "cat-1"):
        info = c.get(f"/v1/features/{ref}")
        assert info.status_code == 200, info.text
        assert info.json() == {"feature_hash": digest, "shape": item["shape"], "dtype": "float32"}
        lease = c.post(f"/v1/features/{ref}/lease?ttl_s=30")
        assert lease.status_code == 200, lease.text
        got = lease.json()
        assert got["cached"] is True and got["feature_hash"] == digest
        assert torch.equal(features(c, got["lease_id"]), features(c, item["lease_id"]))
    assert encoded(c) == 1
    assert c.get("/v1/features/" + "0" * 64).status_code == 404
    r = c.post("/v1/features/nobody/lease")
    assert r.status_code == 404 and r.json()["error"]["type"] == "feature_not_found"
    assert metric(c, "featpool_feature_cache_lookups_total", result="miss") == 2  # encode + 404
    # Multipart: one 'id' field per image.
    files = [("image", ("a.jpg", DOG, "image/jpeg")), ("image", ("b.png", OWL, "image/png"))]
    r = c.post("/v1/encode", files=files, data={"id": ["dog", "owl"]})
    assert r.status_code == 200, r.text
    assert c.get("/v1/features/owl").json()["feature_hash"] == r.json()["items"][1]["feature_hash"]


def test_ids_that_disagree_are_refused_and_not_cached(
    make_client: Callable[..., TestClient],
) -> None:
    c = make_client()
    item = upload(c, CAT, "?id=pet").json()["items"][0]
    before, n = occupancy(c), encoded(c)
    # The same id for other bytes: refused before any work, nothing leased, the id unchanged.
    r = upload(c, DOG, "?id=pet")
    assert r.status_code == 409 and r.json()["error"]["type"] == "id_conflict"
    assert occupancy(c) == before and encoded(c) == n
    assert c.get("/v1/features/pet").json()["feature_hash"] == item["feature_hash"]
    # A consumer that expects another shape or dtype is refused, and gets no lease.
    for query in ("?shape=17,65", "?dtype=bfloat16", "?shape=64"):
        r = c.post(f"/v1/features/pet/lease{query}")
        assert r.status_code == 409 and r.json()["error"]["type"] == "feature_mismatch", query
    assert occupancy(c) == before
    assert c.post("/v1/features/pet/lease?shape=17,64&dtype=float32").status_code == 200
    # Malformed ids and id counts.
    assert upload(c, CAT, "?id=" + "x" * 200).status_code == 422
    assert upload(c, CAT, "?id=..%2Fetc").status_code == 422
    files = [("image", ("a.jpg", CAT, "image/jpeg"))] * 2
    assert c.post("/v1/encode", files=files, data={"id": ["only-one"]}).status_code == 422
    assert c.post("/v1/encode?id=x", files=files).status_code == 422


def test_entries_die_with_their_memory(make_client: Callable[..., TestClient]) -> None:
    c = make_client()
    first = upload(c, CAT, "?id=cat").json()["items"][0]
    hit = upload(c, CAT).json()["items"][0]
    for lease in (first, hit):
        assert c.delete(f"/v1/leases/{lease['lease_id']}").status_code == 204
    assert c.get("/v1/features/cat").status_code == 404
    assert metric(c, "featpool_feature_cache_evictions_total", reason="ended") == 1
    again = upload(c, CAT).json()["items"][0]
    assert again["cached"] is False and encoded(c) == 2
    # A lease that expires takes its entry with it too.
    short = upload(c, OWL, "?ttl_s=0.05").json()["items"][0]
    assert short["cached"] is False
    time.sleep(0.2)
    assert c.get(f"/v1/features/{short['feature_hash']}").status_code == 404


def test_the_index_is_bounded_lru(make_client: Callable[..., TestClient]) -> None:
    c = make_client(feature_cache_entries=2)
    a = upload(c, CAT).json()["items"][0]
    b = upload(c, DOG).json()["items"][0]
    assert c.get(f"/v1/features/{a['feature_hash']}").status_code == 200  # a is now the newest
    upload(c, OWL)  # evicts b, the least recently used
    assert c.get(f"/v1/features/{b['feature_hash']}").status_code == 404
    assert c.get(f"/v1/features/{a['feature_hash']}").status_code == 200
    assert metric(c, "featpool_feature_cache_evictions_total", reason="capacity") == 1
    assert metric(c, "featpool_feature_cache_entries") == 2
    # Forgotten is not freed: b's lease is still there for its holder.
    assert c.get(f"/v1/leases/{b['lease_id']}").status_code == 200
    assert c.get("/v1/pool").json()["feature_cache"]["entries"] == 2


def test_index_off(make_client: Callable[..., TestClient]) -> None:
    c = make_client(feature_cache_entries=0)
    a = upload(c, CAT).json()["items"][0]
    b = upload(c, CAT).json()["items"][0]
    assert a["feature_hash"] == b["feature_hash"] and not b["cached"] and encoded(c) == 2
    assert c.get(f"/v1/features/{a['feature_hash']}").status_code == 404


def test_one_tenant_cannot_reach_anothers_features(
    make_client: Callable[..., TestClient],
) -> None:
    """The attack: tenant B knows (or guesses) the image tenant A uploaded, computes its hash
    or guesses A's id, and asks for the features. Scoping by key answers as if they were never
    uploaded; B's own upload of the same bytes is encoded for B."""
    c = make_client(api_key="key-of-a", api_keys=["key-of-b"])
    a = {"authorization": "Bearer key-of-a"}
    b = {"authorization": "Bearer key-of-b"}
    item = upload(c, CAT, "?id=secret-scan", **a).json()["items"][0]
    digest = item["feature_hash"]
    for ref in (digest, "secret-scan"):
        assert c.get(f"/v1/features/{ref}", headers=b).status_code == 404
        assert c.post(f"/v1/features/{ref}/lease", headers=b).status_code == 404
        assert c.get(f"/v1/features/{ref}", headers=a).status_code == 200
    mine = upload(c, CAT, **b).json()["items"][0]
    assert mine["cached"] is False and mine["feature_hash"] == digest
    assert encoded(c) == 2
    # Now B holds features of the same hash: only the id's own scope still hides A's id (a
    # lookup of ids in every scope would tell B what A stored under it).
    assert c.get("/v1/features/secret-scan", headers=b).status_code == 404
    assert c.post("/v1/features/secret-scan/lease", headers=b).status_code == 404
    # B can use the same id for its own features: ids are per tenant too.
    dog = upload(c, DOG, "?id=secret-scan", **b).json()["items"][0]
    assert (
        c.get("/v1/features/secret-scan", headers=b).json()["feature_hash"] == dog["feature_hash"]
    )
    assert c.get("/v1/features/secret-scan", headers=a).json()["feature_hash"] == digest
    # And without a key, nothing at all.
    assert c.get(f"/v1/features/{digest}").status_code == 401
    assert upload(c, CAT, "", authorization="Bearer key-of-c").status_code == 401


def test_content_bytes_are_what_is_hashed(make_client: Callable[..., TestClient]) -> None:
    """The same picture saved twice by Pillow is the same bytes; re-encoding it changes them."""
    from PIL import Image

    c = make_client()
    im = Image.open(io.BytesIO(CAT))
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=50)
    a = upload(c, CAT).json()["items"][0]
    b = upload(c, buf.getvalue()).json()["items"][0]
    assert a["feature_hash"] != b["feature_hash"] and b["cached"] is False


def test_every_descriptor_of_a_lease_names_its_features(
    make_client: Callable[..., TestClient],
) -> None:
    """A consumer handed only a lease ID looks the lease up (HTTP or the socket's lookup) and
    gets the same feature_hash and cached flag the encode answer gave, also after a renew."""
    from pool.client import FeatureClient

    c = make_client()
    first = upload(c, CAT).json()["items"][0]
    copy = upload(c, CAT).json()["items"][0]
    assert first["cached"] is False and copy["cached"] is True
    sock = c.get("/v1/pool").json()["socket_path"]
    with FeatureClient.connect(sock) as client:
        for item in (first, copy):
            lid = item["lease_id"]
            for got in (
                c.get(f"/v1/leases/{lid}").json(),
                c.post(f"/v1/leases/{lid}/renew", json={"ttl_s": 30}).json(),
                client.lookup(lid),
            ):
                assert (got["feature_hash"], got["cached"]) == (
                    item["feature_hash"],
                    item["cached"],
                )
    for item in (first, copy):
        c.delete(f"/v1/leases/{item['lease_id']}")


def test_an_id_taken_by_a_request_that_finished_first_is_refused_when_binding(
    make_client: Callable[..., TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two requests name different images with one id at once: both pass the check made
    before any work, and the second to finish must still get 409 (both got 200, the id then
    naming whichever bound last), its leases given back."""
    c = make_client()
    engine = c.app.state.engine  # type: ignore[attr-defined]
    first = upload(c, CAT, "?id=same").json()["items"][0]
    monkeypatch.setattr(engine.index, "check_id", lambda *a: None)  # as if both passed it
    used = occupancy(c)
    r = upload(c, DOG, "?id=same")
    assert r.status_code == 409 and r.json()["error"]["type"] == "id_conflict"
    assert occupancy(c) == used  # the refused request's lease went back
    assert c.get("/v1/features/same").json()["feature_hash"] == first["feature_hash"]


@pytest.mark.parametrize("resident", [False, True], ids=["new", "resident"])
def test_one_id_for_two_images_of_a_request_is_refused_and_leaks_nothing(
    make_client: Callable[..., TestClient], resident: bool
) -> None:
    """ids x, x, y on three different images: 409 before any work, whether the images are new
    or their features already resident (cache hits copy leases); no lease is left behind and
    neither id is bound to anything."""
    c = make_client()
    images = [CAT, DOG, OWL]
    if resident:
        for data in images:
            assert upload(c, data).status_code == 200
    before, n = occupancy(c), encoded(c)
    files = [("image", (f"{i}.img", data, "image/jpeg")) for i, data in enumerate(images)]
    r = c.post("/v1/encode", files=files, data={"id": ["x", "x", "y"]})
    assert r.status_code == 409 and r.json()["error"]["type"] == "id_conflict", r.text
    assert occupancy(c) == before and encoded(c) == n
    for ref in ("x", "y"):
        assert c.get(f"/v1/features/{ref}").status_code == 404
    # The same image twice under one id is one name for one image: served.
    twice = [("image", ("a.jpg", CAT, "image/jpeg"))] * 2
    r = c.post("/v1/encode", files=twice, data={"id": ["cat", "cat"]})
    assert r.status_code == 200 and len(r.json()["items"]) == 2


def test_a_request_refused_when_binding_releases_every_lease_and_binds_no_id(
    make_client: Callable[..., TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three images, the second id taken by a request that finished first: every lease of the
    refused request goes back (not only those made before the refusal), and the ids it named
    are free again."""
    c = make_client()
    engine = c.app.state.engine  # type: ignore[attr-defined]
    other = image_bytes("JPEG", size=(40, 30), seed=4)
    upload(c, other, "?id=taken")
    monkeypatch.setattr(engine.index, "check_id", lambda *a: None)  # as if both passed it
    used = occupancy(c)
    files = [("image", (f"{i}.img", d, "image/jpeg")) for i, d in enumerate([CAT, DOG, OWL])]
    r = c.post("/v1/encode", files=files, data={"id": ["a", "taken", "b"]})
    assert r.status_code == 409 and r.json()["error"]["type"] == "id_conflict", r.text
    assert occupancy(c) == used
    monkeypatch.undo()
    assert c.get("/v1/features/a").status_code == 404
    assert upload(c, DOG, "?id=a").status_code == 200  # `a` names nothing: free for DOG


def test_an_id_whose_leases_ended_is_free_again(make_client: Callable[..., TestClient]) -> None:
    """The id of released features is free for other bytes at once: it answered 409 (``release
    those leases first``) after they were released, until some lookup happened to prune it."""
    c = make_client()
    first = upload(c, CAT, "?id=pet").json()["items"][0]
    assert upload(c, DOG, "?id=pet").status_code == 409  # still resident: taken
    assert c.delete(f"/v1/leases/{first['lease_id']}").status_code == 204
    r = upload(c, DOG, "?id=pet")
    assert r.status_code == 200, r.text
    assert c.get("/v1/features/pet").json()["feature_hash"] == r.json()["items"][0]["feature_hash"]


def test_many_short_hits_do_not_forget_the_long_lease(
    make_client: Callable[..., TestClient],
) -> None:
    """An encode with a long TTL, then more short-lived hits at once than an entry remembers
    (the vLLM connector's pattern): once they end, the features are still resident through the
    first lease. Before, each hit pushed out the oldest lease the entry named, the long one."""
    from app.featindex import MAX_LEASES_PER_ENTRY

    c = make_client()
    first = upload(c, CAT, "?ttl_s=3600").json()["items"][0]
    ref = first["feature_hash"]
    hits = [c.post(f"/v1/features/{ref}/lease?ttl_s=60") for _ in range(MAX_LEASES_PER_ENTRY)]
    assert all(h.status_code == 200 for h in hits)
    for h in hits:
        assert c.delete(f"/v1/leases/{h.json()['lease_id']}").status_code == 204
    assert c.get(f"/v1/features/{ref}").status_code == 200
    again = upload(c, CAT).json()["items"][0]
    assert again["cached"] is True and encoded(c) == 1


def test_a_failed_request_discards_its_hits_without_counting_a_delete(
    make_client: Callable[..., TestClient],
) -> None:
    """A resident image beside a broken one: 400, no lease left, and the hit's copy given back
    counted as ``discarded``, not as a DELETE nobody sent; created = ended + active."""
    c = make_client()
    upload(c, OWL)
    used = occupancy(c)
    broken = image_bytes("PNG", size=(24, 24), seed=5)[:-40]  # the header still parses
    files = [("image", ("a.png", OWL, "image/png")), ("image", ("b.png", broken, "image/png"))]
    r = c.post("/v1/encode", files=files)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_image", r.text
    assert occupancy(c) == used
    assert metric(c, "featpool_leases_released_total", reason="delete") == 0
    assert metric(c, "featpool_leases_released_total", reason="discarded") == 1
    created = metric(c, "featpool_leases_created_total", tier="host") + metric(
        c, "featpool_leases_created_total", tier="inline"
    )
    assert created == 2 == 1 + used[1]


def test_a_hit_waiting_for_room_leaves_the_server_answering(tmp_path: Path) -> None:
    """Under ``--fallback wait`` a hit's copy waits for room: it waited on the event loop, so
    the DELETE that would make room could not be served until the wait gave up (503 after
    --fallback-wait-s, the DELETE answered only then). Now the DELETE is served at once and the
    waiting lease gets the room it made."""
    settings = small_settings(
        tmp_path,
        host_pool_bytes=2 << 20,
        slab_bytes=2 << 20,
        fallback="wait",
        fallback_wait_s=3.0,
    )
    with live_server(settings) as live:
        first = httpx.post(
            f"{live.url}/v1/encode", content=CAT, headers={"content-type": "image/jpeg"}
        ).json()["items"][0]
        ref, pool = first["feature_hash"], live.app.state.engine.pool
        held = [first["lease_id"]]

        def room() -> int:
            return int(httpx.get(f"{live.url}/v1/pool").json()["tiers"][0]["largest_free_bytes"])

        while room() >= first["nbytes"]:  # filled with copies, in-process: quicker than HTTP
            held.append(pool.copy_lease(first["lease_id"], 600).id)
        result: dict[str, Any] = {}

        def lease() -> None:
            start = time.monotonic()
            r = httpx.post(f"{live.url}/v1/features/{ref}/lease", timeout=10)
            result.update(status=r.status_code, took=time.monotonic() - start)

        waiter = threading.Thread(target=lease)
        waiter.start()
        time.sleep(0.3)
        start = time.monotonic()
        assert httpx.delete(f"{live.url}/v1/leases/{held[-1]}", timeout=10).status_code == 204
        deleted = time.monotonic() - start
        waiter.join(10)
        assert deleted < 1.0, deleted  # served while the copy waits
        assert result["status"] == 200 and result["took"] < 2.0, result
