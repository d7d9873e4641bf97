"""Building the pool's tiers from settings, with the CUDA decision made once, at start-up, and
explained: which transport, why, and what fell back."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from app.settings import Settings
from pool import socket_file
from pool.backends.base import Backend
from pool.backends.host_shm import HostShmBackend
from pool.errors import CudaUnavailable, HandoffError, SocketInUse
from pool.featurepool import check_welcome_fds

log = logging.getLogger(__name__)


@dataclass
class Capabilities:
    """What start-up found; logged once and served in /v1/pool."""

    device: str
    transport: str
    cuda: bool
    vmm: bool = False
    posix_fd: bool = False
    fabric: bool = False
    fabric_reason: str = ""
    startup_fallbacks: list[tuple[str, str]] = field(default_factory=list)  # (reason, tier)


def wants_cuda(settings: Settings) -> bool:
    """Whether this service will run on CUDA, for the defaults chosen before the device is
    resolved (and checked, by ``resolve_device``) at start."""
    return settings.device != "cpu" and torch.cuda.is_available()


def resolve_device(settings: Settings) -> torch.device:
    if settings.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(settings.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CudaUnavailable(
            f"--device {settings.device} (FEATPOOL_DEVICE) needs an NVIDIA GPU with CUDA, and "
            f"torch sees none (torch {torch.__version__}); use --device cpu"
        )
    return device


def split_slabs(total: int, slab: int) -> list[int]:
    """``total`` bytes as slabs of at most ``slab`` bytes, each a multiple of 2 MiB (the VMM
    granularity on current GPUs; harmless for memfd)."""
    unit = 2 << 20
    slab = max(unit, slab // unit * unit)
    total = max(unit, (total + unit - 1) // unit * unit)
    sizes = [slab] * (total // slab)
    if total % slab:
        sizes.append(total % slab)
    return sizes


def socket_in_use(why: str) -> SocketInUse:
    """A second instance on one machine, most often: the flag that gives it a socket."""
    return SocketInUse(f"{why}; give this one its own: --socket-path (FEATPOOL_SOCKET_PATH)")


def preflight(settings: Settings) -> torch.device:
    """The device the settings ask for, or CudaUnavailable naming the flag to change: checked
    before the server starts, so a wrong flag is one clear line, not a traceback."""
    device = resolve_device(settings)
    if socket_file.served(settings.socket_path):
        raise socket_in_use(f"another featpool server is serving {settings.socket_path}")
    if settings.transport == "cuda_vmm":
        _vmm_needs_cuda(device)
    if settings.fabric_listen is not None:
        _remote_needs(settings, device)
    # The slabs the tiers will have (the GPU tier's granularity may move its count by one:
    # FeaturePool checks the real tiers again), so that too many is one line, not a traceback.
    gpu = settings.transport == "cuda_vmm" or (
        settings.transport == "auto" and device.type == "cuda"
    )
    totals = [settings.pool_bytes] if gpu else []
    if settings.host_pool_bytes > 0:
        totals.append(settings.host_pool_bytes)
    check_welcome_fds([len(split_slabs(total, settings.slab_bytes)) for total in totals])
    return device


def _remote_needs(settings: Settings, device: torch.device) -> None:
    """What --fabric-listen (consumers on other nodes) needs, checked before anything starts."""
    flag = "--fabric-listen (FEATPOOL_FABRIC_LISTEN)"
    if settings.socket_token is None:
        raise HandoffError(
            f"{flag} needs --socket-token (FEATPOOL_SOCKET_TOKEN): the FABRIC handles it hands "
            f"out map the pool from any node of the NVLink domain"
        )
    if settings.transport == "host_shm" or device.type != "cuda":
        raise CudaUnavailable(
            f"{flag} serves the GPU pool to other nodes, but this server runs "
            f"--transport {settings.transport} on {device}; use an NVIDIA GPU with "
            f"--transport cuda_vmm, or drop {flag}"
        )
    if settings.fabric == "off":
        raise CudaUnavailable(f"{flag} needs FABRIC handles, but --fabric is off")


def _vmm_needs_cuda(device: torch.device) -> None:
    if device.type != "cuda":
        raise CudaUnavailable(
            "--transport cuda_vmm (FEATPOOL_TRANSPORT) needs an NVIDIA GPU with CUDA, but the "
            f"device is {device} (torch.cuda.is_available() is "
            f"{torch.cuda.is_available()}); use --transport host_shm"
        )


def build_backends(settings: Settings, device: torch.device) -> tuple[list[Backend], Capabilities]:
    caps = Capabilities(device=str(device), transport="host_shm", cuda=device.type == "cuda")
    backends: list[Backend] = []
    if settings.transport == "cuda_vmm" or (settings.transport == "auto" and device.type == "cuda"):
        _vmm_needs_cuda(device)
        try:
            from pool.backends.cuda_vmm import CudaVmmBackend

            gpu = CudaVmmBackend.create(
                device.index if device.index is not None else torch.cuda.current_device(),
                pool_bytes=settings.pool_bytes,
                slab_bytes=settings.slab_bytes,
                fabric=settings.fabric,
            )
        except (CudaUnavailable, ImportError) as e:
            if settings.transport == "cuda_vmm":
                raise CudaUnavailable(
                    f"--transport cuda_vmm (FEATPOOL_TRANSPORT) could not start: {e}; "
                    f"use --transport host_shm"
                ) from e
            log.warning("GPU pool unavailable (%s); falling back to the host pool", e)
            caps.startup_fallbacks.append(("no_cuda", "host"))
        else:
            backends.append(gpu)
            caps.transport = "cuda_vmm"
            caps.vmm = caps.posix_fd = True
            status = getattr(gpu, "fabric_status", None)
            if status is not None:
                caps.fabric = bool(status.available)
                caps.fabric_reason = str(status.reason)
                if not status.available and settings.fabric == "auto":
                    caps.startup_fallbacks.append(("fabric_unavailable", "gpu"))
    if settings.host_pool_bytes > 0:
        backends.append(HostShmBackend(split_slabs(settings.host_pool_bytes, settings.slab_bytes)))
    return backends, caps
