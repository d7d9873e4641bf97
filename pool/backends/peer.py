"""Which GPU a same-node consumer reads the GPU tier from, and how: the producer's GPU itself,
another GPU of the node reading it in place over peer access (NVLink or PCIe), or another GPU
that cannot reach it and gets a copy (docs/protocol.md 9).

The producer's GPU is named in the welcome by UUID (``cuda.device_uuid``): device ordinals
differ between processes with different CUDA_VISIBLE_DEVICES, UUIDs do not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pool.driver import DriverAPI, P2PAttribute, normalize_uuid
from pool.errors import CudaUnavailable, HandoffError

CrossGpu = Literal["auto", "map", "copy"]
Path = Literal["same_device", "peer", "copy"]

# Reasons an open() returns a copy instead of a view (FeatureClient.fallbacks' keys).
NO_PEER_ACCESS = "no_peer_access"
COPY_REQUESTED = "copy_requested"


@dataclass(frozen=True)
class GpuLink:
    """How this consumer reaches the producer's GPU. Ordinals are this process's."""

    producer_device: int  # the GPU the slabs live on
    device: int  # the GPU this consumer computes on (where open() tensors are)
    path: Path
    reason: str = ""  # why a copy (empty unless path == "copy")
    performance_rank: int | None = None  # the driver's relative rank of the link (peer only)

    @property
    def access_device(self) -> int:
        """The device the imported mappings are made accessible to (cuMemSetAccess)."""
        return self.producer_device if self.path == "copy" else self.device


def find_device(driver: DriverAPI, uuid: str) -> int:
    """This process's ordinal of the GPU with ``uuid``, or CudaUnavailable saying what to do."""
    want = normalize_uuid(uuid)
    count = driver.device_count()
    for i in range(count):
        if normalize_uuid(driver.device_uuid(i)) == want:
            return i
    raise CudaUnavailable(
        f"the producer's GPU {uuid} is not among the {count} GPU(s) this process sees: a "
        f"consumer maps the pool through the producer's GPU (in place or for a copy), so that "
        f"GPU must be visible here (CUDA_VISIBLE_DEVICES, or the same ResourceClaim)"
    )


def plan_link(
    driver: DriverAPI, device: int | None, uuid: str | None, mode: CrossGpu = "auto"
) -> GpuLink:
    """Resolve the producer's GPU from its UUID and decide the path to ``device`` (None: the
    producer's GPU). ``mode``: ``auto`` reads in place where the driver says the consumer's GPU
    can access the producer's, else copies; ``map`` refuses the copy; ``copy`` always copies."""
    if mode not in ("auto", "map", "copy"):
        raise ValueError(f"cross_gpu must be auto, map or copy, not {mode!r}")
    if not uuid:
        raise HandoffError("the welcome names no producer GPU (cuda.device_uuid)")
    owner = find_device(driver, uuid)
    if device is None or device == owner:
        return GpuLink(owner, owner, "same_device")
    count = driver.device_count()
    if not 0 <= device < count:
        raise CudaUnavailable(f"CUDA device {device} does not exist ({count} visible)")
    if mode == "copy":
        return GpuLink(owner, device, "copy", COPY_REQUESTED)
    # Reading memory that lives on ``owner`` from ``device``: both the peer capability and the
    # link's access attribute must say yes (cuMemSetAccess would fail otherwise).
    if driver.can_access_peer(device, owner) and driver.p2p_attribute(
        P2PAttribute.ACCESS_SUPPORTED, device, owner
    ):
        rank = driver.p2p_attribute(P2PAttribute.PERFORMANCE_RANK, device, owner)
        return GpuLink(owner, device, "peer", performance_rank=rank)
    if mode == "map":
        raise CudaUnavailable(
            f"GPU {device} cannot access GPU {owner}'s memory (no peer access between them, "
            f"per cuDeviceCanAccessPeer) and cross_gpu='map' refuses the copy: use "
            f"cross_gpu='auto' to get copies into GPU {device}, or consume on GPU {owner}"
        )
    return GpuLink(owner, device, "copy", NO_PEER_ACCESS)
