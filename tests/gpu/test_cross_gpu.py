"""A consumer on another GPU of the node than the producer's (docs/protocol.md 8): the producer
process (tests/gpu/producer_proc.py) pools on GPU 0, this process reads on GPU 1, in place over
peer access or through counted copies. Needs two GPUs (skipped otherwise), except the first
test, which checks on one GPU that the same-device path is unchanged and that the pieces the
other GPU's path adds (UUIDs from the driver, DLPack views of mapped memory) are right there.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest
import torch

from pool.errors import PoolRestarted
from tests.gpu._harness import Producer, pattern
from tests.helpers import wait_until

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA"),
]
two_gpus = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2,
    reason="needs two GPUs (a consumer on another GPU than the producer's)",
)

OTHER = "cuda:1"


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def gpu_used(p: Producer) -> int:
    return int(p.call("stats")["stats"]["tiers"][0]["used_bytes"])


@pytest.fixture
def sock(tmp_path: Path) -> Path:
    return tmp_path / "featpool.sock"


@pytest.fixture
def producer(sock: Path) -> Iterator[Producer]:
    p = Producer(sock, max_leases=16)
    yield p
    p.close()


def test_same_device_path_is_unchanged(producer: Producer, sock: Path) -> None:
    from pool.backends.dlpack import bytes_on_device
    from pool.client import FeatureClient

    with FeatureClient.connect(sock, cross_gpu="copy") as client:
        link = client.link
        assert link is not None and link.path == "same_device" and link.producer_device == 0
        drv = client._cuda.driver
        # The driver's UUID spelling is torch's (the welcome's), device by device.
        for i in range(torch.cuda.device_count()):
            assert drv.device_uuid(i) == str(torch.cuda.get_device_properties(i).uuid)
        desc = producer.call("put", nbytes=1 << 20, dtype="bfloat16", seed=61)["lease"]
        t = client.open(desc)
        slab = client._slabs[("gpu", desc["slab"])]
        assert t.device == torch.device("cuda", 0)
        assert t.data_ptr() == slab.ptr + desc["offset"]  # a view, no copy
        assert torch.equal(as_bytes(t), pattern(desc["nbytes"], 61, "cuda:0"))
        assert client.fallbacks == {}
        # A DLPack view (what the other-GPU paths build) of the same bytes reads the same.
        dl = bytes_on_device(slab.ptr + desc["offset"], desc["nbytes"], torch.device("cuda", 0))
        assert dl.device == torch.device("cuda", 0) and dl.data_ptr() == t.data_ptr()
        assert torch.equal(dl, as_bytes(t))
        client.release(desc)
        torch.cuda.synchronize()
        assert wait_until(lambda: gpu_used(producer) == 0)


@two_gpus
@pytest.mark.parametrize("mode", ["map", "copy"])
def test_bytes_read_on_the_other_gpu_are_right(
    producer: Producer, sock: Path, mode: Literal["map", "copy"]
) -> None:
    from pool.client import FeatureClient

    with FeatureClient.connect(sock, device=OTHER, cross_gpu=mode) as client:
        link = client.link
        assert link is not None and (link.producer_device, link.device) == (0, 1)
        assert link.path == ("peer" if mode == "map" else "copy")
        n = 0
        for i, (nbytes, dtype) in enumerate(
            [(4096, "uint8"), (77_778, "float16"), (1 << 22, "bfloat16"), (300_004, "float32")]
        ):
            desc = producer.call("put", nbytes=nbytes, dtype=dtype, seed=70 + i)["lease"]
            t = client.open(desc)
            assert t.device == torch.device(OTHER) and t.shape == tuple(desc["shape"])
            slab = client._slabs[("gpu", desc["slab"])]
            in_place = t.data_ptr() == slab.ptr + desc["offset"]
            assert in_place == (mode == "map")
            assert torch.equal(as_bytes(t), pattern(nbytes, 70 + i, OTHER)), desc
            client.release(desc)
            n += 1
        assert client.fallbacks == ({} if mode == "map" else {"copy_requested": n})
        torch.cuda.synchronize(OTHER)  # the acks, written by GPU 1's stream, have landed
        assert wait_until(lambda: gpu_used(producer) == 0), "acks from GPU 1 did not free"


@two_gpus
@pytest.mark.parametrize("mode", ["map", "copy"])
def test_stream_wait_and_ack_across_gpus(
    producer: Producer, sock: Path, mode: Literal["map", "copy"]
) -> None:
    """The producer's copy on GPU 0 is held behind a ~0.3 s kernel; this process's stream on
    GPU 1 waits on the ready word (host memory) and its read sees the bytes; its ack frees."""
    from pool.client import FeatureClient

    with FeatureClient.connect(sock, device=OTHER, cross_gpu=mode) as client:
        t0 = time.perf_counter()
        reply = producer.call(
            "put", nbytes=8 << 20, dtype="bfloat16", seed=81, sleep_cycles=600_000_000
        )
        desc = reply["lease"]
        assert reply["ready_after_put"] < desc["generation"]  # not yet published
        t = client.open(desc, host_wait=False)  # only the stream wait, on GPU 1
        ok = torch.equal(as_bytes(t), pattern(8 << 20, 81, OTHER))
        waited = time.perf_counter() - t0
        assert ok and waited > 0.1, f"GPU 1 finished after {waited:.3f}s: it did not wait"
        client.release(desc)  # after the read, on GPU 1's stream
        torch.cuda.synchronize(OTHER)
        assert wait_until(lambda: gpu_used(producer) == 0)


@two_gpus
def test_producer_killed_under_a_lease_mapped_on_the_other_gpu(sock: Path) -> None:
    from pool.client import FeatureClient

    p1 = Producer(sock)
    client = FeatureClient.connect(sock, device=OTHER, cross_gpu="map")
    try:
        old = p1.call("put", nbytes=1 << 20, dtype="uint8", seed=91)["lease"]
        held = client.open(old)
        assert held.device == torch.device(OTHER)
        torch.cuda.synchronize(OTHER)
        p1.proc.kill()
        p1.proc.wait(timeout=30)
        # The mapping holds GPU 0's physical memory: GPU 1 still reads the published bytes.
        assert torch.equal(as_bytes(held), pattern(1 << 20, 91, OTHER))
        p2 = Producer(sock)
        try:
            with pytest.raises(PoolRestarted):
                client.lookup(old["lease_id"])
            client.reattach()
            assert client.link is not None and client.link.path == "peer"
            new = p2.call("put", nbytes=4096, dtype="uint8", seed=92)["lease"]
            assert torch.equal(as_bytes(client.open(new)), pattern(4096, 92, OTHER))
            client.release(new)
            torch.cuda.synchronize(OTHER)
        finally:
            client.close()
            p2.close()
        del held
        torch.cuda.synchronize(OTHER)
    finally:
        client.close()
        p1.close()
