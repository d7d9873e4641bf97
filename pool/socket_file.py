"""Who may remove a hand-off socket file: only a process holding ``<socket>.lock``.

A Unix socket's name outlives its server when the server dies, so a starting server, and
discovery's clean-up of dead entries, remove a socket file that nobody listens on. "Nobody
listens" is seen by a refused connect, which a server also gives between its ``bind`` and its
``listen``; without a lock, a clean-up at that instant removes a live server's fresh socket and
leaves it listening on a name nobody can reach. So the server holds an exclusive ``flock`` on
``<socket>.lock`` from before it binds until after it unlinks its socket, and anyone else
removes a socket file only while holding that lock. The kernel drops the lock with the process,
however it ends. Whoever releases the lock removes the lock file while holding it; a lock taken
on a file that is no longer at its name is therefore dropped and taken anew (``same_file``).
"""

from __future__ import annotations

import fcntl
import os
import socket
import stat
from pathlib import Path


def lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def same_file(path: Path, fd: int) -> bool:
    """True while ``path`` still names the file open at ``fd`` (not removed, not replaced)."""
    try:
        named, held = os.stat(path, follow_symlinks=False), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def try_lock(path: Path) -> int | None:
    """Take ``<path>.lock`` without waiting: its fd, or None while another process holds it.
    OSError when the lock file cannot be opened (permissions, a symlink in its place)."""
    lock = lock_path(path)
    for _ in range(100):  # each retry means a holder released the lock meanwhile
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            ours = same_file(lock, fd)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        if ours:
            return fd
        os.close(fd)
    raise OSError(f"could not take {lock}: its holders keep releasing and retaking it")


def served(path: Path) -> bool:
    """Whether a live server holds ``<path>.lock`` now (a check before starting one, for a
    clear message; the start itself takes the lock and is what decides)."""
    if not path.parent.is_dir():
        return False
    try:
        fd = try_lock(path)
    except OSError:  # not ours to judge: the start reports it
        return False
    if fd is None:
        return True
    unlock(path, fd)
    return False


def unlock(path: Path, fd: int) -> None:
    """Release a lock taken by ``try_lock``; its file is removed while still held."""
    try:
        lock_path(path).unlink()
    except FileNotFoundError:
        pass
    os.close(fd)


def clear_dead_socket(path: Path) -> str | None:
    """With ``<path>.lock`` held: remove ``path`` if it is a socket nobody listens on (a
    leftover of a dead server). None when the name is free now, else why it is not."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISSOCK(mode):
        return f"{path} exists and is not a socket; refusing to replace it"
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink(missing_ok=True)  # nobody listens
        return None
    finally:
        probe.close()
    return f"another featpool server is listening on {path}"


def remove_dead_socket(path: Path) -> None:
    """Remove ``path`` if it is a socket nobody listens on, unless a server holds its lock
    (one between its bind and its listen does)."""
    try:
        fd = try_lock(path)
    except OSError:
        return  # not ours to lock (another owner's directory): leave it
    if fd is None:
        return
    try:
        clear_dead_socket(path)
    finally:
        unlock(path, fd)
