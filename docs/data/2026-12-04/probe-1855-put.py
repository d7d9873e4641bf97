"""Producer steps of a 9.8 MB GPU hand-off, in-process (no consumer): put, describe, wire,
pickle, release; reaper on (2 ms, as the suite) or off. argv: tree root, reaper 0|1."""
import statistics, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from multiprocessing.reduction import ForkingPickler
from pool.backends.cuda_vmm import CudaVmmBackend
from pool.featurepool import FeaturePool
be = CudaVmmBackend.create(0, 1 << 30, 256 << 20, fabric="off")
pool = FeaturePool([be], max_leases=1024, policy="wait", wait_s=5.0, default_ttl_s=60)
if sys.argv[2] == "1":
    pool.start_reaper(0.002)
feat = torch.randn(2393, 2048, device="cuda").to(torch.bfloat16)
steps = {k: [] for k in ("put", "describe", "wire", "pickle", "release", "producer")}
pc = time.perf_counter
for i in range(400):
    f = feat.clone(); torch.cuda.synchronize()
    t0 = pc(); lease = pool.put(f); t1 = pc(); d = pool.describe(lease); t2 = pc()
    w = d.wire() if hasattr(d, "wire") else d; t3 = pc(); ForkingPickler.dumps(("pool", w)); t4 = pc()
    torch.cuda.synchronize(); t5 = pc(); pool.release(lease.id); t6 = pc()
    if i >= 50:
        for k, v in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t6 - t5, t4 - t0)):
            steps[k].append(v * 1e6)
print(sys.argv[1].split("/")[-1] or "head", "reaper" if sys.argv[2] == "1" else "noreap",
      " ".join(f"{k} {statistics.median(v):.1f}" for k, v in steps.items()), flush=True)
