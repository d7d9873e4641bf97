"""The encoder interface, and the shared plumbing of the built-in implementations."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from app.preprocess import ImageSpec

log = logging.getLogger(__name__)


@runtime_checkable
class Encoder(Protocol):
    """Turns a batch of normalised images into feature tokens.

    `encode` takes `[B, 3, image_size, image_size]` floats already normalised with `mean`/`std`,
    on `device` (any float dtype), and returns `[B, *output_shape]` in `dtype` on `device`.
    """

    name: str
    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    output_shape: tuple[int, int]
    dtype: torch.dtype
    device: torch.device

    def encode(self, pixels: torch.Tensor) -> torch.Tensor: ...

    def warmup(self, batch_sizes: Sequence[int]) -> None: ...


@runtime_checkable
class DynamicEncoder(Protocol):
    """A dynamic-resolution tower (Qwen2-VL): each image keeps its own size and gives its own
    number of tokens. The encoder does its model's pre-processing itself.

    `encode_images` takes upright RGB `[3, H, W]` uint8 images on `device` and returns, per
    image, `([tokens, D] in dtype, (t, h, w))`: the features and the image grid in patches.
    """

    dynamic: bool
    name: str
    dtype: torch.dtype
    device: torch.device

    def encode_images(
        self, images: Sequence[torch.Tensor]
    ) -> list[tuple[torch.Tensor, tuple[int, int, int]]]: ...

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) for an image of that size; ValueError for a shape the model refuses."""
        ...

    def warmup(self, batch_sizes: Sequence[int]) -> None: ...


def is_dynamic(encoder: object) -> bool:
    return bool(getattr(encoder, "dynamic", False))


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA, float32 elsewhere (CPU bf16 matmuls are slow and imprecise)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_device(device: torch.device | str) -> torch.device:
    """`cuda` -> `cuda:<current>`, so that device comparisons are exact."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class ModuleEncoder:
    """An `Encoder` around an `nn.Module`: input checks, casting, inference mode, warm-up.

    Subclasses set the attributes and `_forward` (a callable from a `dtype` batch to tokens).
    """

    name: str
    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    output_shape: tuple[int, int]
    dtype: torch.dtype
    device: torch.device
    module: nn.Module
    _forward: Callable[[torch.Tensor], torch.Tensor]
    # The model's own preprocessing (app.preprocess), which the engine then applies instead of
    # its default (centre square, bicubic resize to image_size, normalise with mean/std).
    preprocess_spec: ImageSpec | None = None
    # batch size -> (graph, static input, static output); None: run eagerly
    _graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] | None = None
    _graph_pool: Any = None  # the memory pool the captured graphs share

    def enable_cuda_graphs(self) -> None:
        """Capture one CUDA graph per batch size that warmup() is given, and replay it for
        batches of exactly that size. A forward is then one launch instead of hundreds, so a
        busy Python process (HTTP parsing on other threads) no longer starves the GPU."""
        if self.device.type == "cuda":
            self._graphs = {}

    def _maybe_compile(self, compile: bool) -> None:
        if not compile:
            return
        if self.device.type != "cuda":
            log.warning(
                "encoder %s: torch.compile is only used on CUDA; running eagerly on %s",
                self.name,
                self.device,
            )
            return
        # Shapes are static per batch size; warmup() compiles each size the batcher will use,
        # and captures the compiled forward as a CUDA graph per size when graphs are on.
        self._forward = torch.compile(self._forward, dynamic=False)

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        # Only metadata is inspected here: nothing in encode() waits for the GPU.
        s = self.image_size
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != (3, s, s):
            raise ValueError(
                f"encoder {self.name} expects [B, 3, {s}, {s}], got {list(pixels.shape)}"
            )
        if pixels.device.type != self.device.type:
            raise ValueError(
                f"encoder {self.name} runs on {self.device}, got a tensor on {pixels.device}"
            )
        if not pixels.is_floating_point():
            raise TypeError(f"encoder {self.name} expects normalised floats, got {pixels.dtype}")
        graph = self._graphs.get(pixels.shape[0]) if self._graphs else None
        with torch.inference_mode():
            if graph is not None:
                g, static_in, static_out = graph
                static_in.copy_(pixels)
                g.replay()
                # A copy: the static output is overwritten by the next replay.
                return static_out.clone()
            out = self._forward(pixels.to(self.dtype))
            return out.to(self.dtype)

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        s = self.image_size
        # A compiled forward recompiles per batch size; past dynamo's recompile limit (8) it
        # would silently run the remaining sizes eagerly (the engine prepares 12 at 128).
        limit = max(torch._dynamo.config.recompile_limit, len(set(batch_sizes)) + 1)
        with torch._dynamo.config.patch(recompile_limit=limit):
            for b in batch_sizes:
                self.encode(torch.zeros(b, 3, s, s, device=self.device, dtype=self.dtype))
        if self._graphs is not None:
            # Largest first: the smaller graphs then fit in the memory pool it leaves.
            for b in sorted(set(batch_sizes), reverse=True):
                try:
                    self._capture(b)
                except RuntimeError as e:  # e.g. a model with a host sync in its forward
                    log.warning(
                        "encoder %s: CUDA graph capture failed (%s); running eagerly", self.name, e
                    )
                    self._graphs = None
                    break
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _capture(self, batch: int) -> None:
        assert self._graphs is not None
        s = self.image_size
        static_in = torch.zeros(batch, 3, s, s, device=self.device, dtype=self.dtype)
        side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.inference_mode():
            self._forward(static_in)  # warm the side stream's allocator state before capture
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._graph_pool):
            static_out = self._forward(static_in).to(self.dtype)
        self._graph_pool = graph.pool()
        self._graphs[batch] = (graph, static_in, static_out)
