"""``--decoder nvimgcodec`` on a GPU: nvImageCodec's decode of real photos (scikit-image's)
against torchvision's nvJPEG and Pillow, a bad JPEG failing alone, and a server that serves
with it and says so."""

from __future__ import annotations

import io
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from app.engine import byte_tensor
from app.gpu_decode import ByteSpans, JpegDecoder, preprocess
from app.imaging import inspect
from app.main import create_app
from app.settings import Settings
from tests.gpu._harness import threads_decoding_at_once
from tests.test_imaging import LIMITS, bogus_huffman, jpeg

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def photos() -> list[bytes]:
    from skimage import data

    return [jpeg(f(), quality=90) for f in (data.astronaut, data.coffee, data.chelsea)]


def test_nvimgcodec_decodes_like_nvjpeg_and_pillow() -> None:
    pytest.importorskip("nvidia.nvimgcodec")
    dev = torch.device("cuda")
    nvimg = JpegDecoder.create(dev, "auto", "nvimgcodec")
    nvjpeg = JpegDecoder.create(dev, "auto", "nvjpeg")
    assert nvimg is not None and nvimg.name == "nvimgcodec"
    assert nvjpeg is not None
    datas = photos()
    a = nvimg.decode([byte_tensor(d) for d in datas])
    b = nvjpeg.decode([byte_tensor(d) for d in datas])
    for d, x, y in zip(datas, a, b, strict=True):
        assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
        assert x.is_cuda and x.dtype == torch.uint8 and x.shape == y.shape, (x.shape, y.shape)
        want = torch.from_numpy(np.asarray(Image.open(io.BytesIO(d)).convert("RGB")).copy())
        for out in (x, y):
            diff = (out.permute(1, 2, 0).cpu().float() - want.float()).abs()
            assert diff.mean() < 1.5 and diff.max() < 48, (diff.mean(), diff.max())


def test_nvimgcodec_refuses_only_the_bad_image() -> None:
    pytest.importorskip("nvidia.nvimgcodec")
    dec = JpegDecoder.create(torch.device("cuda"), "auto", "nvimgcodec")
    assert dec is not None
    good = photos()[0]
    bad = bogus_huffman(good)
    assert inspect(bad, **LIMITS).gpu_jpeg
    outs = dec.decode([byte_tensor(x) for x in (good, bad, good)])
    assert isinstance(outs[0], torch.Tensor) and isinstance(outs[2], torch.Tensor)
    print(f"nvImageCodec on a bogus Huffman table: {type(outs[1]).__name__}")


def test_server_with_nvimgcodec(tmp_path: Path) -> None:
    pytest.importorskip("nvidia.nvimgcodec")
    s = Settings(
        socket_path=tmp_path / "s.sock",
        device="cuda",
        encoder="tiny-test",
        decoder="nvimgcodec",
        pool_bytes=64 << 20,
        host_pool_bytes=64 << 20,
    )
    with TestClient(create_app(s)) as c:
        assert c.get("/v1/pool").json()["decoder"] == "nvimgcodec"
        assert 'decoder="nvimgcodec"' in c.get("/metrics").text
        files = [("image", (f"{i}.jpg", d, "image/jpeg")) for i, d in enumerate(photos())]
        r = c.post("/v1/encode", files=files)
        assert r.status_code == 200, r.text
        assert len(r.json()["items"]) == 3


def test_nvimgcodec_one_call_is_decode_then_preprocess() -> None:
    """nvImageCodec has no decode-and-preprocess operator: the decoder's one call is its
    decode, then ``preprocess`` compiled by TorchScript, and gives exactly what the two steps
    give from Python (orientations included)."""
    pytest.importorskip("nvidia.nvimgcodec")
    dec = JpegDecoder.create(torch.device("cuda"), "auto", "nvimgcodec")
    assert dec is not None and dec._fused is not None
    datas = [byte_tensor(d) for d in photos()]
    orientations = [1, 6, 3]
    got = dec.decode_preprocess(ByteSpans.of(datas), orientations, 224)
    decoded = dec.decode(datas)
    assert all(isinstance(x, torch.Tensor) for x in decoded)
    want = preprocess(cast(list[torch.Tensor], decoded), orientations, 224)
    assert got is not None and got.shape == (3, 3, 224, 224)
    assert torch.equal(got, want)


def test_nvimgcodec_decodes_on_several_threads_at_once() -> None:
    """Each concurrent call takes a decoder of its own (nvImageCodec's are not thread safe):
    four threads, each on a CUDA stream of its own as the prepare threads are, decoding the
    photos in their own order, each get every image's own pixels, every time."""
    pytest.importorskip("nvidia.nvimgcodec")
    dev = torch.device("cuda")
    dec = JpegDecoder.create(dev, "auto", "nvimgcodec")
    assert dec is not None
    datas = [byte_tensor(d) for d in photos()]
    errors = threads_decoding_at_once(dec, datas)
    assert not errors, errors[:5]
