"""preprocess of 128 decoded photos (1024 x 768, nvJPEG): torch's antialiased bicubic kernel
(float32) against resize_square (two float16 products), alone and beside the ViT-B/16 forward
loop (images/s of each)."""
import sys, threading, time
import torch
import torch.nn.functional as nnf
sys.path.insert(0, "bench")
from make_images import photo_jpeg
from app.encoders import build_encoder
from app.gpu_decode import JpegDecoder, preprocess

dev = torch.device("cuda")
blobs = [photo_jpeg(i, 1024, 768) for i in range(32)]
datas = [torch.frombuffer(bytearray(blobs[i % 32]), dtype=torch.uint8) for i in range(128)]
dec = JpegDecoder.create(dev, "on", "nvjpeg")
imgs = dec.decode(datas)
ones = [1] * 128

def old() -> torch.Tensor:
    sq = torch.stack([im[:, :, 128:896] for im in imgs]).float()
    return nnf.interpolate(sq, size=[224, 224], mode="bicubic", antialias=True, align_corners=False).clamp_(0, 255).round_()

def new() -> torch.Tensor:
    return preprocess(imgs, ones, 224)

d = (old() - new()).abs()
print(f"new vs old on these: max {d.max():.1f}, share differing {(d > 0).float().mean():.4f}")
enc = build_encoder("vit-b16-224", device=dev, dtype=torch.bfloat16)
enc.enable_cuda_graphs(); enc.warmup([128])
x = torch.randn(128, 3, 224, 224, device=dev)
stop = threading.Event(); count = [0]
def fwd():
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        while not stop.is_set():
            enc.encode(x); s.synchronize(); count[0] += 128
for name, fn in (("torch kernel", old), ("two products", new), ("torch kernel", old), ("two products", new)):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3): fn()
        s.synchronize()
        res = []
        for beside in (False, True):
            if beside:
                stop.clear(); count[0] = 0; t = threading.Thread(target=fwd); t.start(); time.sleep(0.3); c0 = count[0]
            t0 = time.perf_counter(); n = 0
            while time.perf_counter() - t0 < 2:
                fn(); s.synchronize(); n += 128
            dt = time.perf_counter() - t0
            if beside:
                f = (count[0] - c0) / dt; stop.set(); t.join()
                res.append(f"beside forward {n/dt:.0f}/s (forward {f:.0f}/s)")
            else:
                res.append(f"alone {n/dt:.0f}/s")
    print(f"preprocess 128, {name}: " + "; ".join(res), flush=True)
