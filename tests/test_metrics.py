"""Issue 5: a scripted scenario through the HTTP API, then /metrics parsed with
prometheus_client's own parser and the values asserted; request IDs; JSON logs; start-up line."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from app.logs import JsonFormatter, LineFormatter
from tests.conftest import image_bytes

TINY = ("a.jpg", image_bytes("JPEG", size=(8, 8)), "image/jpeg")
LEASE_BYTES = 17 * 64 * 4  # tiny-test features, float32, already 256-aligned


def scrape(c: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(c.get("/metrics").text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(
    m: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def test_scripted_scenario_metrics(make_client: Callable[..., TestClient]) -> None:
    # Host tier of 2 MiB = 481 leases; inline room for 2 more.
    # The same bytes are uploaded throughout: without the feature index each is encoded
    # (tests/test_feature_cache.py covers the index's own metrics).
    c = make_client(
        host_pool_bytes=2 << 20,
        slab_bytes=2 << 20,
        inline_max_bytes=2 * LEASE_BYTES,
        feature_cache_entries=0,
    )

    # 1. Encode one image, release it by DELETE.
    lid = c.post("/v1/encode", files=[("image", TINY)]).json()["items"][0]["lease_id"]
    assert c.delete(f"/v1/leases/{lid}").status_code == 204

    # 2. Fill the host tier until it falls back inline, then until it is exhausted.
    held = []
    for _ in range(8):
        held += c.post("/v1/encode", files=[("image", TINY)] * 60).json()["items"]
    spill = c.post("/v1/encode", files=[("image", TINY)] * 3).json()["items"]
    assert [x["tier"] for x in spill] == ["host", "inline", "inline"]
    assert c.post("/v1/encode", files=[("image", TINY)]).status_code == 503

    m = scrape(c)
    assert value(m, "featpool_pool_capacity_bytes", tier="host") == 2 << 20
    assert value(m, "featpool_pool_used_bytes", tier="host") == 481 * LEASE_BYTES
    assert value(m, "featpool_pool_used_bytes", tier="inline") == 2 * LEASE_BYTES
    assert value(m, "featpool_leases_active", tier="host") == 481
    assert value(m, "featpool_leases_active", tier="inline") == 2
    assert value(m, "featpool_pool_largest_free_bytes", tier="host") < LEASE_BYTES
    assert value(m, "featpool_leases_created_total", tier="host") == 482
    assert value(m, "featpool_leases_created_total", tier="inline") == 2
    assert value(m, "featpool_leases_released_total", reason="delete") == 1
    # Two leases fell inline; the 503 found the host tier full too, but was placed nowhere.
    assert value(m, "featpool_fallbacks_total", reason="pool_full", tier="inline") == 2
    assert value(m, "featpool_allocation_failures_total", tier="host") == 3
    assert value(m, "featpool_rejected_total", reason="pool_exhausted") == 1
    assert value(m, "featpool_http_requests_total", endpoint="/v1/encode", status_class="5xx") == 1
    assert value(m, "featpool_http_requests_total", endpoint="/v1/encode", status_class="2xx") == 10
    assert value(m, "featpool_images_total", outcome="encoded") == 1 + 480 + 3
    assert value(m, "featpool_batch_size_sum") == 1 + 480 + 3 + 1
    assert value(m, "featpool_encode_duration_seconds_count") >= 1
    batches = value(m, "featpool_batch_size_count")
    assert batches >= 1  # every batch's stages timed, in the stage's own thread
    assert value(m, "featpool_batch_stage_seconds_count", stage="run") == batches
    assert value(m, "featpool_batch_stage_seconds_count", stage="prepare") in (0, batches)
    assert value(m, "featpool_decode_duration_seconds_count") == 1 + 480 + 3 + 1
    assert value(m, "featpool_request_duration_seconds_count", endpoint="/v1/encode") == 11
    assert value(m, "featpool_ready") == 1

    # 3. Let a lease expire, and release everything else.
    short = c.post("/v1/encode?ttl_s=0.05", files=[("image", TINY)])
    assert short.status_code == 503  # still full
    for x in spill[1:]:
        c.delete(f"/v1/leases/{x['lease_id']}")
    short = c.post("/v1/encode?ttl_s=0.05", files=[("image", TINY)]).json()["items"][0]
    time.sleep(0.3)
    for x in [*held, spill[0]]:
        c.delete(f"/v1/leases/{x['lease_id']}")
    assert c.get(f"/v1/leases/{short['lease_id']}").status_code == 410

    m = scrape(c)
    assert value(m, "featpool_leases_expired_total", tier="inline") == 1
    assert value(m, "featpool_leases_released_total", reason="delete") == 1 + 2 + 481
    for tier in ("host", "inline"):
        assert value(m, "featpool_pool_used_bytes", tier=tier) == 0
        assert value(m, "featpool_leases_active", tier=tier) == 0
    assert value(m, "featpool_pool_largest_free_bytes", tier="host") == 2 << 20


def test_build_info_and_label_values_stay_small(make_client: Callable[..., TestClient]) -> None:
    c = make_client()
    for k in range(3):
        item = c.post(f"/v1/encode?id=scan-{k}", files=[("image", TINY)]).json()["items"][0]
        lid, digest = item["lease_id"], item["feature_hash"]
        c.get(f"/v1/leases/{lid}")
        c.get(f"/v1/leases/{lid}/tensor")
        c.get(f"/v1/features/{digest}")
        c.post(f"/v1/features/scan-{k}/lease")
    m = scrape(c)
    info = [labels for (name, labels) in m if name == "featpool_build_info"]
    assert len(info) == 1 and dict(info[0])["transport"] == "host_shm"
    endpoints = {
        dict(labels)["endpoint"] for (name, labels) in m if name == "featpool_http_requests_total"
    }
    assert (
        {"/v1/features/{ref}", "/v1/features/{ref}/lease"}
        <= endpoints
        <= {
            "/v1/encode",
            "/v1/leases/{id}",
            "/v1/leases/{id}/tensor",
            "/v1/features/{ref}",
            "/v1/features/{ref}/lease",
            "/v1/pool",
            "/health",
            "/metrics",
            "other",
        }
    )
    # no lease ID, feature hash or client id ever in a label
    assert not any(x in str(labels) for (_, labels) in m for x in (lid, digest, "scan-"))


def test_request_id_is_returned_and_propagated(make_client: Callable[..., TestClient]) -> None:
    c = make_client()
    r = c.get("/v1/pool")
    assert len(r.headers["x-request-id"]) == 32
    r = c.get("/v1/pool", headers={"x-request-id": "trace-abc-123"})
    assert r.headers["x-request-id"] == "trace-abc-123"
    r = c.get("/v1/leases/nope", headers={"x-request-id": "err-1"})
    assert r.status_code == 404 and r.headers["x-request-id"] == "err-1"


def test_json_log_lines_carry_the_request_id(
    make_client: Callable[..., TestClient], caplog: pytest.LogCaptureFixture
) -> None:
    c = make_client()
    with caplog.at_level(logging.INFO, logger="app.access"):
        c.get("/v1/pool", headers={"x-request-id": "rid-42"})
    record = next(r for r in caplog.records if r.name == "app.access")
    line = json.loads(JsonFormatter().format(record))
    assert line["request_id"] == "rid-42" and line["status"] == 200
    assert line["level"] == "INFO" and "/v1/pool" in line["message"]


def test_a_path_cannot_forge_a_plain_log_line(
    make_client: Callable[..., TestClient], caplog: pytest.LogCaptureFixture
) -> None:
    """A request path with an encoded line break (%0A) is logged decoded; in a plain log its
    second line is indented, so it cannot pass for a record of its own; a carriage return,
    which would move a terminal back over the real line, is escaped."""
    c = make_client()
    forged = "x%0D%0A2026-12-07 00:00:00,000 INFO app.access: DELETE /v1/leases/y -> 204 in 1 ms"
    with caplog.at_level(logging.INFO, logger="app.access"):
        assert c.get(f"/v1/leases/{forged}").status_code == 404
    record = next(r for r in caplog.records if r.name == "app.access")
    assert "\n" in record.getMessage()  # the middleware logs the decoded path
    first, *rest = LineFormatter().format(record).split("\n")
    assert first.endswith("/v1/leases/x\\r") and "\r" not in first, first
    assert len(rest) == 1 and rest[0].startswith("    2026-12-07 00:00:00,000 INFO"), rest


def test_startup_line_lists_changed_settings_and_capabilities(
    make_client: Callable[..., TestClient], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="app.main"):
        make_client(max_batch_size=7, api_key="hush")
    line = next(r.getMessage() for r in caplog.records if "ready:" in r.getMessage())
    assert "transport=host_shm" in line and "encoder=tiny-test" in line
    assert "'max_batch_size': 7" in line and "fabric=False" in line
    assert "hush" not in line  # secrets never reach the logs


def test_a_publish_that_waits_for_room_lands_in_a_bucket(
    make_client: Callable[..., TestClient],
) -> None:
    """Under --fallback wait a publish waits up to --fallback-wait-s (1 s here) for room: such
    waits fell above the top bucket (0.1 s) and the dashboard's publish p99 stopped there."""
    c = make_client(
        host_pool_bytes=2 << 20,
        slab_bytes=2 << 20,
        fallback="wait",
        fallback_wait_s=1.0,
        feature_cache_entries=0,
    )
    for n in (60,) * 8 + (1,):  # 481 leases fill the one slab
        assert c.post("/v1/encode", files=[("image", TINY)] * n).status_code == 200
    assert c.post("/v1/encode", files=[("image", TINY)]).status_code == 503
    m = scrape(c)
    count = value(m, "featpool_publish_duration_seconds_count")
    slow = count - value(m, "featpool_publish_duration_seconds_bucket", le="0.5")
    assert slow >= 1  # the waits were observed ...
    assert value(m, "featpool_publish_duration_seconds_bucket", le="2.5") == count  # ... in range
