"""Would nvImageCodec's decode in a process of its own keep up beside the forward? A ViT-B/16
forward (batch 128, bf16, one CUDA graph) loop and nvImageCodec decode+preprocess (3 threads,
a decoder each, batches of 128 photos) for 6 s: each alone, both in one process (threads), and
in two processes (no MPS: the GPU time-slices between contexts). Images/s of each."""
import multiprocessing as mp, os, sys, threading, time
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
SECS = 6.0

def forward_loop(q, start_evt):
    import torch
    from app.encoders import build_encoder
    dev = torch.device("cuda")
    enc = build_encoder("vit-b16-224", device=dev, dtype=torch.bfloat16)
    model = enc._forward
    x = torch.randn(128, 3, 224, 224, device=dev, dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    with torch.inference_mode():
        with torch.cuda.stream(s):
            for _ in range(3): model(x)
        s.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            model(x)
    q.put(("ready", 0)); start_evt.wait()
    n = 0; t0 = time.perf_counter()
    while time.perf_counter() - t0 < SECS:
        with torch.cuda.stream(s):
            g.replay()
        s.synchronize(); n += 128
    q.put(("forward", n / (time.perf_counter() - t0)))

def decode_loop(q, start_evt, threads=3):
    import torch
    from make_images import photo_jpeg
    from app.gpu_decode import JpegDecoder
    dev = torch.device("cuda")
    datas = [torch.frombuffer(bytearray(photo_jpeg(i)), dtype=torch.uint8) for i in range(32)] * 4
    dec = JpegDecoder.create(dev, "on", "nvimgcodec")
    counts = [0] * threads
    ready = threading.Barrier(threads + 1)
    def work(k):
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            dec.decode_preprocess(datas, [1] * 128, 224); s.synchronize()
            ready.wait(); start_evt.wait()
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < SECS:
                dec.decode_preprocess(datas, [1] * 128, 224); s.synchronize(); counts[k] += 128
    ths = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in ths: t.start()
    ready.wait(); q.put(("ready", 0)); start_evt.wait(); t0 = time.perf_counter()
    for t in ths: t.join()
    q.put(("decode", sum(counts) / (time.perf_counter() - t0)))

def run(label, parts, procs):
    ctx = mp.get_context("spawn")
    if procs:
        q = ctx.Queue(); ev = ctx.Event()
        ps = [ctx.Process(target=f, args=(q, ev)) for f in parts]
        for p in ps: p.start()
        for _ in ps: q.get(timeout=120)
        ev.set()
        res = [q.get(timeout=120) for _ in ps]
        for p in ps: p.join()
    else:
        import queue as qu
        q = qu.Queue(); ev = threading.Event()
        ts = [threading.Thread(target=f, args=(q, ev)) for f in parts]
        for t in ts: t.start()
        for _ in ts: q.get(timeout=120)
        ev.set()
        for t in ts: t.join()
        res = [q.get() for _ in ts]
    print(f"{label:40s}", "  ".join(f"{k} {v:8.0f}/s" for k, v in sorted(res)), flush=True)

if __name__ == "__main__":
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    sys.setswitchinterval(0.0005)
    run("two processes: forward | decode", [forward_loop, decode_loop], True)
    run("one process, threads: forward + decode", [forward_loop, decode_loop], False)
    run("decode alone (own process)", [decode_loop], True)
    run("forward alone (own process)", [forward_loop], True)
