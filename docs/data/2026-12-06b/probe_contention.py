"""Probe (run in the twenty-second session: ../2026-12-06c/probe-2130-contention.txt):
nvJPEG's batched decode (torchvision, 64 photos a call) alone, then beside K busy processes on the other cores:
pure-Python spinners, or SHA-256 over 138 KB buffers (what the fronts do per image). Prints ms
per call (median of 30) and the decode thread's CPU time. Run from the repository root.
``--others``: print the CPUs outside CPU 0's core, comma-separated (for taskset), and stop."""
import hashlib, multiprocessing as mp, os, statistics, sys, time


def core_of_cpu0():
    """CPU 0 and its hyperthread siblings, from a list such as "0,8" or "0-1"."""
    text = open("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list").read().strip()
    cpus = {0}
    for part in text.split(","):
        a, _, b = part.partition("-")
        cpus |= set(range(int(a), int(b or a) + 1))
    return cpus


if __name__ == "__main__" and sys.argv[1:] == ["--others"]:
    print(",".join(map(str, sorted(os.sched_getaffinity(0) - core_of_cpu0()))))
    sys.exit()

sys.path.insert(0, "bench")
import torch, torchvision
from torchvision.io import decode_jpeg
from make_images import photo_jpeg

def spin(kind):
    buf = os.urandom(138 * 1024)
    while True:
        if kind == "sha":
            hashlib.sha256(buf).digest()
        else:
            pass

def run(datas, n=30):
    out = []
    for _ in range(n):
        t0 = time.perf_counter(); c0 = time.thread_time()
        imgs = decode_jpeg(datas, device="cuda")
        torch.cuda.current_stream().synchronize()
        out.append((time.perf_counter() - t0, time.thread_time() - c0))
        del imgs
    w = statistics.median(x for x, _ in out) * 1e3
    c = statistics.median(y for _, y in out) * 1e3
    return w, c

if __name__ == "__main__":
    jpegs = [photo_jpeg(i) for i in range(32)] * 2
    datas = [torch.frombuffer(bytearray(j), dtype=torch.uint8) for j in jpegs]
    run(datas, 10)
    print("torch", torch.__version__, "torchvision", torchvision.__version__, "cores", os.cpu_count())
    every = os.sched_getaffinity(0)
    core = core_of_cpu0()
    others = every - core
    print("cpu0's core", sorted(core), "others", len(others))
    # pinned: this thread alone on CPU 0, the busy processes on the CPUs other than its core's
    for kind, k, pinned in [("none", 0, False), ("spin", 8, False), ("sha", 8, False), ("none", 0, False),
                            ("spin", 14, False), ("sha", 14, False), ("sha", len(others), True),
                            ("sha", len(others), False), ("none", 0, True)]:
        os.sched_setaffinity(0, {0} if pinned else every)
        procs = [mp.Process(target=spin, args=(kind,), daemon=True) for _ in range(k)]
        for p in procs: p.start()
        if pinned:
            for p in procs: os.sched_setaffinity(p.pid, others)
        time.sleep(0.5)
        w, c = run(datas)
        for p in procs: p.terminate()
        for p in procs: p.join()
        print(f"{kind:5s} x{k:2d}{' pinned' if pinned else '       '}: {w:6.2f} ms per 64 ({w/64*1000:.0f} us an image), thread CPU {c:6.2f} ms")
