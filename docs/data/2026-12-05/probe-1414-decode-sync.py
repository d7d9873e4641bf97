"""Does torchvision's batched nvJPEG decode wait for the whole device? A thread keeps another
stream 10-20 bf16 matmuls deep (~15-30 ms of queued work); decode calls that wait for the
device take about that long. Batch sizes constant (64) vs varying (40..128), and the same
sizes repeated. Prints per-mode median / p90 / max ms and calls over 12 ms."""
import random, statistics, sys, threading, time
sys.path.insert(0, "bench")
import torch
from torchvision.io import decode_jpeg
from make_images import photo_jpeg

dev = torch.device("cuda")
jpegs = [torch.frombuffer(bytearray(photo_jpeg(i)), dtype=torch.uint8) for i in range(128)]
torch.cuda.set_device(0)
stop = False
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
def busy():
    s = torch.cuda.Stream()
    prev = None
    with torch.cuda.stream(s):
        while not stop:
            for _ in range(10):
                a @ a
            ev = torch.cuda.Event(); ev.record(s)
            if prev is not None:
                prev.synchronize()
            prev = ev
side = torch.cuda.Stream()
def run(sizes, label, busy_on):
    global stop
    stop = False
    th = threading.Thread(target=busy, daemon=True)
    if busy_on:
        th.start(); time.sleep(0.2)
    ts = []
    with torch.cuda.stream(side):
        for n in sizes:
            t0 = time.perf_counter(); out = decode_jpeg(jpegs[:n], device=dev); side.synchronize(); ts.append((time.perf_counter() - t0) * 1e3)
            del out
    stop = True
    if busy_on:
        th.join()
    torch.cuda.synchronize()
    ts = ts[3:]
    print(f"{label:34s} busy={int(busy_on)} median {statistics.median(ts):6.1f} p90 {sorted(ts)[int(.9*len(ts))]:6.1f} max {max(ts):6.1f} over12ms {sum(t > 12 for t in ts)}/{len(ts)}", flush=True)
rng = random.Random(0)
var = [rng.randint(40, 128) for _ in range(40)]
for busy_on in (False, True):
    run([64] * 40, "constant 64", busy_on)
    run(var, "varying 40..128", busy_on)
    run([128] + [rng.randint(40, 127) for _ in range(39)], "after 128: varying below it", busy_on)
t0 = time.perf_counter()
for _ in range(20): a @ a
torch.cuda.synchronize(); print("one matmul ms", (time.perf_counter() - t0) / 20 * 1e3)
# Which CUDA runtime calls does a decode make, per call, with constant and varying batch sizes?
from collections import Counter
from torch.profiler import ProfilerActivity, profile
for label, sizes in (("constant 64", [64] * 12), ("varying 40..128", var[:12]), ("after 128", [128] + var[:11])):
    for n in sizes[:2]:
        decode_jpeg(jpegs[:n], device=dev)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.cuda.stream(side):
            for n in sizes:
                decode_jpeg(jpegs[:n], device=dev); side.synchronize()
    c = Counter(e.name for e in prof.events() if e.name.startswith("cuda") or "nvjpeg" in e.name.lower())
    keep = {k: v for k, v in c.items() if any(s in k for s in ("Free", "Malloc", "Synchronize", "HostAlloc", "HostFree"))}
    print(f"{label:20s} {len(sizes)} calls:", dict(sorted(keep.items())), flush=True)
# Fixed and per-image cost of one decode call: constant sizes, nothing else running.
for n in (1, 8, 32, 64, 128):
    with torch.cuda.stream(side):
        ts = []
        for _ in range(15):
            t0 = time.perf_counter(); decode_jpeg(jpegs[:n], device=dev); side.synchronize(); ts.append((time.perf_counter() - t0) * 1e3)
    print(f"batch {n:3d} alone: median {statistics.median(ts[3:]):6.2f} ms", flush=True)
# The service's one call (decode + preprocess, TorchScript) and preprocess alone, by batch size.
sys.path.insert(0, ".")
from app.gpu_decode import JpegDecoder, preprocess
jd = JpegDecoder.create(dev, "on", "nvjpeg")
decoded = decode_jpeg(jpegs, device=dev)
for n in (1, 8, 32, 64, 128):
    with torch.cuda.stream(side):
        t_f, t_p = [], []
        for _ in range(15):
            t0 = time.perf_counter(); jd.decode_preprocess(jpegs[:n], [1] * n, 224); side.synchronize(); t_f.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter(); preprocess(decoded[:n], [1] * n, 224); side.synchronize(); t_p.append((time.perf_counter() - t0) * 1e3)
    print(f"batch {n:3d}: one call {statistics.median(t_f[3:]):6.2f} ms, preprocess alone {statistics.median(t_p[3:]):6.2f} ms", flush=True)
