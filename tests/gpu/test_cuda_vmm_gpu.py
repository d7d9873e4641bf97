"""The GPU tier on a real GPU: a producer process (FeaturePool + CudaVmmBackend +
HandoffServer) and this test process as the consumer (FeatureClient)."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pool.errors import PoolRestarted, StaleLease
from pool.featurepool import parse_dtype
from tests.gpu._harness import ROOT, Producer, pattern, subprocess_env
from tests.helpers import wait_until

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA"),
]

DTYPES = ["uint8", "float16", "bfloat16", "float32", "int32", "float64"]


@pytest.fixture
def sock(tmp_path: Path) -> Path:
    return tmp_path / "featpool.sock"


@pytest.fixture
def producer(sock: Path) -> Iterator[Producer]:
    p = Producer(sock, max_leases=8)
    yield p
    p.close()


@pytest.fixture
def client(producer: Producer, sock: Path) -> Iterator[Any]:
    from pool.client import FeatureClient

    c = FeatureClient.connect(sock)
    yield c
    c.close()


def expected(desc: dict[str, Any], seed: int) -> torch.Tensor:
    return pattern(int(desc["nbytes"]), seed, "cuda")


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def gpu_used(p: Producer) -> int:
    return int(p.call("stats")["stats"]["tiers"][0]["used_bytes"])


def test_integrity_over_many_leases_of_mixed_sizes(sock: Path) -> None:
    from pool.client import FeatureClient

    p = Producer(sock, pool_mb=64, slab_mb=32, max_leases=64)
    try:
        with FeatureClient.connect(sock) as client:
            # The format docs/protocol.md states: 8-4-4-4-12 lowercase hex, no "GPU-" prefix.
            uuid = client.welcome["cuda"]["device_uuid"]
            assert re.fullmatch(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", uuid), uuid
            assert client.welcome["cuda"]["granularity"] == 2 << 20
            rng = random.Random(7)
            checked = 0
            for batch in range(15):
                leases = []
                for k in range(20):
                    dtype = rng.choice(DTYPES)
                    size = parse_dtype(dtype).itemsize
                    nbytes = size * rng.choice([1, 3, 255, 4096, 77_777, 1 << 18, 300_001])
                    seed = batch * 100 + k
                    desc = p.call("put", nbytes=nbytes, dtype=dtype, seed=seed)["lease"]
                    assert desc["tier"] == "gpu" and desc["transport"] == "cuda_vmm"
                    leases.append((desc, seed))
                for desc, seed in leases:
                    t = client.open(desc)
                    assert t.is_cuda and str(t.dtype) == f"torch.{desc['dtype']}"
                    assert t.shape == tuple(desc["shape"])
                    assert torch.equal(as_bytes(t), expected(desc, seed)), desc
                    client.release(desc)
                    checked += 1
                torch.cuda.synchronize()  # the acks have landed
                assert wait_until(lambda: gpu_used(p) == 0), f"batch {batch} not recycled"
            assert checked == 300
    finally:
        p.close()


def test_consumer_mapping_is_zero_copy(producer: Producer, client: Any) -> None:
    desc = producer.call("put", nbytes=1 << 20, dtype="float32", seed=1)["lease"]
    a = client.open(desc)
    b = client.open(desc)
    assert a.data_ptr() == b.data_ptr()  # both views of the one mapping, no copy
    slab = client._slabs[("gpu", desc["slab"])]
    assert a.data_ptr() == slab.ptr + desc["offset"]
    client.release(desc)


def test_write_through_read_only_mapping_is_refused(
    producer: Producer, client: Any, sock: Path
) -> None:
    desc = producer.call("put", nbytes=4096, dtype="uint8", seed=5)["lease"]
    r = subprocess.run(
        [sys.executable, "-m", "tests.gpu.readonly_writer", str(sock), json.dumps(desc)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=subprocess_env(),
    )
    print(r.stdout, r.stderr[-2000:])
    assert "REFUSED" in r.stdout, r.stdout + r.stderr[-2000:]
    assert torch.equal(as_bytes(client.open(desc)), expected(desc, 5))  # bytes unchanged
    client.release(desc)


def test_consumer_stream_waits_for_a_delayed_producer_copy(producer: Producer, client: Any) -> None:
    cycles = 600_000_000  # about 0.3 s at H200 clocks
    t0 = time.perf_counter()
    reply = producer.call("put", nbytes=8 << 20, dtype="bfloat16", seed=9, sleep_cycles=cycles)
    desc = reply["lease"]
    # The producer's host returned before its stream got to the copy: no host sync. (Read from
    # the ready word, not timed: a timed bound of 0.1 s failed once on a loaded H200.)
    assert reply["ready_after_put"] < desc["generation"]
    t = client.open(desc, host_wait=False)  # enqueues the stream wait; returns at once
    ok = torch.equal(as_bytes(t), expected(desc, 9))  # runs after the wait on this stream
    waited = time.perf_counter() - t0
    assert ok
    assert waited > 0.1, f"consumer finished after {waited:.3f}s: it did not wait"
    client.release(desc)


def test_ack_recycles_and_generation_guards_the_slot(producer: Producer, client: Any) -> None:
    first = producer.call("put", nbytes=1 << 20, dtype="float16", seed=11)["lease"]
    assert gpu_used(producer) > 0
    assert torch.equal(as_bytes(client.open(first)), expected(first, 11))
    client.release(first)  # the ack, written by this process's stream
    torch.cuda.synchronize()
    assert wait_until(lambda: gpu_used(producer) == 0), "reaper did not free the acked extent"
    with pytest.raises(StaleLease):
        client.open(first)
    # Cycle through the 8 slots until the first one is reused with a new generation.
    reused = None
    for i in range(8):
        d = producer.call("put", nbytes=4096, dtype="uint8", seed=20 + i)["lease"]
        if d["slot"] == first["slot"]:
            reused = (d, 20 + i)
    assert reused is not None
    new, seed = reused
    assert new["generation"] > first["generation"]
    with pytest.raises(StaleLease):
        client.open(first)
    assert torch.equal(as_bytes(client.open(new)), expected(new, seed))


def test_producer_restart_is_seen_and_reattach_works(sock: Path) -> None:
    from pool.client import FeatureClient

    p1 = Producer(sock)
    client = FeatureClient.connect(sock)
    try:
        old = p1.call("put", nbytes=65536, dtype="uint8", seed=1)["lease"]
        assert torch.equal(as_bytes(client.open(old)), expected(old, 1))
        torch.cuda.synchronize()
        p1.close()
        p2 = Producer(sock)
        try:
            new = p2.call("put", nbytes=65536, dtype="uint8", seed=2)["lease"]
            assert new["epoch"] != old["epoch"]
            with pytest.raises(PoolRestarted):
                client.open(new)
            with pytest.raises(PoolRestarted):
                client.lookup(old["lease_id"])
            client.reattach()
            assert torch.equal(as_bytes(client.open(new)), expected(new, 2))
            client.release(new)
            torch.cuda.synchronize()
            assert wait_until(lambda: gpu_used(p2) == 0)
        finally:
            client.close()
            p2.close()
    finally:
        p1.close()


def test_driver_calls_run_in_torchs_context(producer: Producer, client: Any) -> None:
    r = producer.call("ctx")
    assert r["primary"] != 0
    # Torch's allocations and our calls share the primary context, also on a fresh thread.
    # (VMM memory itself belongs to no context: its CONTEXT attribute reads 0.)
    assert r["current"] == r["primary"] == r["torch_tensor"] == r["other_thread"]
    assert r["slab"] in (0, r["primary"])
    # The consumer side, in this process.
    drv = client._cuda.driver
    ctx_torch = drv.pointer_context(torch.empty(1, device="cuda").data_ptr())
    assert drv.current_context() == ctx_torch == drv.primary_context()
    desc = producer.call("put", nbytes=4096, dtype="uint8", seed=3)["lease"]
    seen: dict[str, int] = {}

    def other() -> None:  # a thread torch never used: open/release must still work
        t2 = client.open(desc)
        seen["ok"] = int(torch.equal(as_bytes(t2), expected(desc, 3)))
        seen["ctx"] = drv.current_context()
        client.release(desc)
        torch.cuda.synchronize()

    th = threading.Thread(target=other)
    th.start()
    th.join()
    assert seen == {"ok": 1, "ctx": ctx_torch}


def test_producer_killed_mapped_data_stays_valid(sock: Path) -> None:
    """SIGKILL the producer while a consumer holds a mapped lease: the consumer's view still
    reads the published bytes (the mapping holds the physical memory), and the next producer
    on the same socket is a new epoch the consumer re-attaches to."""
    from pool.client import FeatureClient

    p1 = Producer(sock)
    client = FeatureClient.connect(sock)
    try:
        old = p1.call("put", nbytes=1 << 20, dtype="uint8", seed=3)["lease"]
        held = client.open(old)
        torch.cuda.synchronize()
        p1.proc.kill()
        p1.proc.wait(timeout=30)
        assert torch.equal(as_bytes(held), expected(old, 3))
        p2 = Producer(sock)
        try:
            with pytest.raises(PoolRestarted):
                client.lookup(old["lease_id"])
            client.reattach()
            new = p2.call("put", nbytes=4096, dtype="uint8", seed=4)["lease"]
            assert torch.equal(as_bytes(client.open(new)), expected(new, 4))
        finally:
            client.close()
            p2.close()
    finally:
        p1.close()


def test_lease_expiring_under_queued_reads_is_not_reused(sock: Path) -> None:
    """The consumer's stream is held behind a ~3 s kernel with its read of a lease queued after
    it; the lease's 1 s deadline passes meanwhile and the producer is asked for more leases
    of the same size. The lease is quarantined (opened, not yet acked): its memory is not
    reused, so the queued read sees the lease's own bytes; the memory returns at the ack."""
    from pool.client import FeatureClient

    p = Producer(sock, pool_mb=32, slab_mb=32, max_leases=16)
    try:
        with FeatureClient.connect(sock) as client:
            nbytes = 8 << 20
            desc = p.call("put", nbytes=nbytes, dtype="uint8", seed=31, ttl_s=1.0)["lease"]
            view = client.open(desc)
            torch.cuda._sleep(6_000_000_000)  # ~3 s on this stream, before the read
            copy = view.clone()  # queued behind the sleep
            client.release(desc)  # the ack, after the read, on this stream
            time.sleep(1.5)  # the deadline passes while the read is still queued
            stats = p.call("stats")["stats"]
            assert stats["expired"] == {"gpu": 1}
            assert stats["quarantined_leases"] == 1, stats
            # Best-fit would hand out the expired extent first: instead the other three quarters
            # of the pool fill up, and then the pool is full rather than reuse it.
            others = [
                p.call("put", nbytes=nbytes, dtype="uint8", seed=100 + i, ttl_s=60)["lease"]
                for i in range(3)
            ]
            assert all((o["slab"], o["offset"]) != (desc["slab"], desc["offset"]) for o in others)
            with pytest.raises(RuntimeError, match="PoolExhausted"):
                p.call("put", nbytes=nbytes, dtype="uint8", seed=104, ttl_s=60)
            torch.cuda.synchronize()
            assert torch.equal(copy, expected(desc, 31))
            assert wait_until(lambda: p.call("stats")["stats"]["quarantined_leases"] == 0)
            assert p.call("stats")["stats"]["quarantine"] == {"held": 1, "released": 1}
    finally:
        p.close()


def test_producer_dying_before_its_copy_gives_open_a_timeout(sock: Path) -> None:
    """The producer's copy and ready write are queued behind a long kernel and the producer is
    SIGKILLed before they run: the ready word never comes. ``open`` gives up after its timeout
    (the host-visible ready word) and this process's stream is not left waiting."""
    from pool.client import FeatureClient

    p = Producer(sock)
    client = FeatureClient.connect(sock)
    try:
        desc = p.call("put", nbytes=1 << 20, dtype="uint8", seed=41, sleep_cycles=8_000_000_000)[
            "lease"
        ]
        p.proc.kill()
        p.proc.wait(timeout=30)
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError, match="not published"):
            client.open(desc, timeout_s=1.0)
        waited = time.perf_counter() - t0
        assert 1.0 <= waited < 1.5, waited
        torch.cuda.synchronize()  # nothing of that lease was enqueued on this stream
    finally:
        client.close()
        p.close()


def test_views_outlive_close_on_the_gpu_tier(producer: Producer, sock: Path) -> None:
    """A tensor from ``open`` keeps its slab mapped after ``close``: reading it reads the
    lease's bytes (unmapping under it would fault), and ``reattach`` maps elsewhere."""
    from pool.client import FeatureClient

    client = FeatureClient.connect(sock)
    desc = producer.call("put", nbytes=1 << 20, dtype="uint8", seed=51)["lease"]
    view = client.open(desc)
    torch.cuda.synchronize()
    client.close()
    assert torch.equal(as_bytes(view), expected(desc, 51))
    client = FeatureClient.connect(sock)
    try:
        again = client.open(desc)
        assert again.data_ptr() != view.data_ptr()  # the old range is still taken by ``view``
        assert torch.equal(as_bytes(view), as_bytes(again))
        client.release(desc)
        del view  # its range is unmapped now, after a synchronize
        torch.cuda.synchronize()
    finally:
        client.close()


@pytest.mark.parametrize("form", ["tensors", "rows"])
def test_put_many_writes_every_ready_word_after_its_bytes(form: str) -> None:
    """A batch of 300 leases (two cuStreamBatchMemOp calls of ready words, 255 + 45) behind a
    GPU sleep: no word is set before the copies ran, then each slot's word is its lease's
    generation and each lease holds its own tensor. As 300 tensors, and as one tensor of 300
    rows (copied by one TorchScript call)."""
    from pool.backends.cuda_vmm import CudaVmmBackend
    from pool.featurepool import FeaturePool

    backend = CudaVmmBackend.create(0, 64 << 20, 32 << 20)
    pool = FeaturePool([backend], max_leases=512, policy="reject")
    try:
        ts = [torch.full((3, 5), float(i), device="cuda") for i in range(300)]
        # The first publish binds the control block, and the first of rows runs TorchScript's
        # first call: both wait for the device.
        for lease in pool.put_many(ts[:8] if form == "tensors" else torch.stack(ts[:8])):
            pool.release(lease.id)  # type: ignore[union-attr]
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time ahead of the copies and words
        leases = pool.put_many(ts if form == "tensors" else torch.stack(ts))
        assert all(not isinstance(lease, BaseException) for lease in leases)
        early = [pool.ctrl.ready(lease.slot) for lease in leases]  # type: ignore[union-attr]
        torch.cuda.synchronize()
        assert early == [0] * 300  # the words wait on the stream behind the sleep
        for lease, t in zip(leases, ts, strict=True):
            assert pool.ctrl.ready(lease.slot) == lease.generation  # type: ignore[union-attr]
            assert torch.equal(pool.read(lease.id).cuda(), t)  # type: ignore[union-attr]
    finally:
        pool.close()
