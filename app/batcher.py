"""Dynamic batching: one owner of a bounded queue; a batch closes when it is full or when its
first item has waited ``max_wait_s``. A batch is gathered only once its first stage has a
thread free to take it (with a prepare stage: while the previous batch runs its second stage).

Admission is all-or-nothing per request: a request of n images is queued only if n places are
free, otherwise it is turned away at once (429) instead of queueing without bound. Items whose
requester went away are skipped; results that nobody will read are handed to ``discard`` (so
the leases they hold are released, not leaked). A failing batch fails only its own items.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Generic, TypeVar

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
    # Set while its batch runs, then done: a failed request waits for its running items, so
    # that when it answers, what they made has already been discarded.
    running: asyncio.Event | None = None


@dataclass
class _Place:
    """A batch's place in the batch thread's order: its turn comes once the batch gathered
    before it has taken its own (``after``); ``mine`` says the same to the batch after it."""

    after: asyncio.Future[None] | None
    mine: asyncio.Future[None]

    def taken(self) -> None:
        if not self.mine.done():
            self.mine.set_result(None)


@dataclass
class BatchStats:
    size: int
    queue_wait_s: list[float]
    skipped: int
    # Time in each stage's own thread: "prepare" (with a prepare stage) and "run". The slower
    # stage's time per batch is the pipeline's cycle.
    stages: dict[str, float] = field(default_factory=dict)


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
        # the order they were gathered (dropped, with what it holds, if the batch is not run).
        if prepare_threads < 1:
            raise ValueError("prepare_threads must be at least 1")
        self._prepare = prepare
        self.prepare_threads = prepare_threads
        # The first stage's threads free to take a batch (the prepare threads, or the batch
        # thread). A batch is gathered only once one is: a batch closed while they were all
        # busy waited there, complete, while the requests that came meanwhile waited for the
        # batch after it. With the GPU's decode the slower stage, that left the prepare thread
        # idle ~20 % of the time at one image per request, c=256 (docs/benchmarks.md,
        # "Eighteenth session").
        self._first_stage = asyncio.Semaphore(prepare_threads if prepare is not None else 1)
        self._prep_executor = ThreadPoolExecutor(
            prepare_threads, thread_name_prefix="featpool-prepare"
        )
        # The previous batch's place in the batch thread's order: done once it has its turn.
        self._order: asyncio.Future[None] | None = None
        if in_flight is None:  # one batch running, one being prepared per prepare thread
            in_flight = 1 + (prepare_threads if prepare is not None else 1)
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.queue_size = queue_size
        self._discard = discard
        self._on_batch = on_batch
        self._queue: asyncio.Queue[_Item[T, R]] = asyncio.Queue()
        self._full = asyncio.Event()  # set by submit once a whole batch is queued
        self._slots = asyncio.Semaphore(in_flight)  # batches gathered but not yet finished
        self._turn = asyncio.Lock()  # batches run one after another, in order
        # One thread runs batches, in order: the encoder and its CUDA stream are not shared.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="featpool-batch")
        self._task: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()

    @property
    def depth(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if not item.future.done():
                item.future.set_exception(ApiError("not_ready", "the service is shutting down"))
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        self._executor.shutdown(wait=True)
        self._prep_executor.shutdown(wait=True)

    async def submit(self, values: Sequence[T]) -> list[R]:
        """Queue all values (or none: 429) and wait for their results, in order."""
        if self._task is None or self._task.done():
            raise ApiError("not_ready", "the encoder is not running")
        if self._queue.qsize() + len(values) > self.queue_size:
            raise ApiError(
                "queue_full",
                f"{self._queue.qsize()} images are queued (limit {self.queue_size})",
                headers=RETRY_AFTER,
            )
        loop = asyncio.get_running_loop()
        items = [_Item[T, R](v, loop.create_future()) for v in values]
        for item in items:
            self._queue.put_nowait(item)
        if self._queue.qsize() >= self.max_batch_size - 1:  # with the one _gather holds
            self._full.set()
        try:
            if len(items) == 1:
                return [await items[0].future]
            return list(await asyncio.gather(*(i.future for i in items)))
        except BaseException as e:
            for i in items:  # our other items: drop them if still queued, discard if done
                if not i.future.done():
                    i.future.cancel()
                elif not i.future.cancelled() and i.future.exception() is None:
                    self._discard(i.future.result())
            if not isinstance(e, asyncio.CancelledError):
                running = [i.running.wait() for i in items if i.running is not None]
                if running:  # their results are discarded as their batch ends
                    await asyncio.gather(*running)
            raise

    async def _loop(self) -> None:
        while True:
            await self._slots.acquire()
            try:
                await self._first_stage.acquire()
            except BaseException:
                self._slots.release()
                raise
            try:
                batch = await self._gather()
            except BaseException:
                self._first_stage.release()
                self._slots.release()
                raise
            loop = asyncio.get_running_loop()
            place = _Place(self._order, loop.create_future())
            self._order = place.mine
            task = loop.create_task(self._run(batch, place))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _gather(self) -> list[_Item[T, R]]:
        first = await self._queue.get()
        # Sleep until the batch is full or its first item has waited long enough: one wake-up
        # per batch (waking for each item as it came cost the event loop a turn per image).
        self._full.clear()
        timeout = first.enqueued + self.max_wait_s - time.perf_counter()
        if timeout > 0 and self._queue.qsize() < self.max_batch_size - 1:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._full.wait(), timeout)
        batch = [first]
        while len(batch) < self.max_batch_size and not self._queue.empty():
            batch.append(self._queue.get_nowait())
        return batch

    async def _run(self, batch: list[_Item[T, R]], place: _Place) -> None:
        """Runs with the first stage's turn taken (by ``_loop``): released by ``_run_live``
        with a prepare stage, here without one."""
        try:
            # With a prepare stage, the batch thread's turn is taken in _run_items instead.
            async with self._turn if self._prepare is None else contextlib.nullcontext():
                await self._run_live(batch, place)
        finally:
            if self._prepare is None:
                self._first_stage.release()
            place.taken()  # (a batch skipped, failed or run without a prepare stage)
            self._slots.release()

    async def _run_live(self, batch: list[_Item[T, R]], place: _Place) -> None:
        first = self._first_stage if self._prepare is not None else None
        # A request cancelled while its batch was gathered is skipped, not run.
        live = [i for i in batch if not i.future.done()]
        if not live:
            if first is not None:
                first.release()
            self._on_batch(BatchStats(0, [], len(batch)))
            return
        for i in live:
            i.running = asyncio.Event()
        try:
            await self._run_items(batch, live, first, place)
        finally:
            for i in live:
                assert i.running is not None
                i.running.set()

    @contextlib.asynccontextmanager
    async def _batch_turn(self, place: _Place) -> AsyncIterator[None]:
        """The batch thread's turn, taken after the batch gathered before this one took its
        own: a batch prepared sooner on another prepare thread waits for it."""
        if place.after is not None:
            await place.after
        async with self._turn:
            place.taken()
            yield

    async def _run_items(
        self,
        batch: list[_Item[T, R]],
        live: list[_Item[T, R]],
        first: asyncio.Semaphore | None,
        place: _Place,
    ) -> None:
        started = time.perf_counter()
        waits = [started - i.enqueued for i in live]
        loop = asyncio.get_running_loop()
        values = [i.value for i in live]
        stages: dict[str, float] = {}
        try:
            if first is not None:  # stage one on its thread, then stage two, each in order
                prepare = self._prepare
                assert prepare is not None
                try:
                    second = await loop.run_in_executor(
                        self._prep_executor, _timed(prepare, stages, "prepare"), values
                    )
                finally:
                    first.release()
                async with self._batch_turn(place):
                    if all(i.future.done() for i in live):
                        # Every requester went away while the batch was prepared or waited
                        # for the batch thread: its second stage (the forward) is not run.
                        self._on_batch(BatchStats(0, [], len(batch), stages))
                        return
                    results: Sequence[R | BaseException] = await loop.run_in_executor(
                        self._executor, _timed(second, stages, "run")
                    )
            else:
                results = await loop.run_in_executor(
                    self._executor, _timed(self._run_batch, stages, "run"), values
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
