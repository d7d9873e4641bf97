"""Running the real service for a benchmark: ``python -m app`` in a process of its own on a
loopback port, ready when ``/health/ready`` says so, stopped with SIGTERM (then SIGKILL). Shared
by bench_e2e.py, load_test.py and suite.py, and by the tests that need a real server process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gpu_name() -> str:
    """``name, driver`` of the first GPU from nvidia-smi, or ``none``."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return "none"
    return out[0].strip() if out else "none"


class AppServer:
    """``python -m app --port PORT *args`` run in ``root``; its output goes to ``log``."""

    def __init__(
        self,
        args: Sequence[str],
        log: Path,
        *,
        port: int | None = None,
        env: dict[str, str] | None = None,
        start_timeout_s: float = 120.0,
        root: Path = ROOT,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "app", "--port", str(self.port), *args]
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                self.cmd,
                cwd=root,  # another checkout's server, for a same-run baseline
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                # Its own process group: a caller can stop it and any children with killpg.
                start_new_session=True,
            )
        try:
            self._wait_ready(start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(f"{self.url}/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {timeout_s} s; see {self.log}")

    def close(self) -> int | None:
        """Stop it (SIGTERM, SIGKILL after 30 s); its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> AppServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
