"""Pure-ASGI middleware: request IDs, request metrics, the body-size limit (enforced while
the body streams in, so a chunked upload cannot get past it either), the body timeout (a body
that sends nothing for ``body_timeout_s`` is answered 408 and its connection closed, which
frees what it had sent), the minimum body rate (past that timeout, a body must have
averaged ``min_body_bytes_per_s`` over the time spent waiting for it, else the same 408: a body
trickled a byte per timeout no longer holds its connection for as long as it likes), and
hang-up detection: a
client that disconnects after sending its body but before the answer starts has its handler
cancelled, so that work queued for it is dropped and leases made for it are released at once
instead of living until their TTL."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import STATUS
from app.metrics import HttpMetrics

log = logging.getLogger("app.access")

# prefix -> the label of a path under it, and labels by the path's last part (sub-resources)
ENDPOINTS: dict[str, tuple[str, dict[str, str]]] = {
    "/v1/encode": ("/v1/encode", {}),
    "/v1/leases": ("/v1/leases/{id}", {"/tensor": "/v1/leases/{id}/tensor"}),
    "/v1/features": ("/v1/features/{ref}", {"/lease": "/v1/features/{ref}/lease"}),
    "/v1/pool": ("/v1/pool", {}),
    "/health": ("/health", {}),
    "/metrics": ("/metrics", {}),
}


def endpoint_label(path: str) -> str:
    """A small fixed set of label values: never a lease ID, hash or client id in a label."""
    for prefix, (label, by_suffix) in ENDPOINTS.items():
        if path.startswith(prefix):
            return next((v for k, v in by_suffix.items() if path.endswith(k)), label)
    return "other"


# Bodies of routes other than /v1/encode (a renew's {"ttl_s": ...}): 64 KiB is ample.
SMALL_BODY_BYTES = 64 << 10


class _BodyTooLargeError(Exception):
    pass


class _BodyTimeoutError(Exception):
    def __init__(self, too_slow: bool) -> None:
        self.too_slow = too_slow  # under the minimum rate, rather than silent


_SAFE_METHODS = frozenset({"GET", "HEAD"})  # HTTP's safe methods that this API serves


class ServiceMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        metrics: HttpMetrics,
        max_body_bytes: int,
        body_timeout_s: float | None = None,
        min_body_bytes_per_s: int = 0,
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.min_body_bytes_per_s = min_body_bytes_per_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        request_id = headers.get(b"x-request-id", b"").decode("latin-1")[:128] or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        endpoint = endpoint_label(scope["path"])
        # Only uploads are large; every other body is a small JSON object, parsed on the
        # event loop: a body cap's worth of JSON there would stall every request for a second.
        upload = scope["path"] == "/v1/encode"
        limit = self.max_body_bytes if upload else min(SMALL_BODY_BYTES, self.max_body_bytes)
        started = time.perf_counter()
        status = 500
        response_started = False

        async def send_wrapper(message: Message) -> None:
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                response_started = True
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [
                    *message["headers"],
                    (b"x-request-id", request_id.encode("latin-1")),
                ]
            await send(message)

        received = 0
        waited = 0.0  # seconds spent waiting for the body's pieces
        first: Message | None = None  # the empty body of a request without one, read early
        handler = asyncio.current_task()
        watcher: asyncio.Task[None] | None = None
        hung_up = False

        async def watch_for_hang_up() -> None:
            nonlocal hung_up
            message = await receive()  # after the body, the server only says "disconnect"
            if message["type"] == "http.disconnect" and not response_started and handler:
                hung_up = True
                handler.cancel()

        async def receive_wrapper() -> Message:
            nonlocal received, watcher, first, waited
            if first is not None:
                message, first = first, None
                return message
            if watcher is None and self.body_timeout_s is not None:
                # Still reading the body: each piece must come within the timeout, and past
                # the timeout the body must average the minimum rate over the time spent
                # waiting for it (as Kestrel's MinRequestBodyDataRate: a handler slow to read
                # does not count against the client). ``received`` bytes are enough until
                # ``received / rate`` seconds of waiting.
                wait = self.body_timeout_s
                if rate := self.min_body_bytes_per_s:
                    wait = min(wait, max(self.body_timeout_s, received / rate) - waited)
                t0 = time.perf_counter()
                try:
                    message = await asyncio.wait_for(receive(), max(wait, 0.0))
                except TimeoutError:
                    raise _BodyTimeoutError(wait < self.body_timeout_s) from None
                finally:
                    waited += time.perf_counter() - t0
            else:
                message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _BodyTooLargeError
                if not message.get("more_body", False) and watcher is None:
                    watcher = asyncio.get_running_loop().create_task(watch_for_hang_up())
            return message

        try:
            length = headers.get(b"content-length")
            if length is not None and length.isdigit() and int(length) > limit:
                raise _BodyTooLargeError
            if (
                scope["method"] not in _SAFE_METHODS
                and b"transfer-encoding" not in headers
                and length in (None, b"0")
            ):
                # No body: a handler may never read one (POST /v1/features/{ref}/lease does
                # not), and the watch starts only once the body is in. Read it now; the app
                # gets it if it asks. Not for GET and HEAD: they make nothing that a hang-up
                # would leave behind, and the watch task costs each of them ~25 us.
                first = await receive_wrapper()
            await self.app(scope, receive_wrapper, send_wrapper)
        except asyncio.CancelledError:
            if not hung_up or handler is None:
                raise
            handler.uncancel()
            status = 499  # nginx's "client closed request": nobody is left to answer
        except _BodyTooLargeError:
            if response_started:
                raise
            status = 413
            self.metrics.rejected.labels("payload_too_large").inc()
            await _send_error(
                send_wrapper,
                "payload_too_large",
                f"request body exceeds {limit} bytes"
                + ("" if upload else f" (the limit of {scope['path']})"),
            )
        except _BodyTimeoutError as e:
            if response_started:
                raise
            TRIMMER.request()  # what the stalled body had sent goes back to the system
            status = 408
            self.metrics.rejected.labels("body_timeout").inc()
            await _send_error(
                send_wrapper,
                "body_timeout",
                f"the request body came slower than {self.min_body_bytes_per_s} bytes/s "
                f"(--min-body-bytes-per-s): {received} bytes in {waited:.1f} s"
                if e.too_slow
                else f"the request body sent nothing for {self.body_timeout_s} s "
                f"(--body-timeout-s); {received} bytes had arrived",
            )
        finally:
            if watcher is not None:
                watcher.cancel()
            elapsed = time.perf_counter() - started
            self.metrics.requests.labels(endpoint, f"{status // 100}xx").inc()
            self.metrics.request_seconds.labels(endpoint).observe(elapsed)
            if endpoint not in ("/metrics", "/health"):
                log.info(
                    "%s %s -> %d in %.1f ms",
                    scope["method"],
                    scope["path"],
                    status,
                    elapsed * 1000,
                    extra={"request_id": request_id, "status": status},
                )


async def _send_error(send: Any, kind: str, message: str) -> None:
    """The JSON error body the API answers with (app/errors.py), written from the middleware
    (the app never saw the request, or gave up on its body); the connection is closed."""
    data = json.dumps({"error": {"type": kind, "message": message}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": STATUS[kind],
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


class HeapTrimmer:
    """Gives freed heap memory back to the system (glibc ``malloc_trim``) after a burst of
    large, short-lived buffers, such as bodies cut off by a timeout. Python frees them, but
    glibc keeps the pages: RSS stayed ~170 MiB up after 40 stalled 5 MiB uploads had been
    answered. Trims run on a thread of their own (ctypes lets go of the GIL), one at a time,
    at most one every ``interval_s``, the last one after the burst has ended."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._wanted = False
        self._running = False
        self._trim = _malloc_trim()

    def request(self) -> None:
        if self._trim is None:
            return
        with self._lock:
            self._wanted = True
            if self._running:
                return
            self._running = True
        threading.Thread(target=self._run, name="featpool-trim", daemon=True).start()

    def _run(self) -> None:
        import time

        assert self._trim is not None
        while True:
            time.sleep(self.interval_s)  # let the burst free what it holds first
            with self._lock:
                if not self._wanted:
                    self._running = False
                    return
                self._wanted = False
            self._trim(0)


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim with
        return None


TRIMMER = HeapTrimmer()  # one per process
