"""The job channel between HTTP front processes and the GPU process (``--http-workers N``).

One Python process cannot both parse HTTP at GPU speed and keep the GPU fed: they share one
interpreter lock. With front processes, each front parses and checks uploads (headers included,
and takes its admission permit) and sends the image bytes here; the GPU process takes its own
permit (the bound is global, whatever the number of fronts), then batches, encodes and
publishes. ``JobClient`` is the fronts' ``EngineClient``: every engine call the routes make
travels this channel. No torch here: fronts import this module.

Frames on a Unix socket (mode 0600: same user only), both directions: a 4-byte big-endian
header length, a JSON header, then ``header["payload"]`` bytes (0 if absent).
  front -> core  {"id", "op": "encode", "ttl_s", "pooled", "dtype", "scope", "ids",
                  "images": [[label, size, header], ...]} + the images' bytes, concatenated
                 {"id", "op": "features" | "lease_features", "scope", "ref", "shape",
                  "dtype", "ttl_s"}
                 {"id", "op": "lease" | "tensor" | "release", "lease_id"}
                 {"id", "op": "renew", "lease_id", "ttl_s"}
                 {"id", "op": "pool" | "health"}
                 {"id": 0, "op": "discard", "lease_ids": [...]}   (answers nobody waited for)
  core -> front  {"id", "status", "body", "headers"}  (body: the answer's JSON, e.g. an
                 EncodeResponse or LeaseDescriptor of pool.descriptor, or the error shape;
                 "tensor" answers with the safetensors file as payload)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.admission import Admission
from app.engine_client import (
    EncodeOptions,
    EngineClient,
    EngineHealth,
    FeatureQuery,
    ImageIn,
)
from app.errors import STATUS, ApiError
from app.imaging import Header
from pool.descriptor import EncodeResponse, FeatureInfo, LeaseDescriptor
from pool.errors import PoolError

if TYPE_CHECKING:  # the GPU process's side only; fronts never import it
    from app.inprocess import InProcessEngineClient

log = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
MAX_HEADER = 1 << 20
Reply = tuple[int, dict[str, Any], dict[str, str], bytes]


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


def _query(q: FeatureQuery) -> dict[str, Any]:
    return {
        "scope": q.scope,
        "ref": q.ref,
        "shape": list(q.shape) if q.shape is not None else None,
        "dtype": q.dtype,
    }


class JobServer:
    """Runs in the GPU process: answers the fronts' jobs with the in-process engine client,
    encode jobs under a permit of the process's one ``Admission``."""

    def __init__(self, path: Path, client: InProcessEngineClient, admission: Admission) -> None:
        self.path = path
        self._client = client
        self._admission = admission
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
                if header.get("op") == "discard":
                    for lease_id in header.get("lease_ids", []):
                        self._client.discard(str(lease_id))
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
        headers: dict[str, str] = {}
        out = b""
        try:
            body, out = await self._answer(header, payload)
            status = 200
        except ApiError as e:
            status, body = _error(e.type, e.message)
            headers = e.headers or {}
        except PoolError as e:
            status, body = _error(e.type, str(e))
        except Exception as e:  # answered, logged, and the channel lives on
            log.exception("%s job failed", header.get("op"))
            status, body = _error("internal_error", f"{type(e).__name__}: {e}")
        async with lock:
            try:
                await _write(
                    writer,
                    {"id": header["id"], "status": status, "body": body, "headers": headers},
                    [out] if out else (),
                )
            except ConnectionError:  # the front went away: its leases must not wait for TTL
                for item in body.get("items", []) if header.get("op") == "encode" else []:
                    self._client.discard(item["lease_id"])

    async def _answer(self, h: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        c, op = self._client, h.get("op")
        if op == "encode":
            images, at = [], 0
            for label, size, head in h["images"]:
                images.append(
                    ImageIn(str(label), payload[at : at + size], Header(**head) if head else None)
                )
                at += size
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
            return EncodeResponse(items=items).model_dump(mode="json"), b""
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


class JobClient(EngineClient):
    """Runs in each front process: one connection to the GPU process, many jobs in flight."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Reply]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._connect_lock = asyncio.Lock()
        self._write_lock = asyncio.Lock()

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
            },
            [i.data for i in images],
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
        self, header: dict[str, Any], payload: Sequence[bytes] = ()
    ) -> tuple[dict[str, Any], bytes]:
        """Send one job and wait for its answer; an error answer is raised as ApiError."""
        job = next(self._ids)
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._waiting[job] = fut
        try:
            await self._send({"id": job, **header}, payload)
            status, body, headers, out = await fut
        finally:
            # Cancelled (the client hung up): the answer, when it comes, is released unread.
            self._waiting.pop(job, None)
        if status != 200:
            err = body.get("error", {})
            kind = err.get("type") if err.get("type") in STATUS else "internal_error"
            raise ApiError(kind, str(err.get("message", "")), headers=headers or None)
        return body, out

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
                header, payload = await _read(reader)
                fut = self._waiting.pop(int(header["id"]), None)
                if fut is not None and not fut.done():
                    fut.set_result(
                        (
                            int(header["status"]),
                            header["body"],
                            header.get("headers") or {},
                            payload,
                        )
                    )
                elif header.get("status") == 200:  # nobody waits: give the leases back now
                    ids = [i["lease_id"] for i in header["body"].get("items", [])]
                    if ids:
                        await self._send({"id": 0, "op": "discard", "lease_ids": ids})
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

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task
