# temporary: profile the hand-off host path on the GPU (not committed)
import cProfile, pstats, sys, tempfile, time, statistics, io
import multiprocessing as mp
from pathlib import Path
sys.path.insert(0, "bench")
import torch
from pool.backends.cuda_vmm import CudaVmmBackend
from pool.featurepool import FeaturePool
from pool.server import HandoffServer

def consumer(conn, sock):
    from pool.client import FeatureClient
    torch.cuda.init()
    c = FeatureClient.connect(sock)
    conn.send("ok")
    prof = cProfile.Profile()
    opens = []
    while True:
        d = conn.recv()
        if d is None:
            break
        t0 = time.perf_counter_ns()
        prof.enable()
        t = c.open(d)
        prof.disable()
        opens.append((time.perf_counter_ns() - t0) / 1e3)
        t.view(-1)[-1].item()
        c.release(d)
        conn.send(1)
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
    conn.send((statistics.median(opens), s.getvalue()))

def main():
    backend = CudaVmmBackend.create(0, 512 << 20, 256 << 20)
    pool = FeaturePool([backend], max_leases=1024, policy="reject")
    pool.start_reaper(0.005)
    sock = str(Path(tempfile.mkdtemp()) / "p.sock")
    server = HandoffServer(pool, sock, extra_welcome=backend.welcome_info)
    server.start()
    base = torch.randn(2392, 2048, device="cuda", dtype=torch.bfloat16)
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=consumer, args=(b, sock), daemon=True)
    p.start(); assert a.recv() == "ok"
    prof = cProfile.Profile()
    puts = []
    for i in range(600):
        feat = base.clone(); torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        if i >= 100: prof.enable()
        lease = pool.put(feat)
        d = pool.describe(lease)
        if i >= 100: prof.disable()
        puts.append((time.perf_counter_ns() - t0) / 1e3)
        a.send(d); a.recv()
    a.send(None)
    med, txt = a.recv()
    print("producer put+describe median us", statistics.median(puts[100:]))
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    print("consumer open median us", med)
    print(txt)
    server.close(); pool.close()

if __name__ == "__main__":
    main()
