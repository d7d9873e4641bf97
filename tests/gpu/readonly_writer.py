"""Attach as a consumer and try to write through the read-only mapping; prints REFUSED or
WROTE. Run in its own process: a refused write can poison the CUDA context."""

from __future__ import annotations

import json
import sys

import torch

from pool.client import FeatureClient


def main() -> None:
    sock, desc = sys.argv[1], json.loads(sys.argv[2])
    client = FeatureClient.connect(sock)
    t = client.open(desc)
    before = int(t.view(torch.uint8)[0].item())
    try:
        t.view(torch.uint8).fill_(before ^ 0xFF)
        torch.cuda.synchronize()
    except Exception as e:  # torch raises RuntimeError (CUDA error: ...) or AcceleratorError
        print("REFUSED", type(e).__name__, str(e).splitlines()[0], flush=True)
        return
    print("WROTE", flush=True)


if __name__ == "__main__":
    main()
