"""The encode pipeline on a real GPU: the whole HTTP path with the real app (ViT-B/16, nvJPEG,
bf16), GPU decode against Pillow, several images per request, bad JPEGs answered with a 400."""

from __future__ import annotations

import concurrent.futures
import io
import logging
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image
from safetensors.torch import load

from app.gpu_decode import ByteSpans, JpegDecoder, preprocess, resize_square
from app.imaging import decode, inspect
from app.main import create_app
from app.settings import Settings
from tests.conftest import image_bytes, occupancy
from tests.test_imaging import LIMITS, bogus_huffman, jpeg, photo

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA"),
]
log = logging.getLogger(__name__)


def _serve(tmp_path_factory: pytest.TempPathFactory, **extra: object) -> Iterator[TestClient]:
    sock = tmp_path_factory.mktemp("sock") / "featpool.sock"
    base = dict(
        device="cuda",
        encoder="vit-b16-224",
        socket_path=sock,
        pool_bytes=256 << 20,
        host_pool_bytes=64 << 20,
        slab_bytes=64 << 20,
        max_batch_size=32,
        max_batch_wait_ms=20.0,
        gpu_decode="on",
        **extra,
    )
    last: Exception | None = None
    for transport in ("cuda_vmm", "host_shm"):
        try:
            c = TestClient(create_app(Settings(transport=transport, **base)))  # type: ignore[arg-type]
            c.__enter__()
        except Exception as e:  # the GPU pool may not start: say so, go on
            last = e
            print(f"transport {transport} did not start: {e!r}")
            continue
        print(f"pipeline GPU tests run with transport={transport}")
        yield c
        c.__exit__(None, None, None)
        return
    raise AssertionError(f"no transport started: {last}")


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    yield from _serve(tmp_path_factory)


@pytest.fixture
def client_two_prepare_threads(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    yield from _serve(tmp_path_factory, prepare_threads=2)


def test_nvjpeg_decode_equals_pillow() -> None:
    dev = torch.device("cuda")
    dec = JpegDecoder.create(dev, "on")
    assert dec is not None
    datas = [jpeg(photo(1024, 768, s), quality=90) for s in range(3)]
    outs = dec.decode([torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas])
    for d, out in zip(datas, outs, strict=True):
        assert isinstance(out, torch.Tensor) and out.is_cuda and out.shape == (3, 768, 1024)
        want = torch.from_numpy(np.asarray(Image.open(io.BytesIO(d)).convert("RGB")).copy())
        diff = (out.permute(1, 2, 0).cpu().float() - want.float()).abs()
        assert diff.mean() < 1.5 and diff.max() < 48, (diff.mean(), diff.max())
        small = preprocess([out], [1], 224)[0].cpu()
        ref = decode(d, 224, **LIMITS).float()
        assert (small - ref).abs().mean() < 3.0


def test_resize_on_tensor_cores_stays_within_a_level_of_torchs_kernel() -> None:
    """On CUDA ``resize_square`` multiplies in float16 (tensor cores): against torch's own
    antialiased bicubic kernel in float32 on the same GPU, on real photos (scikit-image's) of
    four sizes in one batch each, every value within 0.5 before rounding (so at most one level
    after it), 0.1 on average, and the rounded levels mostly the same."""
    from skimage import data as photos

    for name in ("chelsea", "coffee", "astronaut", "rocket"):
        arr = torch.from_numpy(getattr(photos, name)().copy()).permute(2, 0, 1).cuda()
        side = min(arr.shape[-2:])
        squares = torch.stack([arr[:, :side, :side], arr[:, -side:, -side:]])
        want = torch.nn.functional.interpolate(
            squares.float(), size=[224, 224], mode="bicubic", antialias=True, align_corners=False
        )
        got = resize_square(squares, 224)
        assert got.dtype == torch.float16 and got.shape == (2, 3, 224, 224)
        diff = (got.float() - want).abs()
        levels = (got.float().clamp(0, 255).round() != want.clamp(0, 255).round()).float()
        print(f"{name}: mean {diff.mean():.4f}, max {diff.max():.4f}, levels {levels.mean():.4f}")
        assert diff.max() < 0.5 and diff.mean() < 0.1 and levels.mean() < 0.1, name


def test_one_call_decode_equals_decode_then_preprocess() -> None:
    """nvJPEG's decode and ``preprocess`` compiled into one TorchScript call give the same
    pixels, bit for bit, as torchvision's decode followed by ``preprocess`` in Python: real
    photos (scikit-image's), EXIF-rotated, of three shapes in one batch. A batch with a JPEG
    nvJPEG refuses gets None (the engine then decodes image by image)."""
    from skimage import data as photos

    dec = JpegDecoder.create(torch.device("cuda"), "on", "nvjpeg")
    assert dec is not None and dec._fused is not None, "no one-call decode on this GPU"
    arrays = [photos.chelsea(), photos.coffee(), photos.astronaut(), photos.rocket()]
    datas = [jpeg(a, o, quality=90) for a, o in zip(arrays, [1, 6, 3, 8], strict=True)]
    tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas]
    orientations = [inspect(d, **LIMITS).orientation for d in datas]
    assert orientations == [1, 6, 3, 8]
    got = dec.decode_preprocess(ByteSpans.of(tensors), orientations, 224)
    decoded = dec.decode(tensors)
    assert all(isinstance(x, torch.Tensor) for x in decoded)
    want = preprocess([x for x in decoded if isinstance(x, torch.Tensor)], orientations, 224)
    assert got is not None and got.shape == (4, 3, 224, 224)
    assert torch.equal(got, want)
    bad = torch.frombuffer(bytearray(bogus_huffman(datas[0])), dtype=torch.uint8)
    assert dec.decode_preprocess(ByteSpans.of([tensors[1], bad]), [1, 1], 224) is None


@pytest.mark.parametrize("call", ["decode", "decode_preprocess"])
def test_nvjpeg_does_not_overwrite_memory_that_queued_work_still_reads(call: str) -> None:
    """torchvision's nvJPEG allocates its outputs on the current stream and writes them from
    a stream of its own (pytorch/vision#9606). Tensors freed on the current stream while reads
    of them wait there behind a GPU sleep give their blocks to the decoder's next outputs;
    without ``_current_stream_done`` it overwrites them before those reads run."""
    from skimage import data as photos

    dev = torch.device("cuda")
    dec = JpegDecoder.create(dev, "on", "nvjpeg")
    assert dec is not None
    data = jpeg(photos.astronaut(), quality=90)  # 512 x 512: outputs of [3, 512, 512] uint8
    datas = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for _ in range(4)]
    side = torch.cuda.Stream()
    wrong = 0
    with torch.cuda.stream(side):
        for _ in range(8):
            victims = [torch.ones(3, 512, 512, dtype=torch.uint8, device=dev) for _ in range(8)]
            torch.cuda.synchronize()
            torch.cuda._sleep(200_000_000)  # type: ignore[attr-defined]
            sums = [v.sum() for v in victims]  # queued behind the sleep
            del victims  # their blocks are free on `side`, their reads still queued
            if call == "decode":
                assert all(isinstance(x, torch.Tensor) for x in dec.decode(datas))
            else:
                assert dec.decode_preprocess(ByteSpans.of(datas), [1] * 4, 224) is not None
            torch.cuda.synchronize()
            wrong += sum(int(s) != 3 * 512 * 512 for s in sums)
    assert wrong == 0


def test_nvjpeg_refuses_only_the_bad_image() -> None:
    dec = JpegDecoder(torch.device("cuda"))
    good = jpeg(photo(256, 192))
    bad = bogus_huffman(good)
    assert inspect(bad, **LIMITS).gpu_jpeg
    outs = dec.decode(
        [torch.frombuffer(bytearray(x), dtype=torch.uint8) for x in (good, bad, good)]
    )
    assert isinstance(outs[0], torch.Tensor) and isinstance(outs[2], torch.Tensor)
    print(f"nvJPEG on a bogus Huffman table: {type(outs[1]).__name__}")


def test_http_path_many_images_per_request(client: TestClient) -> None:
    imgs = [
        ("a.jpg", jpeg(photo(1024, 768, 1), quality=90), "image/jpeg"),
        ("b.jpg", jpeg(photo(640, 960, 2), orientation=6), "image/jpeg"),
        ("c.png", image_bytes("PNG", size=(300, 200), mode="RGBA"), "image/png"),
        ("d.jpg", image_bytes("JPEG", mode="CMYK"), "image/jpeg"),
        ("e.jpg", image_bytes("JPEG", mode="L"), "image/jpeg"),
    ]
    r = client.post("/v1/encode", files=[("image", i) for i in imgs])
    assert r.status_code == 200, r.text
    items = r.json()["items"]
    assert len(items) == 5 and len({i["lease_id"] for i in items}) == 5
    for item in items:
        assert item["shape"] == [197, 768] and item["dtype"] == "bfloat16"
        t = load(client.get(f"/v1/leases/{item['lease_id']}/tensor").content)["features"]
        assert torch.isfinite(t.float()).all() and t.float().abs().sum() > 0
    print("tiers:", sorted({i["tier"] for i in items}), "transport:", items[0]["transport"])
    for item in items:
        assert client.delete(f"/v1/leases/{item['lease_id']}").status_code == 204


def test_options_on_gpu(client: TestClient) -> None:
    data = jpeg(photo(512, 512, 3))
    r = client.post(
        "/v1/encode?pooled=true&dtype=float32", content=data, headers={"content-type": "image/jpeg"}
    )
    assert r.status_code == 200, r.text
    item = r.json()["items"][0]
    assert item["shape"] == [768] and item["dtype"] == "float32"
    client.delete(f"/v1/leases/{item['lease_id']}")


def test_gpu_decode_features_match_pillow_path(client: TestClient) -> None:
    engine = client.app.state.engine  # type: ignore[attr-defined]
    data = jpeg(photo(1024, 768, 4), orientation=8, quality=90)
    headers = {"content-type": "image/jpeg"}
    a = client.post("/v1/encode?dtype=float32", content=data, headers=headers).json()["items"][0]
    jpeg_decoder, engine.jpeg = engine.jpeg, None
    entries, engine.index.max_entries = engine.index.max_entries, 0  # encode it again
    try:
        b = client.post("/v1/encode?dtype=float32", content=data, headers=headers).json()["items"][
            0
        ]
    finally:
        engine.jpeg = jpeg_decoder
        engine.index.max_entries = entries
    fa, fb = (
        load(client.get(f"/v1/leases/{x['lease_id']}/tensor").content)["features"] for x in (a, b)
    )
    cos = torch.nn.functional.cosine_similarity(fa.flatten(), fb.flatten(), dim=0)
    print(f"cosine(GPU decode, Pillow decode) = {cos:.4f}")
    assert cos > 0.98
    for x in (a, b):
        client.delete(f"/v1/leases/{x['lease_id']}")


def test_bad_jpeg_is_a_400_and_fails_alone(client: TestClient) -> None:
    good = jpeg(photo(800, 600, 5))
    before = occupancy(client)
    headers = {"content-type": "image/jpeg"}
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        futs = {
            name: ex.submit(client.post, "/v1/encode", content=body, headers=headers)
            for name, body in (
                ("bogus_huffman", bogus_huffman(good)),
                ("truncated", good[: len(good) // 2]),
                ("garbage", b"\xff\xd8\xff" + bytes(100)),
                ("good", good),
            )
        }
        res = {k: f.result() for k, f in futs.items()}
    assert res["good"].status_code == 200, res["good"].text
    for name in ("bogus_huffman", "truncated", "garbage"):
        assert res[name].status_code == 400, (name, res[name].text)
        assert res[name].json()["error"]["type"] == "invalid_image"
    client.delete(f"/v1/leases/{res['good'].json()['items'][0]['lease_id']}")
    assert occupancy(client) == before
    assert client.get("/health/live").status_code == 200


def test_metrics_after_traffic(client: TestClient) -> None:
    text = client.get("/metrics").text
    assert 'featpool_images_total{outcome="encoded"}' in text
    assert "featpool_batch_size_bucket" in text


def test_repeat_upload_is_a_device_copy_on_the_gpu_tier(client: TestClient) -> None:
    """Content-addressed features on the GPU tier: the repeat gets its own lease holding a
    device-to-device copy (no encode), which a consumer maps and reads like any other."""
    from pool.client import FeatureClient

    data = jpeg(photo(640, 480, 7), quality=90)
    first = client.post("/v1/encode", content=data, headers={"content-type": "image/jpeg"}).json()[
        "items"
    ][0]
    again = client.post("/v1/encode", content=data, headers={"content-type": "image/jpeg"}).json()[
        "items"
    ][0]
    assert (first["cached"], again["cached"]) == (False, True)
    assert again["tier"] == first["tier"]
    assert (again["slab"], again["offset"]) != (first["slab"], first["offset"])
    want = load(client.get(f"/v1/leases/{first['lease_id']}/tensor").content)["features"]
    sock = client.app.state.settings.socket_path  # type: ignore[attr-defined]
    with FeatureClient.connect(sock) as pool:
        view = pool.open(again)
        assert view.device.type == ("cuda" if again["tier"] == "gpu" else "cpu")
        assert torch.equal(view.cpu(), want)
        pool.release(again)
    client.delete(f"/v1/leases/{first['lease_id']}")


@pytest.mark.parametrize("server", ["client", "client_two_prepare_threads"])
def test_features_under_concurrent_load_are_each_images_own(
    server: str, request: pytest.FixtureRequest
) -> None:
    """Requests of one to three photos from 16 threads at once (batches of mixed shapes and
    sizes, prepared beside the forward of the batch before; with ``--prepare-threads 2`` two
    batches at once, on two streams): every lease's features are its image's own, as encoded
    alone (cosine >= 0.995, closer than to any other photo's), so no buffer of one batch is
    read after another batch reused it."""
    import random

    client: TestClient = request.getfixturevalue(server)

    from skimage import data as photos

    engine = client.app.state.engine  # type: ignore[attr-defined]
    arrays = [photos.chelsea(), photos.coffee(), photos.astronaut(), photos.rocket()]
    files = [jpeg(a, o, quality=90) for a, o in zip(arrays, [1, 6, 3, 8], strict=True)]
    files += [jpeg(photos.coffee()[:, 100:500], quality=90), jpeg(photos.astronaut()[::2])]
    headers = {"content-type": "image/jpeg"}

    def features(item: dict[str, object]) -> torch.Tensor:
        got = client.get(f"/v1/leases/{item['lease_id']}/tensor")
        t = load(got.content)["features"].float().flatten()
        assert client.delete(f"/v1/leases/{item['lease_id']}").status_code == 204
        return t

    entries, engine.index.max_entries = engine.index.max_entries, 0  # every upload encoded
    try:
        alone = []
        for f in files:
            r = client.post("/v1/encode?dtype=float32", content=f, headers=headers)
            assert r.status_code == 200, r.text
            alone.append(features(r.json()["items"][0]))

        def one_client(seed: int) -> list[tuple[int, dict[str, object]]]:
            rng = random.Random(seed)
            out = []
            for _ in range(12):
                picks = [rng.randrange(len(files)) for _ in range(rng.choice([1, 1, 2, 3]))]
                r = client.post(
                    "/v1/encode?dtype=float32",
                    files=[("image", (f"{i}.jpg", files[i], "image/jpeg")) for i in picks],
                )
                assert r.status_code == 200, r.text
                out += list(zip(picks, r.json()["items"], strict=True))
            return out

        with concurrent.futures.ThreadPoolExecutor(16) as ex:
            done = [x for part in ex.map(one_client, range(16)) for x in part]
    finally:
        engine.index.max_entries = entries
    refs = torch.stack(alone)
    worst = 1.0
    for i, item in done:
        cos = torch.nn.functional.cosine_similarity(features(item)[None], refs)
        assert int(cos.argmax()) == i, (i, cos.tolist())
        worst = min(worst, float(cos[i]))
    print(f"{len(done)} leases under load; worst cosine to its image alone {worst:.5f}")
    assert worst >= 0.995
