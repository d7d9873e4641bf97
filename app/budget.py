"""A budget of decoded bytes shared by every request in flight: taken, all or nothing, before
an image is decoded, given back when its pixels have shrunk to the encoder's input size.

Thread-safe (decode threads and the event loop both give back), never blocking: a request
that does not fit now is turned away (429), one that can never fit is too large (413). The
admission permit at the entrance takes its decoded bytes from the same object.
"""

from __future__ import annotations

import threading


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
