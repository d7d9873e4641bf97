"""Shared memory between a front process and the GPU process for the job channel's image bytes.

Each front creates one arena per connection to the GPU process: an anonymous memfd (nothing in
the filesystem), sealed against shrinking, passed once with ``SCM_RIGHTS`` in the connection's
hello. The front copies each encode request's image bytes into a range of it (the one copy the
bytes take from the HTTP body to the decoder) and sends offsets instead of bytes; the GPU
process hands the decoders and the hash views of its own mapping. The front frees the range when
the GPU process's answer for that job arrives, or when the connection ends (then the whole arena
goes and the next connection gets a new one, so a job still running for a dead connection never
sees its bytes rewritten).

The GPU process reads a job's bytes only before it answers the job: their SHA-256 on the event
loop where the front sent none (the fronts send it with every encode job), header parse and
Pillow decode on the decode threads (each through its own copy, ``io.BytesIO``), the GPU
decoders in the batch's prepare stage, which the batcher finishes (or waits for, when a request
fails) before the request is answered. One exception, harmless: when
one image of a request fails, a Pillow decode of another image of it that already started runs
on after the error answer, on bytes the front may be rewriting; its result is dropped.

The GPU process checks what it maps and what it reads: a memfd (``F_GET_SEALS`` answers only
for memfds) sealed against shrinking (a front that truncates the file under a mapping would
kill the GPU process with SIGBUS), and every job's range inside the arena. A view keeps the
mapping alive (``mmap`` refuses to close while views exist), so a connection's arena is unmapped
only after the last job that reads it let go of its views (and the last batch of the engine's
tensor of it). No torch here: fronts import this.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Sequence

from pool.allocator import Extent, SlabAllocator

ALIGNMENT = 64  # ranges start on a cache line
NEEDED_SEALS = fcntl.F_SEAL_SHRINK


class ArenaError(ValueError):
    """The front's arena, or a job's range in it, is not acceptable (answered as a 400)."""


class FrontArena:
    """The front's side: a sealed memfd mapped read-write, and a best-fit allocator over it
    (``pool.allocator``; one slab). Single-threaded: the front's event loop owns it."""

    def __init__(self, nbytes: int) -> None:
        size = nbytes // ALIGNMENT * ALIGNMENT
        if size <= 0:
            raise ValueError(f"an arena of {nbytes} bytes holds nothing")
        self.fd = os.memfd_create("featpool-jobs", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            self._map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.size = size
        self._alloc = SlabAllocator([size], ALIGNMENT)

    def put(self, chunks: Sequence[bytes | memoryview]) -> Extent | None:
        """Copy ``chunks`` back to back into a free range: its extent, or None if no range is
        large enough now (the caller sends them inline)."""
        total = sum(len(c) for c in chunks)
        if total == 0 or self._map.closed:
            return None
        extent = self._alloc.allocate(total)
        if extent is None:
            return None
        at = extent.offset
        for c in chunks:
            self._map[at : at + len(c)] = c
            at += len(c)
        return extent

    def free(self, extent: Extent) -> None:
        if not self._map.closed:
            self._alloc.free(extent)

    @property
    def used_bytes(self) -> int:
        return self._alloc.used_bytes

    def close(self) -> None:
        if not self._map.closed:
            self._map.close()
            os.close(self.fd)


class ArenaView:
    """The GPU process's side: a front's arena mapped from the FD of its hello. Views of it are
    zero-copy ``memoryview`` slices; the mapping is writable because ``torch.frombuffer`` takes
    a writable buffer without a copy or a warning, but nothing in the GPU process writes it."""

    def __init__(self, fd: int, nbytes: int) -> None:
        """Map ``nbytes`` of ``fd`` (which the caller still owns and closes)."""
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            raise ArenaError("the job arena must be a memfd (F_GET_SEALS refused)") from None
        if seals & NEEDED_SEALS != NEEDED_SEALS:
            raise ArenaError("the job arena's memfd must be sealed against shrinking")
        size = os.fstat(fd).st_size
        if not 0 < nbytes <= size:
            raise ArenaError(f"job arena of {nbytes} bytes announced, the memfd has {size}")
        try:
            self._map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise ArenaError(f"the job arena cannot be mapped ({e})") from None
        self.size = nbytes
        self._view: memoryview | None = memoryview(self._map)
        # The engine's uint8 tensor of the whole mapping, with the view that holds it
        # (app.engine.arena_tensor), made once so that a batch's JPEGs are spans of it rather
        # than a tensor each. No torch here: it is whatever the engine keeps, and it goes at
        # close.
        self.tensor: object | None = None

    @property
    def closed(self) -> bool:
        return self._view is None

    def whole(self) -> memoryview | None:
        """A new view of the whole mapping, for one zero-copy tensor of it; None once closed.
        Like the images' views it keeps the mapping alive while it lives (a view of the mmap
        itself would not: ``torch.frombuffer`` lets go of the buffer at once and keeps only a
        reference, and the mapping would be unmapped under the tensor)."""
        return None if self.closed else memoryview(self._map)

    def images(self, offset: object, sizes: Sequence[object]) -> list[memoryview]:
        """Views of images of ``sizes`` bytes stored back to back from ``offset`` (image i's
        from ``offset + sum(sizes[:i])``); ArenaError if any byte of them lies outside the
        arena."""
        if self._view is None:
            raise ArenaError("the job arena is closed")
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ArenaError(f"arena offset {offset!r} is not a non-negative integer")
        out, at = [], offset
        for size in sizes:
            if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
                raise ArenaError(f"image size {size!r} is not a positive integer")
            if at + size > self.size:
                raise ArenaError(
                    f"image bytes [{at}, {at + size}) lie outside the front's job arena "
                    f"({self.size} bytes)"
                )
            out.append(self._view[at : at + size])
            at += size
        return out

    def close(self) -> None:
        """Unmap now if no view is left; else the last view to go unmaps it (the views hold
        the only references to the mapping left)."""
        if self._view is None:
            return
        self._view.release()
        self._view = None
        self.tensor = None  # a batch that still reads holds it, and it the mapping
        try:
            self._map.close()
        except BufferError:  # a job still reads: its views keep the mapping
            pass
        del self._map
