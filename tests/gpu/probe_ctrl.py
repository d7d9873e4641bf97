"""Probe: do GPU stream memory operations on a memfd control block registered with
cuMemHostRegister work across processes? ``python -m tests.gpu.probe_ctrl`` prints one JSON
line. Parent: registers the block, later writes ready=1 with cuStreamWriteValue32. Child:
maps the control block read-only (registered READ_ONLY) and an ack block read-write, enqueues
cuStreamWaitValue32(ready >= 1) then cuStreamWriteValue32(ack = 1) into its ack block. The
parent checks on the host that ack stays 0 until it writes ready, then becomes 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

from pool.backends.cuda_vmm import TorchCuda
from pool.control import READY_OFFSET, AckBlock, ControlBlock, reopen_read_only
from pool.driver import Driver


def child(fd: int, ack_fd: int) -> None:
    ctrl = ControlBlock.attach(fd)
    acks = AckBlock.attach(ack_fd, ctrl.nslots)
    rt = TorchCuda(0)
    rt.init()
    drv = Driver()
    drv.use_device(0)
    drv.host_register(ctrl.address, ctrl.size, read_only=True)
    dptr = drv.host_device_pointer(ctrl.address)
    drv.host_register(acks.address, acks.size)
    ack_ptr = drv.host_device_pointer(acks.address)
    stream = rt.current_stream()
    drv.stream_wait_value32_geq(stream, dptr + 64 + READY_OFFSET, 1)
    drv.stream_write_value32(stream, ack_ptr + 4, 1)
    print("enqueued", flush=True)
    t0 = time.perf_counter()
    rt.synchronize()
    print(
        json.dumps({"child_waited_s": time.perf_counter() - t0, "same_ptr": dptr == ctrl.address}),
        flush=True,
    )
    drv.host_unregister(ctrl.address)
    drv.host_unregister(acks.address)


def parent() -> None:
    ctrl = ControlBlock.create(4)
    acks = AckBlock.create(4)
    ro = reopen_read_only(ctrl.fd)
    rt = TorchCuda(0)
    rt.init()
    drv = Driver()
    drv.use_device(0)
    drv.host_register(ctrl.address, ctrl.size)
    dptr = drv.host_device_pointer(ctrl.address)
    p = subprocess.Popen(
        [sys.executable, "-m", "tests.gpu.probe_ctrl", str(ro), str(acks.fd)],
        stdout=subprocess.PIPE,
        text=True,
        pass_fds=(ro, acks.fd),
    )
    os.close(ro)
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "enqueued"
    time.sleep(0.3)
    ack_before = int(acks.acks[0])
    t0 = time.perf_counter()
    drv.stream_write_value32(rt.current_stream(), dptr + 64 + READY_OFFSET, 1)
    while int(acks.acks[0]) != 1 and time.perf_counter() - t0 < 10:
        pass
    seen = time.perf_counter() - t0
    child_report = json.loads(p.stdout.readline())
    p.wait(timeout=30)
    print(
        json.dumps(
            {
                "probe": "host-registered memfd control words",
                "ack_before_ready": ack_before,
                "ack_after": int(acks.acks[0]),
                "ready_host": ctrl.ready(0),
                "ack_seen_after_s": seen,
                "works": ack_before == 0 and int(acks.acks[0]) == 1 and ctrl.ready(0) == 1,
                **child_report,
            }
        ),
        flush=True,
    )
    rt.synchronize()
    drv.host_unregister(ctrl.address)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        child(int(sys.argv[1]), int(sys.argv[2]))
    else:
        parent()
        torch.cuda.synchronize()
