"""What a front spends on one 16-image multipart body before the job channel, in the front's own
code: ``app.routes._multipart_images`` (starlette's request.form(), the checks, each part's
read) and ``app.routes._inspect_all`` (each image's header and SHA-256 content digest, which the
front runs on its inspector threads). The body is httpx's multipart encoding of the bench's
photos, fed to a starlette Request in 64 KiB chunks; median of 50 after 5 warm-ups. From the
repository root with the project installed: python3 docs/data/2026-12-07e/form_cost.py"""

import asyncio
import sys
import time
from typing import Any

import httpx

sys.path[:0] = ["bench", "."]  # make_images.photo_jpeg: the bench's photos
from make_images import photo_jpeg
from starlette.requests import Request

from app.routes import _inspect_all, _multipart_images
from app.settings import Settings

PER = 16
photos = [photo_jpeg(i) for i in range(PER)]
files = [("image", (f"p{i}.jpg", p, "image/jpeg")) for i, p in enumerate(photos)]
encoded = httpx.Request("POST", "http://front/v1/encode", files=files)
body, ctype = encoded.read(), encoded.headers["content-type"].encode()
s = Settings(device="cpu")


async def one() -> tuple[float, float]:
    chunks = iter([body[i : i + 65536] for i in range(0, len(body), 65536)])

    async def receive() -> dict[str, Any]:
        chunk = next(chunks, b"")
        return {"type": "http.request", "body": chunk, "more_body": bool(chunk)}

    scope = {"type": "http", "method": "POST", "path": "/", "query_string": b""}
    req = Request({**scope, "headers": [(b"content-type", ctype)]}, receive)
    t0 = time.perf_counter()
    images, _ = await _multipart_images(req, s)
    t1 = time.perf_counter()
    _inspect_all(images, s)
    return t1 - t0, time.perf_counter() - t1


async def main() -> None:
    for _ in range(5):
        await one()
    runs = [await one() for _ in range(50)]
    form = sorted(f for f, _ in runs)[25] / PER * 1e6
    inspect = sorted(i for _, i in runs)[25] / PER * 1e6
    kb = sum(map(len, photos)) / PER / 1024
    print(f"{PER} photos of {kb:.0f} KB mean, body {len(body) / 1e6:.2f} MB")
    print(f"_multipart_images {form:.0f} us an image; _inspect_all (header, digest) {inspect:.0f}")


asyncio.run(main())
