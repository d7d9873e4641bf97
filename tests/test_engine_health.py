"""Engine health by error type: a CUDA out-of-memory splits the batch (or fails it with 503)
and the service stays live; a sticky CUDA error (illegal address, launch failure, ECC) makes
it not live; an error while publishing releases that batch's leases at once."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from app.encoders import build_encoder
from app.engine import cuda_error_code, is_out_of_memory, is_sticky
from app.engine_client import ImageIn
from app.main import create_app
from pool.errors import CudaError
from tests.conftest import image_bytes, occupancy
from tests.helpers import small_settings

JPEG = image_bytes("JPEG", size=(64, 48))

# What torch raises for an illegal address: the text of cudaGetErrorString after its prefix.
ILLEGAL_ADDRESS = (
    "CUDA error: an illegal memory access was encountered\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1"
)


class FaultyEncoder:
    """The tiny encoder; ``fail(batch)`` returns an exception to raise for a batch, or None."""

    def __init__(self, fail: Callable[[torch.Tensor], BaseException | None]) -> None:
        self.inner = build_encoder("tiny-test", device=torch.device("cpu"))
        self.fail = fail
        self.batches: list[int] = []
        self.lock = threading.Lock()
        for name in ("name", "image_size", "mean", "std", "output_shape", "dtype", "device"):
            setattr(self, name, getattr(self.inner, name))

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.batches.append(pixels.shape[0])
        error = self.fail(pixels)
        if error is not None:
            raise error
        return self.inner.encode(pixels)

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        self.inner.warmup(batch_sizes)


@contextmanager
def client_with(tmp_path: Path, encoder: Any, **overrides: Any) -> Iterator[TestClient]:
    settings = small_settings(tmp_path, **overrides)
    with TestClient(create_app(settings, encoder=encoder)) as c:
        yield c


def post(client: TestClient, n: int) -> httpx.Response:
    return client.post("/v1/encode", files=[("image", (f"{i}.jpg", JPEG)) for i in range(n)])


def oom(_: torch.Tensor) -> BaseException:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


def test_classification_is_by_type_and_code_not_by_the_word_cuda() -> None:
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory."))
    assert not is_sticky(torch.OutOfMemoryError("CUDA out of memory."))
    assert (
        is_sticky(RuntimeError(ILLEGAL_ADDRESS))
        and cuda_error_code(RuntimeError(ILLEGAL_ADDRESS)) == 700
    )
    assert is_sticky(RuntimeError("CUDA error: unspecified launch failure\nCUDA kernel..."))
    assert is_sticky(RuntimeError("CUDA error: uncorrectable ECC error encountered"))
    accel = torch.AcceleratorError("CUDA error: something new")
    accel.error_code = 719  # type: ignore[attr-defined]  # as torch sets it from the C++ error
    assert is_sticky(accel)
    assert is_sticky(CudaError("cuStreamWriteValue32", 700, "CUDA_ERROR_ILLEGAL_ADDRESS"))
    assert is_out_of_memory(CudaError("cuMemCreate", 2, "CUDA_ERROR_OUT_OF_MEMORY"))
    # Mentions of CUDA that are not a sticky error:
    for text in (
        "CUDA error: invalid argument",
        "Expected all tensors to be on the same device, but found cuda:0 and cpu",
        "an illegal memory access was encountered",  # not torch's CUDA error shape
        "CUDA error: an illegal memory access was encounteredXX",
    ):
        assert not is_sticky(RuntimeError(text)), text
    assert not is_sticky(CudaError("cuMemMap", 1, "CUDA_ERROR_INVALID_VALUE"))


def test_out_of_memory_splits_the_batch_and_the_service_stays_live(tmp_path: Path) -> None:
    enc = FaultyEncoder(lambda x: oom(x) if x.shape[0] > 2 else None)
    with client_with(tmp_path, enc, max_batch_size=8, max_batch_wait_ms=50.0) as c:
        r = post(c, 8)
        assert r.status_code == 200, r.text
        assert len(r.json()["items"]) == 8
        assert enc.batches == [8, 4, 2, 2, 4, 2, 2]  # 8 and 4 ran out of memory
        assert c.get("/health/live").status_code == 200
        assert c.get("/health/ready").status_code == 200
        for item in r.json()["items"]:
            c.delete(f"/v1/leases/{item['lease_id']}")
        assert occupancy(c) == (0, 0)


def test_out_of_memory_on_one_image_is_503_and_leaks_nothing(tmp_path: Path) -> None:
    enc = FaultyEncoder(oom)
    with client_with(tmp_path, enc, max_batch_size=4, max_batch_wait_ms=50.0) as c:
        r = post(c, 3)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "gpu_out_of_memory"
        assert r.headers["retry-after"] == "1"
        assert c.get("/health/live").status_code == 200
        assert occupancy(c) == (0, 0)
        enc.fail = lambda _: None  # memory is back: the next request works
        assert post(c, 1).status_code == 200


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError(ILLEGAL_ADDRESS),
        RuntimeError("CUDA error: unspecified launch failure\nCUDA kernel errors might be ..."),
        RuntimeError("CUDA error: uncorrectable ECC error encountered\n"),
    ],
    ids=["illegal-address", "launch-failure", "ecc"],
)
def test_sticky_cuda_error_makes_the_service_not_live(tmp_path: Path, error: BaseException) -> None:
    enc = FaultyEncoder(lambda _: error)
    with client_with(tmp_path, enc) as c:
        r = post(c, 2)
        assert r.status_code == 500 and r.json()["error"]["type"] == "cuda_error"
        live = c.get("/health/live")
        assert live.status_code == 503
        assert str(cuda_error_code(error)) in live.json()["reason"]
        assert c.get("/health/ready").status_code == 503
        again = post(c, 1)  # a dead engine takes no more work
        assert again.status_code == 503 and again.json()["error"]["type"] == "not_ready"
        assert occupancy(c) == (0, 0)


def test_other_errors_fail_the_batch_and_the_service_stays_live(tmp_path: Path) -> None:
    enc = FaultyEncoder(lambda _: RuntimeError("CUDA error: invalid argument"))
    with client_with(tmp_path, enc) as c:
        r = post(c, 2)
        assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
        assert "invalid argument" in r.json()["error"]["message"]
        assert c.get("/health/live").status_code == 200
        assert occupancy(c) == (0, 0)


@pytest.mark.parametrize(
    ("code", "name", "live"),
    [(700, "CUDA_ERROR_ILLEGAL_ADDRESS", 503), (1, "CUDA_ERROR_INVALID_VALUE", 200)],
)
def test_publish_error_releases_the_batch_leases_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, name: str, live: int
) -> None:
    with client_with(tmp_path, None, lease_ttl_s=3600.0) as c:
        pool = c.app.state.engine.pool  # type: ignore[attr-defined]
        backend = pool.tiers[0].backend

        def broken(*_: Any, **__: Any) -> None:
            raise CudaError("cuMemcpyDtoDAsync", code, name)

        monkeypatch.setattr(backend, "publish", broken)
        monkeypatch.setattr(backend, "publish_many", broken, raising=False)
        r = post(c, 3)
        assert r.status_code == 500, r.text
        assert r.json()["error"]["type"] == "cuda_error"
        # Released now, not at the end of their one-hour TTL.
        assert occupancy(c) == (0, 0)
        stats = pool.stats()
        assert stats["leases_active"] == 0 and sum(stats["created"].values()) == 3
        assert c.get("/health/live").status_code == live


def test_publish_error_in_one_group_keeps_the_others_and_leaks_nothing(tmp_path: Path) -> None:
    """Two requests (two TTLs) in one batch; publishing the second group fails. The first
    request gets its leases; the second's are released at once, not at their TTL."""
    app = create_app(small_settings(tmp_path, max_batch_size=8, max_batch_wait_ms=200.0))
    engine = app.state.engine

    async def scenario() -> tuple[list[Any], dict[str, Any]]:
        await engine.start()
        try:
            backend = engine.pool.tiers[0].backend
            real = backend.publish
            calls = []

            def second_fails(*a: Any, **kw: Any) -> Any:
                calls.append(1)
                if len(calls) == 3:  # the first lease of the second group
                    raise CudaError("cuMemcpyDtoDAsync", 1, "CUDA_ERROR_INVALID_VALUE")
                return real(*a, **kw)

            backend.publish = second_fails
            done = await asyncio.gather(
                engine.encode([ImageIn("a", JPEG, None), ImageIn("b", JPEG, None)], 100.0),
                engine.encode([ImageIn("c", JPEG, None), ImageIn("d", JPEG, None)], 200.0),
                return_exceptions=True,
            )
            stats = engine.pool.stats()
            for result in done:
                if isinstance(result, list):
                    for lease in result:
                        engine.pool.release(lease.id)
            return done, stats
        finally:
            await engine.stop()

    done, stats = asyncio.run(scenario())
    ok = [d for d in done if isinstance(d, list)]
    failed = [d for d in done if isinstance(d, BaseException)]
    assert len(ok) == 1 and len(ok[0]) == 2 and len(failed) == 1, done
    assert isinstance(failed[0], CudaError)
    assert stats["leases_active"] == 2  # the first request's only
    assert engine.dead_reason is None
