"""uvicorn's HTTP/1.1 protocol with featpool's limits and error shape.

uvicorn answers what it cannot parse itself (``Content-Length: -1``, a broken request line,
bad chunked framing, an invalid header) with a plain-text 400, before any middleware runs.
The subclasses here answer those in the service's JSON shape ``{"error": {"type",
"message"}}``, and bound what httptools does not: the URL (414) and the header block (431),
counted while they arrive so that neither can grow without limit, and in time: a connection
whose request line and headers have not all come within ``--body-timeout-s`` of its first
byte (or of its opening) is answered 408 and closed, so silent or trickling connections
cannot pile up (each held an FD for as long as the client liked); likewise a connection whose
client stops taking its answer is aborted. ``http_protocol(settings)``
is the class to give uvicorn (``http=``): httptools where installed, as uvicorn's ``auto``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import termios
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from app.settings import Settings

REASONS = {
    400: b"Bad Request",
    408: b"Request Timeout",
    414: b"URI Too Long",
    431: b"Request Header Fields Too Large",
}


def error_bytes(status: int, kind: str, message: str) -> bytes:
    """A whole HTTP/1.1 response carrying the JSON error; the connection closes after it."""
    body = json.dumps({"error": {"type": kind, "message": message}}).encode()
    head = (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n" % (status, REASONS.get(status, b"Error"), len(body))
    )
    return head + body


MALFORMED = (
    "malformed HTTP request (request line, headers, Content-Length or chunked framing); "
    "nothing was processed"
)


LINGER_S = 2.0


# Requests a connection may have waiting behind the one being answered (HTTP/1.1 pipelining);
# each is a parsed request held in memory. Clients rarely pipeline at all.
MAX_PIPELINED = 16


class _LimitExceeded(Exception):
    pass


def http_protocol(settings: Settings) -> type[Any]:
    """The protocol class for uvicorn, with ``settings``' URL and header limits."""
    max_url = settings.max_url_bytes
    max_headers = settings.max_header_bytes
    head_timeout_s = settings.body_timeout_s
    # An answer the client does not take: at least this much of what waits must go each period.
    drain_bytes = max(1, int(settings.min_body_bytes_per_s * head_timeout_s))
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # no httptools: h11, whose own event-size bound covers URL + headers

        class JsonH11(H11Protocol):
            def send_400_response(self, msg: str) -> None:
                self.transport.write(error_bytes(400, "invalid_request", MALFORMED))
                self.transport.close()

        return JsonH11

    class JsonHttpTools(HttpToolsProtocol):
        _limit: tuple[int, str, str] | None = None
        _header_bytes = 0
        _head_timer: Any = None
        _deferred: bytes | None = None  # a 400 waiting for the answers pipelined before it

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_timer()
            if self._write_timer is not None:
                self._write_timer.cancel()
            super().connection_lost(exc)

        # A client that asks for answers and does not read them (a tensor of megabytes on each
        # of many connections) held each answer in this process for as long as it liked.
        # While an answer waits above the transport's high-water mark (the handler is paused),
        # each --body-timeout-s the client must take --min-body-bytes-per-s worth of it (one
        # byte if that is 0), else the connection is aborted and the answer dropped.
        _write_timer: Any = None

        def pause_writing(self) -> None:
            super().pause_writing()
            self._watch_writes(self._unsent())

        def _unsent(self) -> int:
            """Bytes of the answer the client has not acknowledged: this process's buffer and
            the kernel's send queue (which drains in steps of a third of its size or more)."""
            queued = 0
            sock = self.transport.get_extra_info("socket")
            with contextlib.suppress(OSError, ValueError, AttributeError):
                queued = int.from_bytes(
                    fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(4)), "little"
                )
            return self.transport.get_write_buffer_size() + queued

        def resume_writing(self) -> None:
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None
            super().resume_writing()

        def _watch_writes(self, waiting: int) -> None:
            self._write_timer = self.loop.call_later(head_timeout_s, self._check_writes, waiting)

        def _check_writes(self, waiting: int) -> None:
            self._write_timer = None
            left = self._unsent()
            if waiting - left < drain_bytes:  # nothing is written while paused: only drained
                self.transport.abort()
            else:
                self._watch_writes(left)

        def _arm_head_timer(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(head_timeout_s, self._head_too_slow)

        def _disarm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_too_slow(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            message = f"the request line and headers did not arrive within {head_timeout_s:g} s"
            self.transport.write(error_bytes(408, "body_timeout", message))
            self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._limit = None
            self._header_bytes = 0
            self._arm_head_timer()  # a later request on a kept-alive connection: its own

        def on_headers_complete(self) -> None:
            self._disarm_head_timer()
            if len(self.pipeline) >= MAX_PIPELINED:
                self._refuse(
                    429,
                    "queue_full",
                    f"more than {MAX_PIPELINED} requests pipelined on one connection, unanswered",
                )
            super().on_headers_complete()

        def on_url(self, url: bytes) -> None:
            super().on_url(url)
            if len(self.url) > max_url:
                self._refuse(414, "uri_too_long", f"the URL exceeds {max_url} bytes")

        def on_header(self, name: bytes, value: bytes) -> None:
            self._header_bytes += len(name) + len(value) + 4
            if self._header_bytes > max_headers:
                self._refuse(
                    431, "headers_too_large", f"the request headers exceed {max_headers} bytes"
                )
            super().on_header(name, value)

        def _refuse(self, status: int, kind: str, message: str) -> None:
            # Raising stops the parser: httptools reports it as a parser error, which uvicorn
            # answers through send_400_response, below, with this answer instead.
            self._limit = (status, kind, message)
            raise _LimitExceeded(message)

        def send_400_response(self, msg: str) -> None:
            status, kind, message = self._limit or (400, "invalid_request", MALFORMED)
            self._disarm_head_timer()  # this request is answered: no 408 for it as well
            self._draining = True  # parse nothing more on this connection
            answer = error_bytes(status, kind, message)
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete and not cycle.more_body:
                # Whole requests came before this one on the connection (pipelined) and are
                # not answered yet: HTTP/1.1 answers in order, so this waits for theirs.
                self._deferred = answer
                return
            self._answer_and_close(answer)

        def on_response_complete(self) -> None:
            super().on_response_complete()  # starts the next pipelined request, if any
            if self.pipeline:
                # uvicorn resumed reading: each read would parse a socket buffer's worth of
                # requests more into the queue than one answer took out of it.
                self.flow.pause_reading()
            done = self.cycle is None or self.cycle.response_complete
            if self._deferred is not None and done and not self.pipeline:
                answer, self._deferred = self._deferred, None
                self._answer_and_close(answer)

        def _answer_and_close(self, answer: bytes) -> None:
            if self.transport.is_closing():  # the answer before it closed the connection
                return
            self.transport.write(answer)
            # A lingering close: closing with the client's bytes unread would reset the
            # connection and could destroy the answer before the client reads it. Send FIN,
            # drop whatever still arrives, close for good after LINGER_S at most.
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)

        _draining = False

        def data_received(self, data: bytes) -> None:
            if not self._draining:
                super().data_received(data)

    return JsonHttpTools
