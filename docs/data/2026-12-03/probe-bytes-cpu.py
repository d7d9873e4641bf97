"""CPU probe: per-image byte tensors vs one arena tensor sliced inside TorchScript, beside a busy thread."""
import mmap, sys, threading, time
import torch

SI = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0005
sys.setswitchinterval(SI)
N, SZ = 128, 138_000
m = mmap.mmap(-1, N * SZ)
view = memoryview(m)
views = [view[i * SZ:(i + 1) * SZ] for i in range(N)]

@torch.jit.script
def per_image(datas: list[torch.Tensor]) -> int:
    n = 0
    for d in datas:
        n += d.numel()
    return n

@torch.jit.script
def sliced(arena: torch.Tensor, offs: list[int], lens: list[int]) -> int:
    datas = [arena[o:o + n] for o, n in zip(offs, lens)]
    n = 0
    for d in datas:
        n += d.numel()
    return n

arena = torch.frombuffer(view, dtype=torch.uint8)
offs = [i * SZ for i in range(N)]
lens = [SZ] * N

def a():
    datas = [torch.frombuffer(v, dtype=torch.uint8) for v in views]
    r = per_image(datas)
    del datas
    return r

def b():
    return sliced(arena, offs, lens)

stop = threading.Event()
def spin():
    x = 0
    while not stop.is_set():
        x += 1

for f in (a, b):
    f(); f()
for busy in (False, True):
    if busy:
        threading.Thread(target=spin, daemon=True).start(); time.sleep(0.05)
    for name, f in (("A per-image frombuffer", a), ("B one arena tensor sliced in script", b)):
        ts = []
        for _ in range(100):
            t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
        ts.sort()
        print(f"busy={busy} SI={SI*1e3}ms {name}: median {ts[50]*1e3:.2f} ms, mean {sum(ts)/len(ts)*1e3:.2f} ms, max {ts[-1]*1e3:.2f} ms", flush=True)
stop.set()
