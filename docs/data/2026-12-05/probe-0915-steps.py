"""Mean host time per call of each step of put/describe/release on the GPU tier (9.8 MB),
each step wrapped with a perf_counter_ns timer; argv: tree root, backend (cuda|host)."""
import functools, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from pool.featurepool import FeaturePool
from pool import allocator as alloc_mod, leases as leases_mod
acc = {}
def wrap(owner, name, label):
    f = getattr(owner, name, None)
    if f is None:
        return
    @functools.wraps(f)
    def w(*a, **k):
        t = time.perf_counter_ns()
        try:
            return f(*a, **k)
        finally:
            s = acc.setdefault(label, [0, 0]); s[0] += time.perf_counter_ns() - t; s[1] += 1
    import inspect
    setattr(owner, name, staticmethod(w) if isinstance(inspect.getattr_static(owner, name), staticmethod) else w)
for n in ("put", "put_many", "_checked", "_candidates", "_reserve", "_lease_locked", "_publish", "_mark_ready", "describe", "release", "_live", "_end_many", "_acked", "_free_storage"):
    wrap(FeaturePool, n, "pool." + n)
if sys.argv[2] == "cuda":
    from pool.backends.cuda_vmm import CudaVmmBackend
    be = CudaVmmBackend.create(0, 1 << 30, 256 << 20, fabric="off")
    f = torch.randn(2393, 2048, device="cuda").to(torch.bfloat16)
else:
    from pool.backends.host_shm import HostShmBackend
    be = HostShmBackend([64 << 20]); f = torch.randn(64, 64)
wrap(type(be), "publish", "backend.publish")
wrap(alloc_mod.Allocator if hasattr(alloc_mod, "Allocator") else object, "allocate", "allocator.allocate")
for cls in vars(leases_mod).values():
    if isinstance(cls, type) and hasattr(cls, "reserve") and cls.__module__ == leases_mod.__name__:
        wrap(cls, "reserve", "leases.reserve"); wrap(cls, "end", "leases.end")
pool = FeaturePool([be], max_leases=1024, policy="wait", wait_s=5.0, default_ttl_s=60)
for rnd in range(2):
    acc.clear(); tot = [0, 0, 0]
    for i in range(3000):
        if i % 64 == 0 and f.is_cuda: torch.cuda.synchronize()
        t0 = time.perf_counter_ns(); lease = pool.put(f); t1 = time.perf_counter_ns(); pool.describe(lease); t2 = time.perf_counter_ns(); pool.release(lease.id); t3 = time.perf_counter_ns()
        tot[0] += t1 - t0; tot[1] += t2 - t1; tot[2] += t3 - t2
print(sys.argv[1], sys.argv[2], "| put %.1f describe %.1f release %.1f |" % tuple(x / 3000 / 1e3 for x in tot),
      " ".join(f"{k} {v[0] / v[1] / 1e3:.1f}x{v[1] // 3000}" for k, v in sorted(acc.items())), flush=True)
