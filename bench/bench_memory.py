"""Server RSS under hostile uploads (issue 14), for this checkout and a baseline checkout in
the same run: each case on a fresh ``python -m app`` (CPU, tiny encoder, so that the
figures are the decode's and the HTTP layer's own), RSS sampled every 5 ms.

Cases: four 6300x6300 16-bit PNGs in one request (grey and RGB, made from scikit-image's
astronaut photo upscaled: a few MB of PNG); the same as 8-bit RGB; three 16-bit grey (within
the default per-request budget); 40 uploads that send half a 4 MiB body and stall.

    git worktree add /tmp/featpool-main main
    python bench/bench_memory.py --baseline /tmp/featpool-main --out /tmp/memory.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.appserver import ROOT, AppServer
from bench.make_images import png16, upscaled_photo

MiB = 1 << 20
SIDE = 6300
BODY_TIMEOUT_S = 2.0


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


class Sampler:
    """Peak RSS of ``pid`` while it runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = rss_mib(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_mib(self.pid))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak


def images() -> dict[str, bytes]:
    grey = png16(upscaled_photo(SIDE, grey=True))
    rgb16 = png16(upscaled_photo(SIDE))
    buf = io.BytesIO()
    Image.fromarray((upscaled_photo(SIDE) // 257).astype("uint8")).save(buf, "PNG")
    return {"grey16": grey, "rgb16": rgb16, "rgb8": buf.getvalue()}


def multipart_case(parts: list[bytes]) -> Callable[[str, int], dict[str, Any]]:
    def run(url: str, _: int) -> dict[str, Any]:
        files = [("image", (f"{i}.png", d, "image/png")) for i, d in enumerate(parts)]
        r = httpx.post(f"{url}/v1/encode", files=files, timeout=300)
        err = r.json().get("error", {}) if r.status_code != 200 else {}
        return {
            "status": r.status_code,
            "error": err.get("type"),
            "body_bytes": sum(map(len, parts)),
        }

    return run


def stalled_uploads(url: str, port: int) -> dict[str, Any]:
    """40 uploads send half of a 4 MiB body and stall; RSS while they stall is ``peak``."""
    half = b"\x89PNG\r\n\x1a\n" + bytes(2 * MiB)
    socks = []
    for _ in range(40):
        s = socket.create_connection(("127.0.0.1", port), timeout=60)
        s.sendall(
            b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
            b"Content-Length: %d\r\n\r\n" % (2 * len(half))
        )
        s.sendall(half)
        socks.append(s)
    time.sleep(BODY_TIMEOUT_S + 1.5)  # past the timeout (where there is one)
    answered = 0
    for s in socks:
        s.setblocking(False)
        try:
            answered += s.recv(16).startswith(b"HTTP/1.1 408")
        except BlockingIOError:
            pass
    statuses = {"answered_408": answered}
    socks_ref.extend(socks)  # closed after the "after" reading
    return statuses


socks_ref: list[socket.socket] = []


def run_case(root: Path, name: str, case: Callable[[str, int], dict[str, Any]]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        server = AppServer(
            ["--device", "cpu", "--encoder", "tiny-test"],
            Path(tmp) / "server.log",
            root=root,
            env={
                "FEATPOOL_SOCKET_PATH": str(Path(tmp) / "featpool.sock"),
                # Ignored by a checkout that has no such setting.
                "FEATPOOL_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
            },
        )
        try:
            pid = server.proc.pid
            warm = httpx.post(f"{server.url}/v1/encode", files=[("image", WARM)], timeout=60)
            assert warm.status_code == 200, warm.text
            time.sleep(0.5)
            before = rss_mib(pid)
            sampler = Sampler(pid)
            t0 = time.perf_counter()
            result = case(server.url, server.port)
            elapsed = time.perf_counter() - t0
            peak = sampler.stop()
            time.sleep(2.0)
            after = rss_mib(pid)
            for s in socks_ref:
                s.close()
            socks_ref.clear()
            return {
                "case": name,
                **result,
                "seconds": round(elapsed, 2),
                "rss_before_mib": round(before),
                "rss_peak_mib": round(peak),
                "rss_after_mib": round(after),
                "peak_over_before_mib": round(peak - before),
                "after_over_before_mib": round(after - before),
            }
        finally:
            server.close()


def commit(root: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(root), "log", "-1", "--format=%h %s"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip()[:80]


WARM = b""


def main() -> None:
    global WARM
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--baseline", type=Path, required=True, help="checkout to compare with")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    buf = io.BytesIO()
    Image.fromarray(upscaled_photo(256)[..., 0].astype("uint8")).save(buf, "JPEG")
    WARM = buf.getvalue()
    imgs = images()
    cases: dict[str, Callable[[str, int], dict[str, Any]]] = {
        "4x grey16 6300x6300 (issue)": multipart_case([imgs["grey16"]] * 4),
        "4x rgb16 6300x6300": multipart_case([imgs["rgb16"]] * 4),
        "4x rgb8 6300x6300": multipart_case([imgs["rgb8"]] * 4),
        "3x grey16 6300x6300 (accepted)": multipart_case([imgs["grey16"]] * 3),
        "40 stalled half uploads": stalled_uploads,
    }
    rows = []
    for name, case in cases.items():
        for label, root in (("this", ROOT), ("baseline", args.baseline)):
            row = {"checkout": label, "commit": commit(root), **run_case(root, name, case)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    args.out.write_text(
        json.dumps(
            {
                "date": datetime.now(UTC).isoformat(timespec="seconds"),
                "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} CPUs",
                "python": platform.python_version(),
                "rows": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
