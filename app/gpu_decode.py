"""JPEG decode on the GPU (nvJPEG through torchvision, or nvImageCodec), and the resize that
follows it.

torchvision and nvImageCodec are imported lazily: both are optional, and the service runs
without them (Pillow decodes everything on the CPU then). ``preprocess`` is featpool's default
preprocessing (for encoders without a processor config of their own; those use
``app.preprocess.ImageSpec``); it is plain torch and runs on any device, so its behaviour (EXIF
orientation, crop, antialiased resize) is tested on the CPU against Pillow.
"""

from __future__ import annotations

import importlib
import logging
import queue
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, cast

import torch
import torch.nn.functional as nnf

from app.preprocess import device_index, orient

log = logging.getLogger(__name__)

DecodeFn = Callable[[list[torch.Tensor], torch.device], list[torch.Tensor]]


def narrow_spans(
    sources: list[torch.Tensor], which: list[int], offsets: list[int], sizes: list[int]
) -> list[torch.Tensor]:
    """Image i's bytes, ``sources[which[i]][offsets[i] : offsets[i] + sizes[i]]``, as a view
    each. TorchScript-compatible: inside a compiled call the views are made and freed without
    the interpreter."""
    return [sources[which[i]].narrow(0, offsets[i], sizes[i]) for i in range(len(which))]


class Held(NamedTuple):
    """A source tensor of spans and the view of it that holds it (``held``)."""

    tensor: torch.Tensor
    view: torch.Tensor


def held(t: torch.Tensor) -> Held:
    """``t`` with a view of it, to be kept together while ``t`` is a source of spans.

    Since torch 2.10 a tensor with a Python object takes the interpreter lock whenever its
    count of C++ references goes from 1 to 2 (to hold the object) or from 2 to 1 (to let it
    go). The one-call decode makes and frees a batch's spans, views of their sources, with the
    lock released; each source would take the lock in the middle of the call, and beside busy
    threads each take waits up to the switch interval. This view holds the count at 2 or more
    for as long as it lives, so the spans take no lock (docs/benchmarks.md, "Twenty-fifth
    session"; end to end at sixteen per request it measured no change, "Twenty-sixth")."""
    return Held(t, t[:])


@dataclass
class ByteSpans:
    """A batch's JPEGs as spans of a few uint8 CPU tensors (``narrow_spans``). Behind front
    processes the source of most spans is a front's whole job arena, one tensor made once per
    connection, so the one-call decoder takes a batch without a tensor made and freed per image
    from Python: beside a busy event loop each tensor freed waits for the interpreter lock
    (docs/benchmarks.md, "One call per batch", and "Seventeenth session")."""

    sources: list[torch.Tensor]
    which: list[int]
    offsets: list[int]
    sizes: list[int]

    @classmethod
    def of(cls, datas: Sequence[torch.Tensor]) -> ByteSpans:
        """One span per tensor, each its whole."""
        n = len(datas)
        return cls(list(datas), list(range(n)), [0] * n, [int(d.numel()) for d in datas])

    def tensors(self) -> list[torch.Tensor]:
        return narrow_spans(self.sources, self.which, self.offsets, self.sizes)


def centre_square(x: torch.Tensor) -> torch.Tensor:
    h, w = x.shape[-2:]
    side = min(h, w)
    top, left = (h - side) // 2, (w - side) // 2
    return x[..., top : top + side, left : left + side]


def resize_weights(side: int, size: int, device: torch.device) -> torch.Tensor:
    """``[size, side]``: the weights of torch's antialiased bicubic resize from ``side`` to
    ``size`` along one axis, taken from torch itself by resizing an identity matrix along that
    axis (the other axis keeps its size, and bicubic at scale 1 is the identity)."""
    eye = torch.eye(side, device=device)[None, None]
    return nnf.interpolate(
        eye, size=[size, side], mode="bicubic", antialias=True, align_corners=False
    )[0, 0]


def resize_square(x: torch.Tensor, size: int) -> torch.Tensor:
    """``[N, 3, S, S]`` -> ``[N, 3, size, size]``: torch's antialiased bicubic resize, done as
    two matrix products with its own weights (the filter is separable). On CUDA they run on
    tensor cores in float16: pixels 0..255 are exact in it, and the rounding of the weights and
    of the first product moves a result by ~0.03 on average (0.3 at most), so after rounding
    to whole levels 2-4 % of values differ by one from ``interpolate`` in float32, less than
    the bfloat16 rounding of the encoder's input. torch's own kernel sums ~14 x 14 taps per
    output from a 768 px side: for 128 photos on the H200 it ran at ~36,000 images/s against
    52,000-62,000, and beside a ViT-B/16 forward loop it held the forward to ~2,400 images/s
    against ~5,300 (docs/benchmarks.md, "Seventh session"). On the CPU, float32."""
    dtype = torch.float16 if x.is_cuda else torch.float32
    wt = resize_weights(x.shape[-1], size, x.device).t().to(dtype)  # [S, size]
    x = torch.matmul(x.to(dtype), wt)  # along the rows: [N, 3, S, size]
    return torch.matmul(x.transpose(-1, -2), wt).transpose(-1, -2)  # then the columns


def preprocess(images: list[torch.Tensor], orientations: list[int], size: int) -> torch.Tensor:
    """``[3, H, W]`` uint8 images -> ``[N, 3, size, size]`` float in 0..255, rounded as uint8.

    Like ``ImageOps.fit``: orient, crop the centred square, resize it with an antialiased
    bicubic filter. Images of one shape are resized in one call. TorchScript-compatible, so
    that nvJPEG's decode and this run as one call (``decode_preprocess``).
    """
    if len(images) != len(orientations):
        raise ValueError("one orientation per image")
    if len(images) == 0:
        return torch.empty([0, 3, size, size])
    squares: list[torch.Tensor] = []
    groups: dict[int, list[int]] = {}  # by side: the squares' shape, [3, side, side]
    for i in range(len(images)):
        square = centre_square(orient(images[i], orientations[i]))
        squares.append(square)
        side = square.shape[-1]
        if side in groups:
            groups[side].append(i)
        else:
            groups[side] = [i]
    out = torch.empty([len(images), 3, size, size], device=images[0].device)
    for side, idx in groups.items():
        x = torch.stack([squares[i] for i in idx])
        if side != size:
            x = resize_square(x, size)
        x = x.float().clamp_(0, 255).round_()
        if len(idx) == len(images):
            return x
        out[device_index(idx, x.device)] = x
    return out


def decode_preprocess(  # noqa: PLR0917 (TorchScript: called positionally from the wrapper)
    sources: list[torch.Tensor],
    which: list[int],
    offsets: list[int],
    sizes: list[int],
    orientations: list[int],
    size: int,
    mode: int,
    device: torch.device,
) -> torch.Tensor:
    """nvJPEG's batched decode (torchvision's operator) of the JPEGs in ``ByteSpans``' fields,
    and ``preprocess``, to be compiled by TorchScript into one call. Every torch call from
    Python gives up the interpreter lock and takes it back (as does every tensor freed), and
    beside a busy thread each take waits up to the switch interval: a few per image here (128
    images beside a spinning thread at a 5 ms switch interval: 1.7-1.9 s as Python, 30-40 ms as
    one call; docs/benchmarks.md, "One call per batch")."""
    datas = narrow_spans(sources, which, offsets, sizes)
    images = torch.ops.image.decode_jpegs_cuda(datas, mode, device)
    return preprocess(images, orientations, size)


def decode_preprocess_upright(  # noqa: PLR0917 (as decode_preprocess)
    sources: list[torch.Tensor],
    which: list[int],
    offsets: list[int],
    sizes: list[int],
    orientations: list[int],
    size: int,
    mode: int,
    device: torch.device,
) -> torch.Tensor:
    """``decode_preprocess`` with torchcodec's nvJPEG operator, which turns each image upright
    by its EXIF orientation itself (so ``orientations`` is all 1 here: ``JpegDecoder.upright``)."""
    datas = narrow_spans(sources, which, offsets, sizes)
    images = torch.ops.torchcodec_ns.decode_jpegs_cuda(datas, mode, device)
    return preprocess(images, orientations, size)


FusedFn = Callable[[ByteSpans, list[int], int], torch.Tensor]


def _current_stream_done(device: torch.device) -> None:
    """Wait for the work queued on the current stream, before a GPU decoder writes.

    torchvision's nvJPEG allocates its outputs on the current stream and writes them from a
    stream of its own, without waiting for the current one. The caching allocator hands out a
    block as soon as it is freed on its stream, even while kernels queued there have yet to
    read it; so the decoder can overwrite memory that queued work (the previous batch's
    preprocessing, or its forward) still reads (pytorch/vision#9606). nvJPEG's hardware engine
    is reported not to wait for the stream it is given either (torchcodec's decoder waits like
    this, meta-pytorch/torchcodec#1634), so nvImageCodec, which decodes with that engine into
    memory of its own, waits too. ``JpegDecoder`` waits before each of its decode calls."""
    torch.cuda.current_stream(device).synchronize()


def _torchvision_decoder(device: torch.device) -> DecodeFn:
    """nvJPEG through torchvision (batched; CUDA cores do the IDCT and colour conversion)."""
    _need_cuda(device)
    from torchvision.io import ImageReadMode, decode_jpeg

    def decode(datas: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        out = decode_jpeg(datas, mode=ImageReadMode.RGB, device=device)
        return out if isinstance(out, list) else [out]

    return decode


RGB = 3  # ImageReadMode.RGB, in torchvision's enum and in torchcodec's alike


def _load_torchcodec() -> None:
    """Registers torchcodec's operators (``torchcodec_ns``); its image library needs no
    FFmpeg."""
    importlib.import_module("torchcodec.decoders")


def _torchcodec_decoder(device: torch.device) -> DecodeFn:
    """nvJPEG through torchcodec (``pip install torchcodec``; its CUDA build bundles nvJPEG):
    batched decode on the GPU's hardware JPEG engines where it has them (A100, H100, H200),
    else nvJPEG's CUDA decoder. Unlike torchvision's one decoder behind a process-wide mutex,
    each call takes a decoder of its own from a cache of up to 32 per GPU, so
    ``--prepare-threads N`` decodes N batches at once (on an H200 that served no more images
    a second than nvjpeg: docs/benchmarks.md, "Twenty-second session"). Its output is already
    upright (EXIF orientation applied), and its pixels are nvjpeg's."""
    _need_cuda(device)
    _load_torchcodec()
    op = torch.ops.torchcodec_ns.decode_jpegs_cuda

    def decode(datas: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        return list(op(datas, RGB, device))

    return decode


def torchscript(fn: Callable[..., torch.Tensor]) -> Any:
    """``fn`` compiled by TorchScript. TorchScript is deprecated (for torch.compile), and is
    what runs a batch's decode and preprocessing as one call here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(fn)


def _torchvision_fused(device: torch.device) -> FusedFn:
    """``decode_preprocess`` compiled by TorchScript (torchvision's operator must be loaded
    first: importing ``torchvision.io`` does it)."""
    _need_cuda(device)
    import torchvision.io  # noqa: F401

    return _compiled_fused(decode_preprocess, device)


def _torchcodec_fused(device: torch.device) -> FusedFn:
    """``decode_preprocess_upright`` compiled by TorchScript (after torchcodec's operators)."""
    _need_cuda(device)
    _load_torchcodec()
    return _compiled_fused(decode_preprocess_upright, device)


def _compiled_fused(fn: Callable[..., torch.Tensor], device: torch.device) -> FusedFn:
    compiled = torchscript(fn)

    def fused(spans: ByteSpans, orientations: list[int], size: int) -> torch.Tensor:
        return cast(
            torch.Tensor,
            compiled(
                spans.sources,
                spans.which,
                spans.offsets,
                spans.sizes,
                orientations,
                size,
                RGB,
                device,
            ),
        )

    return fused


def _nvimgcodec_decoder(device: torch.device) -> DecodeFn:
    """nvImageCodec (``nvidia-nvimgcodec-cu13`` with ``nvidia-nvjpeg``): the GPU's hardware
    JPEG decoder where it has one (A100, H100, H200: it leaves the SMs to the encoder), else
    nvImageCodec's CUDA decoder. Planar RGB, EXIF orientation left to ``preprocess`` like
    nvJPEG's output; decoded on torch's current stream. Its Python binding gives up the
    interpreter lock and waits for it twice per image (128 photos beside a thread spinning in
    Python: 8.6 ms alone, 107 ms at the service's 0.5 ms switch interval; docs/benchmarks.md,
    "Fourteenth session"), so beside the service's event loop it is slower than nvJPEG, which
    ``auto`` tries first."""
    _need_cuda(device)
    from nvidia import nvimgcodec  # type: ignore[import-not-found]

    kinds = (nvimgcodec.BackendKind.HW_GPU_ONLY, nvimgcodec.BackendKind.GPU_ONLY)
    params = nvimgcodec.DecodeParams(
        apply_exif_orientation=False,
        color_spec=nvimgcodec.ColorSpec.SRGB,
        sample_format=nvimgcodec.SampleFormat.P_RGB,
    )

    def new_decoder() -> Any:
        backends = [nvimgcodec.Backend(k) for k in kinds]
        return nvimgcodec.Decoder(device_id=device.index or 0, backends=backends)

    # nvImageCodec's types are not all thread safe (its "Thread Safety" note), so no decoder
    # serves two calls at once: each call takes an idle one, or makes one. With
    # --prepare-threads N, N batches decode at once on the hardware engines (torchvision's
    # nvJPEG is one decoder behind a process-wide mutex). Beside the forward, 1 / 2 / 3
    # decoders on as many threads decoded 6,021 / 8,589 / 9,046 images/s on the H200
    # (docs/benchmarks.md, "Why a second thread gains little").
    idle: queue.SimpleQueue[Any] = queue.SimpleQueue()
    idle.put(new_decoder())

    def decode(datas: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        stream = torch.cuda.current_stream(device).cuda_stream
        try:
            decoder = idle.get_nowait()
        except queue.Empty:
            decoder = new_decoder()
        try:
            streams = [nvimgcodec.CodeStream(d.numpy()) for d in datas]
            out = decoder.decode(streams, params=params, cuda_stream=stream)
        finally:
            idle.put(decoder)
        failed = [i for i, im in enumerate(out) if im is None]
        if failed:  # JpegDecoder.decode retries one by one: each failure fails alone
            raise RuntimeError(f"nvImageCodec could not decode image(s) {failed} of {len(out)}")
        return [torch.utils.dlpack.from_dlpack(im) for im in out]

    return decode


def _then_preprocess(decode: DecodeFn, device: torch.device) -> FusedFn:
    """A decoder without a one-call operator of its own (nvImageCodec), then ``preprocess``
    compiled by TorchScript: the preprocessing gives up and retakes the interpreter lock once
    per batch instead of a few times per image (``decode_preprocess`` says why that counts)."""
    compiled = torchscript(preprocess)

    def fused(spans: ByteSpans, orientations: list[int], size: int) -> torch.Tensor:
        return cast(torch.Tensor, compiled(decode(spans.tensors(), device), orientations, size))

    return fused


def _need_cuda(device: torch.device) -> None:
    if device.type != "cuda":
        raise RuntimeError(f"the device is {device}")


DecoderName = Literal["auto", "nvjpeg", "torchcodec", "nvimgcodec", "pillow"]


@dataclass(frozen=True)
class GpuDecoder:
    """A GPU JPEG library as the engine uses it: ``decode`` makes its batched decode; ``fused``
    its one-call decode and preprocess (``decode_preprocess``), where None means its decode,
    then ``preprocess`` compiled (``_then_preprocess``); ``upright``: its output is already
    turned by the EXIF orientation, so the engine passes orientation 1 for its images."""

    decode: Callable[[torch.device], DecodeFn]
    fused: Callable[[torch.device], FusedFn] | None = None
    upright: bool = False


# The GPU JPEG decoders, and the order in which --decoder auto tries them.
GPU_DECODERS: dict[str, GpuDecoder] = {
    "nvjpeg": GpuDecoder(_torchvision_decoder, _torchvision_fused),
    "torchcodec": GpuDecoder(_torchcodec_decoder, _torchcodec_fused, upright=True),
    "nvimgcodec": GpuDecoder(_nvimgcodec_decoder),
}
AUTO_ORDER = ("nvjpeg", "torchcodec", "nvimgcodec")


def _fused(name: str, kind: GpuDecoder, device: torch.device, decode: DecodeFn) -> FusedFn | None:
    """``name``'s one-call decode and preprocess, or None: without it (TorchScript gone from a
    later torch, say) the decoder still works, a few interpreter-lock waits per image slower."""
    try:
        return kind.fused(device) if kind.fused is not None else _then_preprocess(decode, device)
    except Exception as e:
        log.warning("%s: no one-call decode and preprocess (%s); decoding per image", name, e)
        return None


class JpegDecoder:
    """Batched GPU JPEG decode. A batch the library refuses is retried image by image, so one
    bad JPEG fails only itself; the caller falls back to Pillow for the images that still
    fail. ``name`` says which library decodes (``nvjpeg``, ``torchcodec``, ``nvimgcodec``)."""

    def __init__(
        self,
        device: torch.device,
        decode_fn: DecodeFn | None = None,
        name: str = "nvjpeg",
        fused: FusedFn | None = None,
        upright: bool = False,
    ) -> None:
        self.device = device
        self._decode = decode_fn or _torchvision_decoder(device)
        self.name = name
        self._fused = fused
        self.upright = upright  # (GpuDecoder.upright)

    @classmethod
    def create(
        cls,
        device: torch.device,
        mode: Literal["auto", "on", "off"] = "auto",
        decoder: DecoderName = "auto",
    ) -> JpegDecoder | None:
        """The GPU decoder that ``--decoder`` names, or None where Pillow decodes. ``auto``
        takes the first of GPU_DECODERS that loads and decodes a test JPEG, else Pillow (or a
        start-up error under ``--gpu-decode on``); a named one that does not work is a start-up
        error; ``pillow`` and ``--gpu-decode off`` decode on the CPU."""
        if mode == "off" or decoder == "pillow":
            if decoder not in ("auto", "pillow"):
                raise RuntimeError(f"--decoder {decoder} contradicts --gpu-decode off")
            return None
        reasons = []
        for name in AUTO_ORDER if decoder == "auto" else [decoder]:
            try:
                kind = GPU_DECODERS[name]
                decode = kind.decode(device)
                fused = _fused(name, kind, device, decode)
                made = cls(device, decode, name, fused, kind.upright)
                made.warmup()
            except Exception as e:  # not installed, no CUDA, a library that cannot decode
                reasons.append(f"{name}: {e}")
                continue
            log.info("JPEG decode on the GPU with %s", name)
            return made
        why = "; ".join(reasons)
        if decoder != "auto":
            raise RuntimeError(f"--decoder {decoder} (FEATPOOL_DECODER) does not work: {why}")
        if mode == "on":
            raise RuntimeError(f"--gpu-decode on (FEATPOOL_GPU_DECODE): no GPU decoder: {why}")
        log.info("JPEG decode on the CPU with Pillow: %s", why)
        return None

    def warmup(self) -> None:
        import io

        import numpy as np
        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(buf, "JPEG")
        data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        self._decode([data, data], self.device)
        if self._fused is not None:
            try:
                for _ in range(3):  # TorchScript profiles its first calls, then optimises
                    self._fused(ByteSpans.of([data, data]), [1, 6], 8)
            except (RuntimeError, torch.jit.Error) as e:
                log.warning("%s: one-call decode and preprocess failed (%s)", self.name, e)
                self._fused = None

    def _stream_done(self) -> None:
        if self.device.type == "cuda":
            _current_stream_done(self.device)

    def decode_preprocess(
        self, spans: ByteSpans, orientations: list[int], size: int
    ) -> torch.Tensor | None:
        """The batch decoded and preprocessed (``preprocess``) in one call, or None where this
        decoder has no such call or refused the batch (``decode`` then retries image by
        image, and the caller preprocesses)."""
        if self._fused is None:
            return None
        self._stream_done()
        try:
            return self._fused(spans, orientations, size)
        except (RuntimeError, torch.jit.Error) as e:  # TorchScript's is no RuntimeError
            # a JPEG nvJPEG refuses, or the device out of memory: the per-image path sorts it
            last = str(e).strip().splitlines()[-1:] or [type(e).__name__]
            log.info("one-call decode of a batch of %d failed (%s)", len(spans.which), last[0])
            return None

    def decode(self, datas: list[torch.Tensor]) -> list[torch.Tensor | Exception]:
        """``[3, H, W]`` uint8 tensors on the device, or the exception of each failed image."""
        self._stream_done()  # (the retries below free nothing with reads still queued)
        try:
            return list(self._decode(datas, self.device))
        except RuntimeError as e:
            if len(datas) == 1:
                return [e]
            log.info("nvJPEG refused a batch of %d (%s); decoding one by one", len(datas), e)
        results: list[torch.Tensor | Exception] = []
        for d in datas:
            try:
                results.append(self._decode([d], self.device)[0])
            except RuntimeError as e:
                results.append(e)
        return results
