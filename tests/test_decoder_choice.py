"""``--decoder auto|nvjpeg|torchcodec|nvimgcodec|pillow``: which JPEG decoder the engine
takes at start-up, its fallbacks, the start-up error when a named one is absent, and where the
choice is reported (``/v1/pool``, ``featpool_build_info``). The GPU decoders are replaced by
stand-ins here (this machine has no CUDA); the real ones run in tests/gpu."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load

import app.gpu_decode as gd
from app.gpu_decode import DecodeFn, JpegDecoder
from tests.test_imaging import jpeg, photo, pil_decode, upright_decode

CPU = torch.device("cpu")


def works(device: torch.device) -> DecodeFn:
    return pil_decode


def absent(what: str) -> Callable[[torch.device], DecodeFn]:
    def factory(device: torch.device) -> DecodeFn:
        raise ImportError(f"No module named {what!r}")

    return factory


def cannot_decode(device: torch.device) -> DecodeFn:
    def decode(datas: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        raise RuntimeError("decoder built without JPEG support")

    return decode


class StandIns:
    """``update(name=factory)`` puts ``factory`` in place of that GPU decoder's own decode;
    the rest of its record (its one-call decode, whether it is upright) stays the real one."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.table = dict(gd.GPU_DECODERS)
        monkeypatch.setattr(gd, "GPU_DECODERS", self.table)

    def update(self, **factories: Callable[[torch.device], DecodeFn]) -> None:
        for name, factory in factories.items():
            self.table[name] = replace(self.table[name], decode=factory)


@pytest.fixture
def decoders(monkeypatch: pytest.MonkeyPatch) -> StandIns:
    return StandIns(monkeypatch)


def test_auto_takes_nvjpeg_first(decoders: StandIns) -> None:
    decoders.update(nvjpeg=works, nvimgcodec=works)
    made = JpegDecoder.create(CPU, "auto", "auto")
    assert made is not None and made.name == "nvjpeg"


def test_auto_falls_back_to_nvimgcodec_then_pillow(
    decoders: StandIns, caplog: pytest.LogCaptureFixture
) -> None:
    decoders.update(nvjpeg=absent("torchvision"), nvimgcodec=works)
    made = JpegDecoder.create(CPU, "auto", "auto")
    assert made is not None and made.name == "nvimgcodec"
    decoders.update(nvimgcodec=cannot_decode)  # loads, but fails its test JPEG
    with caplog.at_level(logging.INFO, logger="app.gpu_decode"):
        assert JpegDecoder.create(CPU, "auto", "auto") is None
    assert "Pillow" in caplog.text and "torchvision" in caplog.text
    assert "without JPEG support" in caplog.text


def test_a_named_decoder_that_is_absent_stops_start_up(
    decoders: StandIns,
) -> None:
    decoders.update(nvjpeg=works, nvimgcodec=absent("nvidia.nvimgcodec"))
    with pytest.raises(RuntimeError, match=r"--decoder nvimgcodec .*nvidia\.nvimgcodec"):
        JpegDecoder.create(CPU, "auto", "nvimgcodec")
    made = JpegDecoder.create(CPU, "auto", "nvjpeg")
    assert made is not None and made.name == "nvjpeg"


def test_pillow_and_gpu_decode_off(decoders: StandIns) -> None:
    decoders.update(nvjpeg=works, nvimgcodec=works)
    assert JpegDecoder.create(CPU, "auto", "pillow") is None
    assert JpegDecoder.create(CPU, "off", "auto") is None
    with pytest.raises(RuntimeError, match="contradicts --gpu-decode off"):
        JpegDecoder.create(CPU, "off", "nvimgcodec")


def test_gpu_decode_on_needs_one(decoders: StandIns) -> None:
    decoders.update(nvjpeg=absent("torchvision"), nvimgcodec=absent("nvidia.nvimgcodec"))
    with pytest.raises(RuntimeError, match=r"--gpu-decode on .*torchvision.*nvimgcodec"):
        JpegDecoder.create(CPU, "on", "auto")


def test_the_real_decoders_refuse_a_cpu_device() -> None:
    """Without the stand-ins: on this CUDA-less machine each real GPU decoder is refused with
    the reason, and auto means Pillow."""
    for name in ("nvjpeg", "torchcodec", "nvimgcodec"):
        with pytest.raises(RuntimeError, match=f"--decoder {name} .*the device is cpu"):
            JpegDecoder.create(CPU, "auto", name)  # type: ignore[arg-type]
    assert JpegDecoder.create(CPU, "auto", "auto") is None


def test_the_choice_is_reported(
    decoders: StandIns,
    make_client: Callable[..., TestClient],
) -> None:
    c = make_client()
    assert c.get("/v1/pool").json()["decoder"] == "pillow"
    info = [ln for ln in c.get("/metrics").text.splitlines() if ln.startswith("featpool_build")]
    assert len(info) == 1 and 'decoder="pillow"' in info[0]


def test_a_named_decoder_is_reported_by_the_server(
    decoders: StandIns,
    make_client: Callable[..., TestClient],
) -> None:
    """The engine builds the decoder that --decoder names (a stand-in that works on the CPU
    here) and says so; a JPEG goes through it."""
    calls: list[int] = []

    def counting(device: torch.device) -> DecodeFn:
        def decode(datas: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
            calls.append(len(datas))
            return pil_decode(datas, device)

        return decode

    decoders.update(nvimgcodec=counting)
    c = make_client(decoder="nvimgcodec")
    assert c.get("/v1/pool").json()["decoder"] == "nvimgcodec"
    assert 'decoder="nvimgcodec"' in c.get("/metrics").text
    calls.clear()  # the warm-up's
    r = c.post("/v1/encode", content=jpeg(photo(64, 48)), headers={"content-type": "image/jpeg"})
    assert r.status_code == 200, r.text
    assert calls == [1]


def test_each_gpu_decode_call_waits_for_the_current_stream_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The decoders write from streams of their own into memory that work queued on ours may
    still read (pytorch/vision#9606): a CUDA JpegDecoder waits for its current stream before
    each decode and each one-call decode, retries included; on the CPU it has nothing to wait
    for. (The race itself: tests/gpu/test_pipeline_gpu.py.)"""
    calls: list[str] = []
    monkeypatch.setattr(gd, "_current_stream_done", lambda device: calls.append("wait"))

    def decode(datas: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        calls.append(f"decode {len(datas)}")
        return [torch.zeros(3, 2, 2, dtype=torch.uint8) for _ in datas]

    def fused(spans: gd.ByteSpans, orientations: list[int], size: int) -> torch.Tensor:
        calls.append(f"fused {len(spans.which)}")
        return torch.zeros(len(spans.which), 3, size, size)

    data = torch.zeros(4, dtype=torch.uint8)
    dec = JpegDecoder(torch.device("cuda"), decode, "nvjpeg", fused)  # stand-ins: no CUDA used
    dec.decode([data, data])
    assert dec.decode_preprocess(gd.ByteSpans.of([data] * 3), [1] * 3, 8) is not None
    assert calls == ["wait", "decode 2", "wait", "fused 3"]
    calls.clear()
    JpegDecoder(CPU, decode, "nvjpeg", fused).decode([data])
    assert calls == ["decode 1"]


def test_a_decoder_without_a_one_call_of_its_own_gets_compiled_preprocessing(
    decoders: StandIns,
) -> None:
    """nvImageCodec has no decode-and-preprocess operator: its one call is its decode, then
    ``preprocess`` compiled by TorchScript, with preprocess's own result (a stand-in decoder
    on the CPU here)."""
    decoders.update(nvimgcodec=works)
    made = JpegDecoder.create(CPU, "auto", "nvimgcodec")
    assert made is not None and made._fused is not None
    datas = [
        torch.frombuffer(bytearray(jpeg(photo(w, h))), dtype=torch.uint8)
        for w, h in ((64, 48), (30, 50))
    ]
    got = made.decode_preprocess(gd.ByteSpans.of(datas), [1, 6], 24)
    want = gd.preprocess(pil_decode(datas, CPU), [1, 6], 24)
    assert got is not None and torch.equal(got, want)


def test_an_upright_decoder_is_not_turned_again(
    decoders: StandIns,
    make_client: Callable[..., TestClient],
    tmp_path: Path,
) -> None:
    """torchcodec turns its output upright by the EXIF orientation itself; nvJPEG through
    torchvision leaves that to the engine. Stand-ins that decode as each does (Pillow, with
    and without ``exif_transpose``): JPEGs with each EXIF orientation give the same features
    through both, so none is turned twice (or not at all)."""
    decoders.update(nvjpeg=works, torchcodec=lambda device: upright_decode)
    clients = {
        name: make_client(decoder=name, socket_path=tmp_path / f"{name}.sock")
        for name in ("nvjpeg", "torchcodec")
    }
    for orientation in (1, 3, 6, 8):
        data = jpeg(photo(96, 64, orientation), orientation)
        got = {}
        for name, c in clients.items():
            r = c.post(
                "/v1/encode?dtype=float32", content=data, headers={"content-type": "image/jpeg"}
            )
            assert r.status_code == 200, r.text
            lease = r.json()["items"][0]["lease_id"]
            got[name] = load(c.get(f"/v1/leases/{lease}/tensor").content)["features"]
        assert torch.allclose(got["nvjpeg"], got["torchcodec"], atol=1e-5), orientation
