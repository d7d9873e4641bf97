"""featpool_vllm's encoder-cache connector against the real vLLM package and a real featpool
server (host tier, CPU).

vLLM 0.34.0 pins torch 2.14 (and a CUDA stack); this project runs torch 2.13 on the CPU. So the
test makes an environment of its own (``.venv-vllm`` at the repository root, kept between runs):
a virtual environment that sees this one's packages through a ``.pth`` file, with the vllm wheel
and the few pure-Python packages its import chain needs installed without their dependencies'
torch pins. vLLM's classes are used as they are; nothing of vLLM is replaced. It takes ~30 s the
first time (a 240 MB wheel), then nothing.
"""

from __future__ import annotations

import io
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from tests.helpers import ROOT, server_process

VLLM = "vllm==0.34.0"
# vLLM's own pins where it has them; installed without dependencies (their deps are torch & co).
NO_DEPS = [VLLM, "xgrammar==0.2.8", "apache-tvm-ffi==0.1.11"]
# What `import vllm.config` and the connector modules reach, with their usual dependencies.
WITH_DEPS = [
    "llguidance>=1.7,<1.8",
    "psutil",
    "pyzmq>=25",
    "aiohttp>=3.14",
    "pybase64",
    "cachetools",
    "cbor2",
    "msgspec",
    "cloudpickle",
    "py-cpuinfo",
]
ENV_DIR = ROOT / ".venv-vllm"


def vllm_python() -> Path:
    python = ENV_DIR / "bin" / "python"
    stamp = ENV_DIR / "featpool-stamp"
    want = "\n".join([*NO_DEPS, *WITH_DEPS, sys.executable])
    if stamp.exists() and stamp.read_text() == want and python.exists():
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(ENV_DIR)], check=True)
    purelib = next(Path(p) for p in site.getsitepackages() if p.endswith("site-packages"))
    target = ENV_DIR / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    (target / "site-packages" / "featpool_base.pth").write_text(f"{purelib}\n{ROOT}\n")
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "--no-deps", *NO_DEPS], check=True)
    subprocess.run([*pip, *WITH_DEPS], check=True)
    stamp.write_text(want)
    return python


@pytest.mark.e2e
@pytest.mark.timeout(900)
@pytest.mark.parametrize("found", [False, True], ids=["configured", "found-in-the-index"])
def test_connector_against_real_vllm_and_featpool(tmp_path: Path, found: bool) -> None:
    """configured: url and socket given. found-in-the-index: only the socket directory and a
    GPU UUID; the server's entry names its socket and (--advertise-host) its HTTP address."""
    python = vllm_python()
    from skimage import data

    image = tmp_path / "astronaut.png"
    buf = io.BytesIO()
    Image.fromarray(data.astronaut()).save(buf, "PNG")
    image.write_bytes(buf.getvalue())
    sock = tmp_path / "featpool.sock"
    uuid = "GPU-1f6e2c9a-0b1d-4e55-9a43-7c1d2e3f4a5b"
    args = ("--gpu-uuid", uuid, "--advertise-host", "127.0.0.1") if found else ()
    with server_process(sock, tmp_path / "server.log", *args) as (url, _):
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
        env["VLLM_NO_USAGE_STATS"] = "1"
        r = subprocess.run(
            [
                str(python),
                str(ROOT / "tests" / "vllm" / "drive_connector.py"),
                url,
                str(sock),
                str(image),
                *([uuid] if found else []),
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    out = r.stdout + r.stderr
    print(r.stdout)  # the checks it passed (pytest -s shows them)
    assert r.returncode == 0, out[-6000:]
    assert "ALL OK" in r.stdout, out[-6000:]
