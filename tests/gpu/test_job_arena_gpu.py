"""The GPU JPEG decoders reading straight from a front's job arena (app/job_arena.py): the
bytes are a zero-copy view, and the front may rewrite them once the job is answered. That is
only safe if a decoder has read its input by the time ``decode`` returns (the answer goes out
later still); this checks it by rewriting the arena right after the call, before any sync."""

from __future__ import annotations

import ctypes

import pytest
import torch

from app.engine import byte_tensor
from app.gpu_decode import GPU_DECODERS, JpegDecoder
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
