"""A consumer "on another node" for tests/gpu/test_remote_words_gpu.py: FeatureClient over
tcp://, with one substitution: this machine has no IMEX channel, so the producer hands out
POSIX FDs (inherited by this process) where FABRIC handles would be, and importing a "handle"
imports that FD. Everything else is the remote path: device control words, stream waits and
acks in GPU memory, the TCP hand-off.

    python -m tests.gpu.remote_consumer_proc PORT TOKEN

Reads JSON lines {"lease": descriptor, "seed": n}; answers {"ok": bool, "held_s": seconds from
reading the line to having compared the bytes on the GPU}.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time
from typing import Any

import torch

from pool.backends import cuda_vmm
from pool.client import FeatureClient
from tests.gpu._harness import pattern


def import_fd_as_fabric(self: Any, handle_b64: str | bytes) -> Any:
    raw = base64.b64decode(handle_b64) if isinstance(handle_b64, str) else handle_b64
    return self.driver.import_fd(os.dup(int.from_bytes(raw[:8], "little")))


def main() -> None:
    port, token = int(sys.argv[1]), sys.argv[2]
    cuda_vmm.CudaConsumer._import_fabric = import_fd_as_fabric  # type: ignore[method-assign]
    torch.cuda.init()  # type: ignore[no-untyped-call]
    client = FeatureClient.connect(f"tcp://127.0.0.1:{port}", token=token)
    print(json.dumps({"attached": client.remote, "epoch": client.epoch}), flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        t0 = time.perf_counter()
        desc = msg["lease"]
        t = client.open(desc)
        want = pattern(int(desc["nbytes"]), int(msg["seed"]), "cuda")
        ok = bool(torch.equal(t.reshape(-1).view(torch.uint8), want))  # syncs this stream
        client.release(desc)  # the ack, after the reads, on this stream
        current = client.is_current(desc)
        torch.cuda.synchronize()
        print(
            json.dumps({"ok": ok, "held_s": time.perf_counter() - t0, "current": current}),
            flush=True,
        )
    client.close()


if __name__ == "__main__":
    main()
