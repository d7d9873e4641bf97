"""Shared-memory words that producer and consumers use to hand a lease over without talking.

Two kinds of block, both memfds (docs/protocol.md section 3 is the reference):

The **control block**, one per pool, written by the producer only. Consumers receive a read-only
descriptor of it and map it ``PROT_READ``; the memfd is sealed against growing, shrinking and
any later writable mapping (``F_SEAL_FUTURE_WRITE``), so a consumer that reopens it through
``/proc/self/fd`` still cannot write it. Little-endian:

    header, 64 bytes:
      0  magic    8 bytes  b"FEATPOOL"
      8  version  u32      2
     12  nslots   u32
     16  epoch    u64      random per pool instance: a consumer tells a restarted pool by it
     24  stride   u32      bytes per slot record (16)
     28  reserved
    slot i at 64 + i * 16:
      0  gen      u32  generation of the lease now in the slot (0: none); the producer writes it
                       on the host when it reserves the slot and clears it when the lease ends
      4  ready    u32  set to ``gen`` once the lease's bytes are in place; on the GPU tier the
                       producer's CUDA stream writes it after the copy (cuStreamWriteValue32)
      8  ack      u32  the producer's own ack word (in-process users; the device control words
                       of remote consumers use the same record layout)
     12  reserved

An **ack block**, one per attached consumer, created at attach and sent read-write to that
consumer only: slot i at ``i * 8`` holds ``opened`` (u32, the generation the consumer opened)
and ``ack`` (u32, the generation it is done with). Sealed against resizing. A consumer's bad
words can only keep leases it marked opened (up to the quarantine limit) or end leases nobody
else has opened.

The control block is registered by the producer as mapped pinned memory on CUDA, so GPU streams
write ready words; consumers register it read-only and their own ack block read-write, so
their streams wait on ready words and write acks. The reaper reads every word with numpy.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import struct
import threading

import numpy as np

MAGIC = b"FEATPOOL"
VERSION = 2
ACK_STRIDE = 8  # bytes per slot in an ack block: opened u32, ack u32
ACK_DTYPE = np.dtype([("opened", "<u4"), ("ack", "<u4")], align=False)
# Python 3.11's fcntl lacks this name; Linux >= 5.1 has the seal.
F_SEAL_FUTURE_WRITE: int = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
SEAL_SIZE = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
HEADER_SIZE = 64
SLOT_STRIDE = 16
_HEADER = struct.Struct("<8sIIQI")
SLOT_DTYPE = np.dtype(
    [("gen", "<u4"), ("ready", "<u4"), ("ack", "<u4"), ("reserved", "<u4")], align=False
)
GEN_OFFSET, READY_OFFSET, ACK_OFFSET = 0, 4, 8


def sealed_memfd(name: str, size: int) -> int:
    """A memfd of ``size`` bytes that allows sealing (the caller seals it once mapped)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def seal(fd: int, *, read_only: bool) -> None:
    """Seal a memfd against shrinking and growing (a consumer's ``ftruncate`` would SIGBUS the
    producer) and, with ``read_only``, against every writable mapping or ``write`` made from
    now on: the producer's existing mapping stays writable, nobody gets a new one, not even
    through ``open("/proc/self/fd/N", O_RDWR)``. Then no more seals may be added."""
    seals = SEAL_SIZE | (F_SEAL_FUTURE_WRITE if read_only else 0) | fcntl.F_SEAL_SEAL
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)


def reopen_read_only(fd: int) -> int:
    """A new descriptor of the same memfd opened O_RDONLY: ``mmap(PROT_WRITE, MAP_SHARED)`` of
    it fails with EACCES, and it cannot add seals. The caller owns it."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


_fence_lock = threading.Lock()


def full_fence() -> None:
    """Order this thread's earlier stores before its later loads (the Dekker handshake between
    a consumer's ``opened`` mark and the producer's ``gen`` word, docs/protocol.md 6). An
    uncontended lock acquire is a locked read-modify-write (``lock cmpxchg``), a full barrier
    on x86-64; Python has no bare fence."""
    with _fence_lock:
        pass


def gen_reached(word: int, gen: int) -> bool:
    """``word >= gen`` in 32-bit serial arithmetic: ``(int32)(word - gen) >= 0``, the compare
    cuStreamWaitValue32 GEQ makes, so it stays right when generations wrap."""
    return ((word - gen) & 0xFFFFFFFF) < 0x80000000


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
        if self.size > len(mm):
            raise ValueError(f"control block of {len(mm)} bytes is too small for {nslots} slots")

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
        fd = sealed_memfd("featpool-control", size)
        try:
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            epoch = epoch if epoch is not None else secrets.randbits(63) | 1
            _HEADER.pack_into(mm, 0, MAGIC, VERSION, nslots, epoch, SLOT_STRIDE)
            seal(fd, read_only=True)  # only the mapping above may ever write it
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, mm, owner=True)

    @classmethod
    def attach(cls, fd: int) -> ControlBlock:
        """Map a control block received from the producer, read-only. Takes ``fd`` (closed
        here, mapped or not)."""
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_SIZE:
                raise ValueError("control block too small")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        try:
            return cls(-1, mm, owner=False)
        except BaseException:
            mm.close()
            raise

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
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class AckBlock:
    """One consumer's ``opened`` and ``ack`` words, one pair per slot (module docstring). The
    pool creates it at attach and maps it read-only; the consumer maps it read-write."""

    def __init__(self, fd: int, mm: mmap.mmap, nslots: int) -> None:
        self.fd = fd
        self._mm = mm
        self.nslots = nslots
        self.size = len(mm)
        self.words = np.frombuffer(mm, dtype=ACK_DTYPE, count=nslots)
        self.opened, self.acks = self.words["opened"], self.words["ack"]
        self.address: int = self.words.ctypes.data

    @staticmethod
    def size_for(nslots: int) -> int:
        return max(mmap.PAGESIZE, -(-nslots * ACK_STRIDE // mmap.PAGESIZE) * mmap.PAGESIZE)

    @classmethod
    def create(cls, nslots: int) -> AckBlock:
        """The producer's side: a new zeroed block, sealed against resizing, mapped read-only
        here. ``fd`` stays open for the hand-off (send it, or a dup, to the consumer)."""
        size = cls.size_for(nslots)
        fd = sealed_memfd("featpool-acks", size)
        try:
            seal(fd, read_only=False)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, mm, nslots)

    @classmethod
    def attach(cls, fd: int, nslots: int) -> AckBlock:
        """The consumer's side: map the received block read-write. Takes ``fd``."""
        try:
            size = os.fstat(fd).st_size
            if size < nslots * ACK_STRIDE:
                raise ValueError(f"ack block of {size} bytes is too small for {nslots} slots")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(-1, mm, nslots)

    def set_opened(self, slot: int, gen: int) -> None:
        self.opened[slot] = gen

    def set_ack(self, slot: int, gen: int) -> None:
        self.acks[slot] = gen

    def close(self) -> None:
        self.words = np.empty(0, dtype=ACK_DTYPE)
        self.opened, self.acks = self.words["opened"], self.words["ack"]
        try:
            self._mm.close()
        except BufferError:
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
