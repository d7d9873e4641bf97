"""The hand-off servers. ``HandoffServer``: consumers on the node connect to a Unix socket, are
checked, and receive the control block and slab FDs once. ``FabricHandoffServer``: consumers on
other nodes of a multi-node NVLink domain connect over TCP with the shared token and receive
FABRIC handles of the slabs and of the device control words instead. Later messages look up,
renew or release leases. docs/protocol.md is the reference, docs/security.md the threat model.

Authentication comes before anything of the pool is handed out or allocated. Until a connection
has authenticated it costs a socket and a buffer of at most ``MAX_HELLO_FRAME`` bytes:
- on the Unix socket the peer's uid/gid (SO_PEERCRED, from the kernel, not the peer) must be on
  the allowlist, checked at accept, before anything is read; the socket file is mode 0660;
- its first frame must be a ``hello`` of at most ``MAX_HELLO_FRAME`` bytes (a larger length ends
  the connection without reading the body), arriving within ``Limits.auth_timeout_s``;
- its token must match when one is set (always over TCP: a FABRIC handle maps the memory from
  anywhere in the domain), compared in constant time;
- at ``Limits.max_connections`` open connections a newcomer displaces the oldest
  unauthenticated one, or is refused when every connection is an attached consumer.
Only then does the pool attach the consumer and build its welcome (``FeaturePool.attach_consumer``;
its connection's end calls ``detach_consumer``). Every refusal is counted by reason
(``FeaturePool.note_refused``, exported as ``featpool_handoff_refused_total``).

One thread per server runs a selector loop over every connection: requests are tiny, and an idle
or silent peer costs no thread. Replies are written without blocking; a peer that does not read
its replies is not read from either, so it holds at most one reply. Messages are JSON: nothing is
ever unpickled. A malformed message ends only its own connection. Consumers never send FDs; any
that arrive are closed on receipt.
"""

from __future__ import annotations

import array
import errno
import hmac
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pool import socket_file
from pool.errors import HandoffError, PoolError, SocketInUse
from pool.featurepool import FeaturePool
from pool.leases import LeaseIds
from pool.protocol import (
    HEADER_SIZE,
    MAX_FRAME,
    MAX_HELLO_FRAME,
    PROTOCOL_VERSION,
    decode_body,
    encode_frame,
    frame_length,
    peer_credentials,
)

log = logging.getLogger(__name__)

_READ_CHUNK = 1 << 16  # bytes read per call once authenticated
_ANCILLARY = socket.CMSG_SPACE(16 * array.array("i").itemsize)  # room for stray FDs, closed
_ACCEPTS_PER_WAKE = 64  # then the loop serves the connections it has
_FD_LIMIT_PAUSE_S = 0.1  # the process is out of FDs: stop accepting for this long
_WAKE = object()  # the selector key of the loop's wake-up socket


@dataclass(frozen=True)
class Limits:
    """What a hand-off server allows around authentication (``--socket-auth-timeout-s``,
    ``--socket-max-connections``)."""

    auth_timeout_s: float = 5.0  # a connection must have sent an acceptable hello by then
    max_connections: int = 256  # open connections, attached consumers included

    def __post_init__(self) -> None:
        if not self.auth_timeout_s > 0:
            raise ValueError(f"auth_timeout_s must be positive, got {self.auth_timeout_s}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {self.max_connections}")


class _Refused(Exception):
    def __init__(self, reason: str, kind: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.kind, self.message = reason, kind, message


class _Conn:
    """One connection's state; only the loop thread touches it."""

    def __init__(self, sock: socket.socket, peer: dict[str, Any], deadline: float) -> None:
        self.sock = sock
        self.peer = peer  # who it is, as the kernel or the network says: for logs and attach
        self.deadline = deadline  # of authentication
        self.attached = False
        self.consumer: Any = None  # what attaching gave this connection, for detaching it
        self.open = True
        self.events = 0  # what the selector watches for
        self.inbuf = bytearray()
        self.out = b""  # the rest of the reply being sent
        self.out_fds: list[int] = []  # ours, to send with the first byte of ``out``, then close

    def __str__(self) -> str:
        described = " ".join(f"{k} {v}" for k, v in self.peer.items() if k != "transport")
        return described or "(not identified)"


class HandoffServer:
    kind = "unix"  # the ``server`` label of the refusal metric
    remote = False  # consumers on other nodes (counted apart)

    def __init__(
        self,
        pool: FeaturePool,
        path: str | os.PathLike[str],
        *,
        allowed_uids: Iterable[int] = (),
        allowed_gids: Iterable[int] = (),
        token: str | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.pool = pool
        self.path = Path(path)
        self.allowed_uids = set(allowed_uids) or {os.getuid()}
        self.allowed_gids = set(allowed_gids)
        self.token = token or None
        self.limits = limits or Limits()
        self._sock: socket.socket | None = None
        self._bound = False  # the socket file is ours to remove
        self._lock_fd = -1  # flock on ``<path>.lock``, held from before bind until after unlink
        self._sel: selectors.BaseSelector | None = None
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[_Conn] = set()
        self._pending: dict[_Conn, None] = {}  # not yet authenticated, oldest first
        self._accept_paused_until = 0.0
        self._closing = False

    @property
    def connections(self) -> int:
        """Open connections, authenticated or not."""
        return len(self._conns)

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._sock = self._listen()
        try:
            self._sock.setblocking(False)
            self._wake = socket.socketpair()
            self._wake[0].setblocking(False)
            self._sel = selectors.DefaultSelector()
            self._sel.register(self._sock, selectors.EVENT_READ, None)
            self._sel.register(self._wake[0], selectors.EVENT_READ, _WAKE)
        except BaseException:
            self._shutdown()
            self._cleanup()
            raise
        self._thread = threading.Thread(
            target=self._run, name=f"featpool-handoff-{self.kind}", daemon=True
        )
        self._thread.start()

    def _listen(self) -> socket.socket:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_path()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            why = socket_file.clear_dead_socket(self.path)  # a crashed server's leftover
            if why is not None:
                raise HandoffError(why)
            sock.bind(str(self.path))
            self._bound = True
            os.chmod(self.path, 0o660)
            sock.listen(socket.SOMAXCONN)  # a flood of connects must not fill the backlog
        except BaseException:
            sock.close()
            self._cleanup()
            raise
        log.info(
            "hand-off socket listening at %s (uids %s, gids %s, token %s, auth timeout %g s, "
            "at most %d connections)",
            self.path,
            sorted(self.allowed_uids),
            sorted(self.allowed_gids),
            "required" if self.token else "off",
            self.limits.auth_timeout_s,
            self.limits.max_connections,
        )
        return sock

    def _lock_path(self) -> None:
        """Take ``<path>.lock`` for as long as the socket file is ours (pool/socket_file.py
        says why): held from before bind until after the unlink in ``_cleanup``."""
        try:
            fd = socket_file.try_lock(self.path)
        except OSError as e:
            raise HandoffError(f"cannot take the socket's lock file: {e}") from e
        if fd is None:
            raise SocketInUse(
                f"another featpool server is serving {self.path} "
                f"(it holds {socket_file.lock_path(self.path)})"
            )
        self._lock_fd = fd

    def close(self) -> None:
        """Stop serving: every connection is closed (its consumer counted as gone)."""
        self._closing = True
        if self._thread is not None:
            wake = self._wake  # None once the loop has ended (closing, or a bug killed it)
            if wake is not None:
                try:
                    wake[1].send(b"\0")
                except OSError:  # the loop closed it meanwhile
                    pass
            self._thread.join(timeout=5)
            if self._thread.is_alive():
                log.error("the hand-off loop did not stop within 5 s")
            self._thread = None
        else:
            self._shutdown()
        self._cleanup()

    def _cleanup(self) -> None:
        if self._bound:  # never a socket file that another server bound
            self._bound = False
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        if self._lock_fd >= 0:  # only after the socket's unlink: the next server may bind
            socket_file.unlock(self.path, self._lock_fd)
            self._lock_fd = -1

    def _shutdown(self) -> None:
        """Close every connection, the listening socket and the loop's own (loop thread, or a
        server that never started)."""
        for c in list(self._conns):
            self._drop(c)
        if self._sel is not None:
            self._sel.close()
            self._sel = None
        for s in (self._sock, *(self._wake or ())):
            if s is not None:
                s.close()
        self._sock, self._wake = None, None

    # ---- the loop --------------------------------------------------------------------------

    def _run(self) -> None:
        assert self._sel is not None
        try:
            while not self._closing:
                for key, mask in self._sel.select(self._next_timeout()):
                    if key.data is None:
                        self._accept()
                    elif key.data is _WAKE:
                        self._drain_wake()
                    else:
                        self._ready(key.data, mask)
                self._expire()
        except Exception:  # a bug in the loop itself: nobody can attach any more; say so
            log.exception("the hand-off loop failed; the %s hand-off is down", self.kind)
        finally:
            self._shutdown()

    def _next_timeout(self) -> float | None:
        now = time.monotonic()
        waits = []
        if self._pending:
            waits.append(next(iter(self._pending)).deadline - now)
        if self._accept_paused_until:
            waits.append(self._accept_paused_until - now)
        return max(0.0, min(waits)) if waits else None

    def _expire(self) -> None:
        now = time.monotonic()
        while self._pending:
            c = next(iter(self._pending))
            if c.deadline > now:
                break
            timeout = self.limits.auth_timeout_s
            self._refuse(c, _Refused("auth_timeout", "auth_timeout", f"no hello in {timeout:g} s"))
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            if self._sel is not None and self._sock is not None:
                self._sel.register(self._sock, selectors.EVENT_READ, None)

    def _drain_wake(self) -> None:
        assert self._wake is not None
        try:
            self._wake[0].recv(64)
        except OSError:
            pass

    def _ready(self, c: _Conn, mask: int) -> None:
        try:
            if mask & selectors.EVENT_WRITE:
                self._flush(c)
                if c.open and not c.out:
                    self._pump(c)  # frames that arrived while the reply was going out
            if c.open and mask & selectors.EVENT_READ:
                self._read(c)
        except Exception:  # a bug must end this connection only, and say so in the log
            log.exception("hand-off connection %s failed", c)
            if c.open:
                self._refuse(c, _Refused("internal_error", "internal_error", "server error"))

    # ---- accepting -------------------------------------------------------------------------

    def _accept(self) -> None:
        assert self._sock is not None
        for _ in range(_ACCEPTS_PER_WAKE):
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # The peer waits in the backlog; retry once FDs may have been freed.
                    log.warning("hand-off cannot accept (%s); pausing %g s", e, _FD_LIMIT_PAUSE_S)
                    self.pool.note_refused(self.kind, "fd_limit")
                    assert self._sel is not None
                    self._sel.unregister(self._sock)
                    self._accept_paused_until = time.monotonic() + _FD_LIMIT_PAUSE_S
                    return
                if e.errno != errno.ECONNABORTED:
                    log.warning("hand-off accept failed: %s", e)
                    return
                continue
            self._take(sock)

    def _take(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        c = _Conn(sock, {}, time.monotonic() + self.limits.auth_timeout_s)
        try:
            c.peer = self._admit(sock)
        except _Refused as r:
            self._refuse(c, r)
            return
        except OSError as e:  # gone already (reset), or not a peer we can describe
            log.info("hand-off connection dropped at accept: %s", e)
            sock.close()
            return
        if len(self._conns) >= self.limits.max_connections:
            cap = self.limits.max_connections
            if not self._pending:
                self._refuse(
                    c,
                    _Refused(
                        "too_many_connections",
                        "too_many_connections",
                        f"{cap} consumers are attached, the limit of this hand-off server "
                        f"(--socket-max-connections)",
                    ),
                )
                return
            # Full, partly of connections that have not authenticated: the oldest of those makes
            # room, so silent connections cannot lock consumers out.
            self._refuse(
                next(iter(self._pending)),
                _Refused(
                    "evicted",
                    "too_many_connections",
                    f"the hand-off server is at its limit of {cap} connections and this one had "
                    f"not authenticated",
                ),
            )
        assert self._sel is not None
        self._conns.add(c)
        self._pending[c] = None
        self._watch(c, selectors.EVENT_READ)
        self._ready(c, selectors.EVENT_READ)  # a consumer's hello is often here already

    def _admit(self, sock: socket.socket) -> dict[str, Any]:
        """Who the peer is, if it may go on to authenticate; else raises _Refused."""
        pid, uid, gid = peer_credentials(sock)
        if uid not in self.allowed_uids and gid not in self.allowed_gids:
            message = f"uid {uid} / gid {gid} not allowed"
            raise _Refused("peer_not_allowed", "peer_rejected", message)
        return {"transport": "unix", "pid": pid, "uid": uid, "gid": gid}

    # ---- reading ---------------------------------------------------------------------------

    def _read(self, c: _Conn) -> None:
        # Before authentication nothing beyond one hello frame is read.
        want = _READ_CHUNK if c.attached else HEADER_SIZE + MAX_HELLO_FRAME - len(c.inbuf)
        if want <= 0:
            return
        try:
            # recvmsg, not recv: FDs a peer attaches are then ours to close, here, once.
            data, ancdata, _flags, _addr = c.sock.recvmsg(want, _ANCILLARY, socket.MSG_CMSG_CLOEXEC)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(c)
            return
        _close_received_fds(ancdata)
        if not data:
            self._drop(c)  # the peer closed
            return
        c.inbuf += data
        self._pump(c)

    def _pump(self, c: _Conn) -> None:
        """Handle the complete frames in the buffer, one reply at a time."""
        while c.open and not c.out and len(c.inbuf) >= HEADER_SIZE:
            try:
                length = frame_length(c.inbuf, MAX_FRAME if c.attached else MAX_HELLO_FRAME)
            except HandoffError as e:
                reason = "protocol_error" if c.attached else "hello_too_large"
                self._refuse(c, _Refused(reason, "protocol_error", str(e)))
                return
            if len(c.inbuf) < HEADER_SIZE + length:
                return
            body = bytes(c.inbuf[HEADER_SIZE : HEADER_SIZE + length])
            del c.inbuf[: HEADER_SIZE + length]
            try:
                msg = decode_body(body)
            except HandoffError as e:
                reason = "protocol_error" if c.attached else "bad_hello"
                self._refuse(c, _Refused(reason, "protocol_error", str(e)))
                return
            if c.attached:
                self._send(c, self._handle(msg))
            else:
                self._hello(c, msg)

    def _hello(self, c: _Conn, msg: dict[str, Any]) -> None:
        if msg["op"] != "hello":
            self._refuse(
                c, _Refused("bad_hello", "protocol_error", "the first message must be 'hello'")
            )
            return
        version = msg.get("version")
        if type(version) is not int or version != PROTOCOL_VERSION:  # 2.0 or true are not 2
            self._refuse(
                c,
                _Refused(
                    "bad_hello",
                    "protocol_error",
                    f"protocol version {msg.get('version')!r} unsupported; "
                    f"this server speaks {PROTOCOL_VERSION}",
                ),
            )
            return
        if not self._token_ok(msg.get("token")):
            self._refuse(c, _Refused("bad_token", "peer_rejected", "bad or missing token"))
            return
        try:
            welcome, fds = self._attach(c)
        except (PoolError, OSError) as e:  # remote consumers not enabled, an FD export that
            # failed, the process out of FDs: the peer is told, not dropped without a word
            log.error("hand-off welcome for %s failed: %s", c, e)
            kind = e.type if isinstance(e, PoolError) else "handoff_error"
            self._refuse(c, _Refused("welcome_failed", kind, str(e)))
            return
        del self._pending[c]
        c.attached = True
        log.info("consumer %s attached", c)
        self._send(c, welcome, fds)

    def _token_ok(self, given: object) -> bool:
        if self.token is None:
            return True
        # Compared as bytes: hmac.compare_digest refuses non-ASCII str (a peer could send one),
        # and JSON can carry lone surrogates ("\ud800"), which strict UTF-8 cannot encode.
        text = given if isinstance(given, str) else ""
        return hmac.compare_digest(text.encode("utf-8", "surrogatepass"), self.token.encode())

    # The attach seam: what an authenticated peer receives, and what its disconnect undoes.

    def _attach(self, c: _Conn) -> tuple[dict[str, Any], list[int]]:
        """The welcome and FDs (ours to close) for ``c``; counted before the welcome is sent,
        so a client that has it is counted."""
        attachment = self.pool.attach_consumer(str(c), fabric_handles=self.token is not None)
        c.consumer = attachment.consumer_id
        self.pool.note_consumer(+1, remote=self.remote)
        return attachment.welcome, attachment.fds

    def _detach(self, c: _Conn) -> None:
        if c.consumer:
            self.pool.detach_consumer(c.consumer)
        self.pool.note_consumer(-1, remote=self.remote)
        log.info("consumer %s detached", c)

    def _handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg["op"]
        lease_id = msg.get("lease_id")
        # Nothing a peer sent is echoed at length: an answer must fit a frame too.
        if op not in ("lookup", "release", "renew"):
            return _error("protocol_error", f"unknown op {op[:64]!r}")
        if not isinstance(lease_id, str) or not LeaseIds.valid(lease_id):
            return _error(
                "protocol_error", f"'{op}' needs a 'lease_id' of {2 * LeaseIds.SIZE} hex digits"
            )
        try:
            if op == "lookup":
                return {"op": "lease", "lease": self.pool.describe(self.pool.get(lease_id)).wire()}
            if op == "release":
                self.pool.release(lease_id)
                return {"op": "released", "lease_id": lease_id}
            ttl = msg.get("ttl_s")
            if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int | float)):
                return _error("protocol_error", "'ttl_s' must be a number")
            return {
                "op": "lease",
                "lease": self.pool.describe(self.pool.renew(lease_id, ttl)).wire(),
            }
        except PoolError as e:
            return _error(e.type, str(e))
        except ValueError as e:
            return _error("protocol_error", str(e))

    # ---- writing ---------------------------------------------------------------------------

    def _send(self, c: _Conn, msg: dict[str, Any], fds: list[int] | None = None) -> None:
        """Send ``msg`` (and ``fds``, which the server owns from here: each is closed once, after
        the kernel has copied it to the peer, or when the connection ends before that)."""
        c.out_fds = list(fds or ())
        try:
            c.out = encode_frame(msg)
        except BaseException:
            _close_all(c.out_fds)
            c.out_fds = []
            raise
        self._flush(c)

    def _flush(self, c: _Conn) -> None:
        try:
            if c.out_fds:  # with the first byte of the frame, as the protocol says
                rights = array.array("i", c.out_fds)
                sent = c.sock.sendmsg([c.out], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])
                fds, c.out_fds = c.out_fds, []
                _close_all(fds)  # the peer has its copies
            else:
                sent = c.sock.send(c.out)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._drop(c)
            return
        c.out = c.out[sent:]
        # While a reply waits for the peer to read, the peer is not read from either.
        self._watch(c, selectors.EVENT_WRITE if c.out else selectors.EVENT_READ)

    def _watch(self, c: _Conn, events: int) -> None:
        if c.events == events or self._sel is None:
            return
        if c.events:
            self._sel.modify(c.sock, events, c)
        else:
            self._sel.register(c.sock, events, c)
        c.events = events

    # ---- ending ----------------------------------------------------------------------------

    def _refuse(self, c: _Conn, r: _Refused) -> None:
        """Count, tell the peer why (best effort, never waiting for it), close."""
        self.pool.note_refused(self.kind, r.reason)
        quiet = r.reason in ("auth_timeout", "evicted", "too_many_connections")
        (log.info if quiet else log.warning)(
            "hand-off peer %s refused (%s): %s", c, r.reason, r.message
        )
        try:
            c.sock.send(encode_frame(_error(r.kind, r.message)))
            c.sock.shutdown(socket.SHUT_WR)
            # Unread input would make the kernel reset the connection (TCP), which can discard
            # the answer before the peer reads it: take what is already here, no more.
            c.sock.recv(_READ_CHUNK)
        except OSError:
            pass
        self._drop(c)

    def _drop(self, c: _Conn) -> None:
        if not c.open:
            return
        c.open = False
        self._conns.discard(c)
        self._pending.pop(c, None)
        if c.events and self._sel is not None:
            self._sel.unregister(c.sock)
        c.events = 0
        fds, c.out_fds = c.out_fds, []
        _close_all(fds)  # a welcome that never went out
        if c.attached:
            c.attached = False
            self._detach(c)
        c.sock.close()


class FabricHandoffServer(HandoffServer):
    """The hand-off for consumers on other nodes: TCP, token mandatory, FABRIC handles in the
    welcome (``FeaturePool.attach_consumer(remote=True)``), no FDs."""

    kind = "tcp"
    remote = True

    def __init__(
        self,
        pool: FeaturePool,
        host: str,
        port: int,
        *,
        token: str,
        limits: Limits | None = None,
    ) -> None:
        if not token:
            raise HandoffError(
                "a FABRIC hand-off over TCP needs a token (--socket-token): a FABRIC handle "
                "maps the pool's memory from any node of the NVLink domain"
            )
        # The path is a label here: _listen and _cleanup below never bind or unlink it.
        super().__init__(pool, Path(f"{host}:{port}"), token=token, limits=limits)
        self.host, self.port = host, port

    def _listen(self) -> socket.socket:
        sock = socket.create_server((self.host, self.port), backlog=socket.SOMAXCONN)
        self.port = sock.getsockname()[1]  # the port given may be 0 (any free port)
        log.info(
            "FABRIC hand-off listening on %s:%d (token required, auth timeout %g s, at most %d "
            "connections)",
            self.host,
            self.port,
            self.limits.auth_timeout_s,
            self.limits.max_connections,
        )
        return sock

    def _admit(self, sock: socket.socket) -> dict[str, Any]:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small request/replies
        host, port = sock.getpeername()[:2]
        return {"transport": "tcp", "address": f"{host}:{port}"}  # the token decides, on hello

    def _attach(self, c: _Conn) -> tuple[dict[str, Any], list[int]]:
        attachment = self.pool.attach_consumer(str(c), remote=True)
        c.consumer = attachment.consumer_id  # 0: no ack block, it acks in device words
        self.pool.note_consumer(+1, remote=True)
        return attachment.welcome, attachment.fds


def _close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _close_received_fds(ancdata: list[tuple[int, int, bytes]]) -> None:
    """Close every FD that arrived as SCM_RIGHTS: consumers send none, and an FD the server
    kept would be a leak a peer controls. (The kernel already dropped any that did not fit.)"""
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds = array.array("i")
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
            _close_all(fds)


def _error(kind: str, message: str) -> dict[str, Any]:
    return {"op": "error", "type": kind, "message": message}
