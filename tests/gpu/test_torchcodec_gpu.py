"""``--decoder torchcodec`` on a GPU: torchcodec's nvJPEG operator against torchvision's on real
photos (scikit-image's) with EXIF orientations, its one call against its two steps, a bad JPEG
failing alone, several threads decoding at once, and a server that serves with it and says so."""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load

from app.engine import byte_tensor
from app.gpu_decode import ByteSpans, JpegDecoder, preprocess
from app.imaging import inspect
from app.preprocess import orient
from tests.gpu._harness import threads_decoding_at_once
from tests.gpu.test_pipeline_gpu import _serve
from tests.test_imaging import LIMITS, bogus_huffman, jpeg

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
ORIENTATIONS = [1, 6, 3, 8]


def photos() -> list[bytes]:
    from skimage import data

    arrays = [data.chelsea(), data.coffee(), data.astronaut(), data.rocket()]
    return [jpeg(a, o, quality=90) for a, o in zip(arrays, ORIENTATIONS, strict=True)]


@pytest.fixture(scope="module")
def decoders() -> tuple[JpegDecoder, JpegDecoder]:
    """torchcodec's decoder and nvJPEG's, each made (and its one call compiled) once."""
    pytest.importorskip("torchcodec")
    dev = torch.device("cuda")
    tc = JpegDecoder.create(dev, "on", "torchcodec")
    tv = JpegDecoder.create(dev, "on", "nvjpeg")
    assert tc is not None and tc.name == "torchcodec" and tc.upright
    assert tv is not None and not tv.upright
    return tc, tv


def test_torchcodec_decodes_like_torchvision_turned_upright(
    decoders: tuple[JpegDecoder, JpegDecoder],
) -> None:
    """Both are nvJPEG; torchcodec's output is already turned by the EXIF orientation, so it
    matches torchvision's turned by ``orient``: same shape, pixels within a level on average
    (the two may take different nvJPEG back-ends)."""
    tc, tv = decoders
    datas = photos()
    assert [inspect(d, **LIMITS).orientation for d in datas] == ORIENTATIONS
    a = tc.decode([byte_tensor(d) for d in datas])
    b = tv.decode([byte_tensor(d) for d in datas])
    for o, x, stored in zip(ORIENTATIONS, a, b, strict=True):
        assert isinstance(x, torch.Tensor) and isinstance(stored, torch.Tensor)
        y = orient(stored, o)
        assert x.is_cuda and x.dtype == torch.uint8 and x.shape == y.shape, (o, x.shape, y.shape)
        diff = (x.float() - y.float()).abs()
        print(f"orientation {o}: mean {diff.mean():.3f}, max {diff.max():.0f}")
        assert diff.mean() < 1.0 and diff.max() < 48, (o, diff.mean(), diff.max())


def test_torchcodec_one_call_is_its_decode_then_preprocess(
    decoders: tuple[JpegDecoder, JpegDecoder],
) -> None:
    """Its one TorchScript call gives exactly what its decode and ``preprocess`` give from
    Python; with the orientations the engine passes it (all 1: ``JpegDecoder.upright``) it
    matches nvJPEG's one call with the real ones. A batch with a JPEG it refuses gets None."""
    tc, tv = decoders
    assert tc._fused is not None and tv._fused is not None
    tensors = [byte_tensor(d) for d in photos()]
    ones = [1] * len(tensors)
    got = tc.decode_preprocess(ByteSpans.of(tensors), ones, 224)
    decoded = tc.decode(tensors)
    want = preprocess(cast(list[torch.Tensor], decoded), ones, 224)
    assert got is not None and got.shape == (4, 3, 224, 224)
    assert torch.equal(got, want)
    ref = tv.decode_preprocess(ByteSpans.of(tensors), ORIENTATIONS, 224)
    assert ref is not None
    diff = (got - ref).abs()
    print(f"torchcodec against nvJPEG, one call each: mean {diff.mean():.3f}, max {diff.max():.1f}")
    assert diff.mean() < 1.0
    bad = byte_tensor(bogus_huffman(photos()[0]))
    assert tc.decode_preprocess(ByteSpans.of([tensors[1], bad]), [1, 1], 224) is None


def test_torchcodec_refuses_only_the_bad_image(decoders: tuple[JpegDecoder, JpegDecoder]) -> None:
    tc, _ = decoders
    good = photos()[0]
    bad = bogus_huffman(good)
    assert inspect(bad, **LIMITS).gpu_jpeg
    outs = tc.decode([byte_tensor(x) for x in (good, bad, good)])
    assert isinstance(outs[0], torch.Tensor) and isinstance(outs[2], torch.Tensor)
    assert isinstance(outs[1], Exception), type(outs[1])


def test_torchcodec_decodes_on_several_threads_at_once(
    decoders: tuple[JpegDecoder, JpegDecoder],
) -> None:
    """Each call takes a decoder of its own from torchcodec's cache: four threads, each on a
    CUDA stream of its own as the prepare threads are, decoding the photos in their own order,
    each get every image's own pixels, every time."""
    tc, _ = decoders
    errors = threads_decoding_at_once(tc, [byte_tensor(d) for d in photos()])
    assert not errors, errors[:5]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, TestClient]]:
    pytest.importorskip("torchcodec")
    tc = _serve(tmp_path_factory, decoder="torchcodec", prepare_threads=2)
    tv = _serve(tmp_path_factory, decoder="nvjpeg")
    yield {"torchcodec": next(tc), "nvjpeg": next(tv)}
    for gen in (tc, tv):
        next(gen, None)


def test_server_with_torchcodec_turns_each_photo_once(servers: dict[str, TestClient]) -> None:
    """ViT-B/16 over HTTP: a server with ``--decoder torchcodec`` says so, and its features of
    EXIF-rotated photos are nvJPEG's (cosine > 0.99), which a photo turned twice is not."""
    c = servers["torchcodec"]
    assert c.get("/v1/pool").json()["decoder"] == "torchcodec"
    assert 'decoder="torchcodec"' in c.get("/metrics").text
    datas = photos()
    from skimage import data

    # turned 90 degrees clockwise, as orientation 6 asks, then marked to turn again
    twice = jpeg(np.ascontiguousarray(np.rot90(data.coffee(), -1)), 6, quality=90)
    feats: dict[str, list[torch.Tensor]] = {}
    for name, client in servers.items():
        files = [("image", (f"{i}.jpg", d, "image/jpeg")) for i, d in enumerate([*datas, twice])]
        r = client.post("/v1/encode?dtype=float32", files=files)
        assert r.status_code == 200, r.text
        items = r.json()["items"]
        feats[name] = [
            load(client.get(f"/v1/leases/{x['lease_id']}/tensor").content)["features"]
            for x in items
        ]
        for x in items:
            client.delete(f"/v1/leases/{x['lease_id']}")

    def cos(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))

    for o, a, b in zip(ORIENTATIONS, feats["torchcodec"], feats["nvjpeg"], strict=False):
        print(f"orientation {o}: cosine(torchcodec, nvJPEG) = {cos(a, b):.4f}")
        assert cos(a, b) > 0.99, o
    control = cos(feats["torchcodec"][-1], feats["nvjpeg"][1])  # coffee turned twice vs once
    print(f"a photo turned twice against once: cosine {control:.4f}")
    assert control < 0.99
