"""Prepare-stage cost against batch size, and whether a second decoder instance decodes in
parallel. For b in 16..128: ms per fused decode+preprocess call (nvJPEG via torchvision), alone,
beside the ViT-B/16 forward loop, and beside the forward plus a Python thread holding the
interpreter lock ~40 % of the time. Then k threads x k decoders (nvImageCodec instances; nvJPEG
through torchvision is one global decoder behind a mutex) at b=64: images/s alone and beside."""

import os
import sys
import threading
import time

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "bench")
from make_images import photo_jpeg  # noqa: E402

from app.encoders import build_encoder  # noqa: E402
from app.gpu_decode import JpegDecoder, preprocess  # noqa: E402

dev = torch.device("cuda")
print("CUDA_DEVICE_MAX_CONNECTIONS", os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), flush=True)


class Loop:
    def __init__(self, step, per: int, stream: bool = True) -> None:
        self.step, self.per = step, per
        self.stream = torch.cuda.Stream() if stream else None
        self.stop = threading.Event()
        self.times: list[float] = []

    def run(self) -> None:
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else None
        if ctx is not None:
            ctx.__enter__()
        while not self.stop.is_set():
            t = time.perf_counter()
            self.step()
            if self.stream is not None:
                self.stream.synchronize()
            self.times.append(time.perf_counter() - t)
            self.n += 1

    def start(self) -> None:
        self.stop.clear()
        self.times = []
        self.n, self.t0 = 0, time.perf_counter()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def end(self) -> float:
        self.stop.set()
        self.thread.join()
        return self.n * self.per / (time.perf_counter() - self.t0)

    def ms(self) -> float:
        t = sorted(self.times)
        return 1000 * t[len(t) // 2] if t else float("nan")


class Busy:
    """A Python thread that holds the lock ~40 % of the time (spins 0.4 ms, sleeps 0.6 ms)."""

    def __init__(self) -> None:
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            t = time.perf_counter()
            while time.perf_counter() - t < 0.0004:
                pass
            time.sleep(0.0006)

    def __enter__(self):
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def __exit__(self, *a):
        self.stop.set()
        self.thread.join()


def main() -> None:
    sys.setswitchinterval(0.0005)
    blobs = [photo_jpeg(i, 1024, 768) for i in range(32)]
    datas = [torch.frombuffer(bytearray(blobs[i % 32]), dtype=torch.uint8) for i in range(128)]
    enc = build_encoder("vit-b16-224", device=dev, dtype=torch.bfloat16)
    enc.enable_cuda_graphs()  # type: ignore[union-attr]
    enc.warmup([128])
    x = torch.randn(128, 3, 224, 224, device=dev)
    fwd = Loop(lambda: enc.encode(x), 128)
    fwd.start(); time.sleep(2); print(f"forward alone: {fwd.end():.0f} images/s", flush=True)
    nv = JpegDecoder.create(dev, "on", "nvjpeg")
    assert nv is not None
    T = 2.0
    for b in (16, 32, 64, 128):
        d, ones = datas[:b], [1] * b
        lp = Loop(lambda: nv.decode_preprocess(d, ones, 224), b)
        for _ in range(3):
            lp.step()
        lp.start(); time.sleep(T); r0 = lp.end(); m0 = lp.ms()
        lp.start(); fwd.start(); time.sleep(T); f1 = fwd.end(); r1 = lp.end(); m1 = lp.ms()
        with Busy():
            lp.start(); fwd.start(); time.sleep(T); f2 = fwd.end(); r2 = lp.end(); m2 = lp.ms()
        print(f"nvjpeg fused b={b}: alone {m0:.2f} ms ({r0:.0f}/s); beside forward {m1:.2f} ms "
              f"({r1:.0f}/s, fwd {f1:.0f}); + busy thread {m2:.2f} ms ({r2:.0f}/s, fwd {f2:.0f})",
              flush=True)
    # decode only (no preprocess), per batch size, alone: the decoder's own fixed cost
    for b in (16, 64, 128):
        d = datas[:b]
        lp = Loop(lambda: nv.decode(d), b)
        lp.start(); time.sleep(T); r0 = lp.end()
        print(f"nvjpeg decode only b={b}: {lp.ms():.2f} ms ({r0:.0f}/s)", flush=True)
    # k threads, each its own decoder
    b = 64
    d, ones = datas[:b], [1] * b
    for name in ("nvjpeg", "nvimgcodec"):
        for k in (1, 2, 3):
            decs = [JpegDecoder.create(dev, "on", name) for _ in range(k)]

            def mk(dec):
                def step():
                    out = dec.decode_preprocess(d, ones, 224)
                    if out is None:
                        preprocess(dec.decode(d), ones, 224)
                return step

            loops = [Loop(mk(dec), b) for dec in decs]
            for lp in loops:
                lp.step(); lp.step()
            for lp in loops:
                lp.start()
            time.sleep(T)
            alone = sum(lp.end() for lp in loops)
            for lp in loops:
                lp.start()
            fwd.start(); time.sleep(T); f = fwd.end()
            both = sum(lp.end() for lp in loops)
            with Busy():
                for lp in loops:
                    lp.start()
                fwd.start(); time.sleep(T); f2 = fwd.end()
                busy = sum(lp.end() for lp in loops)
            print(f"{name} x{k} threads b={b}: alone {alone:.0f}/s; beside forward {both:.0f}/s "
                  f"(fwd {f:.0f}); + busy {busy:.0f}/s (fwd {f2:.0f})", flush=True)


if __name__ == "__main__":
    main()
