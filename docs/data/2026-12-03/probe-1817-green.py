"""Does keeping SMs out of the forward's reach let the JPEG decode run beside it? The ViT-B/16
forward (CUDA graph, 128 images) on a stream of a green context of K SMs, nvJPEG's batched
decode (128 photos) on ordinary streams: each alone, then both at once, 3 s each."""

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
N = 128


class Loop:
    def __init__(self, step, per: int, stream: torch.cuda.Stream) -> None:
        self.step, self.per, self.stream = step, per, stream
        self.stop = threading.Event()

    def run(self) -> None:
        with torch.cuda.stream(self.stream):
            while not self.stop.is_set():
                self.step()
                self.stream.synchronize()
                self.n += 1

    def start(self) -> None:
        self.stop.clear()
        self.n, self.t0 = 0, time.perf_counter()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def end(self) -> float:
        self.stop.set()
        self.thread.join()
        return self.n * self.per / (time.perf_counter() - self.t0)


def green_stream(num_sms: int):
    from torch.cuda.green_contexts import GreenContext

    gc = GreenContext.create(num_sms=num_sms, device_id=0)
    if hasattr(gc, "Stream"):
        return gc, gc.Stream()
    gc.set_context()
    s = torch.cuda.current_stream()
    gc.pop_context()
    return gc, s


def main() -> None:
    sys.setswitchinterval(0.0005)
    print(torch.__version__, torch.cuda.get_device_properties(0).multi_processor_count, "SMs")
    blobs = [photo_jpeg(i, 1024, 768) for i in range(32)]
    datas = [torch.frombuffer(bytearray(blobs[i % 32]), dtype=torch.uint8) for i in range(N)]
    enc = build_encoder("vit-b16-224", device=dev, dtype=torch.bfloat16)
    enc.enable_cuda_graphs()  # type: ignore[union-attr]
    enc.warmup([N])
    x = torch.randn(N, 3, 224, 224, device=dev)
    dec = JpegDecoder.create(dev, "on", "nvjpeg")
    assert dec is not None
    ones = [1] * N

    def dp() -> None:
        out = dec.decode_preprocess(datas, ones, 224)
        assert out is not None

    dstream = torch.cuda.Stream()
    for step_name, step in (("decode", lambda: dec.decode(datas)), ("decode+preprocess", dp)):
        d = Loop(step, N, dstream)
        d.start(); time.sleep(2); print(f"{step_name} alone {d.end():.0f}/s", flush=True)
    keep = []
    for k in (0, 124, 116, 100):
        if k == 0:
            s = torch.cuda.Stream()
        else:
            try:
                gc, s = green_stream(k)
                keep.append(gc)
            except Exception as e:  # noqa: BLE001
                print(f"green context of {k} SMs: {type(e).__name__}: {e}")
                continue
        f = Loop(lambda: enc.encode(x), N, s)
        f.start(); time.sleep(2); alone = f.end()
        for step_name, step in (("decode", lambda: dec.decode(datas)), ("decode+preprocess", dp)):
            d = Loop(step, N, dstream)
            f.start(); d.start(); time.sleep(3); dr = d.end(); fr = f.end()
            print(f"forward on {k or 'all'} SMs: alone {alone:.0f}/s; beside {step_name}: "
                  f"forward {fr:.0f}/s, {step_name} {dr:.0f}/s", flush=True)


if __name__ == "__main__":
    main()
