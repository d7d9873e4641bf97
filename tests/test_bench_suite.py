"""The benchmark suite and its report, on the CPU and fast: the allocator sweep through the
suite's own subprocess runner, a sweep that fails without taking the others down, the fresh-VMM
baseline against the fake driver, the report rendered from synthetic GPU + CPU results, and the
job-channel bench through the real job server."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import report  # noqa: E402
import suite  # noqa: E402

from tests.test_cuda_vmm_fake import FakeDriver, FakeRuntime  # noqa: E402


def test_cpu_alloc_sweep_small_and_a_failing_sweep_is_recorded(tmp_path: Path) -> None:
    out = tmp_path / "suite.json"
    rc = suite.main(
        [
            "--mode",
            "cpu",
            "--only",
            "encoder,alloc",
            "--quick",
            "--out",
            str(out),
            "--inject-fail",
            "encoder",
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["mode"] == "cpu" and res["quick"] is True
    assert {"date", "command", "machine", "sweeps", "wall_s"} <= set(res)
    enc = res["sweeps"]["encoder"]
    assert enc["status"] == "error" and "injected" in enc["error"]
    alloc = res["sweeps"]["alloc"]
    assert alloc["status"] == "ok", alloc.get("log_tail")
    assert alloc["machine"]["torch"] == torch.__version__
    assert alloc["date"] and "--child alloc" in alloc["command"]
    r = alloc["result"]
    assert set(r) == {"config", "allocator", "pool", "frag_series", "pool_size"}
    assert [round(x["occupancy_target"], 1) for x in r["allocator"]] == [0.1, 0.5, 0.9]
    for row in r["allocator"]:
        assert row["allocate_ns"]["n"] > 0 and row["allocate_ns"]["median"] > 0
        assert 0.0 <= row["frag"] <= 1.0 and 0.0 <= row["usable_for_9.8MB"] <= 1.0
        assert abs(row["occupancy"] - row["occupancy_target"]) < 0.1
    for row in r["pool"]:
        assert row["put_ns"]["median"] > 0 and row["release_ns"]["median"] > 0
    assert all(len(s["series"]) > 2 for s in r["frag_series"])
    assert len(r["pool_size"]) == 2


def test_fresh_vmm_baseline_against_the_fake_driver() -> None:
    calls: list[tuple[Any, ...]] = []
    drv = FakeDriver(calls)
    rt = FakeRuntime(drv)
    src = torch.arange(3000, dtype=torch.int16)  # 6000 bytes: rounded up to one granule
    nbytes = src.numel() * 2
    gran = drv.granularity(0, suite_handle_posix())
    prod, fd = suite.fresh_vmm_export(
        drv, 0, gran, src_ptr=src.data_ptr(), nbytes=nbytes, stream=rt.current_stream()
    )
    assert prod.size == gran
    cons = suite.fresh_vmm_import(drv, fd, prod.size, gran, 0)
    seen = rt.tensor_at(cons.ptr, nbytes).view(torch.int16)
    assert torch.equal(seen, src)
    assert drv.maps[cons.ptr][1] is True  # the consumer maps read-only
    assert drv.maps[prod.ptr][1] is False
    suite.fresh_vmm_free(drv, cons)
    suite.fresh_vmm_free(drv, prod)
    assert not drv.live and not drv.maps and not drv.vas
    names = [c[0] for c in calls]
    assert names == [
        "granularity",
        "mem_create",
        "address_reserve",
        "mem_map",
        "set_access",
        "memcpy_dtod_async",
        "export_fd",
        "import_fd",
        "address_reserve",
        "mem_map",
        "set_access",
        "mem_unmap",
        "address_free",
        "mem_release",
        "mem_unmap",
        "address_free",
        "mem_release",
    ]


def suite_handle_posix() -> Any:
    from pool.driver import HandleType

    return HandleType.POSIX_FD


def _transports(base: float, kinds: list[str]) -> dict[str, Any]:
    mult = {"pool": 1.0, "cuda_ipc": 1.6, "fresh_vmm": 5.0, "fresh_shm": 3.0, "cpu_bytes": 60.0}
    return {
        k: {
            "median_us": base * mult[k],
            "p90_us": base * mult[k] * 1.2,
            "p99_us": base * mult[k] * 1.5,
            "n": 10,
            "producer_median_us": base * 0.5,
            "consumer_median_us": base * 0.3,
            "wrong_reads": 0,
            **(
                {"producer_teardown_median_us": 50.0, "consumer_teardown_median_us": 40.0}
                if k.startswith("fresh")
                else {}
            ),
        }
        for k in kinds
    }


def synthetic(mode: str) -> dict[str, Any]:
    gpu = mode == "gpu"
    kinds = (
        ["pool", "cuda_ipc", "fresh_vmm", "cpu_bytes"]
        if gpu
        else ["pool", "fresh_shm", "cpu_bytes"]
    )
    mach = {
        "gpu": "NVIDIA H200, 580.0" if gpu else "none",
        "cpu": "Test CPU",
        "cpu_count": 16,
        "torch": "2.11.0",
        "python": "3.12",
    }
    sizes = [0.3, 1.0, 9.8, 128.0]
    handoff_pts: list[dict[str, Any]] = [
        {
            "size_mb": s,
            "nbytes": int(s * 1e6),
            "transports": _transports(100 + 30 * s, kinds),
            "bandwidth": {
                "nbytes": int(s * 1e6),
                "copies": 5,
                "publish_GBps": 100 * s**0.3,
                "copy_GBps": 120 * s**0.3,
                "plain_GBps": 121 * s**0.3,
                "publish_fraction": 0.8,
                "copy_fraction": 0.99,
                "publish_us_per_lease": 5 * s,
                "plain_us_per_copy": 4 * s,
            },
            "pool_put_median_us": 40.0,
            "wall_s": 1.0,
        }
        for s in sizes
    ]
    handoff_pts.append({"size_mb": 32.0, "error": "RuntimeError: boom", "wall_s": 0.1})
    common = {
        "status": "ok",
        "machine": mach,
        "date": "Wed Dec  2 15:00:00 UTC 2026",
        "command": "python3 bench/suite.py --child x",
        "wall_s": 1.0,
        "cap_s": 10,
    }
    e2e_pts = []
    for server, body, k, c, ips in (
        ("featpool", "raw", 1, 1, 50),
        ("featpool", "raw", 1, 64, 700),
        ("featpool", "multipart", 16, 32, 1300),
        ("naive", "raw", 1, 1, 40),
        ("naive", "raw", 1, 16, 120),
    ):
        e2e_pts.append(
            {
                "server": server,
                "body": body,
                "images_per_request": k,
                "concurrency": c,
                "images_per_s": ips,
                "requests": 100,
                "p50_ms": 10.0 * c**0.5,
                "p99_ms": 30.0 * c**0.5,
                "status": {"200": 100},
                "decode_ms": 0.2,
                "queue_ms": 5.0,
                "encode_ms_per_batch": 8.0,
                "publish_us": 300.0,
                "mean_batch": 20.0,
                "batches": 10,
            }
        )
    e2e_pts.append(
        {
            "server": "naive",
            "body": "raw",
            "images_per_request": 1,
            "concurrency": 64,
            "skipped": "out of the time budget",
        }
    )
    alloc_row = {
        "occupancy_target": 0.5,
        "occupancy": 0.5,
        "pool_bytes": 1 << 30,
        "slabs": 8,
        "live_extents": 100,
        "ops": 10,
        "allocate_ns": {"median": 3000, "mean": 3100, "p99": 6000, "n": 10},
        "free_ns": {"median": 2000, "mean": 2100, "p99": 4000, "n": 10},
        "requests": 10,
        "fails": 0,
        "frag_fails": 0,
        "frag": 0.0,
        "usable_for_9.8MB": 0.9,
        "free_extents": 3,
    }
    hi = dict(alloc_row, occupancy_target=0.9, occupancy=0.9, fails=3, frag_fails=2, frag=0.8)
    pool_row = {
        "occupancy_target": 0.5,
        "occupancy": 0.5,
        "live_leases": 100,
        "ops": 5,
        "put_ns": {"median": 20000, "mean": 1, "p99": 1, "n": 5},
        "release_ns": {"median": 7000, "mean": 1, "p99": 1, "n": 5},
        "fails": 0,
    }
    return {
        "suite_version": 1,
        "mode": mode,
        "quick": False,
        "date": "Wed Dec  2 15:00:00 UTC 2026",
        "command": f"python3 bench/suite.py --mode {mode} --out x.json",
        "machine": mach,
        "budget_s": 215,
        "wall_s": 200,
        "sweeps": {
            "handoff": {
                **common,
                "config": {},
                "points": handoff_pts,
                "pipe_floor": {"median_us": 35.0},
            },
            "consumers": {
                **common,
                "config": {
                    "consumers": [1, 2, 4, 8],
                    "size_mb": 9.8,
                    "seconds_per_point": 1.5,
                    "loop": "closed",
                },
                "points": [
                    {
                        "consumers": k,
                        "median_us": 200.0 * k,
                        "p99_us": 500.0 * k,
                        "leases_per_s": 4000.0 + 10 * k,
                        "leases": 100,
                        "consumer_median_us": 50.0,
                        "wrong_reads": 0,
                    }
                    for k in (1, 2, 4, 8)
                ],
            },
            "encoder": {
                **common,
                "config": {
                    "encoder": "vit-b16-224",
                    "batch": 128,
                    "iters": 20,
                    "timing": "CUDA events",
                },
                "points": [
                    {
                        "variant": "cuda_graphs",
                        "encoder": "vit-b16-224",
                        "batch": 128,
                        "images_per_s": 9000.0,
                        "ms_per_batch": 14.0,
                        "host_ms_per_call": 0.3,
                    }
                ],
            },
            "e2e": {
                **common,
                "config": {
                    "encoder": "vit-b16-224",
                    "device": "cuda",
                    "seconds": 3,
                    "warmup": 1,
                    "client_procs": 6,
                },
                "images": {"count": 16, "size": "1024x768", "mean_kb": 200},
                "servers": {
                    "featpool": {
                        "command": "python -m app ...",
                        "start_s": 20,
                        "transport": "cuda_vmm",
                    },
                    "naive": {"error": "RuntimeError: server not ready"},
                },
                "points": e2e_pts,
            },
            "alloc": {
                **common,
                "result": {
                    "config": {
                        "slab_bytes": 128 << 20,
                        "pool_bytes": 1 << 30,
                        "mix": [[302592, 0.5], [9797632, 0.5]],
                        "ops_per_point": 10,
                        "timer_overhead_ns": 50,
                    },
                    "allocator": [alloc_row, hi],
                    "pool": [pool_row, dict(pool_row, occupancy_target=0.9)],
                    "frag_series": [
                        {
                            "occupancy_target": 0.9,
                            "series": [
                                {
                                    "op": i,
                                    "occupancy": 0.9,
                                    "fails": 0,
                                    "frag": i / 10,
                                    "usable_for_9.8MB": 1 - i / 10,
                                    "free_extents": i,
                                }
                                for i in range(5)
                            ],
                        },
                        {"error": "ValueError: x"},
                    ],
                    "pool_size": [dict(alloc_row, pool_bytes=256 << 20, slabs=2)],
                },
            },
        },
    }


def test_report_renders_synthetic_gpu_and_cpu_results(tmp_path: Path) -> None:
    gpu, cpu = synthetic("gpu"), synthetic("cpu")
    broken = copy.deepcopy(cpu)
    broken["sweeps"]["consumers"] = {
        "status": "timeout",
        "error": "killed after its cap",
        "points": [],
    }
    md = tmp_path / "docs" / "report.md"
    img = tmp_path / "docs" / "img"
    images = report.render(gpu, cpu=broken, md=md, img_dir=img)
    text = md.read_text()
    for needle in (
        "## GPU mode",
        "## CPU mode (REDUCED",
        "Hand-off latency",
        "vs cuda_ipc",
        "fresh VMM",
        "Where the time goes",
        "of encoder ceiling",
        "RuntimeError: boom",
        "naive server FAILED",
        "killed after its cap",
        "out of the time budget",
        "img/gpu_latency_vs_size.png",
    ):
        assert needle in text, needle
    assert "GPU figures pending" not in text
    names = {p.name for p in images}
    for stem in (
        "latency_vs_size",
        "bandwidth_vs_size",
        "images_vs_concurrency",
        "p99_vs_concurrency",
        "allocator",
        "latency_vs_consumers",
    ):
        assert f"gpu_{stem}.png" in names
    assert "cpu_latency_vs_consumers.png" not in names  # that sweep timed out
    for p in images:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    only_cpu = tmp_path / "cpu.md"
    report.render(cpu, cpu=None, md=only_cpu, img_dir=tmp_path / "img2")
    assert "GPU figures pending" in only_cpu.read_text()


def test_job_channel_bench_runs_through_the_real_job_server() -> None:
    """bench_job_channel.py drives the real JobServer and JobClient (it broke once when the
    server started handing unread answers to the engine client's ``discard``)."""
    import subprocess

    out = subprocess.run(
        [sys.executable, str(BENCH / "bench_job_channel.py"), "--images", "40", "--kb", "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["mode"] for r in rows] == ["inline", "arena", "inline", "arena"]
    assert all(r["images"] == 40 and r["gpu_process_cpu_us_per_image"] > 0 for r in rows)


def test_cpu_handoff_sweep_runs_its_consumer_processes(tmp_path: Path) -> None:
    """The hand-off sweep starts consumer processes that map and read each transport; a
    consumer that cannot start (an import gone from pool/) fails the sweep, not silently."""
    out = tmp_path / "suite.json"
    assert suite.main(["--mode", "cpu", "--only", "handoff", "--quick", "--out", str(out)]) == 0
    sweep = json.loads(out.read_text())["sweeps"]["handoff"]
    assert sweep["status"] == "ok", sweep.get("log_tail")
    for point in sweep["points"]:
        assert set(point["transports"]) == {"pool", "fresh_shm", "cpu_bytes"}
        for name, t in point["transports"].items():
            assert t["n"] > 0 and t["wrong_reads"] == 0, (point["size_mb"], name)


def test_cpu_e2e_sweep_starts_both_servers_and_measures_them(tmp_path: Path) -> None:
    """The e2e sweep builds bench_e2e's arguments itself: one it no longer passes (the
    --server-root that bench_e2e's Server reads) failed both servers while the sweep said ok."""
    out = tmp_path / "suite.json"
    suite.main(["--mode", "cpu", "--only", "e2e", "--quick", "--out", str(out)])
    sweep = json.loads(out.read_text())["sweeps"]["e2e"]
    assert sweep["status"] == "ok", sweep
    assert {n: s.get("error") for n, s in sweep["servers"].items()} == {
        "featpool": None,
        "naive": None,
    }
    assert {p["server"] for p in sweep["points"]} == {"featpool", "naive"}
    assert all(p["images_per_s"] > 0 for p in sweep["points"]), sweep["points"]
