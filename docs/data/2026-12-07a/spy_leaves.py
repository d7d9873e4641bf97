"""Where each thread of a `bench_e2e.py --py-spy DIR --py-spy-native` profile spends its
samples: per thread (by name), its share of the samples and its most common innermost frames
(the last DEPTH frames of each stack, library names kept, addresses dropped).
Usage: python3 spy_leaves.py FILE [THREAD_PREFIX] [DEPTH]"""

import re
import sys
from collections import Counter, defaultdict

path = sys.argv[1]
only = sys.argv[2] if len(sys.argv) > 2 else ""
depth = int(sys.argv[3]) if len(sys.argv) > 3 else 3
per_thread: dict[str, Counter[str]] = defaultdict(Counter)
with open(path) as f:
    for line in f:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        frames = stack.split(";")
        name = frames[0].partition(": ")[2] or frames[0]  # "thread (123): featpool-prepare_0"
        if not name.startswith(only):
            continue
        # "0x7f.. (libc.so.6)" -> "(libc.so.6)"; keep function names and Python frames as they are
        inner = [re.sub(r"^0x[0-9a-f]+ ", "", fr) for fr in frames[1:]][-depth:]
        per_thread[name][" < ".join(reversed(inner))] += int(count)

total = sum(sum(c.values()) for c in per_thread.values())
for name, leaves in sorted(per_thread.items(), key=lambda kv: -sum(kv[1].values())):
    n = sum(leaves.values())
    print(f"{name}: {n} samples ({100 * n / total:.0f} % of these threads')")
    for leaf, k in leaves.most_common(12):
        print(f"  {100 * k / n:5.1f} %  {leaf}")
