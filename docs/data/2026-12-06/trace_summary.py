"""Summarise a torch.profiler chrome trace: runtime/driver API time per thread, GPU work per
stream, and inside each image::decode_jpegs_cuda op the API calls made."""
import collections, gzip, json, sys

path = sys.argv[1]
op = gzip.open if path.endswith(".gz") else open
with op(path, "rt") as f:
    ev = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
span = (min(e["ts"] for e in ev), max(e["ts"] + e.get("dur", 0) for e in ev))
print(f"events {len(ev)}, window {(span[1]-span[0])/1e3:.1f} ms")
cats = collections.Counter(e.get("cat") for e in ev)
print("cats", dict(cats))
api = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
for e in ev:
    if e.get("cat") in ("cuda_runtime", "cuda_driver"):
        a = api[e["tid"]][e["name"]]; a[0] += 1; a[1] += e.get("dur", 0)
for tid, d in sorted(api.items(), key=lambda kv: -sum(v[1] for v in kv[1].values())):
    tot = sum(v[1] for v in d.values())
    print(f"\n-- thread {tid}: API {tot/1e3:.1f} ms")
    for name, (n, dur) in sorted(d.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"   {name:40s} n={n:6d} {dur/1e3:9.2f} ms  mean {dur/max(n,1):8.1f} us")
gpu = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
for e in ev:
    if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
        s = e.get("args", {}).get("stream", "?")
        g = gpu[s][e["cat"] + ": " + e["name"][:70]]; g[0] += 1; g[1] += e.get("dur", 0)
for s, d in sorted(gpu.items(), key=lambda kv: -sum(v[1] for v in kv[1].values())):
    tot = sum(v[1] for v in d.values())
    print(f"\n== stream {s}: GPU {tot/1e3:.1f} ms")
    for name, (n, dur) in sorted(d.items(), key=lambda kv: -kv[1][1])[:10]:
        print(f"   {name:80s} n={n:6d} {dur/1e3:8.2f} ms")
# inside each decode op: API calls by name, on that op's thread
decs = [e for e in ev if e.get("cat") == "cpu_op" and "decode_jpegs_cuda" in e["name"]]
print(f"\n{len(decs)} decode ops, mean {sum(e['dur'] for e in decs)/max(len(decs),1)/1e3:.2f} ms")
inside = collections.defaultdict(lambda: [0, 0.0])
for d in decs:
    t0, t1 = d["ts"], d["ts"] + d["dur"]
    for e in ev:
        if e["tid"] == d["tid"] and e.get("cat") in ("cuda_runtime", "cuda_driver") and t0 <= e["ts"] < t1:
            a = inside[e["name"]]; a[0] += 1; a[1] += e.get("dur", 0)
for name, (n, dur) in sorted(inside.items(), key=lambda kv: -kv[1][1])[:15]:
    print(f"   {name:40s} per op: n={n/max(len(decs),1):7.1f} {dur/max(len(decs),1)/1e3:7.2f} ms")
# the preprocessing op(s) and other cpu ops on the decode thread
if decs:
    tid = decs[0]["tid"]
    ops = collections.defaultdict(lambda: [0, 0.0])
    for e in ev:
        if e["tid"] == tid and e.get("cat") == "cpu_op":
            a = ops[e["name"]]; a[0] += 1; a[1] += e["dur"]
    print(f"\ncpu ops on the decode thread {tid} (inclusive):")
    for name, (n, dur) in sorted(ops.items(), key=lambda kv: -kv[1][1])[:20]:
        print(f"   {name:40s} n={n:6d} {dur/1e3:8.2f} ms")
