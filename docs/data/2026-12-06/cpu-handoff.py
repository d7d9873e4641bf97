"""The prepare thread's idle time between batches, with the event loop busy: a batcher whose
prepare stage sleeps (native work without the GIL) P ms per batch and whose run stage sleeps R,
fed by C closed-loop clients that each spend W us of Python per request on the loop."""
import asyncio, sys, time, statistics, threading
sys.path.insert(0, sys.argv[1])
from app.batcher import Batcher
P, R, C, W = float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
spans = []  # (start, end) of each prepare
def prepare(values):
    t = time.perf_counter(); time.sleep(P / 1e3 + 0.14e-3 * len(values)); spans.append((t, time.perf_counter()))
    return lambda: (time.sleep(R / 1e3 + 0.09e-3 * len(values)), list(values))[1]
def spin(us):
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end: pass
async def client(b, stop):
    n = 0
    while not stop.is_set():
        spin(W / 2)           # the job's parse and submit
        await b.submit([n])
        spin(W / 2)           # its answer
        await asyncio.sleep(0.002)  # the outside (front, client)
        n += 1
    return n
async def main():
    sys.setswitchinterval(0.0005)
    import os; kw = {"in_flight": int(os.environ["INFL"])} if os.environ.get("INFL") else {}
    b = Batcher(lambda v: v, max_batch_size=128, max_wait_s=0.004, queue_size=4096, prepare=prepare, **kw)
    b.start(); stop = asyncio.Event()
    tasks = [asyncio.create_task(client(b, stop)) for _ in range(C)]
    await asyncio.sleep(1.0); spans.clear(); t0 = time.perf_counter()
    await asyncio.sleep(4.0); stop.set(); t1 = time.perf_counter()
    done = await asyncio.gather(*tasks); await b.stop()
    s = [x for x in spans if t0 <= x[0] <= t1]
    busy = sum(e - a for a, e in s); gaps = [s[i + 1][0] - s[i][1] for i in range(len(s) - 1)]
    print(f"{sys.argv[1]}: batches {len(s)} prepare busy {busy / (t1 - t0):.2f} gap median {1e3 * statistics.median(gaps):.2f} ms p90 {1e3 * sorted(gaps)[int(.9 * len(gaps))]:.2f}  req/s {sum(done) / 5.0:.0f}")
asyncio.run(main())
