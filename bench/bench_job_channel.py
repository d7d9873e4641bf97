"""The job channel alone, on the CPU: what the GPU process spends per image to take an encode
job's bytes from a front and hand them on, through the front's shared-memory arena or inline on
the socket (``--job-arena-bytes 0``).

    python bench/bench_job_channel.py [--images 4000] [--kb 138] [--concurrency 64] [--no-hash]

The GPU process's side (``JobServer``, with an engine client that does per image what the
engine does with the bytes before the GPU: the feature hash, and the uint8 tensor the JPEG
decoders take) runs in this process, and its CPU time is what is reported; the front
(``JobClient``) runs in a child process. Prints one JSON line per mode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.admission import Admission
from app.engine import byte_tensor
from app.engine_client import EncodeOptions, ImageIn
from app.featindex import content_digest, feature_hash
from app.jobs import JobClient, JobServer


class BytesOnly:
    """The engine's work on the bytes, without the engine."""

    def __init__(self, hash_bytes: bool) -> None:
        self.hash_bytes = hash_bytes

    async def encode(self, images: list[ImageIn], options: EncodeOptions) -> list[Any]:
        for img in images:
            if self.hash_bytes:
                feature_hash(b"identity", img.digest or content_digest(img.data))
            byte_tensor(img.data)
        return []

    def discard(self, lease_id: str) -> None:  # answers nobody waited for: none here
        pass


async def serve(args: argparse.Namespace, arena_bytes: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "featpool.sock.jobs"
        server = JobServer(path, BytesOnly(args.hash), Admission(1 << 20, 1 << 50))  # type: ignore[arg-type]
        await server.start()
        try:
            cpu0 = time.process_time()
            front = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "--front", str(path), "--arena-bytes", str(arena_bytes),
                "--images", str(args.images), "--kb", str(args.kb),
                "--concurrency", str(args.concurrency),
            )  # fmt: skip
            assert await front.wait() == 0
            cpu = time.process_time() - cpu0
        finally:
            await server.stop()
    return {
        "mode": "arena" if arena_bytes else "inline",
        "images": args.images,
        "image_kb": args.kb,
        "feature_hash": args.hash,
        "gpu_process_cpu_us_per_image": round(cpu / args.images * 1e6, 1),
    }


async def front(args: argparse.Namespace) -> None:
    client = JobClient(Path(args.front), args.arena_bytes)
    data = os.urandom(args.kb * 1024)
    todo = iter(range(args.images))

    async def worker() -> None:
        for _ in todo:
            await client.encode([ImageIn("x", data)], EncodeOptions())

    try:
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    finally:
        await client.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=4000)
    p.add_argument("--kb", type=int, default=138, help="bytes of one image, in KiB")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--arena-bytes", type=int, default=256 << 20)
    p.add_argument(
        "--hash",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="include the feature hash (SHA-256 of the bytes), as the engine does",
    )
    p.add_argument("--front", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.front:
        asyncio.run(front(args))
        return
    for arena_bytes in (0, args.arena_bytes, 0, args.arena_bytes):
        print(json.dumps(asyncio.run(serve(args, arena_bytes))), flush=True)


if __name__ == "__main__":
    main()
