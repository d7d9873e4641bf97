"""The job channel between HTTP front processes and the GPU process (``--http-workers N``).

One Python process cannot both parse HTTP at GPU speed and keep the GPU fed: they share one
interpreter lock. With front processes, each front parses and checks uploads (headers included,
and takes its admission permit) and sends the image bytes here; the GPU process takes its own
permit (the bound is global, whatever the number of fronts), then batches, encodes and
publishes. ``JobClient`` is the fronts' ``EngineClient``: every engine call the routes make
travels this channel. No torch here: fronts import this module.

Frames on a Unix socket (mode 0600: same user only), both directions: a 4-byte big-endian
header length, a JSON header, then ``header["payload"]`` bytes (0 if absent).
  front -> core  {"id": 0, "op": "hello", "arena_bytes"}   first, alone; with arena_bytes > 0
                 it carries (SCM_RIGHTS) the FD of the front's job arena (app/job_arena.py)
  core -> front  {"id": 0, "op": "hello", "status", "body"}   200, or the error shape and close
  front -> core  {"id", "op": "encode", "ttl_s", "pooled", "dtype", "scope", "ids",
                  "images": [[label, size, header], ...], "digests", "arena_offset"}:
                 digests, each image's SHA-256 (hex) computed by the front (a malformed list
                 is a 400 invalid_request); the images' bytes,
                 back to back, lie in the arena from arena_offset (checked against its size);
                 without arena_offset they follow as the payload (the arena had no room, or
                 the front has none)
                 {"id", "op": "features" | "lease_features", "scope", "ref", "shape",
                  "dtype", "ttl_s"}
                 {"id", "op": "lease" | "tensor" | "release", "lease_id"}
                 {"id", "op": "renew", "lease_id", "ttl_s"}
                 {"id", "op": "pool" | "health"}
                 {"id": 0, "op": "discard", "lease_ids": [...]}   (answers nobody waited for)
  core -> front  {"id", "status", "body", "headers"}  (body: the answer's JSON, e.g. an
                 EncodeResponse or LeaseDescriptor of pool.descriptor, or the error shape;
                 "tensor" answers with the safetensors file as payload)
An encode job's arena range stays the front's to keep untouched until its answer arrives (the
GPU process reads it only before it answers); then the front allocates it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import Histogram
from pydantic import BaseModel

from app.admission import Admission
from app.engine_client import (
    EncodeOptions,
    EngineClient,
    EngineHealth,
    FeatureQuery,
    ImageIn,
)
from app.errors import STATUS, ApiError
from app.featindex import content_digest
from app.imaging import Header, ImageData
from app.job_arena import ArenaError, ArenaView, FrontArena
from app.metrics import HttpMetrics
from pool.allocator import Extent
from pool.descriptor import EncodeResponse, FeatureInfo, LeaseDescriptor
from pool.errors import PoolError

if TYPE_CHECKING:  # the GPU process's side only; fronts never import it
    from app.inprocess import InProcessEngineClient

log = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
MAX_HEADER = 1 << 20
MAX_HELLO = 4096  # the hello frame, read before the connection becomes a stream
HELLO_TIMEOUT_S = 10.0
Reply = tuple[int, dict[str, Any], dict[str, str], bytes]


def channel_paths(socket_path: Path) -> tuple[Path, Path]:
    """(job socket, the GPU process's own HTTP socket), beside the hand-off socket."""
    return (
        socket_path.with_name(socket_path.name + ".jobs"),
        socket_path.with_name(socket_path.name + ".http"),
    )


def _frame(
    header: dict[str, Any], payload: Sequence[ImageData] = (), body: BaseModel | None = None
) -> list[ImageData]:
    """A frame's bytes. ``body``: a model to send as the header's "body", serialised by
    pydantic straight to JSON (3 us for a one-lease answer on the CPU box, against 10 us for
    model_dump then json.dumps)."""
    raw = json.dumps({**header, "payload": sum(len(p) for p in payload)}).encode()
    if body is not None:  # the same JSON object, with "body" last
        raw = raw[:-1] + b', "body": ' + body.model_dump_json().encode() + b"}"
    return [_LEN.pack(len(raw)) + raw, *payload]


def _put(
    writer: asyncio.StreamWriter, header: dict[str, Any], payload: Sequence[ImageData] = ()
) -> None:
    for part in _frame(header, payload):
        writer.write(part)


async def _write(
    writer: asyncio.StreamWriter, header: dict[str, Any], payload: Sequence[ImageData] = ()
) -> None:
    _put(writer, header, payload)
    await writer.drain()


async def _read(reader: asyncio.StreamReader) -> tuple[dict[str, Any], bytes]:
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > MAX_HEADER:
        raise ConnectionError(f"job header of {n} bytes")
    header = json.loads(await reader.readexactly(n))
    payload = await reader.readexactly(int(header.get("payload", 0)))
    return header, payload


def _digests(given: Any, n: int) -> Sequence[bytes | None]:
    """The images' content digests a front computed (hex SHA-256 each), or None for each."""
    if given is None:
        return [None] * n
    try:
        out = [bytes.fromhex(d) for d in given]
    except (TypeError, ValueError):
        out = []
    if len(out) != n or any(len(d) != 32 for d in out):
        raise ApiError("invalid_request", f"job frame: {n} images need {n} SHA-256 digests")
    return out


def _error(kind: str, message: str) -> tuple[int, dict[str, Any]]:
    return STATUS.get(kind, 500), {"error": {"type": kind, "message": message}}


def _query(q: FeatureQuery) -> dict[str, Any]:
    return {
        "scope": q.scope,
        "ref": q.ref,
        "shape": list(q.shape) if q.shape is not None else None,
        "dtype": q.dtype,
    }


def _handed_over(op: str, body: dict[str, Any] | EncodeResponse) -> list[str]:
    """The leases a job's answer hands to its caller (who must release them, or its stand-in
    when the caller went away): as the GPU process sends it, or as the front reads it."""
    if isinstance(body, EncodeResponse):
        return [item.lease_id for item in body.items]
    if op == "encode":
        return [item["lease_id"] for item in body.get("items", [])]
    if op == "lease_features":
        return [str(body["lease_id"])]
    return []


async def _readable(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(sock.fileno(), wake)
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())


async def _receive_hello(conn: socket.socket) -> ArenaView | None:
    """Read a connection's hello frame with its FD, if any: the front's arena, mapped. Every
    FD that arrives is closed here (the mapping outlives it); a bad hello is an ArenaError."""
    data, fds = b"", []
    try:
        while True:
            if len(data) >= _LEN.size:
                (n,) = _LEN.unpack(data[: _LEN.size])
                if n > MAX_HELLO:
                    raise ArenaError(f"a hello of {n} bytes")
                if len(data) >= _LEN.size + n:
                    break
            await _readable(conn)
            try:
                chunk, got, flags, _ = socket.recv_fds(
                    conn, MAX_HELLO + _LEN.size - len(data), 1, socket.MSG_CMSG_CLOEXEC
                )
            except BlockingIOError:
                continue
            fds += got
            if flags & socket.MSG_CTRUNC:  # the kernel closed the FDs that did not fit
                raise ArenaError("a hello with more than one FD")
            if not chunk:
                raise EOFError("closed before its hello")
            data += chunk
        if len(data) > _LEN.size + n:
            raise ArenaError("frames sent before the hello was answered")
        hello = json.loads(data[_LEN.size :])
        if not isinstance(hello, dict) or hello.get("op") != "hello":
            raise ArenaError("the first frame must be a hello")
        nbytes = hello.get("arena_bytes", 0)
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ArenaError(f"arena_bytes {nbytes!r} is not a non-negative integer")
        if len(fds) != (1 if nbytes else 0):
            raise ArenaError(f"a hello with arena_bytes {nbytes} and {len(fds)} FD(s)")
        return ArenaView(fds[0], nbytes) if nbytes else None
    finally:
        for fd in fds:
            os.close(fd)


def _image_data(
    header: dict[str, Any], payload: bytes, arena: ArenaView | None
) -> list[memoryview]:
    """The bytes of an encode job's images, as views (of the arena, or of the payload): each
    range checked to lie inside what the front sent (ArenaError if not). Views of the arena
    lie back to back from the header's arena_offset."""
    if header.get("op") != "encode":
        return []
    try:
        sizes = [size for _, size, _ in header["images"]]
    except (KeyError, TypeError, ValueError):
        raise ArenaError("an encode job needs images: [[label, size, header], ...]") from None
    offset = header.get("arena_offset")
    if offset is not None:
        if arena is None:
            raise ArenaError("arena_offset on a connection whose hello brought no arena")
        return arena.images(offset, sizes)
    view, out, at = memoryview(payload), [], 0
    for size in sizes:
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ArenaError(f"image size {size!r} is not a positive integer")
        out.append(view[at : at + size])
        at += size
    if at != len(payload):
        raise ArenaError(f"the images' sizes add up to {at} bytes, the payload has {len(payload)}")
    return out


class _Replies:
    """The answers on one front's connection. Those made in one turn of the event loop go out
    together at its end, in one write (a batch's jobs are answered in the same turn: one
    system call instead of one each, and no lock or drain per answer). A front that stops
    reading holds back only its own jobs (they wait for the buffer to drain past the
    transport's high-water mark). Answers that cannot be written give their leases back."""

    def __init__(self, writer: asyncio.StreamWriter, discard: Callable[[str], None]) -> None:
        self._writer = writer
        self._discard = discard
        self._parts: list[ImageData] = []
        self._leases: list[str] = []

    async def send(
        self,
        header: dict[str, Any],
        payload: Sequence[ImageData],
        leases: Sequence[str],
        body: BaseModel | None = None,
    ) -> None:
        if not self._parts:
            asyncio.get_running_loop().call_soon(self._flush)
        self._parts += _frame(header, payload, body)
        self._leases += leases
        transport = self._writer.transport
        if transport.get_write_buffer_size() > transport.get_write_buffer_limits()[1]:
            with contextlib.suppress(ConnectionError):  # then _flush gives the leases back
                await self._writer.drain()

    def _flush(self) -> None:
        parts, leases = self._parts, self._leases
        self._parts, self._leases = [], []
        try:
            if self._writer.is_closing():  # uvloop raises RuntimeError on a write then
                raise ConnectionResetError("the front went away")
            self._writer.writelines(parts)
        except (ConnectionError, RuntimeError):  # its leases must not wait for their TTL
            for lease_id in leases:
                self._discard(lease_id)


class JobServer:
    """Runs in the GPU process: answers the fronts' jobs with the in-process engine client,
    encode jobs under a permit of the process's one ``Admission``."""

    def __init__(
        self,
        path: Path,
        client: InProcessEngineClient,
        admission: Admission,
        job_seconds: Histogram | None = None,
    ) -> None:
        self.path = path
        self._client = client
        self._admission = admission
        self._job_seconds = job_seconds  # featpool_job_duration_seconds: encode jobs
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        # A listening socket of our own, not asyncio's server: each connection's first frame
        # (the hello) is read with recvmsg, for its FD, before the connection becomes a stream.
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(self.path))
            os.chmod(self.path, 0o600)
            sock.listen(256)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._listener = sock
        self._accepting = asyncio.create_task(self._accept(sock))

    async def stop(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
        if self._listener is not None:
            self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as e:  # out of FDs, say: the fronts retry
                log.warning("job channel: accept failed (%s)", e)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._connection(conn))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _connection(self, conn: socket.socket) -> None:
        arena: ArenaView | None = None
        refused = ""
        try:
            try:
                arena = await asyncio.wait_for(_receive_hello(conn), HELLO_TIMEOUT_S)
            except ValueError as e:  # a bad hello or arena (ArenaError), malformed JSON
                refused = str(e)
            reader, writer = await asyncio.open_unix_connection(sock=conn, limit=1 << 20)
        except (OSError, TimeoutError, EOFError):
            conn.close()
            return
        try:
            if refused:
                log.warning("job channel: hello refused: %s", refused)
                status, body = _error("invalid_request", f"hello refused: {refused}")
                await _write(writer, {"id": 0, "op": "hello", "status": status, "body": body})
                return
            await _write(writer, {"id": 0, "op": "hello", "status": 200, "body": {}})
            await self._serve(reader, writer, arena)
        except ConnectionError:
            pass
        except Exception:  # a malformed frame: this connection ends, the others live on
            log.exception("job channel: a connection ended on a malformed frame")
        finally:
            writer.close()
            if arena is not None:  # unmapped now, or by the last running job's views
                arena.close()

    async def _serve(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        arena: ArenaView | None,
    ) -> None:
        replies = _Replies(writer, self._client.discard)
        tasks: set[asyncio.Task[None]] = set()
        try:
            while True:
                header, payload = await _read(reader)
                if header.get("op") == "discard":
                    for lease_id in header.get("lease_ids", []):
                        self._client.discard(str(lease_id))
                    continue
                try:
                    # The views are taken here, while the arena is surely mapped; they keep
                    # it mapped until the job lets go of them.
                    datas = _image_data(header, payload, arena)
                except ArenaError as e:
                    await self._reply(replies, header, *_error("invalid_request", str(e)))
                    continue
                job = self._job(header, datas, arena, replies, time.perf_counter())
                task = asyncio.create_task(job)
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError, json.JSONDecodeError):
            pass

    async def _job(
        self,
        header: dict[str, Any],
        datas: list[memoryview],
        arena: ArenaView | None,
        replies: _Replies,
        started: float,
    ) -> None:
        headers: dict[str, str] = {}
        out = b""
        try:
            body, out = await self._answer(header, datas, arena)
            status = 200
        except ApiError as e:
            status, body = _error(e.type, e.message)
            headers = e.headers or {}
        except PoolError as e:
            status, body = _error(e.type, str(e))
        except Exception as e:  # answered, logged, and the channel lives on
            log.exception("%s job failed", header.get("op"))
            status, body = _error("internal_error", f"{type(e).__name__}: {e}")
        await self._reply(replies, header, status, body, headers=headers, out=out)
        if self._job_seconds is not None and header.get("op") == "encode":
            self._job_seconds.observe(time.perf_counter() - started)

    async def _reply(
        self,
        replies: _Replies,
        header: dict[str, Any],
        status: int,
        body: dict[str, Any] | EncodeResponse,
        *,
        headers: dict[str, str] | None = None,
        out: bytes = b"",
    ) -> None:
        frame = {"id": header["id"], "status": status, "headers": headers or {}}
        leases = _handed_over(str(header.get("op")), body) if status == 200 else []
        if isinstance(body, EncodeResponse):  # an encode job's answer, serialised by pydantic
            await replies.send(frame, [out] if out else (), leases, body)
        else:
            await replies.send({**frame, "body": body}, [out] if out else (), leases)

    async def _answer(
        self, h: dict[str, Any], datas: list[memoryview], arena: ArenaView | None
    ) -> tuple[dict[str, Any] | EncodeResponse, bytes]:
        c, op = self._client, h.get("op")
        if op == "encode":
            digests = _digests(h.get("digests"), len(datas))
            # Arena images lie back to back from arena_offset (_image_data checked the ranges)
            at = h.get("arena_offset") if arena is not None else None
            images = []
            for (label, _, head), data, digest in zip(h["images"], datas, digests, strict=True):
                header = Header(**head) if head else None
                if at is None:  # sent inline
                    images.append(ImageIn(str(label), data, header, digest))
                else:
                    images.append(ImageIn(str(label), data, header, digest, arena, at))
                    at += len(data)
            # The fronts' permits bound each front; this one bounds them all together.
            decoded = sum(i.header.decoded_bytes for i in images if i.header is not None)
            with self._admission.try_acquire(len(images), decoded):
                ids = h.get("ids")
                options = EncodeOptions(
                    h.get("ttl_s"),
                    bool(h.get("pooled")),
                    h.get("dtype"),
                    scope=str(h.get("scope") or ""),
                    ids=tuple(None if i is None else str(i) for i in ids) if ids else None,
                )
                items = await c.encode(images, options)
            return EncodeResponse(items=items), b""
        if op == "lease":
            return (await c.lease(str(h["lease_id"]))).wire(), b""
        if op in ("features", "lease_features"):
            shape = h.get("shape")
            q = FeatureQuery(
                str(h.get("scope") or ""),
                str(h["ref"]),
                tuple(int(x) for x in shape) if shape is not None else None,
                h.get("dtype"),
            )
            if op == "features":
                return (await c.features(q)).model_dump(mode="json"), b""
            return (await c.lease_features(q, h.get("ttl_s"))).wire(), b""
        if op == "tensor":
            return {}, await c.tensor(str(h["lease_id"]))
        if op == "renew":
            return (await c.renew(str(h["lease_id"]), h.get("ttl_s"))).wire(), b""
        if op == "release":
            await c.release(str(h["lease_id"]))
            return {}, b""
        if op == "pool":
            return await c.pool_info(), b""
        if op == "health":
            return dataclasses.asdict(await c.health()), b""
        raise ApiError("invalid_request", f"unknown job op {op!r}")


@dataclass
class _Connection:
    """A front's connection to the GPU process, with its own arena and its own jobs."""

    writer: asyncio.StreamWriter
    arena: FrontArena | None
    waiting: dict[int, asyncio.Future[Reply]] = field(default_factory=dict)
    placed: dict[int, Extent] = field(default_factory=dict)  # job -> its images' range

    def answered(self, job: int) -> None:
        """The GPU process answered ``job``: it reads the job's bytes no more."""
        extent = self.placed.pop(job, None)
        if extent is not None and self.arena is not None:
            self.arena.free(extent)

    def close(self) -> None:
        # The arena goes with the connection (jobs of it may still run in the GPU process,
        # reading their bytes: nothing is ever written there again); the next gets a new one.
        self.placed.clear()
        if self.arena is not None:
            self.arena.close()
        self.writer.close()
        waiting, self.waiting = self.waiting, {}
        for fut in waiting.values():
            if not fut.done():
                fut.set_exception(ApiError("not_ready", "the GPU process went away"))


class JobClient(EngineClient):
    """Runs in each front process: one connection to the GPU process, many jobs in flight.
    Encode jobs' image bytes go through the connection's arena (``arena_bytes`` of shared
    memory; 0: none) when it has room, else inline on the socket."""

    def __init__(
        self, path: Path, arena_bytes: int = 0, metrics: HttpMetrics | None = None
    ) -> None:
        self.path = path
        self.arena_bytes = arena_bytes
        self._metrics = metrics
        self._ids = itertools.count(1)
        self._conn: _Connection | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._connect_lock = asyncio.Lock()
        self._write_lock = asyncio.Lock()
        self._giving_back: set[asyncio.Task[None]] = set()

    # ---- EngineClient ----------------------------------------------------------------------

    async def encode(
        self, images: Sequence[ImageIn], options: EncodeOptions
    ) -> list[LeaseDescriptor]:
        heads = [dataclasses.asdict(i.header) if i.header else None for i in images]
        body, _ = await self._call(
            {
                "op": "encode",
                "ttl_s": options.ttl_s,
                "pooled": options.pooled,
                "dtype": options.dtype,
                "scope": options.scope,
                "ids": list(options.ids) if options.ids is not None else None,
                "images": [[i.label, len(i.data), h] for i, h in zip(images, heads, strict=True)],
                "digests": [(i.digest or content_digest(i.data)).hex() for i in images],
            },
            [i.data for i in images],
            arena=True,
        )
        return EncodeResponse.model_validate(body).items

    async def lease(self, lease_id: str) -> LeaseDescriptor:
        body, _ = await self._call({"op": "lease", "lease_id": lease_id})
        return LeaseDescriptor.parse(body)

    async def features(self, q: FeatureQuery) -> FeatureInfo:
        body, _ = await self._call({"op": "features", **_query(q)})
        return FeatureInfo.model_validate(body)

    async def lease_features(self, q: FeatureQuery, ttl_s: float | None) -> LeaseDescriptor:
        body, _ = await self._call({"op": "lease_features", "ttl_s": ttl_s, **_query(q)})
        return LeaseDescriptor.parse(body)

    async def tensor(self, lease_id: str) -> bytes:
        _, payload = await self._call({"op": "tensor", "lease_id": lease_id})
        return payload

    async def renew(self, lease_id: str, ttl_s: float | None) -> LeaseDescriptor:
        body, _ = await self._call({"op": "renew", "lease_id": lease_id, "ttl_s": ttl_s})
        return LeaseDescriptor.parse(body)

    async def release(self, lease_id: str) -> None:
        await self._call({"op": "release", "lease_id": lease_id})

    async def pool_info(self) -> dict[str, Any]:
        body, _ = await self._call({"op": "pool"})
        return body

    async def health(self) -> EngineHealth:
        body, _ = await self._call({"op": "health"})
        return EngineHealth(ready=bool(body["ready"]), dead_reason=body.get("dead_reason"))

    # ---- the channel -----------------------------------------------------------------------

    async def _call(
        self, header: dict[str, Any], payload: Sequence[ImageData] = (), *, arena: bool = False
    ) -> tuple[dict[str, Any], bytes]:
        """Send one job and wait for its answer; an error answer is raised as ApiError. With
        ``arena``, the payload goes through the connection's arena when it has room."""
        started = time.perf_counter()
        conn = await self._connection()
        job = next(self._ids)
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        conn.waiting[job] = fut
        sent = False
        try:
            async with self._write_lock:
                if conn.writer.is_closing():
                    raise ApiError("not_ready", "the GPU process went away")
                frame = {"id": job, **header}
                if arena:
                    payload = self._place(conn, job, frame, payload)
                # Placed and written without a pause: a frame in the transport's buffer goes
                # out (and is answered, which frees its range) even if we are cancelled now.
                _put(conn.writer, frame, payload)
                sent = True
                try:
                    await conn.writer.drain()
                except ConnectionError as e:
                    raise ApiError("not_ready", f"the GPU process went away ({e})") from e
            # Shielded: a cancelled caller (the client hung up) leaves the answer to come
            # (or just come) in, and its leases are given back when it does.
            status, body, headers, out = await asyncio.shield(fut)
            if self._metrics is not None and header.get("op") == "encode":
                self._metrics.front_job_seconds.observe(time.perf_counter() - started)
        except asyncio.CancelledError:
            if sent:  # in drain() or waiting: the answer comes all the same
                op = str(header["op"])
                fut.add_done_callback(lambda f: self._give_back(conn, op, f))
            raise
        finally:
            if not sent:  # no answer will come (a sent job's is taken off by the read loop)
                conn.waiting.pop(job, None)
        if status != 200:
            err = body.get("error", {})
            kind = err.get("type") if err.get("type") in STATUS else "internal_error"
            raise ApiError(kind, str(err.get("message", "")), headers=headers or None)
        return body, out

    def _place(
        self,
        conn: _Connection,
        job: int,
        frame: dict[str, Any],
        payload: Sequence[ImageData],
    ) -> Sequence[ImageData]:
        """Copy the payload into the arena and name its offset in the frame: what is left to
        send inline (nothing, or all of it when the arena has no room for it now)."""
        nbytes = sum(len(p) for p in payload)
        extent = conn.arena.put(payload) if conn.arena is not None else None
        path = "inline" if extent is None else "arena"
        if self._metrics is not None:
            self._metrics.job_images.labels(path).inc(len(payload))
            self._metrics.job_bytes.labels(path).inc(nbytes)
        if extent is None:
            return payload
        conn.placed[job] = extent
        frame["arena_offset"] = extent.offset
        return ()

    async def _connection(self) -> _Connection:
        async with self._connect_lock:
            if self._conn is None or self._conn.writer.is_closing():
                try:
                    self._conn, reader = await self._connect()
                except (OSError, EOFError, TimeoutError, ValueError) as e:
                    raise ApiError("not_ready", f"the GPU process is not reachable ({e})") from e
                self._reader_task = asyncio.create_task(self._read_loop(self._conn, reader))
            return self._conn

    async def _connect(self) -> tuple[_Connection, asyncio.StreamReader]:
        """Connect and say hello, handing over a new arena's FD; wait for the answer."""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        arena = None
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, str(self.path))
            if self.arena_bytes:
                try:
                    arena = FrontArena(self.arena_bytes)
                except (OSError, ValueError) as e:  # no memfd here, or a tiny setting
                    log.warning("no job arena (%s): image bytes go through the socket", e)
            hello = json.dumps(
                {"id": 0, "op": "hello", "arena_bytes": arena.size if arena else 0}
            ).encode()
            frame = _LEN.pack(len(hello)) + hello
            # A fresh connection's empty buffer takes a frame this small at once.
            fds = [arena.fd] if arena is not None else []
            sent = socket.send_fds(sock, [frame], fds) if fds else sock.send(frame)
            if sent != len(frame):
                raise ConnectionError("the hello was cut short")
            reader, writer = await asyncio.open_unix_connection(sock=sock, limit=1 << 20)
        except BaseException:
            sock.close()
            if arena is not None:
                arena.close()
            raise
        try:
            answer, _ = await asyncio.wait_for(_read(reader), HELLO_TIMEOUT_S)
            if answer.get("status") != 200:
                raise ConnectionError(
                    str(answer.get("body", {}).get("error", {}).get("message", answer))
                )
        except BaseException as e:
            writer.close()
            if arena is not None:
                arena.close()
            if isinstance(e, asyncio.IncompleteReadError):
                raise EOFError("the GPU process closed the connection at its hello") from e
            raise
        return _Connection(writer, arena), reader

    async def _read_loop(self, conn: _Connection, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                header, payload = await _read(reader)
                job = int(header["id"])
                conn.answered(job)  # its range in the arena is free again
                fut = conn.waiting.pop(job, None)
                if fut is not None and not fut.done():
                    fut.set_result(
                        (
                            int(header["status"]),
                            header["body"],
                            header.get("headers") or {},
                            payload,
                        )
                    )
        except (asyncio.IncompleteReadError, ConnectionError, json.JSONDecodeError):
            pass
        finally:
            conn.close()

    def _give_back(self, conn: _Connection, op: str, answer: asyncio.Future[Reply]) -> None:
        """Discard the leases of an answer its caller will not read (it was cancelled). A task
        of its own, as this runs from the answer's done-callback; with the connection gone,
        they live until their TTL."""
        if answer.cancelled() or answer.exception() is not None or answer.result()[0] != 200:
            return
        lease_ids = _handed_over(op, answer.result()[1])
        if not lease_ids:
            return

        async def discard() -> None:
            with contextlib.suppress(ConnectionError):
                await self._send(conn, {"id": 0, "op": "discard", "lease_ids": lease_ids})

        task = asyncio.create_task(discard())
        self._giving_back.add(task)
        task.add_done_callback(self._giving_back.discard)

    async def _send(self, conn: _Connection, header: dict[str, Any]) -> None:
        async with self._write_lock:
            await _write(conn.writer, header)

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task
