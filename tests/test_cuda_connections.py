"""``python -m app`` gives the CUDA driver 32 hardware work queues (CUDA_DEVICE_MAX_CONNECTIONS)
before anything can make a CUDA context, and keeps a value the environment already has. With
the driver's 8, nvJPEG's streams waited behind the encoder's forwards (docs/benchmarks.md,
"Sixth session")."""

from __future__ import annotations

import os

import pytest

import app.__main__ as cli
from pool.errors import PoolError

VAR = "CUDA_DEVICE_MAX_CONNECTIONS"


def _value_seen_by_preflight(monkeypatch: pytest.MonkeyPatch) -> str | None:
    """Run ``main`` up to ``preflight`` (the first step that may touch the driver): the
    variable's value there."""
    seen: list[str | None] = []

    def preflight(_settings: object) -> None:
        seen.append(os.environ.get(VAR))
        raise PoolError("stop here")

    monkeypatch.setattr(cli, "preflight", preflight)
    with pytest.raises(SystemExit, match="stop here"):
        cli.main(["--device", "cpu"])
    assert len(seen) == 1
    return seen[0]


def test_the_service_asks_for_32_work_queues_before_cuda_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(VAR, raising=False)
    assert _value_seen_by_preflight(monkeypatch) == "32"


def test_a_value_in_the_environment_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VAR, "4")
    assert _value_seen_by_preflight(monkeypatch) == "4"
