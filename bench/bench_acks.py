"""How the producer learns of consumers' acks, measured both ways (issue 3: "host-mapped control
words, or one batched read on a side stream: measure and choose").

    python3 bench/bench_acks.py --out OUT_DIR

(a) host-mapped words (what featpool ships): the control block is pinned host memory registered
    with cuMemHostRegister(DEVICEMAP); consumers' streams write acks into it with
    cuStreamWriteValue32 and the producer reads them with a numpy scan. No GPU work to read.
(b) device words + one batched read: the ack words live in device memory; the producer reads
    all of them with one D2H copy on a side stream into pinned memory, waits for that copy's
    event (not the device), then scans the copy. This is the pool's own DeviceControl, which
    the GPU tier keeps for consumers on other nodes (--fabric-listen).

For 1k, 4k and 16k slots: host time of one scan, idle and with the GPU busy copying features on
another stream, and the time from a GPU ack write to the producer seeing it. Both in one
process on one GPU; cross-process visibility of (a) is covered by tests/gpu (probe_ctrl).
Writes OUT_DIR/acks.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from appserver import gpu_name

from pool.backends.cuda_vmm import TorchCuda, register_control
from pool.backends.device_control import DeviceControl
from pool.control import ACK_OFFSET, HEADER_SIZE, SLOT_STRIDE, ControlBlock
from pool.driver import Driver, HandleType


def acked(slots: np.ndarray) -> np.ndarray:
    """The scan the reaper runs: slots whose ack equals their live generation."""
    return np.flatnonzero((slots["ack"] == slots["gen"]) & (slots["gen"] != 0))


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def remote_acked(remote: DeviceControl, ctrl: ControlBlock) -> np.ndarray:
    """The reaper's pass over remote acks: one batched read of the device words
    (DeviceControl.read_slots), compared with the host block's generations."""
    gen = ctrl.slots["gen"]
    return np.flatnonzero((remote.read_slots()["ack"] == gen) & (gen != 0))


def time_us(fn: Any, n: int) -> dict[str, float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    times = times[n // 10 :]
    return {"median": statistics.median(times), "p90": pct(times, 0.9)}


def visibility_us(write: Any, seen: Any, reps: int) -> dict[str, float]:
    """From enqueueing a GPU ack write on an idle stream to the producer seeing it."""
    times = []
    for gen in range(1, reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        write(gen)
        while not seen(gen):
            pass
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return {"median": statistics.median(times), "p90": pct(times, 0.9)}


def measure(nslots: int, driver: Driver, rt: TorchCuda, scans: int) -> dict[str, Any]:
    ctrl = ControlBlock.create(nslots)
    ctrl.slots["gen"][:] = np.arange(1, nslots + 1)  # every slot live, none acked
    dptr = register_control(driver, ctrl)
    remote = DeviceControl(  # what the GPU tier keeps for consumers on other nodes
        driver,
        rt,
        0,
        granularity=driver.granularity(0, HandleType.POSIX_FD),
        nslots=nslots,
        handle_types=HandleType.POSIX_FD,
    )
    stream = rt.current_stream()
    slot = nslots // 2
    try:
        row: dict[str, Any] = {"slots": nslots}
        row["host_mapped_scan_us"] = time_us(lambda: acked(ctrl.slots), scans)
        remote_scan = functools.partial(remote_acked, remote, ctrl)
        row["side_stream_scan_us"] = time_us(remote_scan, scans)
        # The same scans while the producer's stream copies 128 MB features back to back.
        src = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        for _ in range(1000):  # ~60 ms of copies queued ahead of both measurements
            dst.copy_(src, non_blocking=True)
        row["host_mapped_scan_busy_us"] = time_us(lambda: acked(ctrl.slots), scans)
        row["side_stream_scan_busy_us"] = time_us(
            lambda: remote_acked(remote, ctrl), min(scans, 200)
        )
        row["gpu_still_busy_after_busy_scans"] = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        # Visibility: a consumer-style ack write on an idle stream, then poll.
        host_word = dptr + HEADER_SIZE + slot * SLOT_STRIDE + ACK_OFFSET
        ctrl.slots["gen"][slot] = 0  # so gen never equals the ack written below
        row["host_mapped_visible_us"] = visibility_us(
            lambda g: driver.stream_write_value32(stream, host_word, g),
            lambda g: ctrl.ack(slot) == g,
            200,
        )
        row["side_stream_visible_us"] = visibility_us(
            lambda g: driver.stream_write_value32(stream, remote.word(slot, ACK_OFFSET), g),
            lambda g: int(remote.read_slots()["ack"][slot]) == g,
            200,
        )
        return row
    finally:
        torch.cuda.synchronize()
        remote.close()
        driver.host_unregister(ctrl.address)
        ctrl.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--scans", type=int, default=1000)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    rt = TorchCuda(0)
    rt.init()
    driver = Driver()
    driver.use_device(0)
    rows = [measure(n, driver, rt, args.scans) for n in (1024, 4096, 16384)]
    result: dict[str, Any] = {
        "machine": {
            "gpu": gpu_name(),
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "rows": rows,
    }
    (args.out / "acks.json").write_text(json.dumps(result, indent=2))
    m = result["machine"]
    print(f"\n{m['gpu']} | torch {m['torch']} | {m['date']}")
    print("host us per scan (median/p90) and ack visibility us: (a) host-mapped, (b) side stream")
    cols = [
        "host_mapped_scan_us",
        "side_stream_scan_us",
        "host_mapped_scan_busy_us",
        "side_stream_scan_busy_us",
        "host_mapped_visible_us",
        "side_stream_visible_us",
    ]
    for r in rows:
        busy = r["gpu_still_busy_after_busy_scans"]
        print(f"  slots {r['slots']}  (GPU still busy after the busy scans: {busy})")
        for c in cols:
            print(f"    {c:28s} {r[c]['median']:9.1f} {r[c]['p90']:9.1f}")


if __name__ == "__main__":
    main()
