"""Every error the pool raises. Each has a stable ``type`` string that the HTTP layer and the
hand-off protocol use as the machine-readable error kind."""

from __future__ import annotations


class PoolError(Exception):
    """Base class. ``type`` is the stable, machine-readable kind of the error."""

    type = "pool_error"


class PoolExhausted(PoolError):
    """No tier could take the tensor under the configured fallback policy."""

    type = "pool_exhausted"


class SlotsExhausted(PoolExhausted):
    """Every lease slot is in use, whatever bytes are free: counted apart from full tiers."""

    type = "lease_slots_exhausted"


class TensorTooLarge(PoolError):
    """The tensor is larger than any slab of any tier: it can never be placed."""

    type = "tensor_too_large"


class InvalidTensor(PoolError):
    """The tensor cannot be published (empty, wrong device, not contiguous-able ...)."""

    type = "invalid_tensor"


class LeaseNotFound(PoolError):
    """No lease with that ID exists (never did, or was released long ago)."""

    type = "lease_not_found"


class LeaseExpired(PoolError):
    """The lease existed but its deadline passed; its memory has been recycled."""

    type = "lease_expired"


class LeaseReleased(PoolError):
    """The lease was released (by ack or DELETE); its memory has been recycled."""

    type = "lease_released"


class StaleLease(PoolError):
    """The slot behind the lease was recycled: its generation no longer matches."""

    type = "stale_lease"


class PoolRestarted(PoolError):
    """The lease belongs to another pool epoch: the producer restarted. Re-attach."""

    type = "pool_restarted"


class HandoffError(PoolError):
    """The hand-off socket refused us or spoke out of protocol."""

    type = "handoff_error"


class SocketInUse(HandoffError):
    """Another live server holds the socket path this one was asked to serve."""


class PeerRejected(HandoffError):
    """The hand-off server rejected this peer (uid/gid not allowed, or bad token)."""

    type = "peer_rejected"


class UntrustedProducer(HandoffError):
    """The process serving the hand-off socket runs as a uid the consumer does not trust
    (``server_uids``); nothing was sent to it."""

    type = "untrusted_producer"


class CudaUnavailable(PoolError):
    """CUDA was asked for but there is no usable NVIDIA driver or device."""

    type = "cuda_unavailable"


class CudaError(PoolError):
    """A CUDA driver call failed. The message names the call and the CUresult."""

    type = "cuda_error"

    def __init__(self, call: str, code: int, name: str, detail: str = "") -> None:
        self.call = call
        self.code = code
        self.name = name
        msg = f"{call} failed: {name} ({code})"
        super().__init__(f"{msg}: {detail}" if detail else msg)
