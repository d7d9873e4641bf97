"""Closed-loop model of the batcher: 256 clients, an outside delay per request, a prepare stage
and a run stage; policy 'now' (gather as soon as a slot is free) against 'onfree' (gather when
the prepare thread is free)."""
import heapq, random, sys, statistics

def sim(policy, clients=256, outside=25e-3, maxb=128, wait=4e-3, post=8e-3, T=20.0, seed=1,
        P=lambda n: 2.5e-3 + 0.14e-3 * n, R=lambda n: 2e-3 + 0.09e-3 * n, slots=2):
    rnd = random.Random(seed)
    ev = []; seq = [0]
    def at(t, fn, *a):
        seq[0] += 1; heapq.heappush(ev, (t, seq[0], fn, a))
    queue = []  # enqueue times
    st = dict(slots=slots, prep_free=True, run_free=True, gathering=False, done=0, lat=[], batches=[], t=0.0,
              prep_busy=0.0)
    pending_prep = []  # batches gathered, waiting for the prepare thread (FIFO)
    pending_run = []
    def arrive(t):
        queue.append(t); try_gather(t)
    def outside_delay():
        return max(1e-3, rnd.gauss(outside, outside * 0.3))
    def try_gather(t):
        if st["gathering"] or not queue or st["slots"] == 0:
            return
        if policy == "onfree" and not st["prep_free"]:
            return
        # close at first+wait or when full
        close = max(t, queue[0] + wait)
        if len(queue) >= maxb - 1:
            close = t
        st["gathering"] = True
        at(close, do_close)
    def do_close(t):
        if len(queue) < maxb - 1 and queue[0] + wait > t + 1e-12:
            at(queue[0] + wait, do_close); return
        batch = queue[:maxb]; del queue[:maxb]
        st["gathering"] = False; st["slots"] -= 1
        if policy == "onfree":
            st["prep_free"] = False
        pending_prep.append(batch)
        start_prep(t)
        try_gather(t)
    def start_prep(t):
        if policy == "now":
            if not st["prep_free"] or not pending_prep: return
            st["prep_free"] = False
        elif not pending_prep: return
        b = pending_prep.pop(0)
        d = P(len(b)); st["prep_busy"] += d
        at(t + d, prep_done, b)
    def prep_done(t, b):
        st["prep_free"] = True
        pending_run.append(b); start_run(t)
        start_prep(t); try_gather(t)
    def start_run(t):
        if not st["run_free"] or not pending_run: return
        st["run_free"] = False
        b = pending_run.pop(0)
        at(t + R(len(b)), run_done, b)
    def run_done(t, b):
        st["run_free"] = True; st["slots"] += 1
        st["batches"].append(len(b))
        for e in b:
            at(t + post, complete, e)
        start_run(t); try_gather(t)
    def complete(t, e):
        if t > 3.0:
            st["done"] += 1; st["lat"].append(t - e + outside)
        at(t + outside_delay(), arrive)
    for i in range(clients):
        at(rnd.random() * 0.05, arrive)
    while ev:
        t, _, fn, a = heapq.heappop(ev)
        if t > T: break
        fn(t, *a)
    lat = sorted(st["lat"])
    return dict(policy=policy, ips=round(st["done"] / (T - 3.0)), batch=round(statistics.mean(st["batches"][50:]), 1),
                p50=round(1e3 * lat[len(lat) // 2], 1), p99=round(1e3 * lat[int(len(lat) * .99)], 1),
                prep_util=round(st["prep_busy"] / T, 2))

for outside in (25e-3, 15e-3):
    for clients in (256, 512):
        for pol in ("now", "onfree"):
            print(outside, clients, sim(pol, clients=clients, outside=outside))
print("--- noisy stages, post 10 ms")
import random as _r
nz = _r.Random(7)
Pn = lambda n: (2.5e-3 + 0.14e-3 * n) * nz.uniform(0.8, 1.3)
Rn = lambda n: (2e-3 + 0.09e-3 * n) * nz.uniform(0.8, 1.3)
for pol in ("now", "onfree"):
    for slots in (2, 3):
        print(pol, slots, sim(pol, outside=20e-3, post=10e-3, P=Pn, R=Rn, slots=slots))
print("--- max wait 0 / 8 ms")
for pol in ("now", "onfree"):
    for w in (0.0, 8e-3):
        print(pol, w, sim(pol, outside=20e-3, wait=w))
