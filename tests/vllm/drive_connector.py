"""Runs in the vLLM test environment (tests/test_vllm_connector.py makes it): vLLM's own config,
connector factory, request and scheduler-output types and its V2 GPU model runner's connector
driver (ActiveECConnector, with its EncoderCache) exercise featpool_vllm's connector against a
real featpool server on the host tier. Usage: drive_connector.py URL SOCKET IMAGE [GPU_UUID]:
with GPU_UUID the connector is given only the socket directory and that UUID, and finds the
server's socket and HTTP address in the directory's index. Exits non-zero on the first failed
check."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import load
from vllm import SamplingParams
from vllm.config import DeviceConfig, ECTransferConfig, VllmConfig
from vllm.distributed.ec_transfer import ec_transfer_state
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
from vllm.v1.request import Request
from vllm.v1.worker.gpu.ec_connector import ActiveECConnector
from vllm.v1.worker.gpu.mm.encoder_cache import EncoderCache

from featpool_vllm.connector import FeaturePoolECConnector

URL, SOCKET = sys.argv[1], sys.argv[2]
GPU_UUID = sys.argv[4] if len(sys.argv) > 4 else None
http = httpx.Client(base_url=URL, timeout=30)


def check(ok: object, what: str) -> None:
    if not ok:
        raise SystemExit(f"FAILED: {what}")
    print("ok:", what, flush=True)


def request(rid: str, identifier: str, tokens: int) -> Request:
    feature = MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=identifier,
        mm_position=PlaceholderRange(offset=2, length=tokens),
    )
    return Request(
        request_id=rid,
        prompt_token_ids=[1] * (tokens + 4),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        mm_features=[feature],
    )


def step(free: list[str]) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=free,
    )


def lease_state(lease_id: str) -> int:
    return http.get(f"/v1/leases/{lease_id}").status_code


def metric(name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return 0.0


def wait_for(pred: object, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return bool(pred())  # type: ignore[operator]


TTL = 1.5  # lease_ttl_s: short, so that a held lease is seen renewed past it
config = VllmConfig(
    device_config=DeviceConfig(device="cpu"),
    ec_transfer_config=ECTransferConfig(
        ec_connector="FeaturePoolECConnector",
        ec_connector_module_path="featpool_vllm.connector",
        ec_role="ec_consumer",
        ec_connector_extra_config=(
            {"url": URL, "socket": SOCKET, "lease_ttl_s": TTL}
            if GPU_UUID is None
            else {"socket_dir": str(Path(SOCKET).parent), "gpu_uuid": GPU_UUID, "lease_ttl_s": TTL}
        ),
    ),
)

# vLLM loads the connector by module path, once per role.
sched = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
check(type(sched) is FeaturePoolECConnector, "vLLM's factory loads the connector by module path")
check(isinstance(sched, ECConnectorBase) and sched.is_consumer, "it is an ECConnectorBase consumer")
check(
    (sched.url, sched.socket) == (URL, SOCKET),
    "its featpool: as configured, or found by GPU in the socket directory's index",
)
ec_transfer_state.ensure_ec_transfer_initialized(config)
cache = EncoderCache()
runner = ActiveECConnector(config, cache.encoder_outputs)  # what the GPU model runner uses
worker = ec_transfer_state.get_ec_transfer()
check(worker.role is ECConnectorRole.WORKER, "the worker side is made by vLLM's own state module")
try:
    ECConnectorFactory.create_connector(
        VllmConfig(
            device_config=DeviceConfig(device="cpu"),
            ec_transfer_config=ECTransferConfig(
                ec_connector="FeaturePoolECConnector",
                ec_connector_module_path="featpool_vllm.connector",
                ec_role="ec_producer",
            ),
        ),
        ECConnectorRole.SCHEDULER,
    )
    check(False, "a producer role is refused")
except ValueError:
    check(True, "a producer role is refused")

try:
    two = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        ec_transfer_config=config.ec_transfer_config,
    )
    two.parallel_config.world_size = 2
    FeaturePoolECConnector(two, ECConnectorRole.WORKER)
    check(False, "more than one worker per engine is refused")
except ValueError:
    check(True, "more than one worker per engine is refused")

# featpool encodes an image; its answer's feature_hash is the vLLM multimodal uuid.
with open(sys.argv[3], "rb") as f:
    image = f.read()
enc = http.post("/v1/encode", content=image, headers={"content-type": "image/png"}).json()
item = enc["items"][0]
digest, tokens = item["feature_hash"], item["shape"][0]
expected = load(http.get(f"/v1/leases/{item['lease_id']}/tensor").content)["features"]
encoded = metric("featpool_images_total", outcome="encoded")
check(item["tier"] == "host", "featpool published on the host tier")

# Scheduler: vLLM asks whether the item exists outside; the connector leases it.
check(not sched.has_cache_item("0" * 64), "an unknown hash is not there")
check(not sched.has_cache_item("no-such-id"), "an unknown id is not there")
check(sched.has_cache_item(digest), "the pooled features are found by their hash")
check(metric("featpool_images_total", outcome="encoded") == encoded, "no encode for the lookup")
req = request("r1", digest, tokens)
sched.update_state_after_alloc(req, 0)
out1 = step([])
out1.ec_connector_metadata = sched.build_connector_meta(out1)
held = out1.ec_connector_metadata.loads[digest]
check(lease_state(held["lease_id"]) == 200, "the lease for vLLM is live")

# Worker: vLLM's runner binds the metadata and calls start_load_caches.
with runner.maybe_get_output(out1) as ec_out:
    check(ec_out is not None, "the runner drove the connector")
    got = cache.encoder_outputs.get(digest)
    check(got is not None, "the features are in vLLM's encoder cache under the hash")
    assert got is not None
    check(torch.equal(got, expected), "they equal featpool's features bit for bit")
    check(got.device == torch.device("cpu"), "on the worker's device")
time.sleep(2 * TTL)
check(lease_state(held["lease_id"]) == 200, "the lease is held while vLLM's cache views it")
check(
    torch.equal(cache.encoder_outputs[digest], expected),
    "renewed past its TTL with no step run: the entry still holds its features",
)

# vLLM evicts the entry: the scheduler reports it, the runner frees it, the lease ends.
out2 = step([digest])
out2.ec_connector_metadata = sched.build_connector_meta(out2)
check(out2.ec_connector_metadata.freed == [digest], "the eviction goes to the worker")
cache.free_encoder_cache(digest)  # what the model runner's free_states does first
with runner.maybe_get_output(out2):
    pass
check(wait_for(lambda: lease_state(held["lease_id"]) == 410), "the lease ends when vLLM frees it")
check(lease_state(item["lease_id"]) == 200, "the uploader's own lease is untouched")

# A second request after the eviction: a new lease (a copy), still no encode.
check(sched.has_cache_item(digest), "found again after vLLM's eviction")
req2 = request("r2", digest, tokens + 3)  # the prompt expects another token count
sched.update_state_after_alloc(req2, 0)
check(sched.take_unavailable_requests() == {"r2"}, "a token-count mismatch fails the request")
out3 = step([])
out3.ec_connector_metadata = sched.build_connector_meta(out3)
check(not out3.ec_connector_metadata.loads, "and nothing wrong is loaded")
check(sched.has_cache_item(digest), "leased for a request that then finishes unscheduled")
sched.request_finished(request("r3", digest, tokens))
check(
    wait_for(lambda: http.get("/v1/pool").json()["leases_active"] == 1),
    "leases taken and never loaded are given back: only the uploader's remains",
)
check(metric("featpool_images_total", outcome="encoded") == encoded, "one encode in all")

# Evicted and leased again within one step: the old lease ends, the new one is held.
check(sched.has_cache_item(digest), "leased for a new request")
sched.update_state_after_alloc(request("r4", digest, tokens), 0)
out4 = step([])
out4.ec_connector_metadata = sched.build_connector_meta(out4)
old = out4.ec_connector_metadata.loads[digest]
with runner.maybe_get_output(out4):
    pass
check(sched.has_cache_item(digest), "vLLM evicted it and asks again in the same step")
sched.update_state_after_alloc(request("r5", digest, tokens), 0)
out5 = step([digest])
out5.ec_connector_metadata = sched.build_connector_meta(out5)
new = out5.ec_connector_metadata.loads[digest]
check(new["lease_id"] != old["lease_id"], "with a lease of its own")
cache.free_encoder_cache(digest)
with runner.maybe_get_output(out5):
    pass
check(wait_for(lambda: lease_state(old["lease_id"]) == 410), "the evicted entry's lease ends")
check(lease_state(new["lease_id"]) == 200, "the new entry's lease is held")
check(torch.equal(cache.encoder_outputs[digest], expected), "and the cache holds the features")
out6 = step([digest])
out6.ec_connector_metadata = sched.build_connector_meta(out6)
cache.free_encoder_cache(digest)
with runner.maybe_get_output(out6):
    pass
check(
    wait_for(lambda: http.get("/v1/pool").json()["leases_active"] == 1),
    "after the last eviction only the uploader's lease remains",
)

worker.shutdown()
sched.shutdown()
ec_transfer_state.ensure_ec_transfer_shutdown()
print("ALL OK", flush=True)
