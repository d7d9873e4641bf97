"""Admission at the entrance, and the bounded thread pools that header parsing and decoding run
on. No torch here: front processes use both.

An encode request takes a ``Permit`` before any work is spent on it (as TEI's
``try_acquire_permit``): first for its images, before any header is parsed; then, once the
headers are parsed (off the event loop), for the bytes its images decode to. When either bound
is reached the request is answered 429 with Retry-After at once. The permit is given back when
the request's work ends, whichever way it ends (success, error, the client hanging up).

Everything here runs on the event loop (one thread), except the done-callbacks of
``BoundedExecutor``, which take its lock.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import TypeVar

from fastapi import FastAPI

from app.errors import RETRY_AFTER, ApiError
from app.settings import Settings

T = TypeVar("T")


class Admission:
    """Bounds on the images and on the decoded bytes of the requests in flight."""

    def __init__(self, max_images: int, max_bytes: int) -> None:
        self.max_images = max_images
        self.max_bytes = max_bytes
        self.images = 0  # held by permits now
        self.bytes = 0

    def try_acquire(self, images: int, nbytes: int = 0) -> Permit:
        """A permit for ``images`` images (and ``nbytes`` decoded bytes), or ApiError: 429 when
        other requests hold the room, 413 when this request could never fit."""
        if images > self.max_images:
            raise ApiError(
                "too_many_images",
                f"{images} images in one request; at most {self.max_images} are admitted at once",
            )
        if self.images + images > self.max_images:
            raise ApiError(
                "queue_full",
                f"{self.images} images are in flight (limit {self.max_images}); retry shortly",
                headers=RETRY_AFTER,
            )
        permit = Permit(self)
        self.images += images
        permit.images = images
        try:
            permit.grow(nbytes)
        except BaseException:
            permit.release()
            raise
        return permit


class Permit:
    """What one request holds; ``release`` is idempotent. Use it as a context manager."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self.images = 0
        self.bytes = 0
        self.released = False

    def grow(self, nbytes: int) -> None:
        """Add decoded bytes, known once the headers are parsed."""
        a = self._admission
        if nbytes <= 0:
            return
        if self.bytes + nbytes > a.max_bytes:
            raise ApiError(
                "image_too_large",
                f"the request's images decode to {self.bytes + nbytes} bytes; at most "
                f"{a.max_bytes} are admitted at once (--max-inflight-decoded-bytes)",
            )
        if a.bytes + nbytes > a.max_bytes:
            raise ApiError(
                "queue_full",
                f"images of {a.bytes} decoded bytes are in flight (limit {a.max_bytes}); "
                "retry shortly",
                headers=RETRY_AFTER,
            )
        a.bytes += nbytes
        self.bytes += nbytes

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self._admission.images -= self.images
        self._admission.bytes -= self.bytes

    def __enter__(self) -> Permit:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class BoundedExecutor:
    """A thread pool whose queue is bounded: at most ``max_pending`` calls submitted and not
    yet finished, beyond which ``run`` answers 429 at once. A call counts until its thread is
    done with it, even if its caller went away (a thread cannot be interrupted)."""

    def __init__(self, workers: int, max_pending: int, name: str) -> None:
        self.max_pending = max_pending
        self.pending = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=name)
        self._name = name

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        with self._lock:
            if self.pending >= self.max_pending:
                raise ApiError(
                    "queue_full",
                    f"{self.pending} calls wait for the {self._name} threads "
                    f"(limit {self.max_pending}); retry shortly",
                    headers=RETRY_AFTER,
                )
            self.pending += 1
        try:
            fut: Future[T] = self._pool.submit(fn, *args)
        except BaseException:
            self._done()
            raise
        fut.add_done_callback(lambda _: self._done())
        return await asyncio.wrap_future(fut)

    def _done(self) -> None:
        with self._lock:
            self.pending -= 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def entrance_state(app: FastAPI, settings: Settings) -> None:
    """What the encode entrance needs on ``app.state``, in the GPU process and in a front: the
    admission bounds and the bounded pool that parses headers."""
    app.state.admission = Admission(settings.queue_size, settings.max_inflight_decoded_bytes)
    app.state.inspector = BoundedExecutor(
        settings.decode_workers, settings.queue_size, "featpool-inspect"
    )
