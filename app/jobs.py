"""The job channel between HTTP front processes and the GPU process (``--http-workers N``).

One Python process cannot both parse HTTP at GPU speed and keep the GPU fed: they share one
interpreter lock. With front processes, each front parses and checks uploads and sends the
image bytes here; the GPU process only batches, encodes and publishes.

Frames on a Unix socket (mode 0600: same user only), both directions: a 4-byte big-endian
header length, a JSON header, then ``header["payload"]`` bytes (0 if absent).
  front -> core  {"id", "op": "encode", "ttl_s", "pooled", "dtype", "scope", "ids",
                  "images": [[label, size]..]}
                 + the images' bytes, concatenated
                 {"id", "op": "release", "lease_ids": [...]}   (answers nobody waited for)
  core -> front  {"id", "status", "body", "headers"}            (body: the HTTP answer's JSON:
                 an EncodeResponse of pool.descriptor, or the error shape)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import struct
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from app.errors import STATUS, ApiError
from pool.descriptor import EncodeResponse, LeaseDescriptor
from pool.errors import PoolError

log = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
MAX_HEADER = 1 << 20


class EncodeFn(Protocol):
    """Encode images and answer with the HTTP body: in the GPU process, or through it."""

    def __call__(
        self,
        images: Sequence[tuple[str, bytes]],
        ttl_s: float | None,
        pooled: bool,
        dtype: str | None,
        *,
        scope: str = "",
        ids: Sequence[str | None] | None = None,
    ) -> Awaitable[list[LeaseDescriptor]]: ...


def channel_paths(socket_path: Path) -> tuple[Path, Path]:
    """(job socket, the GPU process's own HTTP socket), beside the hand-off socket."""
    return (
        socket_path.with_name(socket_path.name + ".jobs"),
        socket_path.with_name(socket_path.name + ".http"),
    )


async def _write(
    writer: asyncio.StreamWriter, header: dict[str, Any], payload: Sequence[bytes] = ()
) -> None:
    raw = json.dumps({**header, "payload": sum(len(p) for p in payload)}).encode()
    writer.write(_LEN.pack(len(raw)) + raw)
    for p in payload:
        writer.write(p)
    await writer.drain()


async def _read(reader: asyncio.StreamReader) -> tuple[dict[str, Any], bytes]:
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > MAX_HEADER:
        raise ConnectionError(f"job header of {n} bytes")
    header = json.loads(await reader.readexactly(n))
    payload = await reader.readexactly(int(header.get("payload", 0)))
    return header, payload


def _error(kind: str, message: str) -> tuple[int, dict[str, Any]]:
    return STATUS.get(kind, 500), {"error": {"type": kind, "message": message}}


class JobServer:
    """Runs in the GPU process: answers encode jobs from the fronts with ``encode``."""

    def __init__(self, path: Path, encode: EncodeFn, release: Callable[[str], None]) -> None:
        self.path = path
        self._encode = encode
        self._release = release
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._server = await asyncio.start_unix_server(
            self._serve, path=str(self.path), limit=1 << 20
        )
        os.chmod(self.path, 0o600)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lock = asyncio.Lock()
        tasks: set[asyncio.Task[None]] = set()
        try:
            while True:
                header, payload = await _read(reader)
                if header.get("op") == "release":
                    for lease_id in header.get("lease_ids", []):
                        self._release(str(lease_id))
                    continue
                task = asyncio.create_task(self._job(header, payload, writer, lock))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError, json.JSONDecodeError):
            pass
        finally:
            writer.close()

    async def _job(
        self,
        header: dict[str, Any],
        payload: bytes,
        writer: asyncio.StreamWriter,
        lock: asyncio.Lock,
    ) -> None:
        images, at = [], 0
        for label, size in header["images"]:
            images.append((str(label), payload[at : at + size]))
            at += size
        headers: dict[str, str] = {}
        try:
            ids = header.get("ids")
            items = await self._encode(
                images,
                header.get("ttl_s"),
                bool(header.get("pooled")),
                header.get("dtype"),
                scope=str(header.get("scope") or ""),
                ids=[None if i is None else str(i) for i in ids] if ids else None,
            )
            body = EncodeResponse(items=items).model_dump(mode="json")
            status = 200
        except ApiError as e:
            status, body = _error(e.type, e.message)
            headers = e.headers or {}
        except PoolError as e:
            status, body = _error(e.type, str(e))
        except Exception as e:  # answered, logged, and the channel lives on
            log.exception("encode job failed")
            status, body = _error("internal_error", f"{type(e).__name__}: {e}")
        async with lock:
            try:
                await _write(
                    writer, {"id": header["id"], "status": status, "body": body, "headers": headers}
                )
            except ConnectionError:  # the front went away: its leases must not wait for TTL
                for item in body.get("items", []):
                    self._release(item["lease_id"])


class JobClient:
    """Runs in each front process: one connection to the GPU process, many jobs in flight."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[tuple[int, dict[str, Any], dict[str, str]]]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._connect_lock = asyncio.Lock()
        self._write_lock = asyncio.Lock()

    async def _connection(self) -> asyncio.StreamWriter:
        async with self._connect_lock:
            if self._writer is None or self._writer.is_closing():
                try:
                    reader, self._writer = await asyncio.open_unix_connection(
                        str(self.path), limit=1 << 20
                    )
                except OSError as e:
                    raise ApiError("not_ready", f"the GPU process is not reachable ({e})") from e
                self._reader_task = asyncio.create_task(self._read_loop(reader))
            return self._writer

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                header, _ = await _read(reader)
                fut = self._waiting.pop(int(header["id"]), None)
                if fut is not None and not fut.done():
                    fut.set_result(
                        (int(header["status"]), header["body"], header.get("headers") or {})
                    )
                elif header.get("status") == 200:  # nobody waits: give the leases back now
                    ids = [i["lease_id"] for i in header["body"].get("items", [])]
                    await self._send({"id": 0, "op": "release", "lease_ids": ids})
        except (asyncio.IncompleteReadError, ConnectionError, json.JSONDecodeError):
            pass
        finally:
            waiting, self._waiting = self._waiting, {}
            for fut in waiting.values():
                if not fut.done():
                    fut.set_exception(ApiError("not_ready", "the GPU process went away"))
            if self._writer is not None:
                self._writer.close()

    async def _send(self, header: dict[str, Any], payload: Sequence[bytes] = ()) -> None:
        writer = await self._connection()
        async with self._write_lock:
            try:
                await _write(writer, header, payload)
            except ConnectionError as e:
                raise ApiError("not_ready", f"the GPU process went away ({e})") from e

    async def encode(
        self,
        images: Sequence[tuple[str, bytes]],
        ttl_s: float | None,
        pooled: bool,
        dtype: str | None,
        *,
        scope: str = "",
        ids: Sequence[str | None] | None = None,
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        job = next(self._ids)
        fut: asyncio.Future[tuple[int, dict[str, Any], dict[str, str]]] = (
            asyncio.get_running_loop().create_future()
        )
        self._waiting[job] = fut
        try:
            await self._send(
                {
                    "id": job,
                    "op": "encode",
                    "ttl_s": ttl_s,
                    "pooled": pooled,
                    "dtype": dtype,
                    "scope": scope,
                    "ids": list(ids) if ids is not None else None,
                    "images": [[lb, len(d)] for lb, d in images],
                },
                [d for _, d in images],
            )
            return await fut
        finally:
            # Cancelled (the client hung up): the answer, when it comes, is released unread.
            self._waiting.pop(job, None)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task
