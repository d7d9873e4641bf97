"""Is nvJPEG's one call slower in the service because its JPEG bytes are cold? In the service
a front process writes each image into its arena (shared memory) just before the GPU process
decodes it, so the decode's host side (parsing, the pageable copy to the device) reads bytes
that another core wrote; the twenty-third session's probe decoded the same 32 photos again and
again, hot in its own caches. Here a child process rewrites a shared arena with 128 photos
before each call ("cold"), then the same call runs again on the same bytes ("hot"), alone and
beside the ViT-B/16 forward loop; then with the arena page-locked (cudaHostRegister). Median ms
per call of 128 and the thread's CPU ms. EVICT=1 adds "evicted": rewritten, then 512 MiB read
so that the bytes are in memory, not in a cache (in the service, at 16x64 ~1,000 images, ~140
MB, wait between a front's write and the decode). Run from the repository root on the device."""

import os, statistics, sys, threading, time
from multiprocessing import shared_memory

sys.path[:0] = [".", "bench"]
from make_images import photo_jpeg  # noqa: E402

N, SLOT = 128, 256 * 1024
photos = [photo_jpeg(i) for i in range(N)]
shm = shared_memory.SharedMemory(create=True, size=N * SLOT)
go_r, go_w = os.pipe()
done_r, done_w = os.pipe()
if os.fork() == 0:  # the "front": rewrites every photo into the arena on each request
    while os.read(go_r, 1) == b"g":
        for i, p in enumerate(photos):
            shm.buf[i * SLOT : i * SLOT + len(p)] = p
        os.write(done_w, b"d")
    os._exit(0)

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
import torch  # noqa: E402

from app.encoders.vit import ViTEncoder  # noqa: E402
from app.gpu_decode import ByteSpans, JpegDecoder  # noqa: E402

dev = torch.device("cuda")
arena = torch.frombuffer(shm.buf, dtype=torch.uint8)
spans = ByteSpans([arena], [0] * N, [i * SLOT for i in range(N)], [len(p) for p in photos])
decoders = {name: JpegDecoder.create(dev, "on", name) for name in ("nvjpeg",)}
sys.setswitchinterval(0.0005)


def rewrite() -> None:
    os.write(go_w, b"g")
    os.read(done_r, 1)


EVICT = os.environ.get("EVICT") == "1"
sweep = torch.ones(1 << 27 if EVICT else 1, dtype=torch.int32)  # 512 MiB, read to evict the caches


def calls(jd: JpegDecoder, n: int = 30) -> str:
    kinds = ("evicted", "cold", "hot") if EVICT else ("cold", "hot")
    out: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    for _ in range(n):
        for kind in kinds:
            if kind == "evicted":
                rewrite()
                sweep.sum()  # read on torch's threads: the shared cache holds none of the arena
            elif kind == "cold":
                rewrite()
            t, c = time.perf_counter(), time.thread_time()
            jd.decode_preprocess(spans, [1] * N, 224)
            out[kind].append(((time.perf_counter() - t) * 1e3, (time.thread_time() - c) * 1e3))
    return " | ".join(
        f"{k} {statistics.median(w for w, _ in v):5.2f} ms (CPU {statistics.median(c for _, c in v):5.2f})"
        for k, v in out.items()
    )


enc = ViTEncoder("vit-b16-224", device=dev)
enc.enable_cuda_graphs(); enc.warmup([N])
x = torch.randn(N, 3, 224, 224, device=dev)
stop = threading.Event()


def forward_loop() -> None:
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        while not stop.is_set():
            enc.encode(x); s.synchronize()


side = torch.cuda.Stream()
with torch.cuda.stream(side):
    for name, jd in decoders.items():
        calls(jd, 5)  # warm
        print(f"{name} alone:            {calls(jd)}", flush=True)
        th = threading.Thread(target=forward_loop); th.start()
        print(f"{name} beside forward:   {calls(jd)}", flush=True)
        stop.set(); th.join(); stop.clear()
    rc = torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), arena.numel(), 0)
    print("cudaHostRegister:", rc, flush=True)
    for name, jd in decoders.items():
        print(f"{name} pinned alone:     {calls(jd)}", flush=True)
        th = threading.Thread(target=forward_loop); th.start()
        print(f"{name} pinned + forward: {calls(jd)}", flush=True)
        stop.set(); th.join()
    torch.cuda.cudart().cudaHostUnregister(arena.data_ptr())
os.write(go_w, b"q")
del arena, spans
try:
    shm.close()
except BufferError:  # a tensor still views it; the process ends anyway
    pass
shm.unlink()
