"""Every Prometheus metric the service exports, on a registry the app owns (one per app, so
each test gets a fresh one). Pool gauges and counters are read from the pool at scrape time by a
collector, so they can never drift from the pool's own bookkeeping.

Names follow the Prometheus conventions: base units, ``_total`` on counters, label values from
small fixed sets only (tier, reason, endpoint, status class), never a lease or request ID.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,  # past --body-timeout-s (30 s): a request answered 408 at it still lands in a bucket
    120.0,
)
# Host-side steps, microseconds usually; a publish under --fallback wait waits for room up to
# --fallback-wait-s (0.5 s by default), so the buckets go on to seconds.
FAST_BUCKETS = (
    *(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1),
    *(0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# The *_created series double the exposition and no dashboard uses them.
disable_created_metrics()  # type: ignore[no-untyped-call]


class PoolCollector(Collector):
    """Reads ``FeaturePool.stats()`` at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        s = self._stats()
        cap = GaugeMetricFamily("featpool_pool_capacity_bytes", "Pool capacity", labels=["tier"])
        used = GaugeMetricFamily(
            "featpool_pool_used_bytes", "Bytes held by leases", labels=["tier"]
        )
        largest = GaugeMetricFamily(
            "featpool_pool_largest_free_bytes",
            "Largest free extent (fragmentation)",
            labels=["tier"],
        )
        active = GaugeMetricFamily("featpool_leases_active", "Leases alive", labels=["tier"])
        for t in s["tiers"]:
            cap.add_metric([t["tier"]], t["capacity_bytes"])
            used.add_metric([t["tier"]], t["used_bytes"])
            largest.add_metric([t["tier"]], t["largest_free_bytes"])
            active.add_metric([t["tier"]], t["leases_active"])
        inline = s["inline"]
        cap.add_metric(["inline"], inline["capacity_bytes"])
        used.add_metric(["inline"], inline["used_bytes"])
        active.add_metric(["inline"], inline["leases_active"])
        yield from (cap, used, largest, active)

        yield GaugeMetricFamily(
            "featpool_lease_slots", "Lease slots in the control block", value=s["max_leases"]
        )
        yield GaugeMetricFamily(
            "featpool_consumers_attached",
            "Consumer processes attached to the hand-off socket",
            value=s["consumers_attached"],
        )
        yield GaugeMetricFamily(
            "featpool_remote_consumers_attached",
            "Of those, consumers on other nodes (TCP FABRIC hand-off, --fabric-listen)",
            value=s.get("remote_consumers_attached", 0),
        )
        refused = CounterMetricFamily(
            "featpool_handoff_refused",
            "Hand-off connections turned away or ended by the server, by server (unix, tcp) and "
            "reason (docs/security.md)",
            labels=["server", "reason"],
        )
        for server, reasons in s.get("handoff_refused", {}).items():
            for reason, n in reasons.items():
                refused.add_metric([server, reason], n)
        yield refused
        created = CounterMetricFamily("featpool_leases_created", "Leases created", labels=["tier"])
        for tier, n in s["created"].items():
            created.add_metric([tier], n)
        yield created
        released = CounterMetricFamily(
            "featpool_leases_released",
            "Leases ended: by consumer ack, DELETE, or discarded (made for a request that failed "
            "or went away, never given to anyone)",
            labels=["reason"],
        )
        for reason, n in s["released"].items():
            released.add_metric([reason], n)
        yield released
        expired = CounterMetricFamily(
            "featpool_leases_expired", "Leases ended by their deadline", labels=["tier"]
        )
        for tier, n in s["expired"].items():
            expired.add_metric([tier], n)
        yield expired
        fallbacks = CounterMetricFamily(
            "featpool_fallbacks",
            "Tensors placed lower in the chain than the first tier",
            labels=["reason", "tier"],
        )
        for (reason, tier), n in s["fallbacks"].items():
            fallbacks.add_metric([reason, tier], n)
        yield fallbacks
        failures = CounterMetricFamily(
            "featpool_allocation_failures", "Allocations a tier could not satisfy", labels=["tier"]
        )
        for tier, n in s["alloc_failures"].items():
            failures.add_metric([tier], n)
        yield failures
        yield CounterMetricFamily(
            "featpool_lease_slots_exhausted",
            "Tensors refused because every lease slot was in use (bytes may have been free)",
            value=s.get("slot_exhaustions", 0),
        )
        quarantine = CounterMetricFamily(
            "featpool_lease_quarantine",
            "Leases whose memory was kept after they ended because a consumer still had them "
            "open (held), and how each hold ended (released: every opener acked or detached; "
            "timed_out: reused after the quarantine limit)",
            labels=["outcome"],
        )
        for outcome in ("held", "released", "timed_out"):
            quarantine.add_metric([outcome], s.get("quarantine", {}).get(outcome, 0))
        yield quarantine
        yield GaugeMetricFamily(
            "featpool_quarantined_leases",
            "Ended leases whose memory is held for consumers that opened them",
            value=s.get("quarantined_leases", 0),
        )
        yield GaugeMetricFamily(
            "featpool_quarantined_bytes",
            "Bytes held by quarantined leases (counted in featpool_pool_used_bytes too)",
            value=s.get("quarantined_bytes", 0),
        )


class HttpMetrics:
    """The per-request metrics, kept by whichever processes answer HTTP. With front processes
    (``--http-workers``) those are the fronts, in prometheus_client's multiprocess mode; the GPU
    process exports their sum (see ``Metrics``)."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        r = registry
        self.requests = Counter(
            "featpool_http_requests", "HTTP requests", ["endpoint", "status_class"], registry=r
        )
        self.request_seconds = Histogram(
            "featpool_request_duration_seconds",
            "HTTP request duration",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.rejected = Counter(
            "featpool_rejected", "Requests turned away before work", ["reason"], registry=r
        )
        self.admission = Counter(
            "featpool_admission_images",
            "Images of encode requests at the entrance: admitted, refused (429: no room), invalid "
            "(refused at the header, before the engine: not an image, over a limit)",
            ["outcome"],
            registry=r,
        )
        # A front's encode jobs: images (and their bytes) handed to the GPU process through
        # the front's shared-memory arena, or inline on the job socket (no room in the arena
        # at that moment, or --job-arena-bytes 0). Only fronts count these.
        self.job_images = Counter(
            "featpool_job_images",
            "Images a front handed to the GPU process, by path: arena (shared memory) or inline",
            ["path"],
            registry=r,
        )
        self.job_bytes = Counter(
            "featpool_job_bytes",
            "Image bytes a front handed to the GPU process, by path: arena or inline",
            ["path"],
            registry=r,
        )
        # Only fronts observe it: an encode job from sending it to the GPU process to its
        # answer (with featpool_job_duration_seconds: how long the job channel itself took).
        self.front_job_seconds = Histogram(
            "featpool_front_job_duration_seconds",
            "Encode jobs as a front sees them: from sending the job to the GPU process until "
            "its answer arrives",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # Only fronts set it: behind fronts the client connections are theirs, so the GPU
        # process's own process_open_fds does not see them. The live front holding the most.
        self.front_open_fds = Gauge(
            "featpool_front_open_fds",
            "Open file descriptors of the HTTP front process holding the most (0 without "
            "fronts); they share process_max_fds, the GPU process's limit",
            multiprocess_mode="livemax",
            registry=r,
        )
        # Collector pauses of the front processes, summed (app/interpreter.py).
        self.front_gc_pause = Counter(
            "featpool_front_gc_pause_seconds",
            "Time the HTTP front processes spent in garbage collections, by generation",
            ["generation"],
            registry=r,
        )


class Metrics(HttpMetrics):
    """The service's metrics. ``registry`` is what ``/metrics`` serves."""

    def __init__(self, front_metrics_dir: Path | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        if front_metrics_dir is None:
            super().__init__(r)
        else:
            # The fronts answer HTTP and count it; what reaches this process is forwarded
            # traffic, so its own counts stay off the export and the fronts' sum goes on it.
            super().__init__(CollectorRegistry())
            MultiProcessCollector(r, path=str(front_metrics_dir))  # type: ignore[no-untyped-call]
        # process_* of this (the GPU) process: open FDs above all, since the hand-off passes
        # them; and python_info. Default collectors register on the global registry, not here.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.build_info = Gauge(
            "featpool_build_info",
            "Build and runtime versions",
            ["version", "torch", "cuda", "transport", "encoder", "device", "decoder"],
            registry=r,
        )
        self.ready = Gauge("featpool_ready", "1 when the service takes requests", registry=r)
        self.job_seconds = Histogram(
            "featpool_job_duration_seconds",
            "Encode jobs from the fronts in this (the GPU) process: from reading the job's frame "
            "to handing its answer to the connection (queue, decode, encode and publish included)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.gc_pause = Counter(
            "featpool_gc_pause_seconds",
            "Time this (the GPU) process spent in garbage collections, holding the interpreter "
            "lock: the event loop, decode and batch threads wait meanwhile; by generation",
            ["generation"],
            registry=r,
        )
        self.queue_seconds = Histogram(
            "featpool_queue_wait_seconds",
            "Time an image waited for its batch",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_seconds = Histogram(
            "featpool_decode_duration_seconds",
            "Decode and preprocess time of one image",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.encode_seconds = Histogram(
            "featpool_encode_duration_seconds",
            "Encoder forward time of one batch",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.stage_seconds = Histogram(
            "featpool_batch_stage_seconds",
            "Host time of one batch in each pipeline stage, on that stage's thread: prepare "
            "(decode, preprocess) and run (forward launch, publish); the slower is the cycle",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.publish_seconds = Histogram(
            "featpool_publish_duration_seconds",
            "Host time to place one tensor in the pool",
            buckets=FAST_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "featpool_batch_size", "Images per encoder batch", buckets=BATCH_BUCKETS, registry=r
        )
        self.queue_depth = Gauge(
            "featpool_queue_depth", "Images waiting for the encoder", registry=r
        )
        self.images = Counter("featpool_images", "Images by outcome", ["outcome"], registry=r)
        self.admitted_images = Gauge(
            "featpool_admission_in_flight_images",
            "Images holding an admission permit (being inspected, decoded, queued or encoded)",
            registry=r,
        )
        self.admitted_bytes = Gauge(
            "featpool_admission_in_flight_decoded_bytes",
            "Decoded bytes (from the headers) of the images holding an admission permit",
            registry=r,
        )

    def watch_pool(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(PoolCollector(stats))

    def watch_feature_index(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(FeatureIndexCollector(stats))


class FeatureIndexCollector(Collector):
    """The content-addressed feature index (app/featindex.py), read at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        s = self._stats()
        yield GaugeMetricFamily(
            "featpool_feature_cache_entries",
            "Images whose features the index can reuse",
            s["entries"],
        )
        lookups = CounterMetricFamily(
            "featpool_feature_cache_lookups",
            "Images and lookups by hash or id: hit (a copy of resident features, no encode) "
            "or miss",
            labels=["result"],
        )
        lookups.add_metric(["hit"], s["hits"])
        lookups.add_metric(["miss"], s["misses"])
        yield lookups
        evictions = CounterMetricFamily(
            "featpool_feature_cache_evictions",
            "Index entries dropped: capacity (LRU) or ended (their leases all ended)",
            labels=["reason"],
        )
        for reason, n in sorted(s["evictions"].items()):
            evictions.add_metric([reason], n)
        yield evictions
