"""The hand-off servers. ``HandoffServer``: consumers on the node connect to a Unix socket, are
checked, and receive the control block and slab FDs once. ``FabricHandoffServer``: consumers on
other nodes of a multi-node NVLink domain connect over TCP with the shared token and receive
FABRIC handles of the slabs and of the device control words instead. Later messages look up,
renew or release leases.

Security: on the Unix socket the peer's uid/gid (SO_PEERCRED, from the kernel, not the peer)
must be on the allowlist, an optional shared token must match, and the socket file is mode
0660. Over TCP the token is mandatory (a FABRIC handle maps the memory from anywhere in the
domain); bind it to the cluster's private network. Messages are JSON: nothing is ever
unpickled. Each connection has its own thread; a malformed message ends only that connection.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import stat
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from pool.errors import HandoffError, PoolError
from pool.featurepool import Attachment, FeaturePool, epoch_hex
from pool.protocol import PROTOCOL_VERSION, peer_credentials, recv_msg, send_msg

log = logging.getLogger(__name__)


class HandoffServer:
    def __init__(
        self,
        pool: FeaturePool,
        path: str | os.PathLike[str],
        *,
        allowed_uids: Iterable[int] = (),
        allowed_gids: Iterable[int] = (),
        token: str | None = None,
        extra_welcome: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.pool = pool
        self.path = Path(path)
        self.allowed_uids = set(allowed_uids) or {os.getuid()}
        self.allowed_gids = set(allowed_gids)
        self.token = token
        self.extra_welcome = extra_welcome
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closing = False

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._sock = self._listen()
        self._thread = threading.Thread(
            target=self._accept_loop, name="featpool-handoff", daemon=True
        )
        self._thread.start()

    def _listen(self) -> socket.socket:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._remove_stale_socket()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(self.path))
            os.chmod(self.path, 0o660)
            sock.listen(64)
        except BaseException:
            sock.close()
            raise
        log.info(
            "hand-off socket listening at %s (uids %s, gids %s, token %s)",
            self.path,
            sorted(self.allowed_uids),
            sorted(self.allowed_gids),
            "required" if self.token else "off",
        )
        return sock

    def _remove_stale_socket(self) -> None:
        try:
            mode = self.path.lstat().st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise HandoffError(f"{self.path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(self.path))
        except OSError:
            self.path.unlink()  # nobody listens: a leftover of a crashed server
            return
        finally:
            probe.close()
        raise HandoffError(f"another featpool server is listening on {self.path}")

    def close(self) -> None:
        self._closing = True
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._cleanup()

    def _cleanup(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    # ---- connections -----------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._closing:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                break
            threading.Thread(
                target=self._serve, args=(conn,), name="featpool-consumer", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        attached = False
        attachment: Attachment | None = None
        with self._lock:
            self._conns.add(conn)
        try:
            peer = self._admit(conn)
            if peer is None:
                return
            msg, _ = recv_msg(conn)
            if msg["op"] != "hello":
                send_msg(conn, _error("protocol_error", "the first message must be 'hello'"))
                return
            if msg.get("version") != PROTOCOL_VERSION:
                send_msg(
                    conn,
                    _error(
                        "protocol_error",
                        f"protocol version {msg.get('version')!r} unsupported; "
                        f"this server speaks {PROTOCOL_VERSION}",
                    ),
                )
                return
            # Compared as bytes: compare_digest refuses non-ASCII str (a peer could send one).
            given = str(msg.get("token", "")).encode()
            if self.token and not hmac.compare_digest(given, self.token.encode()):
                log.warning("hand-off peer %s: bad token", peer)
                send_msg(conn, _error("peer_rejected", "bad or missing token"))
                return
            attachment = self._welcome(peer)
            with self._lock:  # counted before the welcome, so a client that has it is counted
                self._count(+1)
            attached = True
            try:
                send_msg(conn, attachment.welcome, attachment.fds)
            finally:
                attachment.close_fds()  # the kernel made the consumer's copies: ours go
            log.info("consumer %s attached", peer)
            while True:
                msg, _ = recv_msg(conn)
                send_msg(conn, self._handle(msg))
        except ConnectionError:
            pass
        except HandoffError as e:
            try:
                send_msg(conn, _error("protocol_error", str(e)))
            except OSError:
                pass
        except OSError as e:
            if not self._closing:
                log.info("hand-off connection ended: %s", e)
        except Exception:  # a bug must end this connection only, and say so in the log
            log.exception("hand-off connection failed")
        finally:
            if attachment is not None and attachment.consumer_id:
                self.pool.detach_consumer(attachment.consumer_id)
            if attached:
                with self._lock:
                    self._count(-1)
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _admit(self, conn: socket.socket) -> str | None:
        """The peer, described for the log, if it may go on; else tell it why and None."""
        pid, uid, gid = peer_credentials(conn)
        if uid not in self.allowed_uids and gid not in self.allowed_gids:
            log.warning("hand-off peer pid %d uid %d gid %d rejected", pid, uid, gid)
            send_msg(conn, _error("peer_rejected", f"uid {uid} / gid {gid} not allowed"))
            return None
        return f"pid {pid} uid {uid}"

    def _count(self, delta: int) -> None:
        self.pool.consumers_attached += delta

    def _welcome(self, peer: str) -> Attachment:
        """The pool's attachment for this consumer (its own ack block, read-only FDs of the
        control block and host slabs), plus ``extra_welcome``."""
        attachment = self.pool.attach_consumer(peer)
        if self.extra_welcome is not None:
            attachment.welcome.update(self.extra_welcome())
        return attachment

    def _handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg["op"]
        lease_id = msg.get("lease_id")
        if op not in ("lookup", "release", "renew"):
            return _error("protocol_error", f"unknown op {op!r}")
        if not isinstance(lease_id, str):
            return _error("protocol_error", f"'{op}' needs a string 'lease_id'")
        try:
            if op == "lookup":
                return {"op": "lease", "lease": self.pool.describe(self.pool.get(lease_id)).wire()}
            if op == "release":
                self.pool.release(lease_id)
                return {"op": "released", "lease_id": lease_id}
            ttl = msg.get("ttl_s")
            if ttl is not None and not isinstance(ttl, int | float):
                return _error("protocol_error", "'ttl_s' must be a number")
            return {
                "op": "lease",
                "lease": self.pool.describe(self.pool.renew(lease_id, ttl)).wire(),
            }
        except PoolError as e:
            return _error(e.type, str(e))
        except ValueError as e:
            return _error("protocol_error", str(e))


class FabricHandoffServer(HandoffServer):
    """The hand-off for consumers on other nodes: TCP, token mandatory, FABRIC handles in the
    welcome (``welcome``: the GPU tier's ``remote_welcome``), no FDs."""

    def __init__(
        self,
        pool: FeaturePool,
        host: str,
        port: int,
        *,
        token: str,
        welcome: Callable[[], dict[str, Any]],
    ) -> None:
        if not token:
            raise HandoffError(
                "a FABRIC hand-off over TCP needs a token (--socket-token): a FABRIC handle "
                "maps the pool's memory from any node of the NVLink domain"
            )
        # The path is a label here: _listen, _cleanup below never bind or unlink it.
        super().__init__(pool, Path(f"{host}:{port}"), token=token, extra_welcome=welcome)
        self.host, self.port = host, port

    def _listen(self) -> socket.socket:
        sock = socket.create_server((self.host, self.port), backlog=64)
        self.port = sock.getsockname()[1]  # the port given may be 0 (any free port)
        log.info("FABRIC hand-off listening on %s:%d (token required)", self.host, self.port)
        return sock

    def _admit(self, conn: socket.socket) -> str | None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small request/replies
        host, port = conn.getpeername()[:2]
        return f"{host}:{port}"  # the token decides, checked on hello

    def _count(self, delta: int) -> None:
        self.pool.consumers_attached += delta
        self.pool.remote_consumers_attached += delta

    def _welcome(self, peer: str) -> Attachment:
        assert self.extra_welcome is not None
        msg: dict[str, Any] = {
            "op": "welcome",
            "version": PROTOCOL_VERSION,
            "epoch": epoch_hex(self.pool.epoch),
            "remote": True,
            **self.extra_welcome(),
        }
        return Attachment(0, msg)

    def _cleanup(self) -> None:
        pass


def _error(kind: str, message: str) -> dict[str, Any]:
    return {"op": "error", "type": kind, "message": message}
