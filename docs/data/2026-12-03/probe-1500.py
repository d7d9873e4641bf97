"""Which frees wait for the GIL beside a busy thread; can one TorchScript call decode+preprocess without it."""
import sys, threading, time
from typing import Dict, List
sys.path.insert(0, ".")
import torch
import torch.nn.functional as F
from torchvision.io import ImageReadMode, decode_jpeg
from bench.make_images import photo_jpeg

SI = float(sys.argv[1]) if len(sys.argv) > 1 else 0.005
sys.setswitchinterval(SI)
dev = torch.device("cuda")
imgs = [torch.frombuffer(bytearray(photo_jpeg(i)), dtype=torch.uint8) for i in range(16)]
batch = (imgs * 8)[:128]
decode_jpeg(batch, mode=ImageReadMode.RGB, device=dev); torch.cuda.synchronize()

@torch.jit.script
def decode_pre(datas: List[torch.Tensor], mode: int, device: torch.device, size: int) -> torch.Tensor:
    ims = torch.ops.image.decode_jpegs_cuda(datas, mode, device)
    groups: Dict[int, List[int]] = {}
    sq: List[torch.Tensor] = []
    for i, im in enumerate(ims):
        h = im.shape[-2]; w = im.shape[-1]; s = min(h, w)
        t = (h - s) // 2; l = (w - s) // 2
        sq.append(im[:, t:t + s, l:l + s])
        k = s
        if k not in groups:
            groups[k] = torch.jit.annotate(List[int], [])
        groups[k].append(i)
    out = torch.empty([len(ims), 3, size, size], device=device)
    for k, idx in groups.items():
        x = torch.stack([sq[i] for i in idx]).float()
        x = F.interpolate(x, size=[size, size], mode="bicubic", antialias=True, align_corners=False)
        out[torch.tensor(idx, device=device)] = x.clamp_(0, 255).round_()
    return out

def plain_pre(datas):
    ims = decode_jpeg(datas, mode=ImageReadMode.RGB, device=dev)
    sq = []
    for im in ims:
        h, w = im.shape[-2:]; s = min(h, w); t = (h - s) // 2; l = (w - s) // 2
        sq.append(im[:, t:t + s, l:l + s])
    x = torch.stack(sq).float()
    x = F.interpolate(x, size=(224, 224), mode="bicubic", antialias=True, align_corners=False)
    return x.clamp_(0, 255).round_()

a = decode_pre(batch, ImageReadMode.RGB.value, dev, 224); b = plain_pre(batch)
print("script == plain:", bool((a == b).all()), tuple(a.shape), flush=True)

from nvidia import nvimgcodec as nv
dec = nv.Decoder(device_id=0, backends=[nv.Backend(nv.BackendKind.HW_GPU_ONLY)])
params = nv.DecodeParams(apply_exif_orientation=False, color_spec=nv.ColorSpec.SRGB, sample_format=nv.SampleFormat.P_RGB)
npb = [d.numpy() for d in batch]

stop = threading.Event()
def spin():
    while not stop.is_set():
        pass

def timed(label, f):
    torch.cuda.synchronize()
    t = time.perf_counter(); r = f(); torch.cuda.synchronize()
    print(f"  {label}: {1e3*(time.perf_counter()-t):.1f} ms", flush=True); return r

for spinner in (False, True):
    if spinner:
        threading.Thread(target=spin, daemon=True).start(); time.sleep(0.05)
    print(f"switch interval {SI*1e3} ms, busy thread: {spinner}")
    for rep in range(2):
        out = timed("A decode_jpeg 128", lambda: decode_jpeg(batch, mode=ImageReadMode.RGB, device=dev))
        timed("A free its 128 outputs", lambda: out.clear())
        e = timed("B torch.empty 128 x 3x768x1024 cuda", lambda: [torch.empty(3, 768, 1024, dtype=torch.uint8, device=dev) for _ in range(128)])
        timed("B free them", lambda: e.clear())
        c = timed("C torch.empty 128 cpu", lambda: [torch.empty(3, 768, 1024, dtype=torch.uint8) for _ in range(128)])
        timed("C free them", lambda: c.clear())
        big = torch.empty(128, 3, 768, 1024, dtype=torch.uint8, device=dev)
        v = timed("D 128 views of one cuda tensor", lambda: list(big.unbind(0)))
        timed("D free the views", lambda: v.clear()); del big
        timed("E script decode+preprocess 128 (one call)", lambda: decode_pre(batch, ImageReadMode.RGB.value, dev, 224))
        timed("F python decode+preprocess 128", lambda: plain_pre(batch))
        s = torch.cuda.current_stream().cuda_stream
        ni = timed("G nvimgcodec decode 128", lambda: dec.decode([nv.CodeStream(x) for x in npb], params=params, cuda_stream=s))
        nt = timed("G from_dlpack 128", lambda: [torch.from_dlpack(i) for i in ni])
        timed("G free tensors", lambda: nt.clear())
        ni2 = timed("H nvimgcodec decode 128 reusing Images", lambda: dec.decode([nv.CodeStream(x) for x in npb], images=ni, params=params, cuda_stream=s))
        print("    reused same objects:", all(p is q for p, q in zip(ni, ni2)))
        timed("G free Images", lambda: (ni.clear(), ni2.clear()))
stop.set()
