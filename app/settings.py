"""Service settings: environment variables with the prefix ``FEATPOOL_`` and the same names as
command-line flags (``--pool-bytes`` is ``FEATPOOL_POOL_BYTES``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, NonNegativeInt, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from pool.descriptor import MIN_TTL_S
from pool.protocol import parse_host_port

MiB = 1 << 20


def default_socket_path() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return Path(runtime) / "featpool" / "featpool.sock"


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def auto_http_workers(cores: int, cuda: bool) -> int:
    """``--http-workers -1``: with a GPU, one front per two cores (1 to 16): each front is a
    Python process that parses HTTP at one core's speed, and the other half is left to the GPU
    process (event loop, batch thread, decode threads) and the machine. Without one, none: the
    CPU encoder needs the cores itself."""
    return min(max(cores // 2, 1), 16) if cuda else 0


def resolve_batching(settings: Settings, cuda: bool) -> None:
    """Fill in ``--max-batch-size 0`` and ``--queue-size 0`` (the defaults), once, where the
    device is known: the GPU process, before its admission and batcher are made (fronts get
    the values it resolved).

    The largest batch is 128 on a GPU and 32 on the CPU. On the H200 with ViT-B/16, in four
    same-call pairs, 128 served more images/s than 32 at sixteen images per request in all
    four (+8 to +62 %) and at one per request in three (-14 to +31 %) (docs/benchmarks.md,
    "Eighth session"): a batch of 32 leaves the SMs idle between forwards. On the CPU a
    larger batch only makes each answer later.

    The queue admits eight largest batches, as 256 did for 32. A batch being gathered, one
    prepared and one encoded are three; a queue of two would hold the GPU back and refuse
    most of the load (sixteen requests of sixteen). The decoded-bytes bound still caps
    the memory they take."""
    if settings.max_batch_size == 0:
        settings.max_batch_size = 128 if cuda else 32
    if settings.queue_size == 0:
        settings.queue_size = 8 * settings.max_batch_size


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FEATPOOL_", extra="forbid")

    # HTTP
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port")
    http_workers: int = Field(
        -1,
        ge=-1,
        le=64,
        description="HTTP front processes that parse uploads and hand them to the GPU process; "
        "0 serves HTTP in the GPU process; -1 (default): half the usable cores, at most 16, "
        "where there is a CUDA device, else 0 (see auto_http_workers)",
    )
    job_arena_bytes: int = Field(
        256 * MiB,
        ge=0,
        description="shared memory (a sealed memfd) through which each HTTP front hands "
        "uploads to the GPU process instead of copying them through the job socket; a request "
        "that does not fit now goes through the socket (featpool_job_bytes_total{path=inline}); "
        "0: always through the socket",
    )
    api_key: SecretStr | None = Field(
        None, description="if set, every /v1 request needs 'Authorization: Bearer <key>'"
    )
    api_keys: list[SecretStr] = Field(
        default_factory=list,
        description="more API keys, one per tenant, accepted like api_key; cached features "
        "are scoped by the key that made them",
    )

    # Device and pool
    device: str = Field("auto", description="'auto', 'cpu', 'cuda' or 'cuda:N'")
    transport: Literal["auto", "cuda_vmm", "host_shm"] = Field(
        "auto", description="GPU pool (cuda_vmm) or host shared memory; auto picks cuda_vmm on CUDA"
    )
    pool_bytes: int = Field(1024 * MiB, gt=0, description="GPU tier size (cuda_vmm)")
    host_pool_bytes: int = Field(
        256 * MiB, ge=0, description="host tier size; 0 disables the host tier"
    )
    slab_bytes: int = Field(
        128 * MiB, gt=0, description="size of one slab (rounded to granularity)"
    )
    inline_max_bytes: int = Field(256 * MiB, ge=0, description="bound on inline (HTTP-only) leases")
    max_leases: int = Field(
        0,
        ge=0,
        description="lease slots in the control block; 0: enough that the tiers' bytes run out "
        "before the slots do at the encoder's feature size (at least 4096)",
    )
    lease_ttl_s: float = Field(60.0, ge=MIN_TTL_S, description="default lease deadline")
    max_lease_ttl_s: float = Field(
        3600.0, ge=MIN_TTL_S, description="longest deadline a client may ask"
    )
    quarantine_s: float = Field(
        300.0,
        gt=0,
        description="how long an ended lease a consumer still has open keeps its memory",
    )
    fallback: Literal["fallback", "wait", "reject"] = Field(
        "fallback", description="when the first tier is full: next tier, bounded wait, or 503"
    )
    fallback_wait_s: float = Field(0.5, ge=0, description="bound of the 'wait' policy")
    fabric: Literal["auto", "off", "require"] = Field(
        "auto", description="FABRIC handles for multi-node NVLink: probe, never, or must work"
    )
    reap_interval_s: float = Field(0.02, gt=0, description="how often acks and deadlines are read")

    # Hand-off socket
    socket_path: Path = Field(
        default_factory=default_socket_path,
        description="Unix socket consumers attach to (default: $XDG_RUNTIME_DIR/featpool/"
        "featpool.sock, or /tmp/featpool/featpool.sock without XDG_RUNTIME_DIR)",
    )
    socket_allowed_uids: list[int] = Field(
        default_factory=list, description="peer uids allowed; empty means this process's uid"
    )
    socket_allowed_gids: list[int] = Field(default_factory=list, description="peer gids allowed")
    socket_token: SecretStr | None = Field(None, description="shared secret consumers must send")
    socket_auth_timeout_s: float = Field(
        5.0,
        gt=0,
        description="seconds a hand-off connection has to send its hello (Unix socket and TCP); "
        "then it is closed",
    )
    socket_max_connections: int = Field(
        256,
        ge=1,
        le=65536,
        description="open connections per hand-off server; at the limit a new one displaces the "
        "oldest that has not authenticated, or is refused if all are attached consumers",
    )
    gpu_uuid: str | None = Field(
        None,
        description="GPU identity published in the socket directory's index (pool.discovery); "
        "on CUDA the device's own UUID is published and a different value here stops start-up; "
        "on CPU (host tier only) this configured value is what consumers ask for",
    )
    advertise_host: str | None = Field(
        None,
        description="address (IP or name) at which processes on this node reach this instance's "
        "HTTP port; published with the port in the socket directory's index (`http`), so a "
        "consumer that finds its GPU's socket also finds the HTTP API that leases on that "
        "pool (the chart sets the pod's IP)",
    )
    fabric_listen: str | None = Field(
        None,
        description="HOST:PORT where consumers on other NVLink nodes attach over TCP "
        "(FABRIC handles; needs --socket-token)",
    )

    # Encoder and batching
    encoder: str = Field(
        "vit-b16-224",
        description="a built-in preset, or hf:<local directory or org/name in the Hugging Face "
        "cache> (the hf extra)",
    )
    encoder_weights: Path | None = Field(None, description="local safetensors file for the encoder")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="encoder dtype; auto is bfloat16 on CUDA, float32 on CPU"
    )
    encoder_compile: bool = Field(
        False,
        description="torch.compile the encoder on CUDA, one static graph per batch size, each "
        "then captured as a CUDA graph unless --no-encoder-cuda-graphs (~1-2 min more at start)",
    )
    tower_compile: bool = Field(
        True,
        description="torch.compile (dynamic shapes) the blocks of a dynamic-resolution tower "
        "(Qwen2-VL, Qwen2.5-VL) on CUDA: 2.4x on Qwen2.5-VL-7B's tower on an H200, ~10 s more "
        "at start",
    )
    encoder_cuda_graphs: bool = Field(
        True, description="replay a captured CUDA graph per padded batch size (CUDA only)"
    )
    gpu_decode: Literal["auto", "on", "off"] = Field(
        "auto", description="JPEG decode on the GPU: if available, required, never"
    )
    decoder: Literal["auto", "nvjpeg", "torchcodec", "nvimgcodec", "pillow"] = Field(
        "auto",
        description="JPEG decoder, chosen at start-up: nvjpeg (torchvision), torchcodec "
        "(nvJPEG through torchcodec: a decoder per prepare thread, not one behind a lock), "
        "nvimgcodec (the GPU's hardware JPEG decoder, nvidia-nvimgcodec-cu13), pillow (CPU); "
        "auto: the first GPU one that works (nvjpeg, torchcodec, nvimgcodec), else pillow. A "
        "named one that does not work stops start-up",
    )
    prepare_threads: int = Field(
        1,
        ge=1,
        le=8,
        description="threads that decode and preprocess batches (each on a CUDA stream of its "
        "own) while the batch thread runs the encoder; the batch thread still takes batches in "
        "order. More than one lets the next batches' decode overlap each other's preprocessing",
    )
    max_batch_size: int = Field(
        0,
        ge=0,
        description="largest encoder batch; 0 (default): 128 on CUDA, 32 on the CPU (see "
        "resolve_batching)",
    )
    max_batch_wait_ms: float = Field(5.0, ge=0, description="how long a batch waits to fill")
    queue_size: int = Field(
        0,
        ge=0,
        description="images admitted at most (header parse, decode, queue, encode); beyond -> "
        "429; 0 (default): eight largest batches (see resolve_batching)",
    )
    max_inflight_decoded_bytes: int = Field(
        2048 * MiB,
        gt=0,
        description="decoded bytes (width x height x channels x bytes per sample, read from "
        "the headers) admitted at most across requests; beyond -> 429, a request above it -> 413",
    )
    decode_workers: int = Field(4, gt=0, description="threads decoding images on the CPU")

    # Input limits
    max_body_bytes: int = Field(32 * MiB, gt=0, description="largest request body")
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a request body that sends nothing for this long, or a request line and "
        "headers not all in within it, is answered 408 and its connection closed",
    )
    min_body_bytes_per_s: int = Field(
        1024,
        ge=0,
        description="past --body-timeout-s, a request body must have averaged this many bytes "
        "a second over the time spent waiting for it, else 408 and its connection closed; a "
        "client must take this much of a large answer each --body-timeout-s, else it is "
        "disconnected; 0: no minimum",
    )
    max_url_bytes: int = Field(8192, gt=0, description="longest request URL; beyond -> 414")
    max_header_bytes: int = Field(
        64 * 1024, gt=0, description="largest request header block; beyond -> 431"
    )
    max_image_bytes: int = Field(16 * MiB, gt=0, description="largest single image")
    max_image_pixels: int = Field(40_000_000, gt=0, description="decompression-bomb limit")
    max_images_per_request: int = Field(64, gt=0, description="image parts per request")
    # Decoded bytes: width x height x channels x bytes per sample, read from the headers and
    # refused (413) before any pixel is decoded. A 40 Mpx 8-bit RGB photo is 120 MB.
    max_image_decoded_bytes: int = Field(
        128 * MiB, gt=0, description="decoded bytes of one image; beyond -> 413"
    )
    max_request_decoded_bytes: int = Field(
        256 * MiB, gt=0, description="decoded bytes of all images of one request; beyond -> 413"
    )

    # Content-addressed features
    feature_cache_entries: int = Field(
        4096,
        ge=0,
        description="images whose pooled features a repeat upload or a lookup by hash or id "
        "can reuse (LRU); 0 turns the index off",
    )

    # The interpreter of the processes of `python -m app` (app/interpreter.py)
    gil_switch_interval_ms: float = Field(
        0.5,
        gt=0,
        le=100,
        description="the GPU process's interpreter switch interval (sys.setswitchinterval): "
        "how long a thread that gave up the interpreter lock in native code (a CUDA call, a "
        "JPEG decode, a CUDA tensor's deallocation) may wait to get it back from a busy thread; "
        "Python's own default is 5 ms",
    )
    gc_freeze: bool = Field(
        True,
        description="after start-up, move every object to the garbage collector's permanent "
        "generation (gc.freeze) in the processes of `python -m app`, so that collections while "
        "serving walk only what serving made (app/interpreter.py)",
    )
    gc_thresholds: list[NonNegativeInt] = Field(
        default_factory=lambda: [10_000, 10, 100],
        min_length=3,
        max_length=3,
        description="the garbage collector's thresholds (gc.set_threshold) in the processes of "
        "`python -m app` once started (default [10000, 10, 100]; Python's own is [700, 10, 10]; "
        "app/interpreter.py)",
    )

    # Logs
    log_level: str = Field("INFO", description="logging level")
    log_json: bool = Field(False, description="one JSON object per log line")

    @field_validator("fabric_listen")
    @classmethod
    def _check_listen(cls, v: str | None) -> str | None:
        if v is not None:
            parse_host_port(v)  # ValueError says what is expected
        return v

    @field_validator("advertise_host")
    @classmethod
    def _check_advertise_host(cls, v: str | None) -> str | None:
        if v is not None and (not v.strip("[]") or any(c in v for c in "/ @?#")):
            raise ValueError(
                "advertise_host must be an IP address or a host name, no scheme or port"
            )
        return v

    def advertised_url(self) -> str | None:
        """``http://host:port`` from advertise_host (an IPv6 address in brackets), or None."""
        if self.advertise_host is None:
            return None
        host = self.advertise_host.strip("[]")
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    def fabric_address(self) -> tuple[str, int] | None:
        return None if self.fabric_listen is None else parse_host_port(self.fabric_listen)

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        if v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit()):
            return v
        raise ValueError("device must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
