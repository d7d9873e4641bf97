"""A budget of decoded bytes shared by every request in flight: taken, all or nothing, before
an image is decoded, given back when its pixels have shrunk to the encoder's input size.

Thread-safe (decode threads and the event loop both give back), never blocking: a request
that does not fit now is turned away (429), one that can never fit is too large (413). The
admission permit at the entrance takes its decoded bytes from the same object.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class DecodedBytesBudget:
    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._used = 0
        self._lock = threading.Lock()

    @property
    def in_use(self) -> int:
        return self._used

    def fits_ever(self, n: int) -> bool:
        return 0 <= n <= self.capacity

    def try_acquire(self, n: int) -> bool:
        """Take ``n`` bytes if they fit now; False (nothing taken) if they do not."""
        if n < 0:
            raise ValueError(f"cannot acquire {n} bytes")
        with self._lock:
            if self._used + n > self.capacity:
                return False
            self._used += n
            return True

    def release(self, n: int) -> None:
        with self._lock:
            if n < 0 or n > self._used:
                raise ValueError(f"releasing {n} bytes, but {self._used} are in use")
            self._used -= n


class Reservation:
    """Bytes one request took from a budget: given back piece by piece as its images shrink
    (from any thread), and whatever is left by ``close()``, however the request ends."""

    def __init__(self, budget: DecodedBytesBudget, n: int) -> None:
        self._budget = budget
        self._left = n
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        return self._left

    def release(self, n: int) -> None:
        with self._lock:
            n = min(n, self._left)
            self._left -= n
        if n:
            self._budget.release(n)

    def close(self) -> None:
        self.release(self._left)


def reserve(budget: DecodedBytesBudget, n: int) -> Reservation | None:
    """``n`` bytes as a Reservation, or None if they do not fit now."""
    return Reservation(budget, n) if budget.try_acquire(n) else None


class HeapTrimmer:
    """Gives freed heap memory back to the system (glibc ``malloc_trim``) after a burst of
    large, short-lived buffers, such as bodies cut off by a timeout. Python frees them, but
    glibc keeps the pages: RSS stayed ~170 MiB up after 40 stalled 5 MiB uploads had been
    answered. Trims run on a thread of their own (ctypes lets go of the GIL), one at a time,
    at most one every ``interval_s``, the last one after the burst has ended."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._wanted = False
        self._running = False
        self._trim = _malloc_trim()
        self.trims = 0

    def request(self) -> None:
        if self._trim is None:
            return
        with self._lock:
            self._wanted = True
            if self._running:
                return
            self._running = True
        threading.Thread(target=self._run, name="featpool-trim", daemon=True).start()

    def _run(self) -> None:
        import time

        assert self._trim is not None
        while True:
            time.sleep(self.interval_s)  # let the burst free what it holds first
            with self._lock:
                if not self._wanted:
                    self._running = False
                    return
                self._wanted = False
            self._trim(0)
            self.trims += 1


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim with
        return None
