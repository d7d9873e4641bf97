"""The dynamic batcher with a fake run_batch: size and wait limits, all-or-nothing admission
(429), cancellation without leaks, failure isolation, order of results."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest

from app.batcher import Batcher, BatchStats
from app.errors import ApiError


class Fake:
    """run_batch doubles each value; it can be held (to fill the queue) or made to fail."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.discarded: list[int] = []
        self.stats: list[BatchStats] = []
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        self.fail_on: set[int] = set()

    def run(self, values: list[int]) -> Sequence[int | BaseException]:
        self.started.set()
        self.gate.wait(5)
        self.batches.append(list(values))
        if self.fail_on & set(values):
            raise RuntimeError("boom")
        return [v * 2 if v >= 0 else ValueError(f"bad {v}") for v in values]


def run(body: Callable[[Batcher[int, int], Fake], Awaitable[None]], **kw: float) -> Fake:
    fake = Fake()

    async def main() -> None:
        b: Batcher[int, int] = Batcher(
            fake.run,
            max_batch_size=int(kw.get("max_batch_size", 4)),
            max_wait_s=kw.get("max_wait_s", 0.05),
            queue_size=int(kw.get("queue_size", 16)),
            discard=fake.discarded.append,
            on_batch=fake.stats.append,
        )
        b.start()
        try:
            await body(b, fake)
        finally:
            fake.gate.set()
            await b.stop()

    asyncio.run(main())
    return fake


def test_batch_closes_at_max_size_and_results_are_in_order() -> None:
    async def body(b: Batcher[int, int], fake: Fake) -> None:
        results = await asyncio.gather(b.submit(list(range(10))), b.submit([100, 101]))
        assert results == [[v * 2 for v in range(10)], [200, 202]]

    fake = run(body, max_batch_size=4, max_wait_s=10.0)  # only size can close these batches
    assert [len(x) for x in fake.batches][:3] == [4, 4, 4]
    assert sorted(v for x in fake.batches for v in x) == [*range(10), 100, 101]


def test_batch_closes_at_max_wait() -> None:
    async def body(b: Batcher[int, int], fake: Fake) -> None:
        t0 = time.perf_counter()
        assert await b.submit([1, 2]) == [2, 4]
        waited = time.perf_counter() - t0
        assert 0.04 <= waited < 1.0

    fake = run(body, max_batch_size=64, max_wait_s=0.05)
    assert fake.batches == [[1, 2]]
    assert fake.stats[0].size == 2 and all(w >= 0.04 for w in fake.stats[0].queue_wait_s)


def test_full_queue_turns_a_request_away_whole() -> None:
    async def body(b: Batcher[int, int], fake: Fake) -> None:
        fake.gate.clear()
        first = asyncio.ensure_future(b.submit([0]))
        await asyncio.to_thread(fake.started.wait, 5)  # the batch thread holds [0]
        # no batch is gathered while the batch thread is busy: the queue fills
        waiting = [asyncio.ensure_future(b.submit([1, 2, 3, 4]))]
        await asyncio.sleep(0.1)
        waiting.append(asyncio.ensure_future(b.submit([5, 6, 7])))
        await asyncio.sleep(0)
        assert b.depth == 7
        with pytest.raises(ApiError) as e:
            await b.submit([20, 21])  # 2 more would exceed 8: none of them is queued
        assert e.value.status == 429 and e.value.headers == {"Retry-After": "1"}
        assert b.depth == 7
        last = asyncio.ensure_future(b.submit([30]))  # exactly full is still admitted
        await asyncio.sleep(0)
        assert b.depth == 8
        fake.gate.set()
        assert await first == [0]
        assert await last == [60]
        await asyncio.gather(*waiting)

    fake = run(body, max_batch_size=4, max_wait_s=0.01, queue_size=8)
    assert all(20 not in x and 21 not in x for x in fake.batches)


def test_cancelled_requests_are_skipped_and_their_results_discarded() -> None:
    async def body(b: Batcher[int, int], fake: Fake) -> None:
        fake.gate.clear()
        running = asyncio.ensure_future(b.submit([1, 2]))
        await asyncio.to_thread(fake.started.wait, 5)
        queued = asyncio.ensure_future(b.submit([3, 4]))
        await asyncio.sleep(0.05)
        running.cancel()  # its batch is on the batch thread: results come back, are discarded
        queued.cancel()  # not run yet: skipped
        await asyncio.sleep(0)
        fake.gate.set()
        assert await b.submit([5]) == [10]

    fake = run(body, max_batch_size=2, max_wait_s=0.01)
    assert sorted(fake.discarded) == [2, 4]  # no result (lease) of a gone client is kept
    assert all(3 not in x and 4 not in x for x in fake.batches)


def test_one_failed_item_fails_its_request_and_discards_the_rest() -> None:
    async def body(b: Batcher[int, int], fake: Fake) -> None:
        bad, good = await asyncio.gather(
            b.submit([1, -1, 3]), b.submit([4]), return_exceptions=True
        )
        assert isinstance(bad, ValueError) and good == [8]

    fake = run(body, max_batch_size=8, max_wait_s=0.02)
    assert sorted(fake.discarded) == [2, 6]  # the failed request's good results are released


def test_a_failed_batch_fails_only_its_items_and_the_next_succeeds() -> None:
    async def body(b: Batcher[int, int], fake: Fake) -> None:
        fake.fail_on = {7}
        r1 = await asyncio.gather(b.submit([7]), b.submit([8]), return_exceptions=True)
        assert all(isinstance(r, RuntimeError) for r in r1)  # same batch: both failed
        fake.fail_on = set()
        assert await b.submit([9]) == [18]

    fake = run(body, max_batch_size=8, max_wait_s=0.02)
    assert fake.batches == [[7, 8], [9]]


def test_submit_after_stop_is_not_ready() -> None:
    async def main() -> None:
        b: Batcher[int, int] = Batcher(lambda v: v, max_batch_size=2, max_wait_s=0.0, queue_size=4)
        with pytest.raises(ApiError) as e:
            await b.submit([1])
        assert e.value.status == 503
        b.start()
        assert await b.submit([1, 2, 3]) == [1, 2, 3]
        await b.stop()
        with pytest.raises(ApiError):
            await b.submit([1])

    asyncio.run(main())


Prepare = Callable[[list[int]], Callable[[], list[int | BaseException]]]


def piped(
    run_batch: Callable[[list[int]], list[int | BaseException]],
    prepare: Prepare,
    **kw: Any,
) -> Batcher[int, int]:
    """A started two-stage batcher of batches of two (a prepare stage, then run_batch)."""
    b: Batcher[int, int] = Batcher(
        run_batch, max_batch_size=2, max_wait_s=0.01, queue_size=64, prepare=prepare, **kw
    )
    b.start()
    return b


def test_prepare_stage_runs_the_next_batch_beside_the_current_one() -> None:
    """With a prepare stage (the engine's decode), batch N+1 is prepared on its own thread
    while batch N runs: run_batch(N) here waits until prepare(N+1) has started, which would
    never happen with one thread doing both. Order is kept in both stages, every value is
    prepared before it is run, and the results come back in order."""
    prepared: list[list[int]] = []
    ran: list[list[int]] = []
    second_prepare = threading.Event()

    def prepare(values: list[int]) -> Callable[[], list[int | BaseException]]:
        prepared.append(list(values))
        if len(prepared) == 2:
            second_prepare.set()
        return lambda: run_batch(values)

    def run_batch(values: list[int]) -> list[int | BaseException]:
        assert values in prepared  # the same values were prepared first
        if not ran:
            assert second_prepare.wait(5), "batch 2 was not prepared while batch 1 ran"
        ran.append(list(values))
        return [v * 10 for v in values]

    async def main() -> list[list[int]]:
        b = piped(run_batch, prepare)
        try:
            first = asyncio.ensure_future(b.submit([1, 2]))
            await asyncio.sleep(0.05)  # batch 1 is in run_batch, waiting
            second = asyncio.ensure_future(b.submit([3, 4]))
            return [await first, await second]
        finally:
            await b.stop()

    assert asyncio.run(main()) == [[10, 20], [30, 40]]
    assert prepared == [[1, 2], [3, 4]] and ran == [[1, 2], [3, 4]]


def test_a_batch_is_gathered_when_the_prepare_thread_can_take_it() -> None:
    """While the prepare thread is busy, no batch is closed: the requests that come meanwhile,
    each past ``max_wait_s``, are gathered into one batch when it is free. (A batch closed at
    once would hold only the first of them and wait, complete, for the prepare thread, while
    the others waited for the batch after it.)"""
    prepared: list[list[int]] = []
    held = threading.Event()

    def prepare(values: list[int]) -> Callable[[], list[int | BaseException]]:
        prepared.append(list(values))
        if values[0] == 1:
            assert held.wait(5)
        return lambda: list(values)

    async def main() -> list[list[int]]:
        b: Batcher[int, int] = Batcher(
            list, max_batch_size=8, max_wait_s=0.01, queue_size=64, prepare=prepare
        )
        b.start()
        try:
            first = asyncio.ensure_future(b.submit([1, 2]))
            while not prepared:  # batch 1 is being prepared, held
                await asyncio.sleep(0.005)
            later = [asyncio.ensure_future(b.submit([3]))]
            await asyncio.sleep(0.05)  # five times max_wait_s
            later.append(asyncio.ensure_future(b.submit([4, 5])))
            await asyncio.sleep(0.05)
            assert b.depth == 3
            held.set()
            return [await first, *[await f for f in later]]
        finally:
            await b.stop()

    assert asyncio.run(main()) == [[1, 2], [3], [4, 5]]
    assert prepared == [[1, 2], [3, 4, 5]]


def test_a_failed_request_answers_after_its_batch_in_preparation_is_discarded() -> None:
    """A request's images in two batches: the first batch fails one of them while the second
    batch, holding another, is still being prepared. The request fails only once that batch
    is over (its forward then not run: nobody waits for it), and whatever was made for the
    request is discarded, not left to leak."""
    held, six_taken = threading.Event(), threading.Event()
    discarded: list[int] = []
    made: list[int] = []

    def prepare(values: list[int]) -> Callable[[], list[int | BaseException]]:
        if 6 in values:
            six_taken.set()
            assert held.wait(5)

        def run() -> list[int | BaseException]:
            assert six_taken.wait(5)  # the first batch fails once the second is being prepared
            made.extend(v * 2 for v in values if v >= 0)
            return [ValueError("bad") if v < 0 else v * 2 for v in values]

        return run

    async def main() -> None:
        b: Batcher[int, int] = Batcher(
            list,
            max_batch_size=2,
            max_wait_s=0,
            queue_size=64,
            prepare=prepare,
            discard=discarded.append,
        )
        b.start()
        try:
            request = asyncio.ensure_future(b.submit([-1, 5, 6]))
            await asyncio.sleep(0.1)  # [-1, 5] failed; [6] is held in its prepare stage
            assert not request.done() and discarded == [10]
            held.set()
            with pytest.raises(ValueError):
                await request
            assert made == discarded == [10]
        finally:
            await b.stop()

    asyncio.run(main())


def test_two_prepare_threads_prepare_two_batches_at_once_and_run_them_in_order() -> None:
    """With ``prepare_threads=2`` two batches are prepared at the same time (each prepare
    waits for the other at a barrier: with one thread it would time out), and although batch
    2 is ready first, the batch thread runs batch 1 first: the order they were gathered."""
    both = threading.Barrier(2, timeout=5)
    ran: list[list[int]] = []

    def prepare(values: list[int]) -> Callable[[], list[int | BaseException]]:
        both.wait()
        if values[0] == 1:
            time.sleep(0.1)  # batch 1 is ready last
        return lambda: run_batch(values)

    def run_batch(values: list[int]) -> list[int | BaseException]:
        ran.append(list(values))
        return [v * 10 for v in values]

    async def main() -> list[list[int]]:
        b = piped(run_batch, prepare, prepare_threads=2)
        try:
            first = asyncio.ensure_future(b.submit([1, 2]))
            await asyncio.sleep(0.02)
            second = asyncio.ensure_future(b.submit([3, 4]))
            return [await first, await second]
        finally:
            await b.stop()

    assert asyncio.run(main()) == [[10, 20], [30, 40]]
    assert ran == [[1, 2], [3, 4]]


def test_what_one_prepare_thread_leaves_in_the_queue_the_other_takes() -> None:
    """Two idle prepare threads and three items at once, batches of two: the first thread
    takes two and is held in its prepare stage; the other takes the third once it has waited
    max_wait_s, without waiting for more items or for the first thread."""
    held = threading.Event()
    prepared: list[list[int]] = []

    def prepare(values: list[int]) -> Callable[[], list[int | BaseException]]:
        prepared.append(list(values))
        if 1 in values:
            assert held.wait(5)
        return lambda: list(values)

    async def main() -> None:
        b = piped(list, prepare, prepare_threads=2)
        try:
            request = asyncio.ensure_future(b.submit([1, 2, 3]))
            for _ in range(100):
                if len(prepared) == 2:
                    break
                await asyncio.sleep(0.01)
            assert prepared == [[1, 2], [3]] and not request.done()
            held.set()
            assert await request == [1, 2, 3]
        finally:
            held.set()
            await b.stop()

    asyncio.run(main())


def test_a_batch_given_up_while_prepared_does_not_hold_up_the_next() -> None:
    """Two prepare threads; batch 1's requester goes away while it is prepared (and its
    forward is never run): batch 2, waiting for batch 1's turn, runs all the same."""
    release = threading.Event()
    ran: list[list[int]] = []

    def prepare(values: list[int]) -> Callable[[], list[int | BaseException]]:
        if values[0] == 1:
            assert release.wait(5)
        return lambda: run_batch(values)

    def run_batch(values: list[int]) -> list[int | BaseException]:
        ran.append(list(values))
        return list(values)

    async def main() -> list[int]:
        b = piped(run_batch, prepare, prepare_threads=2)
        try:
            first = asyncio.ensure_future(b.submit([1, 2]))
            await asyncio.sleep(0.05)  # batch 1 is being prepared, held
            second = asyncio.ensure_future(b.submit([3, 4]))
            await asyncio.sleep(0.05)  # batch 2 is prepared and waits for batch 1's turn
            assert not second.done()
            first.cancel()
            release.set()
            return await asyncio.wait_for(second, 5)
        finally:
            await b.stop()

    assert asyncio.run(main()) == [3, 4]
    assert ran == [[3, 4]]


def test_a_prepared_batch_whose_requesters_all_went_away_is_not_run() -> None:
    """Batch 2 is prepared while batch 1 runs; its requester goes away before batch 1 ends.
    Its second stage (the forward) is then never run, and the batch is counted as skipped."""
    ran: list[list[int]] = []
    prepared: list[list[int]] = []
    stats: list[BatchStats] = []
    gate = threading.Event()

    def prepare(values: list[int]) -> Callable[[], list[int | BaseException]]:
        prepared.append(list(values))
        return lambda: run_batch(values)

    def run_batch(values: list[int]) -> list[int | BaseException]:
        ran.append(list(values))
        assert gate.wait(5)
        return list(values)

    async def main() -> None:
        b = piped(run_batch, prepare, on_batch=stats.append)
        try:
            first = asyncio.ensure_future(b.submit([1, 2]))
            while not ran:  # batch 1 is in its second stage, held
                await asyncio.sleep(0.005)
            second = asyncio.ensure_future(b.submit([3, 4]))
            while len(prepared) < 2:  # batch 2 is prepared and waits for the batch thread
                await asyncio.sleep(0.005)
            second.cancel()
            await asyncio.sleep(0.02)
            gate.set()
            assert await first == [1, 2]
            with pytest.raises(asyncio.CancelledError):
                await second
        finally:
            await b.stop()

    asyncio.run(main())
    assert prepared == [[1, 2], [3, 4]] and ran == [[1, 2]]
    assert [(s.size, s.skipped) for s in stats] == [(2, 0), (0, 2)]


def test_each_stage_reports_the_time_its_thread_spent_on_the_batch() -> None:
    """The batch statistics carry each stage's own time (measured in its thread, for the
    pipeline's cycle: the slower stage); without a prepare stage, only "run"."""
    stats: list[BatchStats] = []

    def prepare(values: list[int]) -> Callable[[], list[int | BaseException]]:
        time.sleep(0.06)
        return lambda: run_batch(values)

    def run_batch(values: list[int]) -> list[int | BaseException]:
        time.sleep(0.02)
        return list(values)

    async def main(with_prepare: bool) -> None:
        b: Batcher[int, int] = Batcher(
            run_batch,
            max_batch_size=4,
            max_wait_s=0.01,
            queue_size=64,
            prepare=prepare if with_prepare else None,
            on_batch=stats.append,
        )
        b.start()
        try:
            assert await b.submit([1, 2]) == [1, 2]
        finally:
            await b.stop()

    asyncio.run(main(True))
    asyncio.run(main(False))
    piped, plain = (s for s in stats if s.size)
    assert set(piped.stages) == {"prepare", "run"} and set(plain.stages) == {"run"}
    assert piped.stages["prepare"] >= 0.06 and piped.stages["run"] >= 0.02
    assert plain.stages["run"] >= 0.02
