"""The whole HTTP stack on the CPU (tiny encoder, host pool): happy paths, and every bad input
answered with a clear 4xx in the one error shape, leaving the pool as it was."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load

from tests.conftest import image_bytes, occupancy

JPEG = image_bytes("JPEG")
PNG = image_bytes("PNG", size=(40, 70))


def files(*images: tuple[str, bytes, str]) -> list[tuple[str, tuple[str, bytes, str]]]:
    return [("image", img) for img in images]


def test_encode_multipart_jpeg_and_png(make_client: Callable[..., TestClient]) -> None:
    c = make_client()
    r = c.post(
        "/v1/encode", files=files(("a.jpg", JPEG, "image/jpeg"), ("b.png", PNG, "image/png"))
    )
    assert r.status_code == 200, r.text
    items = r.json()["items"]
    assert [i["shape"] for i in items] == [[17, 64], [17, 64]]
    assert {i["transport"] for i in items} == {"host_shm"}
    assert items[0]["lease_id"] != items[1]["lease_id"]
    assert r.headers["x-request-id"]
    assert occupancy(c) == (2 * 17 * 64 * 4, 2)  # 4352 bytes each, already 256-aligned


def test_media_types_are_case_insensitive_and_matched_whole(
    make_client: Callable[..., TestClient],
) -> None:
    """RFC 9110: a media type's type and subtype are case-insensitive. An upper-case multipart
    Content-Type (and part type) is served; a media type that merely starts like multipart's
    is not multipart."""
    c = make_client()
    body = (
        b"--BB\r\n"
        b'Content-Disposition: form-data; name="image"; filename="a.jpg"\r\n'
        b"Content-Type: IMAGE/JPEG\r\n\r\n" + JPEG + b"\r\n--BB--\r\n"
    )
    r = c.post(
        "/v1/encode", content=body, headers={"content-type": "Multipart/Form-Data; boundary=BB"}
    )
    assert r.status_code == 200, r.text
    assert len(r.json()["items"]) == 1
    r = c.post(
        "/v1/encode", content=body, headers={"content-type": "multipart/form-dataX; boundary=BB"}
    )
    assert r.status_code == 415 and r.json()["error"]["type"] == "unsupported_media_type"
    message = r.json()["error"]["message"]
    assert message.count("image/jpeg") == 1, message  # each accepted type named once


def test_encode_raw_body_and_tensor_endpoint(make_client: Callable[..., TestClient]) -> None:
    c = make_client()
    r = c.post("/v1/encode?ttl_s=30", content=JPEG, headers={"content-type": "image/jpeg"})
    assert r.status_code == 200, r.text
    lease = r.json()["items"][0]
    assert lease["ttl_s"] == 30
    t = c.get(f"/v1/leases/{lease['lease_id']}/tensor")
    assert t.status_code == 200
    feats = load(t.content)["features"]
    assert list(feats.shape) == lease["shape"] and feats.dtype == torch.float32
    assert torch.isfinite(feats).all()


def test_same_image_gives_same_features(make_client: Callable[..., TestClient]) -> None:
    c = make_client()
    ids = [
        c.post("/v1/encode", content=JPEG, headers={"content-type": "image/jpeg"}).json()["items"][
            0
        ]["lease_id"]
        for _ in range(2)
    ]
    a, b = (load(c.get(f"/v1/leases/{i}/tensor").content)["features"] for i in ids)
    assert torch.allclose(a, b, atol=1e-5)
    other = c.post(
        "/v1/encode", content=image_bytes(seed=1), headers={"content-type": "image/jpeg"}
    ).json()["items"][0]["lease_id"]
    assert not torch.allclose(a, load(c.get(f"/v1/leases/{other}/tensor").content)["features"])


def test_lease_lifecycle_get_renew_delete(make_client: Callable[..., TestClient]) -> None:
    c = make_client()
    lid = c.post("/v1/encode", content=PNG, headers={"content-type": "image/png"}).json()["items"][
        0
    ]["lease_id"]
    got = c.get(f"/v1/leases/{lid}").json()
    assert got["state"] == "ready"
    renewed = c.post(f"/v1/leases/{lid}/renew", json={"ttl_s": 500}).json()
    assert renewed["ttl_s"] == 500 and renewed["expires_at"] > got["expires_at"]
    for junk in (True, "5", [5]):  # a number or nothing: true was read as 1 s
        r = c.post(f"/v1/leases/{lid}/renew", json={"ttl_s": junk})
        assert r.status_code == 422 and r.json()["error"]["type"] == "validation_error", junk
    assert c.get(f"/v1/leases/{lid}").json()["ttl_s"] == 500
    assert c.delete(f"/v1/leases/{lid}").status_code == 204
    assert occupancy(c) == (0, 0)
    for method, path in (
        ("get", f"/v1/leases/{lid}"),
        ("delete", f"/v1/leases/{lid}"),
        ("get", f"/v1/leases/{lid}/tensor"),
        ("post", f"/v1/leases/{lid}/renew"),
    ):
        r = getattr(c, method)(path)
        assert r.status_code == 410 and r.json()["error"]["type"] == "lease_released"


def test_unknown_and_expired_leases(make_client: Callable[..., TestClient]) -> None:
    import time

    c = make_client()
    r = c.get("/v1/leases/deadbeef")
    assert r.status_code == 404 and r.json()["error"]["type"] == "lease_not_found"
    lid = c.post(
        "/v1/encode?ttl_s=0.05", content=JPEG, headers={"content-type": "image/jpeg"}
    ).json()["items"][0]["lease_id"]
    time.sleep(0.2)
    r = c.get(f"/v1/leases/{lid}")
    assert r.status_code == 410 and r.json()["error"]["type"] == "lease_expired"
    assert occupancy(c) == (0, 0)


BAD_INPUTS: list[tuple[str, dict[str, object], int, str]] = [
    (
        "not an image",
        {"content": b"hello, world" * 10, "headers": {"content-type": "image/jpeg"}},
        400,
        "invalid_image",
    ),
    (
        "truncated jpeg",
        {"content": JPEG[: len(JPEG) // 2], "headers": {"content-type": "image/jpeg"}},
        400,
        "invalid_image",
    ),
    ("empty body", {"content": b"", "headers": {"content-type": "image/png"}}, 400, "empty_image"),
    (
        "wrong content type",
        {"content": JPEG, "headers": {"content-type": "text/plain"}},
        415,
        "unsupported_media_type",
    ),
    (
        "multipart without image",
        {"files": [("photo", ("a.jpg", JPEG, "image/jpeg"))]},
        422,
        "validation_error",
    ),
    (
        "multipart part of wrong type",
        {"files": files(("a.txt", b"hi", "text/plain"))},
        415,
        "unsupported_media_type",
    ),
    ("multipart empty part", {"files": files(("a.jpg", b"", "image/jpeg"))}, 400, "empty_image"),
    (
        "one bad part spoils the request",
        {
            "files": files(
                ("a.jpg", JPEG, "image/jpeg"), ("b.jpg", b"\xff\xd8\xffgarbage", "image/jpeg")
            )
        },
        400,
        "invalid_image",
    ),
]


@pytest.mark.parametrize(
    ("case", "kwargs", "status", "kind"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_input_is_a_clear_4xx_and_leaks_nothing(
    make_client: Callable[..., TestClient],
    case: str,
    kwargs: dict[str, object],
    status: int,
    kind: str,
) -> None:
    c = make_client()
    before = occupancy(c)
    r = c.post("/v1/encode", **kwargs)  # type: ignore[arg-type]
    assert r.status_code == status, r.text
    body = r.json()
    assert body["error"]["type"] == kind and body["error"]["message"]
    assert occupancy(c) == before


def test_decompression_bomb_is_refused(make_client: Callable[..., TestClient]) -> None:
    c = make_client(max_image_pixels=100_000)
    bomb = image_bytes("PNG", size=(1000, 1000), mode="L")  # 1e6 pixels, a few KB of PNG
    r = c.post("/v1/encode", content=bomb, headers={"content-type": "image/png"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "image_too_large"
    assert "pixels" in r.json()["error"]["message"]
    assert occupancy(c) == (0, 0)


def test_oversized_body_is_refused(make_client: Callable[..., TestClient]) -> None:
    c = make_client(max_body_bytes=10_000)
    big = image_bytes("PNG", size=(200, 200))
    assert len(big) > 10_000
    r = c.post("/v1/encode", content=big, headers={"content-type": "image/png"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "payload_too_large"

    def chunks():  # no Content-Length: the limit must hold while streaming
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    r = c.post("/v1/encode", content=chunks(), headers={"content-type": "image/png"})
    assert r.status_code == 413
    assert occupancy(c) == (0, 0)


def test_only_uploads_may_be_large(make_client: Callable[..., TestClient]) -> None:
    """Every body but an upload's is a small JSON object, parsed on the event loop: a renew
    carrying megabytes of JSON is refused as it arrives (an audit stalled every request for
    up to a second a request this way), while an upload of the same size is served."""
    from app.middleware import SMALL_BODY_BYTES

    c = make_client()
    big = image_bytes("PNG", size=(200, 200))
    assert len(big) > SMALL_BODY_BYTES
    r = c.post("/v1/encode", content=big, headers={"content-type": "image/png"})
    assert r.status_code == 200, r.text
    lease = r.json()["items"][0]["lease_id"]
    junk = b"[" + b"{}," * (2 * SMALL_BODY_BYTES // 3) + b"{}]"
    r = c.post(f"/v1/leases/{lease}/renew", content=junk)
    assert r.status_code == 413 and r.json()["error"]["type"] == "payload_too_large"
    assert f"/v1/leases/{lease}/renew" in r.json()["error"]["message"]
    r = c.post(f"/v1/leases/{lease}/renew", json={"ttl_s": 30})
    assert r.status_code == 200, r.text
    assert c.delete(f"/v1/leases/{lease}").status_code == 204


def test_oversized_single_image_and_too_many_parts(make_client: Callable[..., TestClient]) -> None:
    c = make_client(max_image_bytes=2000, max_images_per_request=2)
    r = c.post(
        "/v1/encode",
        content=image_bytes("PNG", size=(100, 100)),
        headers={"content-type": "image/png"},
    )
    assert r.status_code == 413 and r.json()["error"]["type"] == "image_too_large"
    small = image_bytes("JPEG", size=(8, 8))
    r = c.post("/v1/encode", files=files(*[("a.jpg", small, "image/jpeg")] * 3))
    assert r.status_code == 413 and r.json()["error"]["type"] == "too_many_images"
    assert occupancy(c) == (0, 0)


def test_bad_ttl_is_a_422(make_client: Callable[..., TestClient]) -> None:
    c = make_client()
    r = c.post("/v1/encode?ttl_s=-3", content=JPEG, headers={"content-type": "image/jpeg"})
    assert r.status_code == 422 and r.json()["error"]["type"] == "validation_error"
    r = c.post("/v1/encode?ttl_s=abc", content=JPEG, headers={"content-type": "image/jpeg"})
    assert r.status_code == 422
    assert occupancy(c) == (0, 0)


def test_image_modes_users_send(make_client: Callable[..., TestClient]) -> None:
    c = make_client()
    for name, data in {
        "grayscale": image_bytes("PNG", mode="L"),
        "alpha": image_bytes("PNG", mode="RGBA"),
        "cmyk": image_bytes("JPEG", mode="CMYK"),
        "webp": image_bytes("WEBP"),
        "gif": image_bytes("GIF", mode="L"),
    }.items():
        r = c.post("/v1/encode", content=data, headers={"content-type": "application/octet-stream"})
        assert r.status_code == 200, (name, r.text)


def test_pool_full_falls_back_inline_then_503(make_client: Callable[..., TestClient]) -> None:
    # A 2 MiB host tier holds 481 tiny leases (4352 bytes each); inline holds two more.
    c = make_client(host_pool_bytes=2 << 20, slab_bytes=2 << 20, inline_max_bytes=8704)
    tiny = ("a.jpg", image_bytes("JPEG", size=(8, 8)), "image/jpeg")
    tiers: list[str] = []
    for _ in range(8):
        r = c.post("/v1/encode", files=files(*[tiny] * 60))
        assert r.status_code == 200
        tiers += [i["tier"] for i in r.json()["items"]]
    assert tiers == ["host"] * 480
    r = c.post("/v1/encode", files=files(*[tiny] * 3))
    assert [i["tier"] for i in r.json()["items"]] == ["host", "inline", "inline"]
    inline_id = r.json()["items"][2]["lease_id"]
    assert load(c.get(f"/v1/leases/{inline_id}/tensor").content)["features"].shape == (17, 64)
    used, active = occupancy(c)
    r = c.post("/v1/encode", files=files(*[tiny] * 5))
    assert r.status_code == 503 and r.json()["error"]["type"] == "pool_exhausted"
    assert occupancy(c) == (used, active)  # the failed request left nothing behind
    fallbacks = c.get("/v1/pool").json()["fallbacks"]
    assert any(
        f["reason"] == "pool_full" and f["tier"] == "inline" and f["count"] >= 2 for f in fallbacks
    )
    c.delete(f"/v1/leases/{inline_id}")
    r = c.post("/v1/encode", files=files(tiny))  # room again, inline
    assert r.status_code == 200 and r.json()["items"][0]["tier"] == "inline"


def test_reject_policy_answers_503(make_client: Callable[..., TestClient]) -> None:
    c = make_client(host_pool_bytes=2 << 20, slab_bytes=2 << 20, fallback="reject")
    body = files(*[("a.jpg", image_bytes("JPEG", size=(8, 8)), "image/jpeg")] * 60)
    statuses = [c.post("/v1/encode", files=body).status_code for _ in range(9)]
    assert statuses[:8] == [200] * 8 and statuses[8] == 503
    assert occupancy(c)[1] == 480


def test_api_key_guards_v1_but_not_health(make_client: Callable[..., TestClient]) -> None:
    c = make_client(api_key="k3y")
    r = c.post("/v1/encode", content=JPEG, headers={"content-type": "image/jpeg"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "unauthorized"
    r = c.post(
        "/v1/encode",
        content=JPEG,
        headers={"content-type": "image/jpeg", "authorization": "Bearer k3y"},
    )
    assert r.status_code == 200
    assert c.get("/health/ready").status_code == 200
    assert c.get("/metrics").status_code == 200


def test_health_and_unknown_routes(make_client: Callable[..., TestClient]) -> None:
    c = make_client()
    assert c.get("/health/live").json() == {"status": "alive"}
    assert c.get("/health/ready").json() == {"status": "ready"}
    r = c.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found"
    r = c.put("/v1/pool")
    assert r.status_code == 405 and "error" in r.json()


def test_openapi_document_lists_the_api(make_client: Callable[..., TestClient]) -> None:
    paths = make_client().get("/openapi.json").json()["paths"]
    for p in (
        "/v1/encode",
        "/v1/leases/{lease_id}",
        "/v1/leases/{lease_id}/tensor",
        "/v1/leases/{lease_id}/renew",
        "/v1/pool",
        "/health/live",
        "/health/ready",
    ):
        assert p in paths
