"""cProfile of pool.put + describe + release (no consumer), 2,000 9.8 MB leases; argv: tree root."""
import cProfile, pstats, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from pool.backends.cuda_vmm import CudaVmmBackend
from pool.featurepool import FeaturePool
be = CudaVmmBackend.create(0, 1 << 30, 256 << 20, fabric="off")
pool = FeaturePool([be], max_leases=1024, policy="wait", wait_s=5.0, default_ttl_s=60)
f = torch.randn(2393, 2048, device="cuda").to(torch.bfloat16)
def run(n):
    tp = td = 0.0
    for i in range(n):
        if i % 64 == 0: torch.cuda.synchronize()
        t0 = time.perf_counter(); lease = pool.put(f); t1 = time.perf_counter(); d = pool.describe(lease); t2 = time.perf_counter()
        pool.release(lease.id)
        tp += t1 - t0; td += t2 - t1
    return tp / n * 1e6, td / n * 1e6
run(200)
print(sys.argv[1], "put %.1f describe %.1f us" % run(2000))
pr = cProfile.Profile(); pr.enable(); run(2000); pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(14)
