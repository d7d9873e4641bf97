"""What a front spends on one 16-image multipart body before the job channel: starlette's
request.form() (python-multipart, the spooled parts) and part.read(), then SHA-256 of each part
(the content digest), median of 50. Run from the repository root with the project installed:
python3 docs/data/2026-12-07e/form_cost.py"""

import asyncio
import hashlib
import sys
import time

sys.path[:0] = ["bench", "."]  # make_images.photo_jpeg: the bench's photos
from make_images import photo_jpeg
from starlette.requests import Request

photos = [photo_jpeg(i) for i in range(16)]
print("mean KB", sum(map(len, photos)) / 16 / 1024)
boundary = b"----featpoolbench"
body = (
    b"".join(
        b"--"
        + boundary
        + b'\r\nContent-Disposition: form-data; name="image"; filename="p%d.jpg"\r\nContent-Type: image/jpeg\r\n\r\n'
        % i
        + p
        + b"\r\n"
        for i, p in enumerate(photos)
    )
    + b"--"
    + boundary
    + b"--\r\n"
)
CH = 65536


async def one():
    chunks = [body[i : i + CH] for i in range(0, len(body), CH)]
    it = iter(chunks)

    async def receive():
        try:
            c = next(it)
            return {"type": "http.request", "body": c, "more_body": True}
        except StopIteration:
            return {"type": "http.request", "body": b"", "more_body": False}

    scope = {
        "type": "http",
        "method": "POST",
        "headers": [(b"content-type", b"multipart/form-data; boundary=" + boundary)],
        "path": "/",
        "query_string": b"",
    }
    req = Request(scope, receive)
    t0 = time.perf_counter()
    form = await req.form(max_files=64, max_fields=96, max_part_size=64 << 20)
    datas = [await p.read() for p in form.getlist("image")]
    t1 = time.perf_counter()
    for d in datas:
        hashlib.sha256(d).digest()
    t2 = time.perf_counter()
    await form.close()
    return t1 - t0, t2 - t1


async def main():
    for _ in range(5):
        await one()
    r = [await one() for _ in range(50)]
    f = sorted(x for x, _ in r)[25]
    h = sorted(y for _, y in r)[25]
    print(
        f"form+read {f * 1e3:.2f} ms per 16-image request ({f / 16 * 1e6:.0f} us/image); sha256 {h / 16 * 1e6:.0f} us/image; body {len(body) / 1e6:.2f} MB"
    )


asyncio.run(main())
