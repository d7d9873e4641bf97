"""``python -m app [--flags]``: every setting is a flag (``--pool-bytes``) and an environment
variable (``FEATPOOL_POOL_BYTES``)."""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import uvicorn
from prometheus_client.multiprocess import mark_process_dead
from pydantic import ValidationError
from pydantic_settings import CliApp, SettingsConfigDict

from app import logs
from app.backends import preflight, wants_cuda
from app.encoders import check_encoder_name
from app.front import listen_shared, settings_env
from app.http_protocol import http_protocol
from app.jobs import channel_paths
from app.main import create_app
from app.settings import Settings, auto_http_workers, usable_cores
from pool.errors import PoolError

log = logging.getLogger("app.fronts")


class CliSettings(Settings):
    model_config = SettingsConfigDict(
        env_prefix="FEATPOOL_",
        extra="forbid",
        cli_kebab_case=True,
        cli_prog_name="featpool",
        cli_implicit_flags=True,
    )


def _private_unix_socket(path: Path) -> socket.socket:
    """A listening Unix socket only this user can reach (uvicorn's own ``uds`` is mode 0666)."""
    path.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    sock.listen(2048)
    return sock


def raise_fd_limit() -> tuple[int, int]:
    """Every connection holds a file descriptor, and container runtimes often start a process
    at a soft limit of 1,024 under a far higher hard one: 1,100 trickling connections took all
    1,024 and the health probes failed with them. Raise the soft limit to the hard one (as
    vLLM does at start-up); the fronts inherit it. Returns (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20  # the kernel's usual nr_open
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft, soft
        return soft, target
    return soft, soft


def _claim_port(host: str, port: int) -> socket.socket:
    """Bind the public port for the fronts, which each listen on it too (SO_REUSEPORT, see
    app.front.listen_shared). Bound here first and held while they run, so that port 0 means
    one port for all. SO_REUSEPORT would also let a second featpool of this user share a port
    that is already serving, splitting its traffic: refuse a port where someone listens."""
    if port:
        probe_host = "127.0.0.1" if host in ("0.0.0.0", "") else host.strip("[]")
        if probe_host == "::":
            probe_host = "::1"
        try:
            socket.create_connection((probe_host, port), timeout=0.5).close()
        except OSError:
            pass
        else:
            sys.exit(f"featpool: {host}:{port} is already in use (--port)")
    try:
        return listen_shared(host, port)
    except OSError as e:
        sys.exit(f"featpool: cannot listen on {host}:{port} (--host, --port): {e}")


_PRCTL = ctypes.CDLL(None, use_errno=True).prctl
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the front process, before exec: get SIGTERM when the GPU process ends, however it
    ends (uvicorn re-raises SIGTERM after its shutdown, so no `finally` of ours runs then).
    (The signal comes when the forking thread ends: the main thread, or for a replacement the
    supervisor, which lives as long as the service.) Nothing imported here: between fork and
    exec in a process with threads, an import could wait for a lock no thread will free."""
    _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)


# Hardware work queues the CUDA driver gives this process's streams (its default is 8). With 8,
# the decoders' own streams (nvJPEG's and nvImageCodec's many small per-image copies and
# kernels, each waited for) can share a queue with the encoder's stream and wait behind whole
# forwards: on the H200 a batched decode beside the ViT-B/16 forward loop ran at ~1,970
# images/s with 8 and ~11,600 with 32 (docs/benchmarks.md, "Sixth session"). The driver reads
# the variable once, when the context is made, so it is set before anything touches CUDA; a
# value in the environment is kept.
CUDA_CONNECTIONS = "32"


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", CUDA_CONNECTIONS)
    try:
        settings = CliApp.run(CliSettings, cli_args=sys.argv[1:] if argv is None else argv)
    except ValidationError as e:
        sys.exit(f"featpool: invalid settings:\n{e}")
    try:
        preflight(settings)
        check_encoder_name(settings.encoder)
    except (PoolError, ValueError) as e:
        sys.exit(f"featpool: {e}")
    logs.setup(settings.log_level, settings.log_json)
    before, after = raise_fd_limit()
    if after != before:
        logging.getLogger("app").info(
            "open files: soft limit %d -> %d (the hard limit)", before, after
        )
    if settings.http_workers < 0:
        settings.http_workers = auto_http_workers(usable_cores(), wants_cuda(settings))
        logging.getLogger("app").info(
            "--http-workers %d (of %d usable cores)", settings.http_workers, usable_cores()
        )
    # The batch thread launches GPU work and publishes leases while the event loop parses HTTP.
    # A thread that gave up the GIL (in a CUDA driver call, say) waits up to the switch interval
    # to get it back from a busy thread: 5 ms by default, longer than a whole batch's forward.
    sys.setswitchinterval(settings.gil_switch_interval_ms / 1e3)
    if settings.http_workers == 0:
        uvicorn.run(
            create_app(settings, tune_gc=True),
            host=settings.host,
            port=settings.port,
            http=http_protocol(settings),
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=10,
        )
        return
    # Front processes own the public port; this (GPU) process serves them on Unix sockets.
    _, core_http = channel_paths(settings.socket_path)
    core_http.parent.mkdir(parents=True, exist_ok=True)
    holder = _claim_port(settings.host, settings.port)  # first: a start refused here leaves nothing
    # A fresh directory each start: the fronts' request metrics, summed by this process.
    front_metrics = Path(tempfile.mkdtemp(prefix="featpool-front-metrics-"))
    fronts: list[subprocess.Popen[bytes]] = []
    stopping = threading.Event()

    def stop_fronts() -> None:
        """SIGTERM each front (it stops accepting, answers what it has in flight through the
        job channel, still open, then exits), and wait for it."""
        stopping.set()
        for front in fronts:
            front.terminate()
        for front in fronts:
            try:
                front.wait(timeout=15)
            except subprocess.TimeoutExpired:
                front.kill()
        # Their channel for everything but encode jobs: nobody listens on it any more. (Here,
        # in the app's shutdown: after SIGTERM uvicorn re-raises it, and no `finally` runs.)
        core_http.unlink(missing_ok=True)

    app = create_app(
        settings, front_metrics_dir=front_metrics, tune_gc=True, stop_fronts=stop_fronts
    )
    env = {
        **os.environ,
        **settings_env(settings),
        "FEATPOOL_PORT": str(holder.getsockname()[1]),
        "PROMETHEUS_MULTIPROC_DIR": str(front_metrics),
    }

    def start_front() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "app.front"],
            env=env,
            # Fork before uvicorn starts threads; a replacement forks from the supervisor's
            # thread, and runs nothing of this process's Python before its exec.
            preexec_fn=_die_with_parent,  # noqa: PLW1509
        )

    try:
        for _ in range(settings.http_workers):
            fronts.append(start_front())
        threading.Thread(
            target=_supervise_fronts,
            args=(fronts, start_front, stopping, front_metrics),
            name="featpool-fronts",
            daemon=True,
        ).start()
        listener = _private_unix_socket(core_http)  # kept referenced: uvicorn gets its FD
        uvicorn.run(
            app,
            fd=listener.fileno(),
            http=http_protocol(settings),
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=10,
        )
    finally:
        holder.close()
        stop_fronts()  # (stopped already, unless start-up failed)
        shutil.rmtree(front_metrics, ignore_errors=True)  # (the app's shutdown did, if it ran)


FRONT_RESTART_PAUSE_S = 1.0


def _supervise_fronts(
    fronts: list[subprocess.Popen[bytes]],
    start: Callable[[], subprocess.Popen[bytes]],
    stopping: threading.Event,
    metrics_dir: Path,
) -> None:
    """A front that exits while the service runs (killed, out of memory, a bug) is reaped and
    replaced, and said so in the log: without this the port served on with one front fewer,
    silently, and the dead one stayed a zombie. Its unanswered jobs were already failed and
    their leases released by the job channel."""
    while not stopping.wait(0.2):
        for i, front in enumerate(fronts):
            code = front.poll()
            if code is None or stopping.is_set():
                continue
            log.error("front process %d exited (%s); starting another", front.pid, code)
            # Its last open-FD count (a "livemax" gauge) must not outlive it in the export.
            mark_process_dead(front.pid, str(metrics_dir))  # type: ignore[no-untyped-call]
            stopping.wait(FRONT_RESTART_PAUSE_S)  # a front that dies at once does not spin
            if not stopping.is_set():
                fronts[i] = start()
                log.info("front process %d replaces %d", fronts[i].pid, front.pid)


if __name__ == "__main__":
    main()
