"""Why the prepare stage takes ~21 ms per 128 photos in the service and ~11 ms alone (H200).

Times nvJPEG's one-call decode + preprocess of 128 photos (1024x768; --mixed: six shapes) as the
prepare thread pays it (the call's wall) and until its output is ready on the GPU:
  alone | beside a ViT-B/16 bf16 CUDA-graph forward loop on another thread and stream of this
  process (GPU contention; that thread makes one Python call per 11 ms batch) | beside a spinning
  Python thread at the service's 0.5 ms switch interval (the lock only) | both | the forward
  loop with the prepare stream at high priority.
Run from the repository root: python3 probe-contention.py [--mixed]"""

import sys
import threading
import time

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "bench")
from make_images import photo_jpeg  # noqa: E402

from app.encoders import build_encoder  # noqa: E402
from app.gpu_decode import JpegDecoder  # noqa: E402

MIXED = "--mixed" in sys.argv
dev = torch.device("cuda")


class ForwardLoop:
    def __init__(self) -> None:
        self.enc = build_encoder("vit-b16-224", device=dev, dtype=torch.bfloat16)
        self.enc.enable_cuda_graphs()  # type: ignore[union-attr]
        self.enc.warmup([128])
        self.x = torch.randn(128, 3, 224, 224, device=dev)
        self.stream = torch.cuda.Stream()
        self.stop = threading.Event()
        self.n = 0

    def run(self) -> None:
        with torch.cuda.stream(self.stream):
            while not self.stop.is_set():
                self.enc.encode(self.x)
                self.n += 1
                self.stream.synchronize()

    def start(self) -> None:
        self.stop.clear()
        self.n, self.t0 = 0, time.perf_counter()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def end(self) -> str:
        self.stop.set()
        self.thread.join()
        return f"[forward: {self.n * 128 / (time.perf_counter() - self.t0):.0f} images/s]"


def main() -> None:
    sys.setswitchinterval(0.0005)
    shapes = [(1024, 768)]
    if MIXED:
        shapes = [(1024, 768), (768, 1024), (1024, 682), (1024, 576), (1024, 1024), (682, 1024)]
    blobs = [photo_jpeg(i, *shapes[i % len(shapes)]) for i in range(32)]
    datas = [torch.frombuffer(bytearray(blobs[i % 32]), dtype=torch.uint8) for i in range(128)]
    dec = JpegDecoder.create(dev, "on", "nvjpeg")
    assert dec is not None
    normal, high = torch.cuda.Stream(), torch.cuda.Stream(priority=-1)
    fwd = ForwardLoop()

    def once(side: torch.cuda.Stream) -> tuple[float, float]:
        t = time.perf_counter()
        with torch.cuda.stream(side):
            out = dec.decode_preprocess(datas, [1] * 128, 224)
        call = time.perf_counter() - t
        assert out is not None
        side.synchronize()
        return call, time.perf_counter() - t

    for _ in range(5):
        once(normal)
    torch.cuda.synchronize()

    def measure(label: str, side: torch.cuda.Stream = normal) -> None:
        runs = [once(side) for _ in range(40)]
        call = sorted(r[0] for r in runs)
        ready = sorted(r[1] for r in runs)
        print(
            f"{label}: call median {call[20] * 1e3:.1f} ms (p90 {call[36] * 1e3:.1f}), "
            f"output ready median {ready[20] * 1e3:.1f} ms (p90 {ready[36] * 1e3:.1f})",
            flush=True,
        )

    stop_spin = threading.Event()

    def spin() -> None:
        x = 0
        while not stop_spin.is_set():
            x += 1

    def spinner() -> threading.Thread:
        stop_spin.clear()
        t = threading.Thread(target=spin, daemon=True)
        t.start()
        return t

    print(f"shapes: {shapes}", flush=True)
    measure("alone")
    s = spinner()
    measure("beside a spinning thread (lock only)")
    stop_spin.set()
    s.join()
    fwd.start()
    time.sleep(0.5)
    measure("beside the forward loop (GPU only)")
    print("  ", fwd.end(), flush=True)
    fwd.start()
    time.sleep(0.5)
    measure("beside the forward loop, prepare stream at high priority", high)
    print("  ", fwd.end(), flush=True)
    fwd.start()
    s = spinner()
    time.sleep(0.5)
    measure("beside both")
    stop_spin.set()
    print("  ", fwd.end(), flush=True)
    fwd.start()
    time.sleep(0.5)
    print("  forward alone for reference:", fwd.end(), flush=True)


if __name__ == "__main__":
    main()
