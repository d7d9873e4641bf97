"""The job channel's frames (app/jobs.py): an encode answer serialised by pydantic straight to
JSON reads back, through the fronts' own frame reader, as the same header and the same
EncodeResponse as the model_dump + json.dumps it replaced."""

from __future__ import annotations

import asyncio
import time

from app.jobs import _frame, _read
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
