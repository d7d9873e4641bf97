"""Image bytes from the fronts to the GPU process through shared memory (app/job_arena.py),
with real server and front processes: the same features as one process, a small arena that
reuses its space and falls back to the socket, a hostile front, and a front killed while its
jobs are in the GPU process."""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import io
import json
import os
import signal
import socket
import struct
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from PIL import Image
from safetensors.torch import load

from app.engine_client import EncodeOptions, ImageIn
from app.imaging import inspect
from app.job_arena import FrontArena
from app.jobs import JobClient, channel_paths
from tests.e2e.test_http_workers import front_pids
from tests.helpers import server_process, wait_until

pytestmark = pytest.mark.e2e

_LEN = struct.Struct(">I")


def photo(name: str, fmt: str = "PNG") -> bytes:
    """A photo that ships with scikit-image, as its PNG file or re-encoded as a JPEG."""
    skimage_data = pytest.importorskip("skimage.data")
    raw = (Path(skimage_data.__file__).parent / f"{name}.png").read_bytes()
    if fmt == "PNG":
        return raw
    buf = io.BytesIO()
    Image.open(io.BytesIO(raw)).convert("RGB").save(buf, fmt, quality=90)
    return buf.getvalue()


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus text exposition (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    series = f"{name}{{{want}}}" if want else name
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def arena_maps(pid: int) -> list[int]:
    """The sizes of the mappings of front arenas (memfd "featpool-jobs") in process ``pid``."""
    sizes = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if "featpool-jobs" in line:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            sizes.append(end - start)
    return sizes


def arenas_mapped(pid: int) -> int:
    return len(arena_maps(pid))


def encode(url: str, *images: bytes) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/encode",
        files=[
            ("image", (f"{i}", data, "application/octet-stream")) for i, data in enumerate(images)
        ],
        timeout=60,
    )


def features(url: str, lease: dict[str, Any]) -> torch.Tensor:
    r = httpx.get(f"{url}/v1/leases/{lease['lease_id']}/tensor", timeout=30)
    assert r.status_code == 200, r.text
    return load(r.content)["features"]


@pytest.fixture
def one_front(tmp_path: Path) -> Iterator[tuple[str, Path, subprocess.Popen[bytes]]]:
    sock = tmp_path / "featpool.sock"
    args = ("--http-workers", "1", "--job-arena-bytes", "100000")
    with server_process(sock, tmp_path / "server.log", *args) as (url, proc):
        yield url, sock, proc


def test_uploads_through_the_arena_give_the_features_of_one_process(tmp_path: Path) -> None:
    shots = [photo("astronaut"), photo("coffee", "JPEG"), photo("chelsea", "JPEG"), photo("camera")]
    answers: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for workers in ("2", "0"):
        sock = tmp_path / f"w{workers}" / "featpool.sock"
        sock.parent.mkdir()
        log = tmp_path / f"w{workers}.log"
        with server_process(sock, log, "--http-workers", workers) as (url, proc):
            one = encode(url, shots[0])
            many = encode(url, *shots[1:])
            assert one.status_code == 200 and many.status_code == 200, (one.text, many.text)
            items = one.json()["items"] + many.json()["items"]
            answers[workers] = [(x["feature_hash"], features(url, x)) for x in items]
            if workers == "2":
                text = httpx.get(f"{url}/metrics").text
                assert metric(text, "featpool_job_images_total", path="arena") == 4
                assert metric(text, "featpool_job_images_total", path="inline") == 0
                total = sum(len(s) for s in shots)
                assert metric(text, "featpool_job_bytes_total", path="arena") == total
                # The GPU process maps the arena of each front that sent it a job.
                assert 1 <= arenas_mapped(proc.pid) <= 2
    for (hash_front, feats_front), (hash_one, feats_one) in zip(
        answers["2"], answers["0"], strict=True
    ):
        assert hash_front == hash_one
        assert torch.equal(feats_front, feats_one)


def test_a_small_arena_reuses_its_space_and_falls_back_to_the_socket(
    one_front: tuple[str, Path, subprocess.Popen[bytes]],
) -> None:
    url, _, _ = one_front
    cat = photo("chelsea", "JPEG")  # ~35 KB: two fit in the 100 KB arena
    assert 2 * len(cat) < 100_000 < 3 * len(cat)
    # 30 x 35 KB through 100 KB: only if each answer frees its range for the next.
    first = encode(url, cat)
    assert first.status_code == 200, first.text
    for _ in range(29):
        assert encode(url, cat).status_code == 200
    text = httpx.get(f"{url}/metrics").text
    assert metric(text, "featpool_job_images_total", path="arena") == 30
    assert metric(text, "featpool_job_images_total", path="inline") == 0

    # Larger than the arena: over the socket, answered like any other.
    three = encode(url, cat, cat, cat)
    big = encode(url, photo("astronaut"))  # 790 KB
    assert three.status_code == 200 and big.status_code == 200, (three.text, big.text)
    text = httpx.get(f"{url}/metrics").text
    assert metric(text, "featpool_job_images_total", path="inline") == 4
    assert metric(text, "featpool_job_bytes_total", path="inline") == 3 * len(cat) + len(
        photo("astronaut")
    )
    # Same bytes, either path: the same features.
    via_arena, via_socket = first.json()["items"][0], three.json()["items"][0]
    assert via_arena["feature_hash"] == via_socket["feature_hash"]
    assert torch.equal(features(url, via_arena), features(url, via_socket))

    # Many at once through the small arena: some wait for no one and go inline, none fails.
    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            rs = await asyncio.gather(
                *(
                    c.post("/v1/encode", content=cat, headers={"content-type": "image/jpeg"})
                    for _ in range(16)
                )
            )
        return [r.status_code for r in rs]

    assert asyncio.run(burst()) == [200] * 16
    text = httpx.get(f"{url}/metrics").text
    sent = metric(text, "featpool_job_images_total", path="arena") + metric(
        text, "featpool_job_images_total", path="inline"
    )
    assert sent == 30 + 4 + 16


# ---- a hostile front on the job socket ------------------------------------------------------


def recv_exactly(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise EOFError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return out


def read_frame(s: socket.socket) -> dict[str, Any]:
    (n,) = _LEN.unpack(recv_exactly(s, _LEN.size))
    header: dict[str, Any] = json.loads(recv_exactly(s, n))
    recv_exactly(s, int(header.get("payload", 0)))
    return header


def send_frame(s: socket.socket, header: dict[str, Any], payload: bytes = b"") -> None:
    raw = json.dumps({**header, "payload": len(payload)}).encode()
    s.sendall(_LEN.pack(len(raw)) + raw + payload)


def hello(jobs: Path, arena_bytes: int, fds: list[int]) -> tuple[socket.socket, dict[str, Any]]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(60)
    s.connect(str(jobs))
    raw = json.dumps({"id": 0, "op": "hello", "arena_bytes": arena_bytes}).encode()
    socket.send_fds(s, [_LEN.pack(len(raw)) + raw], fds)
    return s, read_frame(s)


def encode_job(job: int, size: int, **extra: object) -> dict[str, Any]:
    return {"id": job, "op": "encode", "images": [["x.jpg", size, None]], **extra}


def healthy(url: str) -> bool:
    return httpx.get(f"{url}/health/live", timeout=10).status_code == 200


def test_job_ranges_outside_the_arena_are_refused(
    one_front: tuple[str, Path, subprocess.Popen[bytes]],
) -> None:
    url, sock, _ = one_front
    jobs, _ = channel_paths(sock)
    cat = photo("chelsea", "JPEG")
    arena = FrontArena(65536)
    try:
        end = arena.size - len(cat)
        arena._map[end : arena.size] = cat  # the JPEG ends where the arena does
        s, answer = hello(jobs, arena.size, [arena.fd])
        with s:
            assert answer["status"] == 200, answer
            # In range: encoded (the GPU process parses the header itself: none was sent).
            send_frame(s, encode_job(1, len(cat), arena_offset=end))
            ok = read_frame(s)
            assert ok["status"] == 200, ok
            # Past the end, by 1000 bytes. Unchecked, the view would stop at the arena's end
            # and the JPEG, whole there, would encode: a lie about the range accepted.
            send_frame(s, encode_job(2, len(cat) + 1000, arena_offset=end))
            # Negative: Python slicing would count from the end.
            send_frame(s, encode_job(3, len(cat), arena_offset=-len(cat)))
            for job in (2, 3):
                bad = read_frame(s)
                assert bad["id"] == job and bad["status"] == 400, bad
                assert bad["body"]["error"]["type"] == "invalid_request"
                assert (
                    "job arena" in bad["body"]["error"]["message"]
                    or "offset" in (bad["body"]["error"]["message"])
                )
            # The connection serves on after the refusals.
            send_frame(s, {"id": 4, "op": "lease", "lease_id": ok["body"]["items"][0]["lease_id"]})
            assert read_frame(s)["status"] == 200
        # Offsets on a connection that brought no arena.
        s, answer = hello(jobs, 0, [])
        with s:
            assert answer["status"] == 200
            send_frame(s, encode_job(1, len(cat), arena_offset=0))
            bad = read_frame(s)
            assert bad["status"] == 400 and "no arena" in bad["body"]["error"]["message"]
            # Inline sizes that do not add up to the payload.
            send_frame(s, encode_job(2, len(cat) + 5), cat)
            bad = read_frame(s)
            assert bad["status"] == 400 and "payload" in bad["body"]["error"]["message"]
            # Content digests (the fronts hash the bytes): one per image, 32 bytes each.
            for job, digests in ((3, ["ab" * 31]), (4, []), (5, ["zz" * 32]), (6, 7)):
                send_frame(s, encode_job(job, len(cat), digests=digests), cat)
                bad = read_frame(s)
                assert bad["status"] == 400 and "digest" in bad["body"]["error"]["message"], bad
            # A front's digest names the features: the answer's hash is built from it.
            given = hashlib.sha256(b"not these bytes").hexdigest()
            send_frame(s, encode_job(7, len(cat), digests=[given]), cat)
            ok = read_frame(s)
            assert ok["status"] == 200, ok
            first = ok["body"]["items"][0]["feature_hash"]
            send_frame(s, encode_job(8, len(cat)), cat)  # hashed by the GPU process
            ok = read_frame(s)
            assert ok["status"] == 200 and ok["body"]["items"][0]["feature_hash"] != first
    finally:
        arena.close()
    assert healthy(url)


def test_an_arena_that_could_shrink_or_is_no_memfd_is_refused(
    one_front: tuple[str, Path, subprocess.Popen[bytes]],
) -> None:
    """A front that truncated its memfd under the GPU process's mapping would kill that
    process with SIGBUS at the next read: only a memfd sealed against shrinking is mapped."""
    url, sock, proc = one_front
    jobs, _ = channel_paths(sock)
    cat = photo("chelsea", "JPEG")
    fd = os.memfd_create("featpool-jobs", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 65536)
        os.pwrite(fd, cat, 0)
        s, answer = hello(jobs, 65536, [fd])
        with s:
            assert answer["status"] == 400, answer
            assert "sealed against shrinking" in answer["body"]["error"]["message"]
            # What the seal check prevents: the file shrinks, then a job reads it.
            os.ftruncate(fd, 0)
            try:
                send_frame(s, encode_job(1, len(cat), arena_offset=0))
                read_frame(s)
            except (OSError, EOFError):
                pass  # refused: the connection is closed
        assert healthy(url) and proc.poll() is None
        r, w = os.pipe()
        try:
            s, answer = hello(jobs, 4096, [r])
            s.close()
            assert answer["status"] == 400 and "memfd" in answer["body"]["error"]["message"]
        finally:
            os.close(r)
            os.close(w)
        sealed = FrontArena(4096)
        try:
            for size, fds in ((0, [sealed.fd]), (4096, []), (4096, [sealed.fd, sealed.fd])):
                s, answer = hello(jobs, size, fds)
                s.close()
                assert answer["status"] == 400 and "FD" in answer["body"]["error"]["message"]
        finally:
            sealed.close()
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)  # sealed at 0 bytes
        s, answer = hello(jobs, 65536, [fd])
        s.close()
        assert answer["status"] == 400 and "announced" in answer["body"]["error"]["message"]
    finally:
        os.close(fd)
    assert healthy(url) and proc.poll() is None
    # Nothing refused stayed mapped: only the real front's arena (its health check went over
    # the job channel), 100,000 bytes rounded down to 64 and up to the page.
    assert arena_maps(proc.pid) == [102400]


# ---- a front killed mid-flight --------------------------------------------------------------


def test_a_front_killed_with_jobs_in_flight_leaks_nothing(tmp_path: Path) -> None:
    sock = tmp_path / "featpool.sock"
    # Batches wait 3 s to fill: the jobs are surely in the GPU process when the front dies.
    args = ("--http-workers", "1", "--max-batch-wait-ms", "3000", "--max-batch-size", "64")
    jobs_path, core_http = channel_paths(sock)
    cat = photo("chelsea", "JPEG")
    with server_process(sock, tmp_path / "server.log", *args) as (url, proc):
        gpu = httpx.Client(transport=httpx.HTTPTransport(uds=str(core_http)), base_url="http://g")

        def in_flight() -> float:
            text = gpu.get("/metrics").text
            return metric(text, "featpool_admission_in_flight_images")

        def uploads() -> None:
            async def go() -> None:
                async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                    await asyncio.gather(
                        *(
                            c.post(
                                "/v1/encode", content=cat, headers={"content-type": "image/jpeg"}
                            )
                            for _ in range(8)
                        ),
                        return_exceptions=True,
                    )

            asyncio.run(go())

        t = threading.Thread(target=uploads)
        t.start()
        try:
            assert wait_until(lambda: in_flight() == 8, timeout_s=30), in_flight()
            assert arenas_mapped(proc.pid) == 1
            (front,) = front_pids(proc.pid)
            os.kill(front, signal.SIGKILL)
        finally:
            t.join(timeout=60)
        # The batch runs after all (decoding what the dead front left in its arena), its
        # answers find no one, and the leases made for them are given back at once.
        assert wait_until(lambda: in_flight() == 0, timeout_s=30)
        assert wait_until(lambda: gpu.get("/v1/pool").json()["leases_active"] == 0, timeout_s=10)
        text = gpu.get("/metrics").text
        assert metric(text, "featpool_images_total", outcome="encoded") == 8
        # given back by the service, not DELETEd by anyone
        assert metric(text, "featpool_leases_released_total", reason="discarded") == 8
        assert metric(text, "featpool_leases_released_total", reason="delete") == 0
        # The dead front's arena is unmapped once no job of it runs.
        assert wait_until(lambda: arenas_mapped(proc.pid) == 0, timeout_s=10)
        assert gpu.get("/health/live").status_code == 200 and proc.poll() is None

        # A new front's connection is served as before.
        async def new_front() -> str:
            client = JobClient(jobs_path, 1 << 20)
            try:
                header = inspect(cat, max_pixels=10**8, max_bytes=10**8, label="cat")
                (lease,) = await client.encode([ImageIn("cat", cat, header)], EncodeOptions())
                await client.release(lease.lease_id)
                return lease.lease_id
            finally:
                await client.close()

        assert asyncio.run(new_front())
        gpu.close()
