"""torchcodec's nvJPEG operator (torchcodec 0.17.0, PyPI, cu130) beside torchvision's, on the
device's torch: does it load, does it decode like torchvision, and does it decode on several
threads at once (torchvision's one decoder sits behind a process-wide mutex; torchcodec keeps up
to 32 per GPU)? Run from the repository root with the wheel on PYTHONPATH."""
import io, sys, threading, time

import torch, torchvision
from PIL import Image

sys.path.insert(0, "bench")
from make_images import photo_jpeg  # noqa: E402

t0 = time.perf_counter()
import torchcodec  # noqa: E402
from torchcodec.decoders import decode_jpeg  # noqa: E402,F401  (loads the image library)
print(f"torch {torch.__version__} torchvision {torchvision.__version__} torchcodec "
      f"{torchcodec.__version__} (import {time.perf_counter() - t0:.2f} s)", flush=True)
dev = torch.device("cuda")
tv = torch.ops.image.decode_jpegs_cuda
tc = torch.ops.torchcodec_ns.decode_jpegs_cuda
jpegs = [photo_jpeg(i) for i in range(32)]
datas = [torch.frombuffer(bytearray(j), dtype=torch.uint8) for j in jpegs] * 4  # 128

a, b = tv(datas[:32], 3, dev), tc(datas[:32], 3, dev)
torch.cuda.synchronize()
diffs = [(x.int() - y.int()).abs() for x, y in zip(a, b)]
print("shapes equal:", all(x.shape == y.shape for x, y in zip(a, b)),
      "max |tv - tc|:", max(int(d.max()) for d in diffs),
      "share equal: %.4f" % (sum(int((d == 0).sum()) for d in diffs) / sum(d.numel() for d in diffs)))

im = Image.open(io.BytesIO(jpegs[0]))
exif = im.getexif(); exif[0x0112] = 6
buf = io.BytesIO(); im.save(buf, "JPEG", quality=90, exif=exif.tobytes())
rot = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
print("EXIF orientation 6: torchvision", tuple(tv([rot], 3, dev)[0].shape),
      "torchcodec", tuple(tc([rot], 3, dev)[0].shape), flush=True)


def rate(op, threads: int, seconds: float = 2.0) -> float:
    stop, counts = threading.Event(), [0] * threads

    def loop(k: int) -> None:
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            while not stop.is_set():
                op(datas, 3, dev)
                s.synchronize()
                counts[k] += len(datas)

    ts = [threading.Thread(target=loop, args=(k,)) for k in range(threads)]
    t = time.perf_counter()
    for th in ts: th.start()
    time.sleep(seconds); stop.set()
    for th in ts: th.join()
    return sum(counts) / (time.perf_counter() - t)


for name, op in (("torchvision", tv), ("torchcodec", tc)):
    for _ in range(3): op(datas, 3, dev)
    torch.cuda.synchronize()
for threads in (1, 2, 3, 4):
    for name, op in (("torchvision", tv), ("torchcodec", tc)):
        print(f"{name:11s} x{threads} threads, batches of 128: {rate(op, threads):7.0f} images/s", flush=True)
