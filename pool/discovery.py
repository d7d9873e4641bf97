"""Finding the featpool of a GPU when several share one socket directory (one featpool per GPU,
several pods per node). docs/protocol.md ("Discovery") states the rule for consumers in any
language; this module is its Python side.

The rule: each running server writes an *entry* ``<socket file>.json`` beside its hand-off
socket, e.g. ``/run/featpool/fp-featpool-7d9c-x2k.sock.json``. An entry is one JSON object::

    {"featpool_index": 1, "socket": "fp-featpool-7d9c-x2k.sock", "gpu_uuid": "GPU-8a3c...",
     "device": "cuda", "transport": "cuda_vmm", "instance": "fp-featpool-7d9c-x2k",
     "pid": 1, "started_at": 1764750000.0, "http": "http://10.0.3.17:8000"}

``socket`` is a file name in the same directory (each pod may mount the directory elsewhere).
An entry is written to a temporary name and renamed into place, so a reader never sees half of
one, and it is removed when the server starts to drain. While its server lives, the server holds
an exclusive ``flock`` on it: an entry whose lock a reader can take was left by a process that
died (SIGKILL, OOM, node reboot) and is ignored. A lock, not a pid, because pods on one node
have their own pid namespaces; the kernel drops the lock with the process, however it ends.

A consumer asks for a GPU by UUID (``GPU-...`` as nvidia-smi and NVIDIA_VISIBLE_DEVICES write
it; torch's form without the prefix is accepted too) or by its own CUDA index, which is turned
into the UUID in the consumer's process (indices differ between processes and containers).
Several live entries for one GPU (a rolling update on a shared GPU) resolve to the newest.

Trust: whoever may write in the socket directory (its group, in the chart) can add an entry that
claims a GPU and points at a socket of its own, newer than the real one. A consumer that passes
``owner_uids`` (the service's uid, 10001 in the image) only counts entries whose file is owned by
one of them: the owner of a file is set by the kernel, not by its content.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pool.errors import HandoffError
from pool.socket_file import remove_dead_socket, same_file

log = logging.getLogger(__name__)

INDEX_VERSION = 1
SUFFIX = ".json"
DEFAULT_DIR = Path("/run/featpool")


class NoFeatpool(HandoffError):
    """No live featpool in the socket directory matches what was asked for."""


def normalize_uuid(value: str) -> str:
    """``GPU-<uuid>`` in lower case, from either form (nvidia-smi's or torch's)."""
    v = value.strip().lower()
    if v.startswith("gpu-"):
        v = v[4:]
    if not v:
        raise ValueError("empty GPU UUID")
    return "GPU-" + v


def cuda_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` as this process numbers its devices."""
    import torch

    if not torch.cuda.is_available() or not 0 <= index < torch.cuda.device_count():
        raise NoFeatpool(
            f"CUDA device {index} is not visible to this process "
            f"({torch.cuda.device_count()} visible); ask by gpu_uuid instead"
        )
    return normalize_uuid(str(torch.cuda.get_device_properties(index).uuid))


@dataclass(frozen=True)
class Entry:
    """One live featpool in a socket directory."""

    path: Path  # the entry file
    socket: Path  # the hand-off socket, resolved against the directory the entry is in
    gpu_uuid: str | None
    device: str
    transport: str
    instance: str
    pid: int
    started_at: float
    owner_uid: int = -1  # of the entry file, from the kernel
    http: str | None = None  # the server's HTTP API as processes on the node reach it

    @classmethod
    def parse(cls, path: Path, data: dict[str, Any], owner_uid: int = -1) -> Entry:
        name = data["socket"]
        if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
            raise ValueError(f"socket must be a file name, got {name!r}")
        uuid = data.get("gpu_uuid")
        if uuid is not None and not isinstance(uuid, str):
            raise ValueError(f"gpu_uuid must be a string, got {uuid!r}")
        return cls(
            path=path,
            socket=path.parent / name,
            gpu_uuid=normalize_uuid(uuid) if uuid else None,
            device=str(data.get("device", "")),
            transport=str(data.get("transport", "")),
            instance=str(data.get("instance", "")),
            pid=int(data.get("pid", 0)),
            started_at=float(data["started_at"]),
            owner_uid=owner_uid,
            http=data["http"] if isinstance(data.get("http"), str) else None,
        )


# ---- the server's side ----------------------------------------------------------------------


class Publication:
    """The entry of one server: written (atomically) by ``publish``, removed by ``close``."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def close(self) -> None:
        """Remove the entry (new consumers stop finding this server), then drop the lock."""
        if self._fd is None:
            return
        try:
            if same_file(self.path, self._fd):
                self.path.unlink()
        except FileNotFoundError:
            pass
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> Publication:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def entry_path(socket_path: Path) -> Path:
    return socket_path.with_name(socket_path.name + SUFFIX)


def publish(
    socket_path: Path,
    *,
    gpu_uuid: str | None,
    device: str,
    transport: str,
    instance: str | None = None,
    http: str | None = None,
) -> Publication:
    """Write this server's entry beside ``socket_path`` and hold its lock until ``close``.

    The file is created under a temporary name, locked, filled, flushed and renamed over the
    final name: readers see no entry or a whole one, and never an unlocked live one. Mode 0640
    (the socket directory's group reads it, like the socket). Stale entries of dead servers in
    the directory are removed on the way."""
    directory = socket_path.parent
    final = entry_path(socket_path)
    collect_stale(directory, keep=final)
    body = {
        "featpool_index": INDEX_VERSION,
        "socket": socket_path.name,
        "gpu_uuid": normalize_uuid(gpu_uuid) if gpu_uuid else None,
        "device": device,
        "transport": transport,
        "instance": instance or socket_path.stem,
        "pid": os.getpid(),
        "started_at": time.time(),
    }
    if http is not None:
        body["http"] = http
    tmp = directory / f".{final.name}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o640)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, json.dumps(body, indent=1).encode() + b"\n")
        os.fsync(fd)
        os.rename(tmp, final)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    log.info("published %s (gpu %s)", final, body["gpu_uuid"] or "none")
    return Publication(final, fd)


def collect_stale(directory: Path, *, keep: Path | None = None) -> list[Path]:
    """Remove entries (and their sockets, when nobody listens there) left by dead servers.

    An entry is stale when its lock can be taken. It is renamed aside before it is removed, and
    put back if what was renamed turns out to be another (live) file that replaced it meanwhile,
    so a server restarting under the same name at that instant keeps its entry."""
    removed: list[Path] = []
    for path in _candidates(directory):
        if path == keep:
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if not _try_lock(fd, fcntl.LOCK_SH):
                continue  # alive
            data = _read_entry(fd)
            aside = path.with_name(f".{path.name}.{os.getpid()}.stale")
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                continue
            if os.stat(aside).st_ino != os.fstat(fd).st_ino:
                os.rename(aside, path)  # a live entry took the name: give it back
                continue
            aside.unlink()
            removed.append(path)
            name = data.get("socket") if data else None
            if isinstance(name, str) and "/" not in name and name:
                remove_dead_socket(directory / name)
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d stale featpool entries in %s", len(removed), directory)
    return removed


# ---- the consumer's side --------------------------------------------------------------------


def socket_dir(directory: str | os.PathLike[str] | None = None) -> Path:
    """The directory to search: the argument, else ``$FEATPOOL_SOCKET_DIR``, else
    ``/run/featpool`` (the chart's mount path)."""
    if directory is not None:
        return Path(directory)
    env = os.environ.get("FEATPOOL_SOCKET_DIR")
    return Path(env) if env else DEFAULT_DIR


def entries(
    directory: str | os.PathLike[str] | None = None, *, owner_uids: Iterable[int] | None = None
) -> list[Entry]:
    """The live featpools in the directory, newest first. Stale and unreadable entries are
    skipped (and logged at debug level), and with ``owner_uids`` those whose file another uid
    owns; this never writes."""
    trusted = None if owner_uids is None else set(owner_uids)
    found: list[Entry] = []
    for path in _candidates(socket_dir(directory)):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if _try_lock(fd, fcntl.LOCK_SH):
                log.debug("skipping %s: its server is gone", path)
                continue
            owner = os.fstat(fd).st_uid
            if trusted is not None and owner not in trusted:
                log.warning("ignoring %s: owned by uid %d, not one of %s", path, owner, trusted)
                continue
            data = _read_entry(fd)
            if data is None:
                continue
            found.append(Entry.parse(path, data, owner))
        except (KeyError, TypeError, ValueError) as e:
            log.debug("skipping %s: %s", path, e)
        finally:
            os.close(fd)
    found.sort(key=lambda e: e.started_at, reverse=True)
    return found


def find(
    directory: str | os.PathLike[str] | None = None,
    *,
    gpu_uuid: str | None = None,
    cuda_index: int | None = None,
    owner_uids: Iterable[int] | None = None,
) -> Entry:
    """The featpool serving a GPU: by ``gpu_uuid``, or by this process's CUDA device
    ``cuda_index``; with neither, the only featpool in the directory. The newest wins when
    several serve the same GPU. ``owner_uids``: only entries written by these uids count (see
    the module's note on trust). Raises NoFeatpool saying what is there instead."""
    if gpu_uuid is not None and cuda_index is not None:
        raise ValueError("ask by gpu_uuid or by cuda_index, not both")
    want = cuda_uuid(cuda_index) if cuda_index is not None else gpu_uuid
    d = socket_dir(directory)
    live = entries(d, owner_uids=owner_uids)
    if want is None:
        if len({e.gpu_uuid for e in live}) == 1:
            return live[0]
        what = "no featpool" if not live else f"{len(live)} featpools of different GPUs"
        raise NoFeatpool(f"{what} in {d}; ask by gpu_uuid or cuda_index")
    uuid = normalize_uuid(want)
    for e in live:
        if e.gpu_uuid == uuid:
            return e
    there = ", ".join(f"{e.instance} ({e.gpu_uuid})" for e in live) or "none"
    raise NoFeatpool(f"no live featpool for {uuid} in {d}; live there: {there}")


# ---- helpers ----------------------------------------------------------------------------------


def _candidates(directory: Path) -> Iterator[Path]:
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return
    for name in names:
        if name.endswith(SUFFIX) and not name.startswith("."):
            yield directory / name


def _try_lock(fd: int, kind: int) -> bool:
    """Take the lock without waiting; True when taken (then the writer is gone)."""
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _read_entry(fd: int) -> dict[str, Any] | None:
    raw = os.pread(fd, 1 << 16, 0)
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("featpool_index") != INDEX_VERSION:
        return None
    return data
