"""A producer process for the GPU tests: ``python -m tests.gpu.producer_proc SOCKET POOL_MB
SLAB_MB MAX_LEASES REAPER_S``; one JSON command per stdin line, one JSON reply per line."""

from __future__ import annotations

import json
import sys
import threading
from typing import Any

import torch

from pool.backends.cuda_vmm import CudaVmmBackend
from pool.featurepool import FeaturePool, parse_dtype
from pool.server import HandoffServer
from tests.gpu._harness import pattern


def main() -> None:
    sock, pool_mb, slab_mb, max_leases, reaper_s = sys.argv[1:6]
    dev = torch.device("cuda", 0)
    backend = CudaVmmBackend.create(0, int(pool_mb) << 20, int(slab_mb) << 20)
    pool = FeaturePool([backend], max_leases=int(max_leases), policy="reject")
    pool.start_reaper(float(reaper_s))
    server = HandoffServer(pool, sock)
    server.start()
    out = sys.stdout
    out.write(
        json.dumps({"op": "ready", "epoch": pool.epoch, "fabric": backend.fabric_status.reason})
        + "\n"
    )
    out.flush()
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg["op"]
        try:
            reply = handle(op, msg, pool, backend, dev)
        except Exception as e:
            reply = {"op": "error", "message": f"{type(e).__name__}: {e}"}
        if op == "quit":
            break
        out.write(json.dumps(reply, default=str) + "\n")
        out.flush()
    server.close()
    pool.close()


def handle(
    op: str, msg: dict[str, Any], pool: FeaturePool, backend: CudaVmmBackend, dev: torch.device
) -> dict[str, Any]:
    reply: dict[str, Any] = {"op": op}
    if op == "put":
        data = pattern(int(msg["nbytes"]), int(msg["seed"]), dev).view(parse_dtype(msg["dtype"]))
        if msg.get("sleep_cycles"):
            torch.cuda._sleep(int(msg["sleep_cycles"]))  # delays the publish's copy behind it
        lease = pool.put(data, ttl_s=msg.get("ttl_s"))
        ready_now = pool.ctrl.ready(lease.slot)  # read on the host right after publish
        reply = {"op": "lease", "lease": pool.describe(lease).wire(), "ready_after_put": ready_now}
    elif op == "stats":
        reply = {"op": "stats", "stats": pool.stats()}
    elif op == "ctx":
        reply = {"op": "ctx", **context_report(backend)}
    elif op != "quit":
        reply = {"op": "error", "message": f"unknown op {op}"}
    return reply


def context_report(backend: CudaVmmBackend) -> dict[str, Any]:
    """The contexts of: this thread, the driver's primary context, a slab, a torch tensor, and
    a driver call made from a thread torch never used."""
    drv: Any = backend.driver
    t = torch.empty(16, device=backend.device)
    report = {
        "current": drv.current_context(),
        "primary": drv.primary_context(),
        "slab": drv.pointer_context(backend._slabs[0].ptr),
        "torch_tensor": drv.pointer_context(t.data_ptr()),
    }

    def other() -> None:
        backend.driver.granularity(0, backend.handle_types)  # any call: sets the context
        report["other_thread"] = drv.current_context()

    th = threading.Thread(target=other)
    th.start()
    th.join()
    return report


if __name__ == "__main__":
    main()
