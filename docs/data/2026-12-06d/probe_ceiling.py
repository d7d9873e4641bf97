"""The pipeline's ceiling on the GPU without HTTP: the ViT-B/16 bf16 forward (a CUDA graph of
128) looping on one thread and stream, the prepare stage (nvJPEG's one-call decode and
preprocess of 128 photos, then the normalisation) on another, as the engine runs them; alone
and together, with each side's parts apart, and the SM time each takes per image (the sum of
its kernels' durations, torch.profiler). PART=spin: only the prepare call beside the forward
and beside threads that hold the interpreter lock. Run from the repository root on the device."""
import os, sys, threading, time

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # as python -m app sets it
import torch
from torch.profiler import ProfilerActivity, profile

sys.path[:0] = [".", "bench"]
from make_images import photo_jpeg  # noqa: E402
from app.encoders.vit import IMAGENET_MEAN, IMAGENET_STD, ViTEncoder  # noqa: E402
from app.gpu_decode import (  # noqa: E402
    ByteSpans, JpegDecoder, centre_square, preprocess, resize_weights, torchscript,
)

dev, N, S = torch.device("cuda"), 128, 224
datas = [torch.frombuffer(bytearray(photo_jpeg(i)), dtype=torch.uint8) for i in range(32)] * 4
spans, ones = ByteSpans.of(datas), [1] * N
mean = torch.tensor(IMAGENET_MEAN, device=dev).view(1, 3, 1, 1) * 255
std = torch.tensor(IMAGENET_STD, device=dev).view(1, 3, 1, 1) * 255
jd = JpegDecoder.create(dev, "on", "nvjpeg")
pre = torchscript(preprocess)
decoded = jd.decode(datas)
x = torch.randn(N, 3, S, S, device=dev)


def pre_copy(images: list[torch.Tensor], size: int) -> torch.Tensor:
    """``preprocess`` of upright images of one shape, each cast to float16 as it is copied into
    the batch (in place of a stack, then a cast of the whole)."""
    squares = [centre_square(im) for im in images]
    side = squares[0].shape[-1]
    x = torch.empty(len(squares), 3, side, side, device=dev, dtype=torch.float16)
    for i, sq in enumerate(squares):
        x[i].copy_(sq)
    wt = resize_weights(side, size, dev).t().half()
    y = torch.matmul(torch.matmul(x, wt).transpose(-1, -2), wt).transpose(-1, -2)
    return y.float().clamp_(0, 255).round_()


def encoder(compile: bool) -> ViTEncoder:
    t = time.perf_counter()
    e = ViTEncoder("vit-b16-224", device=dev, compile=compile)
    e.enable_cuda_graphs(); e.warmup([N])
    print(f"encoder compile={compile}: ready in {time.perf_counter() - t:.0f} s", flush=True)
    return e


eager, compiled = encoder(False), encoder(True)
work = {
    "forward": lambda: eager.encode(x),
    "forward compiled": lambda: compiled.encode(x),
    "decode+pre": lambda: (jd.decode_preprocess(spans, ones, S) - mean) / std,
    "decode": lambda: jd.decode(datas),
    "pre": lambda: (pre(decoded, ones, S) - mean) / std,
    "pre-copy": lambda: (pre_copy(decoded, S) - mean) / std,
}
# Python holding the interpreter lock, as the GPU process's batch thread and job channel do
# beside the prepare thread (which gives it up for its one call and takes it back after).
work["spin"] = lambda: sum(range(20_000))
print("pre-copy equals preprocess:", torch.equal(pre_copy(decoded, S), pre(decoded, ones, S)))


def rates(names: list[str], seconds: float = 3.0) -> list[float]:
    stop, counts = threading.Event(), [0] * len(names)

    def loop(k: int) -> None:
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            while not stop.is_set():
                work[names[k]](); s.synchronize(); counts[k] += N

    ts = [threading.Thread(target=loop, args=(k,)) for k in range(len(names))]
    t = time.perf_counter()
    for th in ts: th.start()
    time.sleep(seconds); stop.set()
    for th in ts: th.join()
    return [c / (time.perf_counter() - t) for c in counts]


def sm_us_per_image(name: str, calls: int = 8) -> str:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls): work[name]()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and "mem" not in e.name.lower()]
    us = sum(e.time_range.elapsed_us() for e in kernels) / (calls * N)
    return f"{us:6.1f} us/image ({len(kernels) // calls} kernels a call)"


if os.environ.get("PART") == "spin":  # the prepare call beside the service's interpreter
    sys.setswitchinterval(0.0005)  # the GPU process's (--gil-switch-interval-ms 0.5)
    rates(["forward", "decode+pre"], 1.0)
    for names in (["decode+pre"], ["forward", "decode+pre"], ["forward", "decode+pre", "spin"],
                  ["forward", "decode+pre", "spin", "spin"], ["forward", "decode+pre"]):
        got = rates(names)
        print("together: " + " | ".join(f"{n} {r:7.0f}" for n, r in zip(names, got) if n != "spin")
              + f" images/s, with {names.count('spin')} spinning thread(s)", flush=True)
    sys.exit()
for name in [n for n in work if n != "spin"]:
    rates([name], 1.0)  # warm
    print(f"{name:17s} alone {rates([name])[0]:7.0f} images/s, SM {sm_us_per_image(name)}", flush=True)
for a, b in (("forward", "decode+pre"), ("forward", "decode"), ("forward", "pre"), ("forward", "pre-copy"),
             ("forward compiled", "decode+pre"), ("forward", "decode+pre")):
    ra, rb = rates([a, b])
    print(f"together: {a} {ra:7.0f} | {b} {rb:7.0f} images/s", flush=True)
