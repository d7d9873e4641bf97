"""The job channel's frames (app/jobs.py): an encode answer serialised by pydantic straight to
JSON reads back, through the fronts' own frame reader, as the same header and the same
EncodeResponse as the model_dump + json.dumps it replaced; the jobs a front starts in one turn
of its event loop go out in one write."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from app.admission import Admission
from app.engine_client import EncodeOptions, ImageIn
from app.jobs import JobClient, JobServer, _frame, _read
from pool.descriptor import EncodeResponse, LeaseDescriptor


def _answer() -> EncodeResponse:
    now = time.time()
    items = [
        LeaseDescriptor(
            lease_id=f"{i:032x}",
            epoch="7d5cab9a561b7e9b",
            state="ready",
            tier="gpu",
            transport="cuda_vmm",
            slab=0,
            offset=302592 * i,
            nbytes=302592,
            shape=[197, 768],
            dtype="bfloat16",
            grid_thw=[1, 12, 18] if i else None,
            tokens=54 if i else None,
            slot=17 + i,
            generation=3,
            created_at=now,
            expires_at=now + 1 / 3,  # a float without a short decimal form
            ttl_s=2.0,
            feature_hash="ab" * 32,
            cached=bool(i),
        )
        for i in range(2)
    ]
    return EncodeResponse(items=items)


async def _read_frame(parts: list[bytes]) -> tuple[dict[str, object], bytes]:
    reader = asyncio.StreamReader()
    reader.feed_data(b"".join(parts))
    reader.feed_eof()
    return await _read(reader)


def test_an_answer_serialised_by_pydantic_reads_back_as_before() -> None:
    answer = _answer()
    head = {"id": 7, "status": 200, "headers": {}}
    new = _frame(head, (), answer)
    old = _frame({**head, "body": answer.model_dump(mode="json")})
    got_new, payload = asyncio.run(_read_frame([bytes(p) for p in new]))
    got_old, _ = asyncio.run(_read_frame([bytes(p) for p in old]))
    assert payload == b""
    assert got_new == got_old
    assert EncodeResponse.model_validate(got_new["body"]) == answer


def test_a_payload_still_follows_the_header() -> None:
    parts = _frame({"id": 1, "status": 200, "headers": {}}, [b"abc", b"de"], _answer())
    header, payload = asyncio.run(_read_frame([bytes(p) for p in parts]))
    assert header["payload"] == 5 and payload == b"abcde"
    assert len(header["body"]["items"]) == 2  # type: ignore[index]


class Labels:
    """An engine client that records the labels of the images it is asked to encode."""

    def __init__(self) -> None:
        self.labels: list[str] = []

    async def encode(self, images: Sequence[ImageIn], options: EncodeOptions) -> list[object]:
        self.labels += [i.label for i in images]
        return []

    def discard(self, lease_id: str) -> None:
        pass


@pytest.mark.parametrize("arena_bytes", [1 << 20, 0])
def test_the_jobs_of_one_turn_go_out_in_one_write(tmp_path: Path, arena_bytes: int) -> None:
    """Sixteen encode jobs started in one turn of a front's event loop reach the GPU process
    in one write of sixteen frames (one system call, read in one go there), and every one of
    them is answered; a later job goes out in a write of its own."""
    engine = Labels()
    writes: list[int] = []

    async def run() -> None:
        server = JobServer(tmp_path / "s.jobs", engine, Admission(1 << 20, 1 << 50))  # type: ignore[arg-type]
        await server.start()
        client = JobClient(server.path, arena_bytes)
        try:
            await client.encode([ImageIn("first", b"connects")], EncodeOptions())
            conn = client._conn
            assert conn is not None
            writelines = conn.writer.writelines

            def counted(parts: Any) -> None:
                parts = list(parts)
                writes.append(sum(map(_is_header, parts)))  # frames in this write
                writelines(parts)

            conn.writer.writelines = counted  # type: ignore[method-assign]
            jobs = [
                client.encode([ImageIn(f"img{i}", b"x" * (100 + i))], EncodeOptions())
                for i in range(16)
            ]
            assert await asyncio.gather(*jobs) == [[]] * 16
            await client.encode([ImageIn("last", b"alone")], EncodeOptions())
        finally:
            await client.close()
            await server.stop()

    asyncio.run(run())
    assert writes == [16, 1]
    assert sorted(engine.labels) == sorted(["first", "last"] + [f"img{i}" for i in range(16)])


def _is_header(part: Any) -> bool:
    """A frame's first part: its 4-byte length, then a JSON header of that length."""
    raw = bytes(part)
    return len(raw) >= 4 and int.from_bytes(raw[:4], "big") == len(raw) - 4
