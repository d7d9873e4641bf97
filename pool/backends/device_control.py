"""Control words in GPU memory, for consumers on other nodes of a multi-node NVLink domain.

The pool's control block is host memory (a memfd): a process on another node cannot map it. For
those consumers the GPU tier keeps a second set of each slot's ready and ack words in one small
VMM allocation, exported as a FABRIC handle next to the slabs':

- the producer's stream writes the slot's ready word here too, right after the host one, so it
  is ordered behind the copy exactly like the host word;
- a remote consumer's stream waits on it (cuStreamWaitValue32 over NVLink) and writes its ack
  here after its reads;
- the producer reads every ack word with one D2H copy on a side stream (a wait on that copy, not
  on the device). bench_acks.py measured this at 40-60 us per pass for 1-4k slots against
  10-19 us for host-mapped words, so the pool only does it while remote consumers are attached.

Layout: the host block's slot records without its header (slot i at ``i * SLOT_STRIDE``; the
gen word is unused here, ready and ack at the same offsets).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pool.backends.vmm import Mapping, map_allocation, round_up, unmap_allocation
from pool.control import SLOT_DTYPE, SLOT_STRIDE
from pool.driver import DriverAPI, HandleType


class DeviceControl:
    """The producer's device-side control words (read-write)."""

    def __init__(
        self,
        driver: DriverAPI,
        rt: Any,
        ordinal: int,
        *,
        granularity: int,
        nslots: int,
        handle_types: HandleType,
    ) -> None:
        if nslots <= 0:
            raise ValueError("device control words need at least one slot")
        self.driver = driver
        self.rt = rt
        self.nslots = nslots
        self.size = round_up(nslots * SLOT_STRIDE, granularity)
        handle = driver.mem_create(self.size, ordinal, handle_types)
        try:
            ptr = map_allocation(driver, handle, self.size, granularity, ordinal, read_only=False)
        except BaseException:
            driver.mem_release(handle)
            raise
        self._m: Mapping | None = Mapping(self.size, handle, ptr)
        try:
            self._m.base = rt.tensor_at(ptr, self.size)
            self._m.base.zero_()  # new VMM memory is not guaranteed to be zero
        except BaseException:
            unmap_allocation(driver, self._m)
            raise
        self.ptr = ptr
        self._fabric: bytes | None = None

    def word(self, slot: int, offset: int) -> int:
        """Device address of one word of a slot's record."""
        if not 0 <= slot < self.nslots:
            raise ValueError(f"slot {slot} outside the device control words ({self.nslots})")
        return self.ptr + slot * SLOT_STRIDE + offset

    def read_slots(self) -> np.ndarray:
        """A host copy of every slot record (one batched read; waits for that copy only)."""
        assert self._m is not None and self._m.base is not None, "device control words closed"
        raw = self.rt.read_back(self._m.base[: self.nslots * SLOT_STRIDE])
        return np.frombuffer(raw, dtype=SLOT_DTYPE, count=self.nslots)

    def fabric_handle(self) -> bytes:
        """The allocation's 64-byte FABRIC handle, exported once."""
        assert self._m is not None, "device control words closed"
        if self._fabric is None:
            self._fabric = self.driver.export_fabric(self._m.handle)
        return self._fabric

    def close(self) -> None:
        m, self._m = self._m, None
        if m is not None:
            self.rt.synchronize()  # ready writes still queued must land before the unmap
            unmap_allocation(self.driver, m)
