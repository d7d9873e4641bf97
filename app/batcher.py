"""Dynamic batching: a bounded queue, and a first stage that takes a batch from it when it has
a thread free: the batch closes when it is full or when its first item has waited
``max_wait_s``. With a prepare stage (the engine's decode) the first stage prepares batch N+1 on
its own thread while the batch thread runs batch N's second stage.

The first stage's threads take their batches from the queue themselves, without a turn of the
event loop between one batch and the next: behind a busy event loop each turn waits for the
jobs ahead of it, and the hand-off from one prepared batch to the next took three of them
(docs/benchmarks.md, "Eighteenth session").

Admission is all-or-nothing per request: a request of n images is queued only if n places are
free, otherwise it is turned away at once (429) instead of queueing without bound. Items whose
requester went away are skipped; results that nobody will read are handed to ``discard`` (so
the leases they hold are released, not leaked). A failing batch fails only its own items.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from app.errors import RETRY_AFTER, ApiError

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")
V = TypeVar("V")


@dataclass
class _Item(Generic[T, R]):
    value: T
    future: asyncio.Future[R]
    enqueued: float = field(default_factory=time.perf_counter)
    # The batch that a first-stage thread took the item into (set under the batcher's lock):
    # set on the event loop once that batch is over. A failed request waits for it, so that
    # when it answers, what its taken items made has already been discarded.
    batch_over: asyncio.Event | None = None


@dataclass
class BatchStats:
    size: int
    queue_wait_s: list[float]
    skipped: int
    # Time in each stage's own thread: "prepare" (with a prepare stage) and "run". The slower
    # stage's time per batch is the pipeline's cycle.
    stages: dict[str, float] = field(default_factory=dict)


@dataclass
class _Taken(Generic[T, R]):
    """A batch as a first-stage thread took it, and what the stage made of it: the second
    stage (with a prepare stage), the results (without), or the error."""

    seq: int
    batch: list[_Item[T, R]]
    live: list[_Item[T, R]]
    started: float
    over: asyncio.Event
    stages: dict[str, float] = field(default_factory=dict)
    out: Any = None
    error: Exception | None = None


def _timed(fn: Callable[..., V], stages: dict[str, float], stage: str) -> Callable[..., V]:
    """``fn``, noting its wall time under ``stage`` (in the thread that runs it)."""

    def call(*args: object) -> V:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            stages[stage] = time.perf_counter() - t0

    return call


class Batcher(Generic[T, R]):
    def __init__(
        self,
        run_batch: Callable[[list[T]], Sequence[R | BaseException]],
        *,
        max_batch_size: int,
        max_wait_s: float,
        queue_size: int,
        discard: Callable[[R], None] = lambda _: None,
        on_batch: Callable[[BatchStats], None] = lambda _: None,
        in_flight: int | None = None,
        prepare: Callable[[list[T]], Callable[[], Sequence[R | BaseException]]] | None = None,
        prepare_threads: int = 1,
    ) -> None:
        self._run_batch = run_batch
        # An optional first stage (the engine's decode), on threads of its own: batch N+1 (and
        # with more prepare threads, N+2...) is prepared while batch N runs. It returns the
        # second stage, which then runs in place of run_batch on the batch thread, batches in
        # the order they were taken (dropped, with what it holds, if the batch is not run).
        # Without it, the first stage is run_batch itself, on one thread.
        if prepare_threads < 1:
            raise ValueError("prepare_threads must be at least 1")
        self._prepare = prepare
        self.prepare_threads = prepare_threads
        if in_flight is None:
            # One batch running; with a prepare stage, also one prepared and waiting for the
            # batch thread, and one being prepared per prepare thread. (The batch that waits
            # keeps the prepare thread from waiting for the event loop to finish the running
            # one: busy 88 -> 95 % of the time behind a busy loop, in the CPU model of
            # docs/benchmarks.md, "Eighteenth session".)
            in_flight = 2 + prepare_threads if prepare is not None else 2
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.queue_size = queue_size
        self._discard = discard
        self._on_batch = on_batch
        # The queue, shared by the event loop (submit) and the first stage's threads (take).
        self._items: collections.deque[_Item[T, R]] = collections.deque()
        self._cv = threading.Condition(threading.Lock())
        self._taken = 0  # batches taken so far: the next one's place in the batch thread's order
        self._stopping = False
        self._slots = threading.Semaphore(in_flight)  # batches taken but not yet finished
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        # The second stage: one thread runs batches, in order (the encoder and its CUDA stream
        # are not shared). A batch's turn comes once the batch taken before it has had its own.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="featpool-batch")
        # Held while a batch's second stage runs. Its waiters are served first come, first
        # served, and each batch's task reaches it first thing, in the order taken.
        self._batch_thread = asyncio.Lock()
        self._arrived: dict[int, _Taken[T, R]] = {}  # handed over ahead of an earlier batch
        self._next = 0  # the next batch, in the order taken, to get its task
        self._running: set[asyncio.Task[None]] = set()

    @property
    def depth(self) -> int:
        return len(self._items)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        threads = self.prepare_threads if self._prepare is not None else 1
        name = "featpool-prepare" if self._prepare is not None else "featpool-batch-first"
        for n in range(threads):
            # Daemon threads: one waiting for work must not hold up the interpreter's exit.
            t = threading.Thread(target=self._first_stage, name=f"{name}_{n}", daemon=True)
            t.start()
            self._threads.append(t)

    async def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        for t in self._threads:
            await asyncio.to_thread(t.join)
        self._threads = []
        await asyncio.sleep(0)  # the batches the threads handed over last get their tasks
        with self._cv:
            queued, self._items = list(self._items), collections.deque()
        for item in queued:
            if not item.future.done():
                item.future.set_exception(ApiError("not_ready", "the service is shutting down"))
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        self._executor.shutdown(wait=True)

    async def submit(self, values: Sequence[T]) -> list[R]:
        """Queue all values (or none: 429) and wait for their results, in order."""
        if not self._threads or self._stopping:
            raise ApiError("not_ready", "the encoder is not running")
        loop = asyncio.get_running_loop()
        items = [_Item[T, R](v, loop.create_future()) for v in values]
        with self._cv:
            if len(self._items) + len(values) > self.queue_size:
                raise ApiError(
                    "queue_full",
                    f"{len(self._items)} images are queued (limit {self.queue_size})",
                    headers=RETRY_AFTER,
                )
            was = len(self._items)
            self._items.extend(items)
            if was == 0 or len(self._items) >= self.max_batch_size:
                self._cv.notify()  # a first batch item to time, or a full batch to take
        try:
            if len(items) == 1:
                return [await items[0].future]
            return list(await asyncio.gather(*(i.future for i in items)))
        except BaseException as e:
            with self._cv:  # (under the lock: a thread takes items, and marks them, under it)
                for i in items:  # skipped if still queued; if taken, discarded when done
                    if not i.future.done():
                        i.future.cancel()
                running = {i.batch_over for i in items if i.batch_over is not None}
            for i in items:  # what is done already is discarded now
                if not i.future.cancelled() and i.future.exception() is None:
                    self._discard(i.future.result())
            if running and not isinstance(e, asyncio.CancelledError):
                await asyncio.gather(*(over.wait() for over in running))
            raise

    # ---- the first stage, on its own threads -------------------------------------------------

    def _take(self) -> _Taken[T, R] | None:
        """The next batch from the queue, once full or once its first item has waited
        ``max_wait_s``; None when stopping."""
        with self._cv:
            while True:
                if self._stopping:
                    return None
                if self._items:
                    left = self._items[0].enqueued + self.max_wait_s - time.perf_counter()
                    if left <= 0 or len(self._items) >= self.max_batch_size:
                        break
                    self._cv.wait(left)
                else:
                    self._cv.wait()
            n = min(len(self._items), self.max_batch_size)
            batch = [self._items.popleft() for _ in range(n)]
            if self._items:  # another thread, if one waits, times what is left
                self._cv.notify()
            # A request cancelled while its items were queued is skipped, not run.
            live = [i for i in batch if not i.future.done()]
            over = asyncio.Event()  # (set on the loop; made here, it binds to no loop yet)
            for i in live:
                i.batch_over = over
            seq, self._taken = self._taken, self._taken + 1
        return _Taken(seq, batch, live, time.perf_counter(), over)

    def _first_stage(self) -> None:
        loop = self._loop
        assert loop is not None
        while True:
            while not self._slots.acquire(timeout=0.1):
                if self._stopping:
                    return
            taken = self._take()
            if taken is None:
                self._slots.release()
                return
            if taken.live:
                values = [i.value for i in taken.live]
                try:
                    if self._prepare is not None:
                        taken.out = _timed(self._prepare, taken.stages, "prepare")(values)
                    else:
                        taken.out = _timed(self._run_batch, taken.stages, "run")(values)
                except Exception as e:
                    taken.error = e
            try:
                loop.call_soon_threadsafe(self._taken_over, taken)
            except RuntimeError:  # the loop is closed: nobody waits for this batch any more
                self._slots.release()
                return

    # ---- the second stage and the results, on the event loop ---------------------------------

    def _taken_over(self, taken: _Taken[T, R]) -> None:
        """Batches come from several prepare threads in any order; their tasks are made in the
        order taken, so that they queue for the batch thread in that order."""
        self._arrived[taken.seq] = taken
        while self._next in self._arrived:
            ready = self._arrived.pop(self._next)
            self._next += 1
            task = asyncio.get_running_loop().create_task(self._finish(ready))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _finish(self, taken: _Taken[T, R]) -> None:
        try:
            await self._results(taken)
        finally:
            taken.over.set()
            self._slots.release()

    async def _results(self, taken: _Taken[T, R]) -> None:
        batch, live, stages = taken.batch, taken.live, taken.stages
        if not live:
            self._on_batch(BatchStats(0, [], len(batch)))
            return
        waits = [taken.started - i.enqueued for i in live]
        try:
            if taken.error is not None:
                raise taken.error
            if self._prepare is None:
                results: Sequence[R | BaseException] = taken.out
            else:
                async with self._batch_thread:  # (the first await: see _taken_over)
                    if all(i.future.done() for i in live):
                        # Every requester went away while the batch was prepared or waited
                        # for the batch thread: its second stage (the forward) is not run.
                        self._on_batch(BatchStats(0, [], len(batch), stages))
                        return
                    loop = asyncio.get_running_loop()
                    results = await loop.run_in_executor(
                        self._executor, _timed(taken.out, stages, "run")
                    )
            if len(results) != len(live):
                raise RuntimeError(f"batch of {len(live)} returned {len(results)} results")
        except Exception as e:
            log.exception("batch of %d failed", len(live))
            results = [e] * len(live)
        for item, result in zip(live, results, strict=True):
            if item.future.done():  # the requester went away while we worked
                if not isinstance(result, BaseException):
                    self._discard(result)
            elif isinstance(result, BaseException):
                item.future.set_exception(result)
            else:
                item.future.set_result(result)
        self._on_batch(BatchStats(len(live), waits, len(batch) - len(live), stages))
