"""Decode (and preprocess) and the ViT-B/16 forward, each on its own thread and stream, at the
same time for 3 s: both rates (images/s). Alone, then together. nvjpeg (torchvision) and
nvimgcodec (hardware engine). Run from the repository root: python3 probe-corun.py [--mixed]"""

import sys
import threading
import time

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "bench")
from make_images import photo_jpeg  # noqa: E402

from app.encoders import build_encoder  # noqa: E402
from app.gpu_decode import JpegDecoder, preprocess  # noqa: E402

MIXED = "--mixed" in sys.argv
dev = torch.device("cuda")
N = 128


class Loop:
    def __init__(self, step, per: int) -> None:
        self.step, self.per = step, per
        self.stream = torch.cuda.Stream()
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


def main() -> None:
    sys.setswitchinterval(0.0005)
    shapes = [(1024, 768)]
    if MIXED:
        shapes = [(1024, 768), (768, 1024), (1024, 682), (1024, 576), (1024, 1024), (682, 1024)]
    blobs = [photo_jpeg(i, *shapes[i % len(shapes)]) for i in range(32)]
    datas = [torch.frombuffer(bytearray(blobs[i % 32]), dtype=torch.uint8) for i in range(N)]
    enc = build_encoder("vit-b16-224", device=dev, dtype=torch.bfloat16)
    enc.enable_cuda_graphs()  # type: ignore[union-attr]
    enc.warmup([N])
    x = torch.randn(N, 3, 224, 224, device=dev)
    fwd = Loop(lambda: enc.encode(x), N)
    print(f"shapes: {shapes}", flush=True)
    fwd.start(); time.sleep(3); print(f"forward alone: {fwd.end():.0f} images/s", flush=True)
    for name in ("nvjpeg", "nvimgcodec"):
        dec = JpegDecoder.create(dev, "on", name)  # type: ignore[arg-type]
        assert dec is not None
        ones = [1] * N

        def dp() -> None:
            out = dec.decode_preprocess(datas, ones, 224)
            if out is None:
                preprocess(dec.decode(datas), ones, 224)  # type: ignore[arg-type]

        decoded = dec.decode(datas)
        work = {
            "decode": lambda: dec.decode(datas),
            "decode+preprocess": dp,
            "preprocess only": lambda: preprocess(decoded, ones, 224),  # type: ignore[arg-type]
        }
        for label, step in work.items():
            if name == "nvimgcodec" and label == "preprocess only":
                continue
            lp = Loop(step, N)
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            lp.start(); time.sleep(3); alone = lp.end()
            lp.start(); fwd.start(); time.sleep(3); f = fwd.end(); both = lp.end()
            print(f"{name} {label}: alone {alone:.0f} images/s; together {both:.0f} images/s "
                  f"and forward {f:.0f} images/s", flush=True)


if __name__ == "__main__":
    main()
