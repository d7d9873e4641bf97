"""The GPU JPEG decoders reading straight from a front's job arena (app/job_arena.py): the
bytes are a zero-copy view, and the front may rewrite them once the job is answered. That is
only safe if a decoder has read its input by the time ``decode`` returns (the answer goes out
later still); this checks it by rewriting the arena right after the call, before any sync."""

from __future__ import annotations

import ctypes

import pytest
import torch

from app.engine import Job, byte_spans, byte_tensor
from app.gpu_decode import GPU_DECODERS, ByteSpans, JpegDecoder
from app.job_arena import ArenaView, FrontArena
from tests.test_imaging import jpeg

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("name", sorted(GPU_DECODERS))
def test_decoders_are_done_with_the_arena_when_decode_returns(name: str) -> None:
    from skimage import data

    if name == "nvimgcodec":
        pytest.importorskip("nvidia.nvimgcodec")
    dec = JpegDecoder.create(torch.device("cuda"), "auto", name)
    assert dec is not None and dec.name == name
    photos = [jpeg(f(), quality=90) for f in (data.astronaut, data.coffee, data.chelsea)] * 8
    want = dec.decode([torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in photos])
    arena = FrontArena(8 << 20)
    view = ArenaView(arena.fd, arena.size)
    try:
        ext = arena.put(photos)
        assert ext is not None
        views = view.images(ext.offset, [len(p) for p in photos])
        datas = [byte_tensor(v) for v in views]
        for v, d in zip(views, datas, strict=True):  # views of the mapping, not copies
            assert d.data_ptr() == ctypes.addressof(ctypes.c_char.from_buffer(v))
        got = dec.decode(datas)
        arena._map[ext.offset : ext.offset + ext.size] = bytes(ext.size)  # the front, reusing
        torch.cuda.synchronize()
        for w, g in zip(want, got, strict=True):
            assert isinstance(w, torch.Tensor) and isinstance(g, torch.Tensor)
            assert torch.equal(w, g)
        del datas, views
    finally:
        view.close()
        arena.close()


@pytest.mark.parametrize("name", sorted(GPU_DECODERS))
def test_one_call_decode_of_arena_spans_is_the_per_image_tensors_one(name: str) -> None:
    """Behind front processes a batch's JPEGs reach the one-call decoder as spans of the
    arena's one tensor (``byte_spans``), not a tensor each: the pixels are the same, bit for
    bit, as from a tensor per image; an image sent inline (no arena) joins the same batch with
    a tensor of its own; and the call has read every span by the time it returns (the front
    rewrites the arena right after)."""
    from skimage import data

    if name == "nvimgcodec":
        pytest.importorskip("nvidia.nvimgcodec")
    dec = JpegDecoder.create(torch.device("cuda"), "auto", name)
    assert dec is not None and dec.name == name and dec._fused is not None
    photos = [jpeg(f(), quality=90) for f in (data.astronaut, data.coffee, data.chelsea)] * 4
    orientations = [1, 6, 3, 8] * 3
    per_image = [torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in photos]
    want = dec.decode_preprocess(ByteSpans.of(per_image), orientations, 224)
    assert want is not None
    arena = FrontArena(8 << 20)
    view = ArenaView(arena.fd, arena.size)
    try:
        ext = arena.put(photos[:-1])
        assert ext is not None
        views = view.images(ext.offset, [len(p) for p in photos[:-1]])
        jobs, at = [], ext.offset
        for v, o in zip(views, orientations, strict=False):
            jobs.append(Job("x", None, jpeg=v, orientation=o, arena=view, arena_offset=at))
            at += len(v)
        jobs.append(Job("inline", None, jpeg=photos[-1], orientation=orientations[-1]))
        spans = byte_spans(jobs)
        assert len(spans.sources) == 2  # the arena's tensor, and the inline JPEG's own
        got = dec.decode_preprocess(spans, orientations, 224)
        arena._map[ext.offset : ext.offset + ext.size] = bytes(ext.size)  # the front, reusing
        torch.cuda.synchronize()
        assert got is not None and torch.equal(got, want)
        del spans, jobs, views
    finally:
        view.close()
        arena.close()
