#!/bin/bash
# Twenty-eighth session: the commands run on the warm H100 after call_k.sh (docs/data/2026-12-07d)
# and call_l.sh, as they ran (each was one device call; $OUT their output folder). Not a script
# to run whole: its parts are the calls, in order.
source docs/data/2026-12-06b/common.sh >/dev/null; O=$OUT

# 16:02 the channel probe for longer (2 x 8 s), with the leases to their TTL, then released
timeout 100 python3 docs/data/2026-12-07d/probe_channel.py 8 64 > $O/probe-channel-2.txt 2>&1
RELEASE=1 timeout 100 python3 docs/data/2026-12-07d/probe_channel.py 8 64 > $O/probe-channel-release-2.txt 2>&1

# 16:03 service rows at 16x64 with 8, then 6 fronts (the default is 4 here)
for w in 8 6; do python3 bench/bench_e2e.py $B --points mp:16x64 --baseline-points= --server-root $PWD "--featpool-args=$FA $BIG --http-workers $w" --out $O/e2e-w$w.json > $O/e2e-w$w.log 2>&1; done

# 16:05 and 16:06 (the second after a control run, probe-channel-3.txt): the channel probe beside
# four processes copying 64 MiB arrays (memory traffic, not the caches)
busy() { for k in 1 2 3 4; do python3 -c "
import numpy as np, time
a=np.ones(64<<20,np.uint8); b=np.empty_like(a); t=time.time()
while time.time()-t<70: np.copyto(b,a)" & done; }
busy; sleep 1; timeout 100 python3 docs/data/2026-12-07d/probe_channel.py 8 64 > $O/probe-channel-membusy4.txt 2>&1; kill %1 %2 %3 %4; wait
timeout 100 python3 docs/data/2026-12-07d/probe_channel.py 8 64 > $O/probe-channel-3.txt 2>&1
busy; sleep 1; timeout 100 python3 docs/data/2026-12-07d/probe_channel.py 8 64 > $O/probe-channel-membusy4b.txt 2>&1; kill %1 %2 %3 %4; wait

# 16:09 (after call_l.sh, same machine): the channel probe alone, then beside four loopback TCP
# streams (a Python process each way, 2 MiB sendall / 1 MiB recv_into). Their rates were to be
# printed at the end, but `pkill -f /tmp/tcp.py` also matched this very command line and ended
# the call first, so the streams' rates were not recorded.
timeout 100 python3 docs/data/2026-12-07d/probe_channel.py 8 64 > $O/probe-channel-4.txt 2>&1
cat > /tmp/tcp.py <<'PY'
import socket, sys, time, os
port = int(sys.argv[1]); srv = socket.create_server(("127.0.0.1", port))
if os.fork() == 0:
    c = socket.create_connection(("127.0.0.1", port)); buf = b"x" * (2 << 20); t = time.time()
    while time.time() - t < 60: c.sendall(buf)
    os._exit(0)
conn, _ = srv.accept(); n = 0; t = time.time(); b = bytearray(1 << 20)
while time.time() - t < 60:
    k = conn.recv_into(b); n += k
    if not k: break
print(port, f"{n / (time.time() - t) / 1e9:.1f} GB/s")
PY
for p in 19001 19002 19003 19004; do python3 /tmp/tcp.py $p > $O/tcp-$p.txt 2>&1 & done
sleep 1; timeout 100 python3 docs/data/2026-12-07d/probe_channel.py 8 64 > $O/probe-channel-tcp4.txt 2>&1
