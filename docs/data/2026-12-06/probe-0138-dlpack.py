"""torch's from_dlpack of nvImageCodec's images: the image itself (torch first asks for a
versioned capsule, refused with a TypeError) against the image's own capsule
(__dlpack__(stream=...)). 128 decoded photos, us per image, median of 50 rounds, alone and
beside a thread spinning in Python (0.5 ms switch interval, as the service)."""
import os, statistics, sys, threading, time
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
import torch
from nvidia import nvimgcodec
from make_images import photo_jpeg
sys.setswitchinterval(0.0005)
photos = [photo_jpeg(i) for i in range(32)] * 4
dec = nvimgcodec.Decoder(device_id=0)
s = torch.cuda.Stream()
ptr = s.cuda_stream
with torch.cuda.stream(s):
    out = dec.decode([nvimgcodec.CodeStream(p) for p in photos], cuda_stream=ptr)
    s.synchronize()
    def rounds(label, fn):
        per = []
        for _ in range(50):
            t0 = time.perf_counter()
            for im in out:
                fn(im)
            per.append((time.perf_counter() - t0) / len(out) * 1e6)
        print(f"{label:44s} {statistics.median(per):7.2f} us per image", flush=True)
    a = lambda im: torch.utils.dlpack.from_dlpack(im)
    b = lambda im: torch.utils.dlpack.from_dlpack(im.__dlpack__(stream=ptr))
    assert all(torch.equal(a(im), b(im)) for im in out[:8])
    rounds("alone  from_dlpack(image)", a)
    rounds("alone  from_dlpack(image.__dlpack__(stream))", b)
    stop = threading.Event()
    def spin():
        while not stop.is_set():
            sum(range(200))
    th = threading.Thread(target=spin, daemon=True); th.start()
    for _ in range(2):
        rounds("beside from_dlpack(image)", a)
        rounds("beside from_dlpack(image.__dlpack__(stream))", b)
    stop.set(); th.join(5)
