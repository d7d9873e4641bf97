"""Per-lease host time of FeaturePool.put_many (rows of one [128, 16] float32 tensor, the
host_shm tier with the rows published in one go, as the GPU tier does; releases between
batches) alone and beside a thread spinning in Python
(0.5 ms switch interval, the service's), in the tree given as argv[1]. Medians of 7 runs of
200 batches, us per lease, put_many and release timed apart."""
import statistics, sys, threading, time
sys.path.insert(0, sys.argv[1])
import torch
from pool.backends.host_shm import HostShmBackend
from pool.featurepool import FeaturePool

sys.setswitchinterval(0.0005)
class RowsInOneGo(HostShmBackend):
    """As the GPU tier publishes a batch (one launch for every row): no torch call per row,
    so what is timed is the pool's own per-lease work."""

    def publish_rows(self, items, rows, ctrl):  # type: ignore[no-untyped-def]
        for _, _, slot, gen in items:
            ctrl.set_ready(slot, gen)


pool = FeaturePool([RowsInOneGo([64 << 20])], max_leases=4096)
rows = torch.randn(128, 16)

def run(batches: int = 200) -> tuple[float, float]:
    put = rel = 0.0
    for _ in range(batches):
        t0 = time.perf_counter()
        leases = pool.put_many(rows)
        t1 = time.perf_counter()
        for lease in leases:
            pool.release(lease.id)
        put, rel = put + t1 - t0, rel + time.perf_counter() - t1
    n = batches * len(rows)
    return 1e6 * put / n, 1e6 * rel / n

stop = False
def spin() -> None:
    while not stop:
        pass

run(20)
def med(xs: list[tuple[float, float]]) -> str:
    return "put_many %6.1f, release %6.1f" % tuple(statistics.median(x[i] for x in xs) for i in (0, 1))

alone = med([run() for _ in range(7)])
th = threading.Thread(target=spin); th.start(); time.sleep(0.05)
beside = med([run() for _ in range(7)])
stop = True; th.join()
print(f"{sys.argv[1]:14s} us/lease alone: {alone};  beside a spinning thread: {beside}")
pool.close()
