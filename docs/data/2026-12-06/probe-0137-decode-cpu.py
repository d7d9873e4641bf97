"""(1) Is nvJPEG's one call slower when the batch size changes from call to call (as the
service's batches do: 40-128 at one image per request), e.g. because torchvision's hardware
batched decoder re-initialises (nvjpegDecodeBatchedInitialize each call, no PreAllocate)?
Batches of a constant 60 and 120 against sizes drawn from 50-70 and 100-128, alone and beside
the ViT-B/16 forward loop (bf16, batch 128, one CUDA graph): median ms per call, images/s.
(2) Is it slower when other processes keep the machine's cores busy (the service's fronts and
the load generator use ~8 of 16)? Constant 60 alone, beside 0/4/8/12/15 processes spinning.
(3) The same with the forward loop running beside it."""
import subprocess
import random
import os, sys, threading, time
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
import torch
from app.encoders import build_encoder
from app.gpu_decode import JpegDecoder
from make_images import photo_jpeg
sys.setswitchinterval(0.0005)
dev = torch.device("cuda")
enc = build_encoder("vit-b16-224", device=dev, dtype=torch.bfloat16)
photos = [torch.frombuffer(bytearray(photo_jpeg(i)), dtype=torch.uint8) for i in range(32)]
dec = JpegDecoder.create(dev, "on", "nvjpeg")
s_fwd = torch.cuda.Stream()
x = torch.randn(128, 3, 224, 224, device=dev, dtype=torch.bfloat16)
with torch.inference_mode(), torch.cuda.stream(s_fwd):
    for _ in range(3): enc._forward(x)
    s_fwd.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s_fwd):
        enc._forward(x)
s_fwd.synchronize()
stop = threading.Event()
def forward() -> None:
    while not stop.is_set():
        with torch.cuda.stream(s_fwd):
            g.replay()
        s_fwd.synchronize()
s = torch.cuda.Stream()
many = photos * 5
def row(label: str, lo: int, hi: int) -> None:
    rng = random.Random(0)
    with torch.cuda.stream(s):
        dec.decode_preprocess(many[:hi], [1] * hi, 224); s.synchronize()
        n, t0, calls = 0, time.perf_counter(), []
        while time.perf_counter() - t0 < 3:
            b = rng.randint(lo, hi)
            c0 = time.perf_counter()
            dec.decode_preprocess(many[:b], [1] * b, 224)
            calls.append((time.perf_counter() - c0) / b)
            s.synchronize(); n += b
        rate = n / (time.perf_counter() - t0)
    calls.sort()
    print(f"{label:7s} batch {lo}-{hi}: {1e3 * calls[len(calls) // 2]:6.3f} ms per image in the call (median), {rate:7.0f} images/s", flush=True)
SIZES = [(60, 60), (50, 70), (120, 120), (100, 128)]
for lo, hi in SIZES:
    row("alone", lo, hi)
th = threading.Thread(target=forward); th.start(); time.sleep(0.5)
for lo, hi in SIZES * 2:
    row("beside", lo, hi)
stop.set(); th.join()

def spinning(k: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(k)]
for k in (0, 4, 8, 12, 15):
    procs = spinning(k); time.sleep(0.3)
    try:
        row(f"cpu{k:02d}", 60, 60)
    finally:
        for p in procs: p.kill()
stop.clear()
th = threading.Thread(target=forward); th.start(); time.sleep(0.5)
for k in (0, 8, 12):
    procs = spinning(k); time.sleep(0.3)
    try:
        row(f"fw+cpu{k:02d}", 60, 60)
    finally:
        for p in procs: p.kill()
stop.set(); th.join()
