"""The path for consumers on other nodes, on a real GPU: ready and ack words in GPU memory
(DeviceControl), the TCP hand-off (FabricHandoffServer), FeatureClient over tcp://, and the
reaper's batched read of acks. This machine has no IMEX channel, so POSIX FDs stand in for the
FABRIC handles (the one substitution; FABRIC export and import are covered against the fake
driver in tests/test_cuda_vmm_fake.py). The producer is this process; the consumer is
tests/gpu/remote_consumer_proc.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pool.backends.cuda_vmm import CudaVmmBackend, FabricStatus
from pool.featurepool import FeaturePool, parse_dtype
from pool.server import FabricHandoffServer
from tests.gpu._harness import ROOT, pattern, subprocess_env
from tests.helpers import wait_until

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA"),
]

TOKEN = "gpu-test-token"


def handle_of(fd: int) -> bytes:
    return fd.to_bytes(8, "little") + bytes(56)


class Remote:
    """Producer here, consumer in a child process attached over TCP."""

    def __init__(self) -> None:
        self.backend = CudaVmmBackend.create(0, 64 << 20, 32 << 20, fabric="off")
        self.backend.fabric_status = FabricStatus("test", True, "")  # POSIX FDs stand in
        self.pool = FeaturePool([self.backend], max_leases=16, policy="wait", wait_s=5.0)
        self.pool.start_reaper(0.01)
        self.backend.enable_remote(self.pool.ctrl.nslots)
        remote = self.backend.remote
        assert remote is not None
        slab_fds = self.backend.slab_fds()
        assert remote._m is not None
        ctl_fd = self.backend.driver.export_fd(remote._m.handle)
        self.backend.fabric_handles = lambda: [handle_of(fd) for fd in slab_fds]  # type: ignore[method-assign]
        remote.fabric_handle = lambda: handle_of(ctl_fd)  # type: ignore[method-assign]
        self.server = FabricHandoffServer(self.pool, "127.0.0.1", 0, token=TOKEN)
        self.server.start()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.gpu.remote_consumer_proc", str(self.server.port), TOKEN],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=subprocess_env(),
            pass_fds=(*slab_fds, ctl_fd),
        )
        self.hello = self.read()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"consumer exited ({self.proc.poll()})"
        return dict(json.loads(line))

    def hand(self, lease: Any, seed: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        desc = self.pool.describe(lease).wire()
        self.proc.stdin.write(json.dumps({"lease": desc, "seed": seed}) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.server.close()
        torch.cuda.synchronize()
        self.pool.close()


@pytest.fixture
def remote() -> Iterator[Remote]:
    r = Remote()
    yield r
    r.close()


def test_remote_consumer_reads_many_leases_and_its_gpu_acks_recycle_them(remote: Remote) -> None:
    assert remote.hello["attached"] is True
    assert remote.pool.stats()["remote_consumers_attached"] == 1
    sizes = [1, 255, 4096, 65_537, 1 << 20, 5_000_000, 9_797_632]
    dtypes = ["uint8", "bfloat16", "float32", "float64"]
    n = 0
    for i in range(40):
        dtype = parse_dtype(dtypes[i % len(dtypes)])
        count = max(1, sizes[i % len(sizes)] // dtype.itemsize)
        data = pattern(count * dtype.itemsize, i, "cuda").view(dtype)
        lease = remote.pool.put(data)
        got = remote.hand(lease, i)
        assert got["ok"], f"lease {i}: bytes differ"
        n += 1
        # The ack went to GPU memory, never to the host control block...
        assert remote.pool.ctrl.ack(lease.slot) != lease.generation
    # ...and the reaper's batched read of the GPU ack words ends every lease.
    assert wait_until(lambda: remote.pool.stats()["leases_active"] == 0)
    stats = remote.pool.stats()
    assert stats["released"] == {"ack": n} and stats["tiers"][0]["used_bytes"] == 0


def test_remote_consumer_stream_waits_on_the_gpu_ready_word(remote: Remote) -> None:
    data = pattern(8 << 20, 7, "cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(600_000_000)  # the producer's stream is busy ~0.3 s before the copy
    t0 = time.perf_counter()
    lease = remote.pool.put(data)
    put_s = time.perf_counter() - t0
    assert put_s < 0.05  # no host synchronisation on publish
    got = remote.hand(lease, 7)
    assert got["ok"]  # the consumer saw the bytes, not what the slot held before
    assert got["held_s"] > 0.1, f"consumer done after {got['held_s']:.3f}s: it did not wait"
    assert wait_until(lambda: remote.pool.stats()["leases_active"] == 0)
