"""Helpers of the GPU tests: a deterministic byte pattern, a producer in its own process
(FeaturePool + CudaVmmBackend + HandoffServer, driven by JSON lines on stdin/stdout), and
JPEG decoders driven from several threads at once."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from app.gpu_decode import JpegDecoder

ROOT = Path(__file__).resolve().parents[2]


def pattern(nbytes: int, seed: int, device: torch.device | str) -> torch.Tensor:
    """``nbytes`` pseudo-random bytes, the same in every process for the same seed."""
    i = torch.arange(nbytes, device=device, dtype=torch.int64)
    return (((i * 2654435761 + seed * 40503) >> 7) & 0xFF).to(torch.uint8)


def threads_decoding_at_once(
    dec: JpegDecoder, datas: list[torch.Tensor], threads: int = 4
) -> list[str]:
    """``threads`` threads, each on a CUDA stream of its own as the prepare threads are, decode
    ``datas`` ten times in their own order: what went wrong (an image that is not its own)."""
    want = [x.cpu() if isinstance(x, torch.Tensor) else x for x in dec.decode(datas)]
    errors: list[str] = []

    def worker(k: int) -> None:
        stream = torch.cuda.Stream(dec.device)
        order = [(k + i) % len(datas) for i in range(len(datas))] * 3
        for _ in range(10):
            with torch.cuda.stream(stream):
                outs = dec.decode([datas[i] for i in order])
                stream.synchronize()
            for i, out in zip(order, outs, strict=True):
                w = want[i]
                if not (
                    isinstance(out, torch.Tensor)
                    and isinstance(w, torch.Tensor)
                    and torch.equal(out.cpu(), w)
                ):
                    errors.append(f"thread {k}: image {i} is not its own")

    pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return errors


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Producer:
    def __init__(
        self,
        socket_path: Path,
        *,
        pool_mb: int = 64,
        slab_mb: int = 32,
        max_leases: int = 256,
        reaper_s: float = 0.02,
    ) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.gpu.producer_proc",
                str(socket_path),
                str(pool_mb),
                str(slab_mb),
                str(max_leases),
                str(reaper_s),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=subprocess_env(),
        )
        self.hello = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"producer exited with {self.proc.wait(timeout=30)}")
        msg: dict[str, Any] = json.loads(line)
        if msg.get("op") == "error":
            raise RuntimeError(f"producer: {msg['message']}")
        return msg

    def call(self, op: str, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, RuntimeError, ValueError):
                self.call("quit")
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
