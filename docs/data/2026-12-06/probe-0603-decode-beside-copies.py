"""The one-call decode of 64 photos alone, and beside a thread making ~65 small D2D copies
per 7 ms (the publish copies of a batch) on a stream of its own."""
import threading, time, torch, statistics
from skimage import data
from app.gpu_decode import ByteSpans, JpegDecoder
from tests.test_imaging import jpeg
dev = torch.device("cuda")
dec = JpegDecoder.create(dev, "auto", "nvjpeg")
imgs = [data.astronaut(), data.coffee(), data.chelsea(), data.rocket(), data.hubble_deep_field()]
photos = [jpeg(torch.nn.functional.interpolate(torch.from_numpy(i).permute(2,0,1)[None].float(), size=(768,1024)).clamp(0,255).byte()[0].permute(1,2,0).numpy(), quality=90) for i in imgs]
photos = (photos * 13)[:64]
spans = ByteSpans.of([torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in photos])
stop = threading.Event()
def copier(n):
    s = torch.cuda.Stream(dev); src = torch.empty(197 * 768, dtype=torch.bfloat16, device=dev)
    dst = torch.empty(128, 197 * 768, dtype=torch.bfloat16, device=dev)
    with torch.cuda.stream(s):
        while not stop.is_set():
            for i in range(n):
                dst[i].copy_(src, non_blocking=True)
            s.synchronize(); time.sleep(0.004)
def measure(label):
    ts = []
    for k in range(60):
        t = time.perf_counter(); dec.decode_preprocess(spans, [1] * 64, 224); ts.append(time.perf_counter() - t)
        torch.cuda.synchronize()
    print(f"{label}: call {1e3*statistics.median(ts[10:]):.2f} ms per 64")
for n in (0, 65, 0, 130):
    stop.clear()
    th = threading.Thread(target=copier, args=(n,)) if n else None
    if th: th.start()
    time.sleep(0.1)
    measure(f"beside {n} copies per ~5 ms")
    stop.set()
    if th: th.join()
