"""Wire format of the hand-off socket: length-prefixed JSON messages, file descriptors passed
alongside with SCM_RIGHTS. Nothing is ever unpickled. docs/protocol.md is the reference.

A frame is a 4-byte big-endian unsigned length, then that many bytes of UTF-8 JSON (an object).
FDs, when a message carries any, arrive with the first bytes of the frame. Before a connection
has authenticated (its ``hello``), a frame is at most ``MAX_HELLO_FRAME`` bytes; after, at most
``MAX_FRAME``.
"""

from __future__ import annotations

import array
import json
import socket
import struct
from typing import Any

from pool.errors import HandoffError

PROTOCOL_VERSION = 2
MAX_FRAME = 1 << 20  # a message is a small JSON object; anything larger is an attack or a bug
MAX_HELLO_FRAME = 4096  # before authentication: a hello is a few dozen bytes plus the token
MAX_FDS = 250  # below the kernel's SCM_MAX_FD (253)
_LEN = struct.Struct(">I")
HEADER_SIZE = _LEN.size


def parse_host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host in brackets: ``[::1]:7070``) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, e.g. 0.0.0.0:7070, got {text!r}")
    return host.strip("[]"), int(port)


def encode_frame(msg: dict[str, Any]) -> bytes:
    body = json.dumps(msg, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise HandoffError(f"message of {len(body)} bytes exceeds {MAX_FRAME}")
    return _LEN.pack(len(body)) + body


def frame_length(head: bytes | bytearray, limit: int = MAX_FRAME) -> int:
    """The body length a 4-byte frame header announces; HandoffError if above ``limit``."""
    (length,) = _LEN.unpack_from(head)
    if length > limit:
        raise HandoffError(f"frame of {length} bytes exceeds {limit}")
    return int(length)


def decode_body(body: bytes | bytearray) -> dict[str, Any]:
    """A frame's body as a message; HandoffError if it is not a JSON object with a string op."""
    try:
        # UTF-8 only (json.loads would guess UTF-16 or UTF-32 from bytes), no NaN or Infinity
        msg = json.loads(bytes(body).decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise HandoffError(f"frame is not JSON: {e}") from None
    except RecursionError:  # "[[[[..." a megabyte deep
        raise HandoffError("frame is nested too deeply") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise HandoffError("a message must be a JSON object with a string 'op'")
    return msg


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def send_msg(sock: socket.socket, msg: dict[str, Any], fds: list[int] | None = None) -> None:
    data = encode_frame(msg)
    if fds:
        if len(fds) > MAX_FDS:
            raise HandoffError(f"{len(fds)} FDs exceed {MAX_FDS} per message")
        sent = socket.send_fds(sock, [data], fds)
        data = data[sent:]
    if data:
        sock.sendall(data)


def recv_msg(sock: socket.socket, *, want_fds: bool = False) -> tuple[dict[str, Any], list[int]]:
    """Read one frame. Raises ConnectionError on EOF, HandoffError on a malformed frame."""
    fds: list[int] = []
    if want_fds:
        head, got, flags, _addr = socket.recv_fds(sock, _LEN.size, MAX_FDS, socket.MSG_CMSG_CLOEXEC)
        fds = list(got)
        if flags & socket.MSG_CTRUNC:  # the kernel closed what did not fit: the set is broken
            for fd in fds:
                _close_quietly(fd)
            raise HandoffError(f"FDs were lost in transit (more than {MAX_FDS} sent)")
    else:
        head = sock.recv(_LEN.size)
    try:
        if not head:
            raise ConnectionError("peer closed the connection")
        head += _recv_exact(sock, _LEN.size - len(head))
        body = _recv_exact(sock, frame_length(head))
        return decode_body(body), fds
    except BaseException:
        for fd in fds:
            _close_quietly(fd)
        raise


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the connection mid-frame")
        buf += chunk
    return bytes(buf)


def _close_quietly(fd: int) -> None:
    import os

    try:
        os.close(fd)
    except OSError:
        pass


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket (SO_PEERCRED)."""
    fmt = array.array("i", [0, 0, 0])
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, fmt.itemsize * 3)
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid
