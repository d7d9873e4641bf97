"""Content-addressed features: which leases already hold the features of which image bytes.

The feature hash of an image is ``SHA-256(identity || SHA-256(bytes))``, where ``identity`` is the
SHA-256 of the encoder's identity (model name, weights path, preprocessing: size, mean, std,
output shape; the dtype and pooling of the published tensor). Equal hashes mean equal features,
so a repeat upload, or a lookup by hash or by a client-supplied id, can get a lease on the
features already in the pool instead of another forward pass.

Scope. Every entry is kept under the scope of the API key that made it (``scope_of``): a lookup
only sees its own scope, so one tenant cannot get (or learn of) another's features by computing
the hash of an image it guesses the other uploaded. Without API keys there is one scope.

Residency. The index holds lease ids, never memory: an entry is as alive as the leases it names
(the lease that first carried the features, and the leases that hits received since). When all
of them have ended (acked, deleted, expired) the entry is dropped on its next lookup and counted
as an eviction with reason ``ended``.

Bound. At most ``max_entries`` entries (and as many client ids); the least recently used entry
(looked up, hit or stored) goes first, counted with reason ``capacity``. Dropping an entry
forgets it; its leases live on for their holders. An entry remembers at most
``MAX_LEASES_PER_ENTRY`` leases: past that, the ended ones and then those that end first are
forgotten, so that the entry stays as long as the longest-lived lease it had (an encode with a
long TTL followed by many short hits keeps the first).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from app.errors import ApiError
from app.imaging import ImageData

ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
HASH_PATTERN = re.compile(r"^[0-9a-f]{64}$")
MAX_LEASES_PER_ENTRY = 8  # leases remembered per entry: enough to outlive a few acks


def scope_of(api_key: str | None) -> str:
    """The cache scope of a caller: a digest of the API key it presented ("" without keys)."""
    if not api_key:
        return ""
    return hashlib.sha256(b"featpool-scope\0" + api_key.encode()).hexdigest()


def identity_digest(identity: dict[str, Any]) -> bytes:
    """The digest of an encoder identity (a JSON-able dict; key order does not matter)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).digest()


def content_digest(data: ImageData) -> bytes:
    """SHA-256 of an image's bytes. The entrance computes it with the image's header, on its
    inspector threads (``app.routes._inspect_all``), so neither its event loop nor the one GPU
    process hashes the image: behind fronts the GPU process hashes 64 bytes per image."""
    return hashlib.sha256(data).digest()


def feature_hash(identity: bytes, content: bytes) -> str:
    """The full-width (256-bit) hex hash of the features of the image whose
    ``content_digest`` is ``content``, under ``identity``."""
    return hashlib.sha256(identity + content).hexdigest()


def check_id(client_id: str) -> str:
    if not ID_PATTERN.match(client_id):
        raise ApiError(
            "validation_error",
            f"id {client_id[:40]!r} must be 1-128 characters of letters, digits and ._:- "
            "starting with a letter or digit",
        )
    return client_id


@dataclass
class Entry:
    shape: tuple[int, ...]
    dtype: str
    lease_ids: list[str] = field(default_factory=list)  # newest first
    ids: set[str] = field(default_factory=set)  # client ids that name it


class FeatureIndex:
    """The bounded LRU index. Thread-safe; it never touches the pool itself: callers say which
    leases are alive (``alive``) and hand it the leases they made."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, str], Entry] = OrderedDict()
        self._ids: OrderedDict[tuple[str, str], str] = OrderedDict()  # (scope, id) -> hash
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions: dict[str, int] = {"capacity": 0, "ended": 0}

    def __len__(self) -> int:
        return len(self._entries)

    def resolve(self, scope: str, ref: str) -> str | None:
        """A hash from a hash or a client id (in this scope); None if unknown."""
        with self._lock:
            if HASH_PATTERN.match(ref) and (scope, ref) in self._entries:
                return ref
            return self._ids.get((scope, ref))

    def candidates(self, scope: str, digest: str) -> tuple[Entry | None, list[str]]:
        """The entry for ``digest`` and its lease ids to try, newest first (LRU touch)."""
        with self._lock:
            entry = self._entries.get((scope, digest))
            if entry is None:
                return None, []
            self._entries.move_to_end((scope, digest))
            return entry, list(entry.lease_ids)

    def forget_lease(self, scope: str, digest: str, lease_id: str) -> None:
        """A lease of the entry has ended; the entry goes with its last one."""
        with self._lock:
            entry = self._entries.get((scope, digest))
            if entry is None:
                return
            if lease_id in entry.lease_ids:
                entry.lease_ids.remove(lease_id)
            if not entry.lease_ids:
                self._drop(scope, digest, "ended")

    def check_id(self, scope: str, client_id: str, digest: str) -> None:
        """409 if ``client_id`` already names other features that are still indexed (checked
        before any work; ``add`` checks again, for a request with the same id that finished
        meanwhile)."""
        with self._lock:
            self._check_id_locked(scope, client_id, digest)

    def _check_id_locked(self, scope: str, client_id: str, digest: str) -> None:
        bound = self._ids.get((scope, client_id))
        if bound is not None and bound != digest and (scope, bound) in self._entries:
            raise ApiError(
                "id_conflict",
                f"id {client_id!r} already names other features (hash {bound}); "
                "use a new id or release those leases first",
            )

    def add(
        self,
        scope: str,
        digest: str,
        lease_id: str,
        *,
        shape: tuple[int, ...],
        dtype: str,
        deadline: Callable[[str], float | None],
        client_id: str | None = None,
    ) -> None:
        """Index ``lease_id`` as holding ``digest``'s features. ``deadline`` tells a lease's
        deadline (None once ended), to choose which leases to forget past the cap."""
        with self._lock:
            if client_id is not None:  # two requests naming other images with one id at once
                self._check_id_locked(scope, client_id, digest)
            key = (scope, digest)
            entry = self._entries.get(key)
            if entry is None or entry.shape != shape or entry.dtype != dtype:
                entry = self._entries[key] = Entry(shape, dtype)
            entry.lease_ids.insert(0, lease_id)
            if len(entry.lease_ids) > MAX_LEASES_PER_ENTRY:
                ends = {i: t for i in entry.lease_ids if (t := deadline(i)) is not None}
                keep = sorted(ends, key=ends.__getitem__)[-MAX_LEASES_PER_ENTRY:]
                entry.lease_ids = [i for i in entry.lease_ids if i in keep]  # newest first
            self._entries.move_to_end(key)
            if client_id is not None:
                self._ids[(scope, client_id)] = digest
                self._ids.move_to_end((scope, client_id))
                entry.ids.add(client_id)
            while len(self._entries) > self.max_entries:
                (s, d), _ = next(iter(self._entries.items()))
                self._drop(s, d, "capacity")
            while len(self._ids) > self.max_entries:
                self._ids.popitem(last=False)

    def _drop(self, scope: str, digest: str, reason: str) -> None:
        entry = self._entries.pop((scope, digest))
        self.evictions[reason] += 1
        for client_id in entry.ids:
            if self._ids.get((scope, client_id)) == digest:
                del self._ids[(scope, client_id)]

    def count(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self.hits += 1
            else:
                self.misses += 1

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "entries": len(self._entries),
                "max_entries": self.max_entries,
                "hits": self.hits,
                "misses": self.misses,
                "evictions": dict(self.evictions),
            }
