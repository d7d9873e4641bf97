"""The lease descriptor: the one definition of what a lease looks like on every wire.

``FeaturePool.describe`` makes it; the HTTP API returns it (``POST /v1/encode`` per image,
``GET /v1/leases/{id}``, renew), the hand-off socket answers ``lookup``/``renew`` with it, the
job channel between HTTP front processes and the GPU process carries it, and ``pool.client``
parses it. docs/protocol.md's table lists these fields (a test keeps the two in step).

Only pydantic here: HTTP front processes import this module and must not load torch.
A new field is one line below; give it a default (``None``) so that a consumer built against an
older producer, or an older consumer reading a newer producer, still parses descriptors
(unknown fields are ignored).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

# The shortest lease deadline anyone may ask for: below it a lease would expire before its
# descriptor reached the client (?ttl_s=1e-300 used to answer 200 with an expired lease).
MIN_TTL_S = 0.01


class LeaseDescriptor(BaseModel):
    """One lease: where its tensor lives and how to check that it is still the one you asked
    for."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    lease_id: str = Field(description="32 hex digits")
    epoch: str = Field(description="pool epoch (16 hex digits); changes when the producer restarts")
    state: str = Field(description="reserved or ready (ended leases are not served)")
    tier: str = Field(description="gpu, host or inline")
    transport: str = Field(description="cuda_vmm, host_shm or inline")
    slab: int | None = Field(description="index of the slab within its tier; null when inline")
    offset: int | None = Field(description="byte offset in the slab (a multiple of 256)")
    nbytes: int = Field(description="bytes of the tensor: prod(shape) * itemsize")
    shape: list[int] = Field(description="C-contiguous (row-major) shape")
    dtype: str = Field(description="PyTorch dtype name: float32, bfloat16, float16, ...")
    grid_thw: list[int] | None = Field(
        None,
        description="dynamic-resolution encoders (Qwen2-VL, Qwen2.5-VL): the image grid "
        "[t, h, w] in patches, the processor's image_grid_thw; null for fixed-size encoders",
    )
    tokens: int | None = Field(
        None,
        description="dynamic-resolution encoders: the image's token count, t*h*w / merge**2 "
        "(the first dimension of shape unless pooled); null for fixed-size encoders",
    )
    slot: int = Field(description="the control-block slot of the lease")
    generation: int = Field(description="the slot's generation that identifies this lease")
    created_at: float = Field(description="seconds since the Unix epoch")
    expires_at: float = Field(description="deadline, seconds since the Unix epoch")
    ttl_s: float = Field(description="the deadline it was given, in seconds")
    feature_hash: str | None = Field(
        None,
        description="encode and feature leases: SHA-256 (hex) of the encoder's identity and the "
        "image bytes; names the features in /v1/features and as an engine's multimodal uuid",
    )
    cached: bool | None = Field(
        None,
        description="encode and feature leases: true when the features were already resident "
        "and copied into this lease, without decoding or encoding",
    )

    @classmethod
    def parse(cls, value: LeaseDescriptor | Mapping[str, Any]) -> LeaseDescriptor:
        """A descriptor from one, or from its JSON object (what HTTP and the socket send)."""
        return value if isinstance(value, LeaseDescriptor) else cls.model_validate(value)

    def wire(self) -> dict[str, Any]:
        """The JSON object sent on the wire: ``model_dump(mode="json")``, which it equals (a
        test holds it to that), at a fifth of the cost. Every field is already a JSON type; the
        lists are copied, so the object can be changed without changing the descriptor."""
        wire = dict(self.__dict__)
        wire["shape"] = list(self.shape)
        if self.grid_thw is not None:
            wire["grid_thw"] = list(self.grid_thw)
        return wire


class FeatureInfo(BaseModel):
    """``GET /v1/features/{ref}``: resident features named by their hash or a client id."""

    feature_hash: str = Field(description="SHA-256 (hex) of the encoder identity and the bytes")
    shape: list[int] = Field(description="shape of the features")
    dtype: str = Field(description="dtype of the features")


class EncodeResponse(BaseModel):
    """``POST /v1/encode``'s answer, also the job channel's answer to an encode job."""

    items: list[LeaseDescriptor] = Field(description="one lease per image, in request order")
