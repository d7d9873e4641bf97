"""Why a GPU JPEG decode slows ~5x beside the ViT forward loop while preprocessing does not:
a wait for the whole context's work (a device-wide sync), or the SMs? Decode rate (128 photos per
call) alone; beside the forward loop; beside a one-block sleep kernel loop (no SM contention);
beside the forward loop in another process (another context). Then the CUDA runtime/driver
calls of decode calls beside the forward loop (torch.profiler, CUPTI), longest first."""

import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "bench")
from make_images import photo_jpeg  # noqa: E402

from app.encoders import build_encoder  # noqa: E402
from app.gpu_decode import JpegDecoder  # noqa: E402

dev = torch.device("cuda")
N = 128

if "--forward-child" in sys.argv:
    enc = build_encoder("vit-b16-224", device=dev, dtype=torch.bfloat16)
    enc.enable_cuda_graphs()  # type: ignore[union-attr]
    enc.warmup([N])
    x = torch.randn(N, 3, 224, 224, device=dev)
    s = torch.cuda.Stream()
    print("ready", flush=True)
    t0, n = time.perf_counter(), 0
    with torch.cuda.stream(s):
        while time.perf_counter() - t0 < 6:
            enc.encode(x)
            s.synchronize()
            n += 1
    print(f"child forward {n * N / (time.perf_counter() - t0):.0f} images/s", flush=True)
    sys.exit(0)


class Loop:
    def __init__(self, step, per: int, priority: int = 0) -> None:
        self.step, self.per = step, per
        self.stream = torch.cuda.Stream(priority=priority)
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
    blobs = [photo_jpeg(i, 1024, 768) for i in range(32)]
    datas = [torch.frombuffer(bytearray(blobs[i % 32]), dtype=torch.uint8) for i in range(N)]
    enc = build_encoder("vit-b16-224", device=dev, dtype=torch.bfloat16)
    enc.enable_cuda_graphs()  # type: ignore[union-attr]
    enc.warmup([N])
    x = torch.randn(N, 3, 224, 224, device=dev)
    fwd = Loop(lambda: enc.encode(x), N)
    # a 10 ms one-block kernel: keeps the context busy, leaves 131 of 132 SMs free
    sleeper = Loop(lambda: torch.cuda._sleep(int(1.98e7)), 1)
    t = time.perf_counter(); sleeper.start(); time.sleep(1); print(f"sleep kernels/s {sleeper.end():.0f}")
    for name in ("nvimgcodec", "nvjpeg"):
        dec = JpegDecoder.create(dev, "on", name)  # type: ignore[arg-type]
        assert dec is not None
        step = lambda: dec.decode(datas)  # noqa: E731
        lp = Loop(step, N)
        for _ in range(3):
            step()
        torch.cuda.synchronize()

        def rate(other: Loop | None) -> str:
            if other is not None:
                other.start()
                time.sleep(0.2)
            lp.start(); time.sleep(3); r = lp.end()
            o = f" (other {other.end():.0f}/s)" if other is not None else ""
            return f"{r:.0f}{o}"

        hp = Loop(step, N, priority=-1)
        fwd.start(); time.sleep(0.2); hp.start(); time.sleep(3); r = hp.end()
        print(f"{name} decode on a high-priority stream beside forward: {r:.0f} (forward {fwd.end():.0f})", flush=True)
        if "--priority-only" in sys.argv:
            continue
        print(f"{name} decode images/s: alone {rate(None)}; beside forward {rate(fwd)}; "
              f"beside one-block sleep kernels {rate(sleeper)}", flush=True)
        child = subprocess.Popen([sys.executable, __file__, "--forward-child"],
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        child.stdout.readline()
        time.sleep(0.3)
        print(f"{name} decode beside forward in another process: {rate(None)}; "
              f"{child.stdout.read().strip()}", flush=True)
        child.wait()
        # which CUDA calls wait, beside the forward loop
        from torch.profiler import ProfilerActivity, profile
        fwd.start(); time.sleep(0.2)
        with torch.cuda.stream(lp.stream):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(4):
                    step()
                    lp.stream.synchronize()
        fwd.end()
        evs = [e for e in prof.key_averages() if e.key.startswith(("cuda", "cu"))]
        evs.sort(key=lambda e: -e.cpu_time_total)
        print(f"{name}: CUDA API calls in 4 decodes beside the forward (count, total ms):")
        for e in evs[:14]:
            print(f"   {e.key:40s} {e.count:6d} {e.cpu_time_total / 1e3:9.2f}")
        tops = sorted(prof.key_averages(), key=lambda e: -e.cpu_time_total)[:6]
        for e in tops:
            print(f"   [all] {e.key[:60]:60s} {e.count:6d} {e.cpu_time_total / 1e3:9.2f}")


if __name__ == "__main__":
    main()
