"""Shared fixtures: small settings, real images made on the fly, a fake clock."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from app.main import create_app
from app.settings import Settings
from tests.helpers import small_settings


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def image_bytes(
    fmt: str = "JPEG",
    size: tuple[int, int] = (96, 64),
    mode: str = "RGB",
    seed: int = 0,
    **save: object,
) -> bytes:
    """A real image with photo-like noise (not a flat colour: compressors treat those kindly)."""
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1, "CMYK": 4, "LA": 2}[mode]
    arr = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    im = Image.fromarray(arr.squeeze(-1) if channels == 1 else arr, mode)
    buf = io.BytesIO()
    im.save(buf, fmt, **save)
    return buf.getvalue()


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return small_settings(tmp_path)


@pytest.fixture
def make_client(tmp_path: Path) -> Iterator[Callable[..., TestClient]]:
    """Start the whole HTTP stack on the CPU with the tiny encoder; overrides are settings."""
    opened: list[TestClient] = []

    def make(**overrides: object) -> TestClient:
        client = TestClient(create_app(small_settings(tmp_path, **overrides)))
        client.__enter__()
        opened.append(client)
        return client

    yield make
    for c in opened:
        c.__exit__(None, None, None)


def occupancy(client: TestClient) -> tuple[int, int]:
    """(bytes used in every tier plus inline, active leases)."""
    p = client.get("/v1/pool").json()
    used = sum(t["used_bytes"] for t in p["tiers"]) + p["inline"]["used_bytes"]
    return used, p["leases_active"]
