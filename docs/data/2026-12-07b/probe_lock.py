"""How many switch intervals the compiled spans call (app.gpu_decode.narrow_spans inside
TorchScript, as the one-call decode makes and frees them) waits for the interpreter lock beside
a thread that never gives it up by itself, for arena tensors held (app.gpu_decode.held) and
not. Each take of the lock costs the call a whole interval, which is long here (0.2 s), so
the counts are counts of takes; one is the call's return. CPU only. Run from the repository
root: python3 docs/data/2026-12-07b/probe_lock.py"""

import sys
import threading
import time

import torch

from app.gpu_decode import held, narrow_spans, torchscript


def spans_bytes(
    sources: list[torch.Tensor], which: list[int], offsets: list[int], sizes: list[int]
) -> int:
    n = 0
    for span in narrow_spans(sources, which, offsets, sizes):
        n += span.numel()
    return n


def waits(call, interval: float = 0.2, runs: int = 8) -> list[int]:
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    sys.setswitchinterval(interval)
    spinner = threading.Thread(target=spin)
    spinner.start()
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        call()
        out.append(round((time.perf_counter() - t) / interval))
    stop.set()
    spinner.join()
    return out


compiled = torchscript(spans_bytes)
print("torch", torch.__version__)
for k in (1, 4, 8):
    arenas = [torch.zeros(128 * 1000, dtype=torch.uint8) for _ in range(k)]
    which, offsets = [i % k for i in range(128)], [1000 * (i // k) for i in range(128)]
    args = (arenas, which, offsets, [900] * 128)
    bare = waits(lambda: compiled(*args))
    kept = [held(a) for a in arenas]
    print(f"{k} arena(s): not held {bare}, held {waits(lambda: compiled(*args))}")
