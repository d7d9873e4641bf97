"""Where nvImageCodec's Python decode of 128 photo JPEGs spends its time: CodeStream per image,
the decode call, from_dlpack per image; alone and beside a thread spinning in Python (the event
loop's share of the lock), at the service's switch interval."""
import statistics, sys, threading, time
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
import torch
from nvidia import nvimgcodec
from make_images import photo_jpeg
dev = torch.device("cuda")
raw = [photo_jpeg(i) for i in range(128)]
datas = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in raw]
kinds = (nvimgcodec.BackendKind.HW_GPU_ONLY, nvimgcodec.BackendKind.GPU_ONLY)
dec = nvimgcodec.Decoder(device_id=0, backends=[nvimgcodec.Backend(k) for k in kinds])
params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB, sample_format=nvimgcodec.SampleFormat.P_RGB)
s = torch.cuda.Stream(); sp = s.cuda_stream
print("switch interval", sys.getswitchinterval())
stop = False
def spin():
    x = 0
    while not stop:
        x += 1
def once(mode):
    t0 = time.perf_counter()
    if mode == "bytes":
        cs = raw; t1 = t0
    else:
        cs = [nvimgcodec.CodeStream(d.numpy()) for d in datas]; t1 = time.perf_counter()
    out = dec.decode(cs, params=params, cuda_stream=sp); t2 = time.perf_counter()
    with torch.cuda.stream(s):
        ts = [torch.utils.dlpack.from_dlpack(im) for im in out]
    t3 = time.perf_counter(); s.synchronize(); t4 = time.perf_counter()
    assert all(t is not None for t in ts) and ts[0].shape[0] == 3, ts[0].shape
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3, (t4 - t3) * 1e3
for spin_on in (False, True):
    for si in ((0.005,) if not spin_on else (0.005, 0.0005)):
        sys.setswitchinterval(si)
        stop = False
        th = threading.Thread(target=spin, daemon=True)
        if spin_on: th.start()
        for mode in ("codestream", "bytes"):
            try:
                r = [once(mode) for _ in range(12)][2:]
            except Exception as e:
                print(mode, "failed", e); continue
            med = [statistics.median(c) for c in zip(*r)]
            print(f"spin={int(spin_on)} switch={si} {mode:10s} codestreams {med[0]:6.2f} decode {med[1]:6.2f} from_dlpack {med[2]:6.2f} sync {med[3]:6.2f} ms per 128", flush=True)
        stop = True
        if spin_on: th.join()
