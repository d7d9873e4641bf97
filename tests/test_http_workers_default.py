"""``--http-workers`` left at its default (-1): the number of front processes is derived from
the usable cores where there is a CUDA device, and is 0 without one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import app.__main__ as cli
from app.settings import Settings, auto_http_workers, usable_cores


def test_auto_http_workers_is_half_the_cores_with_a_gpu_bounded() -> None:
    assert auto_http_workers(16, cuda=True) == 8
    assert auto_http_workers(2, cuda=True) == 1
    assert auto_http_workers(1, cuda=True) == 1
    assert auto_http_workers(128, cuda=True) == 16
    assert auto_http_workers(16, cuda=False) == 0
    assert usable_cores() >= 1


def _run_cli(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *, cores: int, cuda: bool, flags: list[str]
) -> tuple[Settings, int]:
    """Run ``python -m app`` in-process with uvicorn and the front processes faked: the
    settings the app was built with, and how many fronts were started."""
    import torch

    built: list[Settings] = []
    started: list[list[str]] = []

    class FakeFront:
        def __init__(self, cmd: list[str], **_: Any) -> None:
            started.append(cmd)

        def terminate(self) -> None: ...

        def wait(self, timeout: float | None = None) -> int:
            return 0

    monkeypatch.setattr(cli, "usable_cores", lambda: cores)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(cli, "preflight", lambda s: None)
    monkeypatch.setattr(cli, "create_app", lambda s, **_: built.append(s))
    monkeypatch.setattr(cli.uvicorn, "run", lambda *a, **k: None)
    monkeypatch.setattr(cli.subprocess, "Popen", FakeFront)
    for name in Settings.model_fields:
        monkeypatch.delenv(f"FEATPOOL_{name.upper()}", raising=False)
    cli.main(["--socket-path", str(tmp_path / "s.sock"), "--port", "0", *flags])
    return built[0], len(started)


def test_default_starts_fronts_from_the_cores_on_a_gpu_node(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    s, fronts = _run_cli(monkeypatch, tmp_path, cores=16, cuda=True, flags=[])
    assert s.http_workers == 8 and fronts == 8


def test_default_serves_http_in_process_without_cuda(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    s, fronts = _run_cli(monkeypatch, tmp_path, cores=16, cuda=False, flags=[])
    assert s.http_workers == 0 and fronts == 0
    s, fronts = _run_cli(monkeypatch, tmp_path, cores=16, cuda=True, flags=["--device", "cpu"])
    assert s.http_workers == 0 and fronts == 0


def test_an_explicit_count_is_kept(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    s, fronts = _run_cli(monkeypatch, tmp_path, cores=16, cuda=True, flags=["--http-workers", "3"])
    assert s.http_workers == 3 and fronts == 3


def test_the_gpu_process_sets_its_switch_interval(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import sys

    before = sys.getswitchinterval()
    try:
        _run_cli(monkeypatch, tmp_path, cores=4, cuda=True, flags=[])
        assert sys.getswitchinterval() == pytest.approx(0.0005)  # the default, 0.5 ms
        _run_cli(
            monkeypatch, tmp_path, cores=4, cuda=True, flags=["--gil-switch-interval-ms", "0.1"]
        )
        assert sys.getswitchinterval() == pytest.approx(0.0001)
    finally:
        sys.setswitchinterval(before)
