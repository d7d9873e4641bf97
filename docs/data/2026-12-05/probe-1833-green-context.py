"""Does the forward in a green context (fewer SMs) let the decode beside it run faster?
ViT-B/16 bf16 batch-128 CUDA graph in a loop on one thread (primary context, or a green
context of N SMs); nvJPEG's one call (1 thread) or nvImageCodec's (3 threads) on 128 photos
beside it, 4 s per row. Images/s of each; forward alone per N as the check that N binds."""
import os, sys, threading, time
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
import torch
from torch.cuda import green_contexts as gcm
print("torch", torch.__version__, "green SUPPORTED", gcm.SUPPORTED,
      [a for a in dir(gcm.GreenContext) if not a.startswith("__")], flush=True)
from app.encoders import build_encoder
from app.gpu_decode import JpegDecoder
from make_images import photo_jpeg
sys.setswitchinterval(0.0005)
dev = torch.device("cuda")
print(torch.cuda.get_device_name(), "SMs", torch.cuda.get_device_properties(0).multi_processor_count, flush=True)
enc = build_encoder("vit-b16-224", device=dev, dtype=torch.bfloat16)
model = enc._forward
datas = [torch.frombuffer(bytearray(photo_jpeg(i)), dtype=torch.uint8) for i in range(32)] * 4
decs = {n: JpegDecoder.create(dev, "on", n) for n in ("nvjpeg", "nvimgcodec")}
SECS = float(os.environ.get("SECS", "4"))
graphs = {}

def forward_setup(num_sms):
    """(graph, stream, green ctx) captured in this thread's context for num_sms."""
    gc = None
    if num_sms:
        gc = gcm.GreenContext.create(num_sms=num_sms, device_id=0)
        gc.set_context()
        s = gc.Stream()
    else:
        s = torch.cuda.Stream()
    x = torch.randn(128, 3, 224, 224, device=dev, dtype=torch.bfloat16)
    with torch.inference_mode(), torch.cuda.stream(s):
        for _ in range(3): model(x)
        s.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            model(x)
    s.synchronize()
    return g, s, gc, x

def forward_loop(num_sms, start, stop, out):
    g, s, gc, x = forward_setup(num_sms)
    start.wait(); n = 0; t0 = time.perf_counter()
    while not stop.is_set():
        with torch.cuda.stream(s):
            g.replay()
        s.synchronize(); n += 128
    out["forward"] = n / (time.perf_counter() - t0)
    if gc is not None:
        gc.pop_context()

def decode_loop(name, k, start, stop, out):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        decs[name].decode_preprocess(datas, [1] * 128, 224); s.synchronize()
        start.wait(); n = 0; t0 = time.perf_counter()
        while not stop.is_set():
            decs[name].decode_preprocess(datas, [1] * 128, 224); s.synchronize(); n += 128
    out[f"decode{k}"] = n / (time.perf_counter() - t0)

def row(label, num_sms, name, threads):
    start, stop, out = threading.Barrier(1 + (num_sms is not False) + threads, timeout=60), threading.Event(), {}
    ts = []
    if num_sms is not False:
        ts.append(threading.Thread(target=forward_loop, args=(num_sms, start, stop, out)))
    for k in range(threads):
        ts.append(threading.Thread(target=decode_loop, args=(name, k, start, stop, out)))
    for t in ts: t.start()
    start.wait(); time.sleep(SECS); stop.set()
    for t in ts: t.join()
    dec = sum(v for k, v in out.items() if k.startswith("decode"))
    print(f"{label:44s} forward {out.get('forward', 0):7.0f}/s  decode {dec:7.0f}/s", flush=True)

SMS = [int(x) for x in os.environ.get("SMS", "0,116,96").split(",")]
row("decode alone nvjpeg", False, "nvjpeg", 1)
for n in SMS:
    row(f"forward alone sms={n or 'all'}", n, "nvjpeg", 0)
for n in SMS:
    row(f"nvjpeg x1 + forward sms={n or 'all'}", n, "nvjpeg", 1)
for n in [int(x) for x in os.environ.get("SMS_IMG", "0,96").split(",")]:
    row(f"nvimgcodec x3 + forward sms={n or 'all'}", n, "nvimgcodec", 3)
