"""The job arena (app/job_arena.py): the front's allocator over a sealed memfd, the GPU
process's checked, zero-copy views of it, and the mapping's lifetime."""

from __future__ import annotations

import asyncio
import fcntl
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from app.admission import Admission
from app.engine import Job, arena_tensor, byte_spans, byte_tensor
from app.engine_client import EncodeOptions, ImageIn
from app.gpu_decode import ByteSpans, narrow_spans, torchscript
from app.job_arena import ArenaError, ArenaView, FrontArena
from app.jobs import JobClient, JobServer


@pytest.fixture
def mapped() -> Iterator[tuple[FrontArena, ArenaView]]:
    """A front's arena of 64 KiB and the GPU process's mapping of it, both closed after."""
    arena = FrontArena(1 << 16)
    view = ArenaView(arena.fd, arena.size)
    try:
        yield arena, view
    finally:
        view.close()
        arena.close()


def test_ranges_are_freed_and_reused_and_a_full_arena_says_so() -> None:
    arena = FrontArena(4096)
    try:
        a = arena.put([b"x" * 1000, b"y" * 1000])
        b = arena.put([b"z" * 2000])
        assert a is not None and b is not None
        assert arena.put([b"w" * 200]) is None  # 2048 + 2048 of 4096 used: no room
        arena.free(a)
        c = arena.put([b"v" * 2000])
        assert c is not None and c.offset == a.offset  # the freed range, again
        assert arena.put([b"u" * 5000]) is None  # larger than the arena: never fits
        assert arena.put([]) is None
    finally:
        arena.close()
    assert arena.put([b"late"]) is None  # a closed arena takes nothing


def test_the_gpu_side_sees_the_fronts_bytes_without_a_copy(
    mapped: tuple[FrontArena, ArenaView],
) -> None:
    arena, view = mapped
    ext = arena.put([b"\xff\xd8\xffhello", b"world"])
    assert ext is not None
    first, second = view.images(ext.offset, [8, 5])
    assert (bytes(first), bytes(second)) == (b"\xff\xd8\xffhello", b"world")
    assert first[:3] == b"\xff\xd8\xff"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns on a read-only buffer
        t = byte_tensor(second)
    arena._map[ext.offset + 8 : ext.offset + 13] = b"WORLD"  # the front writes again
    assert bytes(t.numpy()) == b"WORLD"  # the tensor is a view, not a copy
    # An upload's bytes (immutable) are copied: the decoders get a writable buffer.
    data = b"abc"
    copied = byte_tensor(data)
    copied[0] = ord("z")
    assert data == b"abc" and torch.equal(copied, torch.tensor([122, 98, 99], dtype=torch.uint8))


@pytest.mark.parametrize(
    ("offset", "sizes"),
    [
        (65536 - 100, [1000]),  # runs past the end
        (65536, [1]),  # starts at the end
        (-10, [5]),  # negative: Python slicing would read the arena's tail
        (0, [0]),
        (0, [-4]),
        ("0", [4]),
        (0, [True]),
        (1.5, [4]),
        (0, [60000, 6000]),  # the second image past the end
    ],
)
def test_ranges_outside_the_arena_are_refused(
    mapped: tuple[FrontArena, ArenaView], offset: object, sizes: list[object]
) -> None:
    _, view = mapped
    with pytest.raises(ArenaError):
        view.images(offset, sizes)
    assert len(view.images(65536 - 10, [10])[0]) == 10  # the last byte is in range


def test_only_a_memfd_sealed_against_shrinking_is_mapped() -> None:
    unsealed = os.memfd_create("t", os.MFD_ALLOW_SEALING)
    no_seals = os.memfd_create("t")  # F_SEAL_SEAL set from the start: no F_SEAL_SHRINK
    r, w = os.pipe()
    try:
        os.ftruncate(unsealed, 4096)
        os.ftruncate(no_seals, 4096)
        with pytest.raises(ArenaError, match="sealed against shrinking"):
            ArenaView(unsealed, 4096)
        with pytest.raises(ArenaError, match="sealed against shrinking"):
            ArenaView(no_seals, 4096)
        with pytest.raises(ArenaError, match="must be a memfd"):
            ArenaView(r, 4096)
        fcntl.fcntl(unsealed, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        with pytest.raises(ArenaError, match="announced"):
            ArenaView(unsealed, 8192)  # more than the file holds
        ArenaView(unsealed, 4096).close()
    finally:
        for fd in (unsealed, no_seals, r, w):
            os.close(fd)


def maps_of_arenas() -> int:
    with open("/proc/self/maps") as f:
        return sum("featpool-jobs" in line for line in f)


def test_the_mapping_outlives_close_while_a_view_is_held() -> None:
    """A connection that ends while a job of it still decodes: the job's views keep the
    mapping; the last one to go unmaps it."""
    before = maps_of_arenas()
    arena = FrontArena(1 << 16)
    ext = arena.put([b"still here"])
    assert ext is not None
    view = ArenaView(arena.fd, arena.size)
    (held,) = view.images(ext.offset, [10])
    tensor = byte_tensor(view.images(ext.offset, [10])[0])
    arena.close()  # the front side is gone too (its FD and its own mapping)
    view.close()
    with pytest.raises(ArenaError, match="closed"):
        view.images(ext.offset, [10])
    assert maps_of_arenas() == before + 1
    assert bytes(held) == b"still here" and bytes(tensor.numpy()) == b"still here"
    del held
    assert maps_of_arenas() == before + 1  # the tensor still holds it
    del tensor
    assert maps_of_arenas() == before


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize(
    "hello, why",
    [
        ({"op": "hello", "arena_bytes": 1 << 16}, None),  # accepted: the arena is mapped
        ({"op": "hello", "arena_bytes": 0}, "0 and 1 FD"),  # an FD it did not announce
        ({"op": "hello", "arena_bytes": 1 << 30}, "announced"),  # more than the memfd holds
        ({"op": "encode"}, "must be a hello"),
        ({"op": "hello", "arena_bytes": "lots"}, "non-negative integer"),
    ],
)
def test_every_fd_a_hello_brings_is_closed(hello: dict[str, object], why: str | None) -> None:
    """The GPU process keeps no FD a front sends with its hello, accepted or refused: a front
    (or anything that reaches the job socket) cannot pile FDs up in it. The mapping of an
    accepted arena holds a descriptor of its own until the view is closed."""
    import json
    import socket

    from app.jobs import _LEN, _receive_hello

    arena = FrontArena(1 << 16)
    ours, theirs = socket.socketpair()
    try:
        theirs.setblocking(False)
        before = open_fds()
        raw = json.dumps(hello).encode()
        socket.send_fds(ours, [_LEN.pack(len(raw)) + raw], [arena.fd])
        if why is None:
            view = asyncio.run(_receive_hello(theirs))
            assert view is not None and open_fds() == before + 1  # the mapping's own
            view.close()
        else:
            with pytest.raises(ArenaError, match=why):
                asyncio.run(_receive_hello(theirs))
        assert open_fds() == before
    finally:
        ours.close()
        theirs.close()
        arena.close()


def test_a_batch_of_arena_jpegs_is_spans_of_one_tensor_of_the_arena(
    mapped: tuple[FrontArena, ArenaView],
) -> None:
    """``byte_spans``: the JPEGs of a batch from one front's arena are spans of one tensor of
    the whole arena, made once and kept on it, zero-copy (the front's writes show through); an
    inline JPEG gets a tensor of its own; after the connection closed, a tensor each again.
    Compiled by TorchScript, the spans are the same bytes."""
    arena, view = mapped
    ext = arena.put([b"first", b"second!"])
    assert ext is not None
    first, second = view.images(ext.offset, [5, 7])
    jobs = [
        Job("a", None, jpeg=first, arena=view, arena_offset=ext.offset),
        Job("b", None, jpeg=second, arena=view, arena_offset=ext.offset + 5),
        Job("c", None, jpeg=b"inline"),
    ]
    spans = byte_spans(jobs)
    assert len(spans.sources) == 2 and spans.which == [0, 0, 1]
    assert spans.sources[0] is arena_tensor(view) is byte_spans(jobs[:1]).sources[0]
    got = [bytes(t.numpy()) for t in spans.tensors()]
    assert got == [b"first", b"second!", b"inline"]
    compiled = torchscript(narrow_spans)(spans.sources, spans.which, spans.offsets, spans.sizes)
    assert [bytes(t.numpy()) for t in compiled] == got
    arena._map[ext.offset : ext.offset + 5] = b"FIRST"  # the front writes again
    assert bytes(spans.tensors()[0].numpy()) == b"FIRST"  # a view, not a copy
    view.close()
    assert view.tensor is None
    late = byte_spans(jobs[:1])
    assert late.sources[0] is not spans.sources[0]  # a tensor of its own
    assert bytes(late.tensors()[0].numpy()) == b"FIRST"
    whole = [torch.frombuffer(bytearray(b"xyz"), dtype=torch.uint8)] * 2
    assert ByteSpans.of(whole) == ByteSpans(whole, [0, 1], [0, 0], [3, 3])


def test_the_engines_tensor_of_an_arena_keeps_the_mapping_until_it_goes() -> None:
    """A connection that ends while a batch still reads the arena's one tensor: the tensor
    keeps the mapping; once it goes, nothing is left mapped."""
    before = maps_of_arenas()
    arena = FrontArena(1 << 16)
    ext = arena.put([b"still here"])
    assert ext is not None
    view = ArenaView(arena.fd, arena.size)
    whole = arena_tensor(view)
    assert whole is not None
    arena.close()
    view.close()
    assert view.tensor is None and arena_tensor(view) is None
    assert maps_of_arenas() == before + 1
    assert bytes(whole[ext.offset : ext.offset + 10].numpy()) == b"still here"
    del whole
    assert maps_of_arenas() == before


class Capture:
    """An engine client that records, for each image of an encode job, whether the GPU process
    knows its place in an arena, and the bytes found there."""

    def __init__(self) -> None:
        self.seen: list[tuple[bool, bytes | None, bytes]] = []

    async def encode(self, images: Sequence[ImageIn], options: EncodeOptions) -> list[object]:
        for img in images:
            mapping = img.arena.whole() if img.arena is not None else None
            at = (
                bytes(mapping[img.arena_offset : img.arena_offset + len(img.data)])
                if mapping is not None
                else None
            )
            self.seen.append((img.arena is not None, at, bytes(img.data)))
        return []

    def discard(self, lease_id: str) -> None:
        pass


@pytest.mark.parametrize("arena_bytes", [1 << 16, 0])
def test_the_gpu_process_knows_where_in_the_arena_each_image_lies(
    tmp_path: Path, arena_bytes: int
) -> None:
    """A job through the arena gives each ImageIn the arena and the image's offset in it
    (where ``byte_spans`` takes the bytes from); a job sent inline gives none."""
    capture = Capture()

    async def run() -> None:
        server = JobServer(tmp_path / "s.jobs", capture, Admission(1 << 20, 1 << 50))  # type: ignore[arg-type]
        await server.start()
        client = JobClient(server.path, arena_bytes)
        try:
            images = [ImageIn("a", b"alpha"), ImageIn("b", b"beta!!"), ImageIn("c", b"c")]
            await client.encode(images, EncodeOptions())
            await client.encode([ImageIn("d", b"delta")], EncodeOptions())
        finally:
            await client.close()
            await server.stop()

    asyncio.run(run())
    datas = [b"alpha", b"beta!!", b"c", b"delta"]
    if arena_bytes:
        assert capture.seen == [(True, d, d) for d in datas]
    else:
        assert capture.seen == [(False, None, d) for d in datas]


def test_the_arenas_tensor_is_held_so_its_spans_need_no_interpreter_lock(
    mapped: tuple[FrontArena, ArenaView],
) -> None:
    """Since torch 2.10 a tensor's Python object gets a reference from C++ when the tensor's
    count of C++ references goes from 1 to 2, and loses it from 2 to 1, each under the
    interpreter lock. The one-call decode makes and frees a batch's spans (views) of the
    arena's tensor with the lock released. Held (``held``), the tensor has that reference for
    as long as the arena lives, so a span made or freed changes nothing that needs the lock; a
    tensor not held gets the reference with its first span (the control)."""
    if torch.__version__ < "2.10":  # (a TorchVersion: compared as a version)
        pytest.skip("before torch 2.10 a tensor's C++ references leave its Python object be")
    _, view = mapped
    whole = arena_tensor(view)
    assert whole is not None
    before = sys.getrefcount(whole)
    span = whole[10:20]
    assert sys.getrefcount(whole) == before
    del span
    assert sys.getrefcount(whole) == before
    bare = torch.frombuffer(view.whole(), dtype=torch.uint8)  # type: ignore[arg-type]
    before = sys.getrefcount(bare)
    span = bare[10:20]
    assert sys.getrefcount(bare) == before + 1
    del span
    assert sys.getrefcount(bare) == before
