"""The control block: one small shared-memory region with a header and, per lease slot, the
words that producer and consumers use to hand a lease over without talking.

Layout (little-endian; see docs/protocol.md, which is the reference):

    header, 64 bytes:
      0  magic    8 bytes  b"FEATPOOL"
      8  version  u32      1
     12  nslots   u32
     16  epoch    u64      random per pool instance: a consumer tells a restarted pool by it
     24  stride   u32      bytes per slot record (16)
     28  reserved
    slot i at 64 + i * 16:
      0  gen      u32  generation of the lease now in the slot; written by the producer, on the
                       host, when it reserves the slot (0: never used)
      4  ready    u32  set to ``gen`` once the lease's bytes are in place; on the GPU tier the
                       producer's CUDA stream writes it after the copy (cuStreamWriteValue32)
      8  ack      u32  set to ``gen`` by the consumer when it is done with the lease
     12  reserved

The block is a memfd, so it maps into every process; on CUDA it is also registered as mapped
pinned memory, so GPU streams write and wait on the same words and the producer reads acks with
plain loads: no device synchronisation per lease.
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct

import numpy as np

MAGIC = b"FEATPOOL"
VERSION = 1
HEADER_SIZE = 64
SLOT_STRIDE = 16
_HEADER = struct.Struct("<8sIIQI")
SLOT_DTYPE = np.dtype(
    [("gen", "<u4"), ("ready", "<u4"), ("ack", "<u4"), ("reserved", "<u4")], align=False
)
GEN_OFFSET, READY_OFFSET, ACK_OFFSET = 0, 4, 8


class ControlBlock:
    """A mapped control block. The producer creates it; consumers attach to its FD."""

    def __init__(self, fd: int, mm: mmap.mmap, *, owner: bool) -> None:
        self.fd = fd
        self._mm = mm
        self.owner = owner
        magic, version, nslots, epoch, stride = _HEADER.unpack_from(mm, 0)
        if magic != MAGIC:
            raise ValueError("not a featpool control block (bad magic)")
        if version != VERSION or stride != SLOT_STRIDE:
            raise ValueError(f"unsupported control block version {version} / stride {stride}")
        self.nslots: int = nslots
        self.epoch: int = epoch
        self.size = HEADER_SIZE + nslots * SLOT_STRIDE
        self._set_slots(np.frombuffer(mm, dtype=SLOT_DTYPE, count=nslots, offset=HEADER_SIZE))
        self.address: int = self.slots.ctypes.data - HEADER_SIZE

    def _set_slots(self, slots: np.ndarray) -> None:
        self.slots = slots
        # Field views made once: ``slots["gen"]`` builds a new view on every access, and the
        # accessors below run several times per lease.
        self._gen, self._ready, self._ack = slots["gen"], slots["ready"], slots["ack"]

    @classmethod
    def create(cls, nslots: int, epoch: int | None = None) -> ControlBlock:
        if nslots <= 0:
            raise ValueError("a control block needs at least one slot")
        size = HEADER_SIZE + nslots * SLOT_STRIDE
        fd = os.memfd_create("featpool-control", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        epoch = epoch if epoch is not None else secrets.randbits(63) | 1
        _HEADER.pack_into(mm, 0, MAGIC, VERSION, nslots, epoch, SLOT_STRIDE)
        return cls(fd, mm, owner=True)

    @classmethod
    def attach(cls, fd: int) -> ControlBlock:
        """Map a control block received from the producer (read-write: consumers write acks)."""
        size = os.fstat(fd).st_size
        if size < HEADER_SIZE:
            raise ValueError("control block too small")
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        return cls(fd, mm, owner=False)

    def slot_address(self, slot: int, word_offset: int) -> int:
        """Host address of one word of a slot record (for CUDA stream memory operations)."""
        return self.address + HEADER_SIZE + slot * SLOT_STRIDE + word_offset

    # Host-side accessors. Aligned 32-bit stores are single instructions on every platform we
    # run on, so a reader never sees a torn word.
    def gen(self, slot: int) -> int:
        return int(self._gen[slot])

    def ready(self, slot: int) -> int:
        return int(self._ready[slot])

    def ack(self, slot: int) -> int:
        return int(self._ack[slot])

    def set_gen(self, slot: int, gen: int) -> None:
        self._gen[slot] = gen

    def set_ready(self, slot: int, gen: int) -> None:
        self._ready[slot] = gen

    def set_ack(self, slot: int, gen: int) -> None:
        self._ack[slot] = gen

    def close(self) -> None:
        self._set_slots(np.empty(0, dtype=SLOT_DTYPE))
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            pass
        os.close(self.fd)
