"""vLLM encoder-cache connector: vLLM (the language model side) takes an image's features from a
featpool pool instead of running its own vision encoder.

    vllm serve MODEL --ec-transfer-config '{
        "ec_connector": "FeaturePoolECConnector",
        "ec_connector_module_path": "featpool_vllm.connector",
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"url": "http://127.0.0.1:8000",
                                      "socket": "/run/featpool/featpool.sock"}}'

A request names its image's features through vLLM's multimodal uuid (``"uuid"`` next to the
``image_url`` of a chat message, ``multi_modal_uuids`` offline): the ``feature_hash`` that
featpool's ``POST /v1/encode`` answered, or the ``id`` given to it. vLLM keys its encoder cache
by that identifier, and asks this connector about it when it is not in its own cache.

Scheduler side (the engine-core process):
  has_cache_item(identifier)   POST {url}/v1/features/{identifier}/lease: a lease of its own on
                               the resident features (featpool copies them, no encode). Held
                               here until the worker has them; 404 -> False, vLLM encodes.
  update_state_after_alloc     the item will be loaded: its descriptor goes to the worker in
                               the next step's metadata. A token count that disagrees with the
                               prompt's placeholders fails the request (take_unavailable_requests)
                               instead of feeding wrong features.
  build_connector_meta         loads for this step, and which identifiers vLLM evicted from its
                               encoder cache (SchedulerOutput.free_encoder_mm_hashes).
  request_finished             leases taken but never loaded are given back.

Worker side (each GPU worker):
  start_load_caches            maps each lease through the hand-off socket (pool.client). GPU
                               tier, same device, same dtype: the pool's memory itself becomes
                               the encoder-cache entry (zero-copy); its lease is held, and
                               renewed every lease_ttl_s / 3 by a thread of the worker's, until
                               vLLM frees the entry (past its deadline and the pool's quarantine
                               its memory would go to other features under vLLM). Host tier
                               (or another dtype/device): copied to the device, and the lease
                               released at once. Inline: fetched over HTTP.
                               Then releases the leases of entries vLLM freed.

vLLM 0.34.0 is what this was built and tested against (see docs/integrations.md for the parts of
its interface it relies on).
"""

from __future__ import annotations

import io
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

from pool.client import FeatureClient
from pool.featurepool import parse_dtype

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_TTL_S = 600.0  # a lease waits this long for its request to be scheduled and run


@dataclass
class FeaturePoolECMetadata(ECConnectorMetadata):
    """Scheduler -> worker, once per step: plain data (vLLM serialises it to the workers)."""

    loads: dict[str, dict[str, Any]] = field(default_factory=dict)  # identifier -> descriptor
    freed: list[str] = field(default_factory=list)  # identifiers vLLM evicted


def featpool_endpoints(extra: dict[str, Any], device: torch.device) -> tuple[str, str | None]:
    """(HTTP address, hand-off socket) of the featpool this engine reads from. Given as ``url``
    and ``socket``; or found in the socket directory's index (``socket_dir``, with
    ``gpu_uuid``, else this engine's CUDA device; ``owner_uids``): the entry of that GPU names
    its socket and its HTTP address, so both ends are the same featpool even where a Service
    balances HTTP over several (a lease is only mapped through its own server's socket)."""
    if "socket_dir" not in extra and "gpu_uuid" not in extra:
        return str(extra.get("url", DEFAULT_URL)), extra.get("socket")
    from pool.discovery import find

    uuid = extra.get("gpu_uuid")
    index = device.index if uuid is None and device.type == "cuda" else None
    entry = find(
        extra.get("socket_dir"),
        gpu_uuid=uuid,
        cuda_index=index,
        owner_uids=extra.get("owner_uids"),
    )
    url = extra.get("url") or entry.http
    if url is None:
        raise ValueError(
            f"featpool's entry {entry.path} names no HTTP address (start it with "
            "--advertise-host, as the chart does); or give 'url'"
        )
    return str(url), extra.get("socket") or str(entry.socket)


def lease_path(identifier: str) -> str:
    """The featpool route that leases the features vLLM knows as ``identifier``: vLLM's
    multimodal identifier is featpool's feature hash or client id, unchanged."""
    return f"/v1/features/{identifier}/lease"


class FeaturePoolECConnector(ECConnectorBase):
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        if self.is_producer:
            raise ValueError(
                "FeaturePoolECConnector is for ec_role 'ec_consumer': featpool is the encoder "
                "(POST images to its /v1/encode)"
            )
        world = int(getattr(vllm_config.parallel_config, "world_size", 1))
        if world > 1:
            # Every worker would open the one lease the scheduler took, and the first ack
            # would end it under the others. One lease per rank needs multi-reader leases.
            raise ValueError(
                f"FeaturePoolECConnector supports one worker per engine, not {world} "
                "(tensor/pipeline parallelism): run vLLM with TP=1 and PP=1"
            )
        extra: dict[str, Any] = dict(vllm_config.ec_transfer_config.ec_connector_extra_config)
        self._device = torch.device(extra.get("device") or vllm_config.device_config.device)
        if self._device.type == "cuda" and self._device.index is None:
            self._device = torch.device("cuda", torch.cuda.current_device())
        url, self.socket = featpool_endpoints(extra, self._device)
        self.url = url.rstrip("/")
        self.ttl_s = float(extra.get("lease_ttl_s", DEFAULT_TTL_S))
        self.expect_dtype: str | None = extra.get("dtype")  # refuse features of another dtype
        api_key = extra.get("api_key")
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=10.0)
        # Scheduler side.
        self._held: dict[str, dict[str, Any]] = {}  # identifier -> descriptor not yet loaded
        self._loading: dict[str, dict[str, Any]] = {}  # to send in the next metadata
        self._given: set[str] = set()  # identifiers whose lease the worker holds or has used
        self._unavailable: set[str] = set()  # request ids to fail
        # Worker side.
        self._token: str | None = extra.get("socket_token")
        self._client: FeatureClient | None = None
        self._open: dict[str, dict[str, Any]] = {}  # identifier -> descriptor, in the cache
        self._pending_free: set[str] = set()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        model = vllm_config.model_config
        self._dtype: torch.dtype | None = getattr(model, "dtype", None) if model else None

    # ---- scheduler side --------------------------------------------------------------------

    def has_cache_item(self, identifier: str) -> bool:
        if identifier in self._held or identifier in self._loading:
            return True
        params: dict[str, Any] = {"ttl_s": self.ttl_s}
        if self.expect_dtype:
            params["dtype"] = self.expect_dtype
        try:
            r = self._http.post(lease_path(identifier), params=params)
        except httpx.HTTPError as e:
            log.warning("featpool at %s unreachable (%s); vLLM encodes %s", self.url, e, identifier)
            return False
        if r.status_code != 200:
            if r.status_code not in (404, 422):  # 422: not a hash or id featpool accepts
                log.warning("featpool answered %s for %s: %s", r.status_code, identifier, r.text)
            return False
        self._held[identifier] = r.json()
        return True

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        identifier = request.mm_features[index].identifier
        desc = self._held.pop(identifier, None)
        if desc is None or not self.is_consumer:
            return
        want = request.get_num_encoder_embeds(index)
        if not desc["shape"] or int(desc["shape"][0]) != want:
            log.warning(
                "featpool features %s have shape %s; request %s expects %d tokens: failing it",
                identifier,
                desc["shape"],
                request.request_id,
                want,
            )
            self._unavailable.add(request.request_id)
            self._delete(desc)
            return
        self._loading[identifier] = desc

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        freed = [h for h in scheduler_output.free_encoder_mm_hashes if h in self._given]
        self._given.difference_update(freed)
        self._given.update(self._loading)
        meta = FeaturePoolECMetadata(loads=dict(self._loading), freed=freed)
        self._loading.clear()
        return meta

    def take_unavailable_requests(self) -> set[str]:
        out, self._unavailable = self._unavailable, set()
        return out

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        for feature in request.mm_features:
            desc = self._held.pop(feature.identifier, None)
            if desc is not None:  # leased for this request, never loaded
                self._delete(desc)
        return False, None

    def _delete(self, desc: dict[str, Any]) -> None:
        try:
            self._http.delete(f"/v1/leases/{desc['lease_id']}")
        except httpx.HTTPError:
            pass  # its deadline ends it

    # ---- worker side -----------------------------------------------------------------------

    def _pool(self) -> FeatureClient:
        if self._client is None:
            if not self.socket:
                raise ValueError(
                    "ec_connector_extra_config needs 'socket' (featpool's hand-off socket path) "
                    "or 'socket_dir' (and 'gpu_uuid' off CUDA) to find it in the index"
                )
            device = self._device if self._device.type == "cuda" else None
            self._client = FeatureClient.connect(self.socket, token=self._token, device=device)
        return self._client

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, FeaturePoolECMetadata)
        # Evictions first: an entry evicted and leased again in one step has two leases.
        self._pending_free.update(meta.freed)
        for identifier in list(self._pending_free):
            if identifier in encoder_cache:  # not popped yet: release on a later step
                continue
            self._pending_free.discard(identifier)
            gone = self._open.pop(identifier, None)
            if gone is not None:
                self._release(gone)
        for identifier, desc in meta.loads.items():
            if identifier in encoder_cache:  # another step already placed it
                self._release(desc)
                continue
            tensor, keep = self._load(desc)
            encoder_cache[identifier] = tensor
            if keep:
                self._open[identifier] = desc
                if self._renewer is None:
                    self._renewer = threading.Thread(
                        target=self._renew_held, name="featpool-renew", daemon=True
                    )
                    self._renewer.start()
            else:
                self._release(desc)

    def _renew_held(self) -> None:
        """Renew the leases whose memory is in vLLM's encoder cache, every third of their TTL,
        also while no step runs: an entry outlives any TTL for as long as vLLM keeps it."""
        while not self._stop.wait(self.ttl_s / 3):
            for identifier, desc in list(self._open.items()):
                if self._open.get(identifier) is not desc:
                    continue  # freed meanwhile
                try:
                    self._pool().renew(desc, self.ttl_s)
                except Exception as e:
                    log.warning(
                        "featpool lease %s of encoder-cache entry %s could not be renewed "
                        "(%s): its memory may be reused once the pool's quarantine ends",
                        desc.get("lease_id"),
                        identifier,
                        e,
                    )

    def _load(self, desc: dict[str, Any]) -> tuple[torch.Tensor, bool]:
        """(the tensor for vLLM's encoder cache, whether it views the pool's memory)."""
        dtype = self._dtype or parse_dtype(desc["dtype"])
        if desc["tier"] == "inline":
            r = self._http.get(f"/v1/leases/{desc['lease_id']}/tensor")
            r.raise_for_status()
            from safetensors.torch import load

            t = load(io.BytesIO(r.content).getvalue())["features"]
            return t.to(self._device, dtype), False
        view = self._pool().open(desc)
        if view.device == self._device and view.dtype == dtype:
            return view, True  # zero-copy: the pool's memory is the cache entry
        out = view.to(self._device, dtype, copy=True)
        if out.device.type == "cuda":
            torch.cuda.current_stream(out.device).synchronize()  # before the ack frees it
        return out, False

    def _release(self, desc: dict[str, Any]) -> None:
        try:
            self._pool().release(desc)
        except Exception as e:  # already ended (deadline): nothing to give back
            log.debug("release of %s: %s", desc.get("lease_id"), e)

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        return  # a consumer only: featpool produces the features

    def shutdown(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=10)
        for desc in self._open.values():
            self._release(desc)
        self._open.clear()
        for desc in self._held.values():
            self._delete(desc)
        self._held.clear()
        if self._client is not None:
            self._client.close()
            self._client = None
        self._http.close()
