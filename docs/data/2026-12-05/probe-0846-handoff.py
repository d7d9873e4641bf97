"""Where a 9.8 MB GPU hand-off's producer time goes with a consumer attached: put, describe,
wire, send (pickle + pipe write), per step; reaper on (2 ms, as the suite) or off; the
consumer's open with host_wait on or off. argv: tree root, reaper_ms (0 = off), host_wait 0|1."""
import multiprocessing as mp, statistics, sys, tempfile, time
sys.path.insert(0, sys.argv[1])
import torch

pc = time.perf_counter


def consumer(conn, sock, host_wait):
    sys.path.insert(0, sys.argv[1])
    import torch
    from pool.client import FeatureClient
    torch.cuda.init(); torch.empty(1, device="cuda")
    client = FeatureClient.connect(sock)
    conn.send("attached")
    while True:
        kind, payload = conn.recv()
        tr = pc()
        if kind == "quit":
            break
        kw = {} if host_wait is None else {"host_wait": host_wait}
        t = client.open(payload, **kw)
        to = pc()
        last = int(t.view(-1)[-1].view(torch.int16).item())
        t1 = pc()
        client.release(payload)
        del t
        conn.send((t1, last, tr, to, pc()))
    client.close()


def main():
    root, reap_ms, hw = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "1"
    from pool.backends.cuda_vmm import CudaVmmBackend
    from pool.featurepool import FeaturePool
    from pool.server import HandoffServer
    import inspect
    from pool.client import FeatureClient
    has_hw = "host_wait" in inspect.signature(FeatureClient.open).parameters
    be = CudaVmmBackend.create(0, 1 << 30, 256 << 20, fabric="off")
    pool = FeaturePool([be], max_leases=1024, policy="wait", wait_s=5.0, default_ttl_s=60)
    if reap_ms > 0:
        pool.start_reaper(reap_ms / 1e3)
    sock = tempfile.mkdtemp() + "/p.sock"
    server = HandoffServer(pool, sock); server.start()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=consumer, args=(child, sock, hw if has_hw else None), daemon=True)
    p.start(); assert parent.recv() == "attached"
    base = torch.randn(2393, 2048, device="cuda").to(torch.bfloat16)
    keys = ("put", "describe", "wire", "send", "producer", "c_open", "c_read", "c_release", "total")
    steps = {k: [] for k in keys}
    for i in range(430):
        f = base.clone(); torch.cuda.synchronize()
        t0 = pc(); lease = pool.put(f); t1 = pc(); d = pool.describe(lease); t2 = pc()
        w = d.wire() if hasattr(d, "wire") else d; t3 = pc(); parent.send(("pool", w)); t4 = pc()
        tc1, last, tr, to, trel = parent.recv()
        assert last == int(f.view(-1)[-1].view(torch.int16).item())
        if i >= 30:
            for k, v in zip(keys, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0, to - tr, tc1 - to, trel - tc1, tc1 - t0)):
                steps[k].append(v * 1e6)
    parent.send(("quit", None)); p.join(10)
    server.close(); pool.close()
    print(root.rstrip("/").split("/")[-1], f"reap={reap_ms}", f"host_wait={hw if has_hw else 'n/a'}",
          " ".join(f"{k} {statistics.median(v):.1f}" for k, v in steps.items()), flush=True)


if __name__ == "__main__":
    main()
