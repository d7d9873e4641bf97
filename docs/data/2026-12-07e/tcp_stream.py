"""One loopback TCP stream for SECONDS: a forked sender writes 2 MiB at a time; this process
reads until the sender closes and prints the rate it received.

    python3 docs/data/2026-12-07e/tcp_stream.py PORT SECONDS"""

import os
import socket
import sys
import time

port, secs = int(sys.argv[1]), float(sys.argv[2])
server = socket.create_server(("127.0.0.1", port))
if os.fork() == 0:
    out = socket.create_connection(("127.0.0.1", port))
    block, t = b"x" * (2 << 20), time.time()
    while time.time() - t < secs:
        out.sendall(block)
    out.close()
    os._exit(0)
conn, _ = server.accept()
received, t, buf = 0, time.time(), bytearray(1 << 20)
while k := conn.recv_into(buf):
    received += k
print(port, f"{received / (time.time() - t) / 1e9:.2f} GB/s")
