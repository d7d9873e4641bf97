"""Where the prepare thread's samples go in a py-spy --native profile of the GPU process
(bench_e2e.py --py-spy-native): waiting for a batch, inside the one-call decode (nvJPEG, the
interpreter lock taken for a Python object's count, other takes of the lock, the rest), and
outside it by Python line. Usage: python3 spy_prepare.py PROFILE[.gz]"""

import collections
import gzip
import sys

path = sys.argv[1]
lines = (gzip.open if path.endswith(".gz") else open)(path, "rt")
cats: collections.Counter[str] = collections.Counter()
outside: collections.Counter[str] = collections.Counter()
total = 0
for line in lines:
    stack, _, n = line.rstrip("\n").rpartition(" ")
    frames = stack.split(";")
    if "featpool-prepare_0" not in frames[0]:
        continue
    k, total = int(n), total + int(n)
    if "fused" not in stack:
        if "Condition.wait" in stack:
            cats["waiting for a batch"] += k
            continue
        cats["outside the one call"] += k
        py = [f for f in frames if ".py:" in f]
        outside[py[-1].split(" (")[0] + " " + py[-1].rsplit(" (", 1)[1].rstrip(")")] += k
    elif "_pyobject" in stack:
        cats["one call: the lock, for a Python object's count (incref/decref_pyobject)"] += k
    elif "pthread_cond_timedwait" in frames[-2:][0] or "gil_scoped" in stack:
        cats["one call: the lock, other (to return, ...)"] += k
    elif "nvjpeg" in stack.lower():
        cats["one call: nvJPEG"] += k
    else:
        cats["one call: other (resize matmuls, copies, ...)"] += k
print(f"prepare thread: {total} samples")
for name, k in cats.most_common():
    print(f"  {100 * k / total:5.1f} %  {name}")
print("outside the one call, by innermost Python line:")
for name, k in outside.most_common(6):
    print(f"  {100 * k / total:5.1f} %  {name}")
