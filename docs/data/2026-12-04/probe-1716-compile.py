"""Forward only: ViT-B/16 bf16 at batch 112/128, CUDA graph replay, eager vs compiled."""
import time, torch, sys
from app.encoders import build_encoder
dev = torch.device("cuda")
def timed(enc, b, n=60):
    s = enc.image_size
    x = torch.zeros(b, 3, s, s, device=dev, dtype=enc.dtype)
    for _ in range(5): enc.encode(x)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): enc.encode(x)
    torch.cuda.synchronize(); dt = (time.perf_counter() - t) / n
    return dt * 1e3, b / dt
for mode in sys.argv[1:]:
    t0 = time.perf_counter()
    enc = build_encoder("vit-b16-224", device=dev, compile=(mode != "eager"))
    if mode == "compile-nograph":
        enc.warmup([112, 128])
    else:
        enc.enable_cuda_graphs(); enc.warmup([112, 128])
    start = time.perf_counter() - t0
    for b in (112, 128):
        ms, ips = timed(enc, b)
        print(f"{mode} b={b}: {ms:.2f} ms/forward, {ips:,.0f} images/s (start {start:.1f} s)", flush=True)
    del enc; torch.cuda.empty_cache()
