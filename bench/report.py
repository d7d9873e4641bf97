"""Turn bench/suite.py results into docs/report.md and PNG plots in docs/img/.

    python3 bench/report.py suite-gpu.json --append-cpu docs/img/suite-cpu.json
    python3 bench/report.py docs/img/suite-cpu.json          # CPU (reduced mode) only

Every figure is shown with its ratio against the baselines of the same run and against the
device's own limits (plain copy bandwidth, the encoder's throughput without HTTP); each section
names the command, date and machine that produced it. The last part of each section ("where the
time goes") is generated from the numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[1]
COLORS = {
    "pool": "tab:blue",
    "cuda_ipc": "tab:orange",
    "fresh_vmm": "tab:red",
    "fresh_shm": "tab:red",
    "cpu_bytes": "tab:gray",
}
LABELS = {
    "pool": "featpool pool",
    "cuda_ipc": "CUDA IPC (torch.multiprocessing)",
    "fresh_vmm": "fresh VMM alloc per lease",
    "fresh_shm": "fresh memfd per lease",
    "cpu_bytes": "CPU transport (tensor->bytes->tensor)",
}
Json = dict[str, Any]


def num(x: Any) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return math.nan
    return v


def fmt(x: Any, digits: int = 0) -> str:
    v = num(x)
    if math.isnan(v):
        return "-"
    if digits == 0 and abs(v) >= 1:
        return f"{v:,.0f}"
    if abs(v) < 10**-digits and v != 0:
        return f"{v:.2g}"
    return f"{v:,.{digits}f}"


def ratio(a: Any, b: Any, digits: int = 1) -> str:
    """a / b as '12.3x' (or '-' when either is missing)."""
    va, vb = num(a), num(b)
    if math.isnan(va) or math.isnan(vb) or vb == 0:
        return "-"
    return f"{va / vb:.{digits}f}x"


def table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def ok_points(rec: Json | None, key: str = "points") -> list[Json]:
    if not rec:
        return []
    return [p for p in rec.get(key, []) if "error" not in p and "skipped" not in p]


def bad_points(rec: Json | None, key: str = "points") -> list[str]:
    if not rec:
        return []
    out = []
    for p in rec.get(key, []):
        if "error" in p or "skipped" in p:
            label = {
                k: v for k, v in p.items() if k not in ("error", "skipped", "traceback", "wall_s")
            }
            out.append(f"- {label}: {p.get('error') or p.get('skipped')}")
    return out


class Section:
    """One results file rendered: markdown lines plus the PNGs it wrote."""

    def __init__(self, res: Json, img_dir: Path, md_dir: Path, prefix: str) -> None:
        self.res = res
        self.img_dir = img_dir
        self.md_dir = md_dir
        self.prefix = prefix
        self.mode = res.get("mode", "?")
        self.gpu = self.mode == "gpu"
        self.sw: Json = res.get("sweeps", {})
        self.lines: list[str] = []
        self.images: list[Path] = []
        self.findings: list[str] = []

    # ---- helpers -------------------------------------------------------------------------

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def save(self, fig: Any, name: str, alt: str) -> None:
        path = self.img_dir / f"{self.prefix}_{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        self.images.append(path)
        rel = os.path.relpath(path, self.md_dir)
        self.add(f"![{alt}]({rel})", "")

    def provenance(self, name: str) -> None:
        rec = self.sw.get(name) or {}
        m = rec.get("machine") or {}
        status = rec.get("status", "missing")
        self.add(
            f"*{status}; `date -u`: {rec.get('date', '-')}; wall {rec.get('wall_s', '-')} s "
            f"(cap {rec.get('cap_s', '-')} s); machine: {machine_line(m)}*",
            "",
        )
        if rec.get("error"):
            self.add(f"Sweep error: `{rec['error']}`", "")
        bad = bad_points(rec)
        if bad:
            self.add("Points that failed or were skipped (recorded, not plotted):", *bad, "")

    # ---- sections ------------------------------------------------------------------------

    def header(self) -> None:
        r = self.res
        m = r.get("machine", {})
        label = (
            "GPU mode"
            if self.gpu
            else "CPU mode (REDUCED: host_shm pool, tiny-test encoder, 2-core box; not GPU figures)"
        )
        self.add(
            f"## {label}",
            "",
            f"- Command: `{r.get('command', '-')}` (repository root)",
            f"- Date (`date -u` at the start): {r.get('date', '-')}",
            f"- Machine: {machine_line(m)}",
            f"- Wall time: {r.get('wall_s', '-')} s of a {r.get('budget_s', '-')} s budget",
            "",
        )
        rows = []
        for name, rec in self.sw.items():
            mm = rec.get("machine") or {}
            rows.append(
                [
                    name,
                    str(rec.get("status", "?")),
                    fmt(rec.get("wall_s"), 1),
                    str(mm.get("torch", "-")),
                    f"`{rec.get('command', '-')}`",
                ]
            )
        if rows:
            self.add(
                "Sweeps (each ran in its own process; the command is the child's):",
                "",
                table(["sweep", "status", "wall s", "torch", "command"], rows),
                "",
            )

    def handoff(self) -> None:
        rec = self.sw.get("handoff")
        if not rec:
            return
        pts = ok_points(rec)
        pool_kind = "cuda_vmm" if self.gpu else "host_shm"
        plain = "D2D" if self.gpu else "memcpy"
        self.add(
            "### Hand-off latency and bandwidth vs feature size",
            "",
            f"Producer starts `FeaturePool.put` ({pool_kind}) -> the consumer process has "
            "read the last element (`.item()`), median over the iterations; baselines in "
            "the same run, same consumer process. A size of S MB is a `[S*1e6/4096, 2048]` "
            "bf16 tensor.",
            "",
        )
        self.provenance("handoff")
        if not pts:
            return
        kinds = [
            k
            for k in ("pool", "cuda_ipc", "fresh_vmm", "fresh_shm", "cpu_bytes")
            if any(k in p.get("transports", {}) for p in pts)
        ]
        floor = (rec.get("pipe_floor") or {}).get("median_us")

        def t(p: Json, k: str, f: str = "median_us") -> float:
            return num((p.get("transports", {}).get(k) or {}).get(f))

        head = ["size MB", "pool us"] + [f"{k} us" for k in kinds if k != "pool"]
        head += [f"pool vs {k}" for k in kinds if k != "pool"]
        head += ["producer us", "consumer us", "put us", f"copy on device us ({plain})"]
        rows = []
        for p in pts:
            bw = p.get("bandwidth") or {}
            row = [fmt(p["size_mb"], 1), fmt(t(p, "pool"))]
            row += [fmt(t(p, k)) for k in kinds if k != "pool"]
            row += [ratio(t(p, k), t(p, "pool")) for k in kinds if k != "pool"]
            row += [
                fmt(t(p, "pool", "producer_median_us")),
                fmt(t(p, "pool", "consumer_median_us")),
                fmt(p.get("pool_put_median_us")),
                fmt(bw.get("plain_us_per_copy"), 1),
            ]
            rows.append(row)
        self.add(
            table(head, rows),
            "",
            f"Pipe round trip of a small message (floor): {fmt(floor, 1)} us. "
            "`pool vs X` is X's latency / the pool's (above 1: the pool is faster). "
            "Producer = put + describe + send; consumer = open + first read.",
            "",
        )
        fresh = "fresh_vmm" if self.gpu else "fresh_shm"
        if fresh in kinds:
            rows = []
            for p in pts:
                for k in (fresh,):
                    v = p.get("transports", {}).get(k) or {}
                    if "producer_teardown_median_us" in v:
                        rows.append(
                            [
                                fmt(p["size_mb"], 1),
                                fmt(v.get("producer_median_us")),
                                fmt(v.get("consumer_median_us")),
                                fmt(v.get("producer_teardown_median_us")),
                                fmt(v.get("consumer_teardown_median_us")),
                            ]
                        )
            if rows:
                what = (
                    "create, map, copy, export, sync, send"
                    if self.gpu
                    else "memfd_create, ftruncate, mmap, copy, send FD"
                )
                self.add(
                    f"{LABELS[fresh]}: where its time goes (us; teardown comes after the "
                    "read and is not in the latency above):",
                    "",
                    table(
                        [
                            "size MB",
                            f"producer ({what})",
                            "consumer (import/mmap, read)",
                            "producer teardown",
                            "consumer teardown",
                        ],
                        rows,
                    ),
                    "",
                )
        brow = []
        for p in pts:
            bw = p.get("bandwidth") or {}
            if "error" in bw:
                brow.append([fmt(p["size_mb"], 1), bw["error"], "", "", "", ""])
                continue
            brow.append(
                [
                    fmt(p["size_mb"], 1),
                    fmt(bw.get("publish_GBps"), 1),
                    fmt(bw.get("copy_GBps"), 1),
                    fmt(bw.get("plain_GBps"), 1),
                    fmt(bw.get("publish_fraction"), 3),
                    fmt(bw.get("copy_fraction"), 3),
                ]
            )
        self.add(
            f"Bandwidth into the pool vs a plain {plain} (back-to-back copies"
            + (", queued behind a GPU sleep, CUDA events" if self.gpu else ", perf_counter")
            + "; GB/s, bytes counted once):",
            "",
            table(
                [
                    "size MB",
                    "publish (copy + ready word)",
                    "copy into pool",
                    f"plain {plain} (limit)",
                    f"publish / {plain}",
                    f"copy / {plain}",
                ],
                brow,
            ),
            "",
        )

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for k in kinds:
            xs = [p["size_mb"] for p in pts if not math.isnan(t(p, k))]
            ys = [t(p, k) for p in pts if not math.isnan(t(p, k))]
            if xs:
                ax.plot(
                    xs,
                    ys,
                    "o-",
                    color=COLORS.get(k),
                    label=LABELS.get(k, k),
                    lw=2.5 if k == "pool" else 1.5,
                )
        if not math.isnan(num(floor)):
            ax.axhline(num(floor), ls=":", color="k", label="pipe round trip (floor)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("feature size (MB)")
        ax.set_ylabel("hand-off latency, median (us)")
        ax.set_title(f"Hand-off latency vs size ({self.mode} mode, {pool_kind} pool)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        self.save(fig, "latency_vs_size", "hand-off latency vs feature size")

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for key, lab, style in (
            ("plain_GBps", f"plain {plain} (device limit)", "k--"),
            ("copy_GBps", "copy into pool memory", "s-"),
            ("publish_GBps", "publish (copy + ready word)", "o-"),
        ):
            xs = [p["size_mb"] for p in pts if "bandwidth" in p and key in p["bandwidth"]]
            ys = [p["bandwidth"][key] for p in pts if "bandwidth" in p and key in p["bandwidth"]]
            if xs:
                ax.plot(xs, ys, style, label=lab)
        ax.set_xscale("log")
        ax.set_xlabel("feature size (MB)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"Bandwidth into the pool vs plain {plain} ({self.mode} mode)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        self.save(fig, "bandwidth_vs_size", "bandwidth into the pool vs size")

        # Findings: where the time goes at the size nearest 9.8 MB, and at the largest size.
        ref = min(pts, key=lambda p: abs(num(p["size_mb"]) - 9.8))
        total = t(ref, "pool")
        prod, cons = t(ref, "pool", "producer_median_us"), t(ref, "pool", "consumer_median_us")
        dev = num((ref.get("bandwidth") or {}).get("publish_us_per_lease"))
        where = "GPU" if self.gpu else "CPU (memcpy)"
        msg = (
            f"Hand-off of {fmt(ref['size_mb'], 1)} MB: {fmt(total)} us median. The copy into "
            f"the pool is {fmt(dev, 1)} us of {where} time per lease "
            f"({fmt(100 * dev / total, 0)} % of it); the rest is host-side Python and "
            f"messaging: producer put + describe + send {fmt(prod)} us (the put alone "
            f"{fmt(ref.get('pool_put_median_us'))} us), consumer open + first read "
            f"{fmt(cons)} us, against a pipe round trip of {fmt(floor, 1)} us."
        )
        if not math.isnan(dev) and not math.isnan(total):
            msg += (
                " Host-side steps dominate: fewer Python steps per lease (put, descriptor, "
                "socket message) would move it, a faster copy would not."
                if dev < 0.3 * total
                else " The copy is a large share: at this size the hand-off is bandwidth-bound."
            )
        self.findings.append(msg)
        big = max(pts, key=lambda p: num(p["size_mb"]))
        bwb = big.get("bandwidth") or {}
        if "publish_fraction" in bwb:
            self.findings.append(
                f"At {fmt(big['size_mb'])} MB the pool's publish reaches "
                f"{fmt(bwb.get('publish_fraction'), 2)} of a plain {plain} and its hand-off is "
                f"{ratio(t(big, 'cpu_bytes'), t(big, 'pool'))} faster than the CPU transport"
                + (
                    f", {ratio(t(big, 'cuda_ipc'), t(big, 'pool'))} vs CUDA IPC and "
                    f"{ratio(t(big, 'fresh_vmm'), t(big, 'pool'))} vs a fresh VMM allocation"
                    if self.gpu
                    else f" and {ratio(t(big, 'fresh_shm'), t(big, 'pool'))} vs a fresh memfd"
                )
                + "."
            )

    def consumers(self) -> None:
        rec = self.sw.get("consumers")
        if not rec:
            return
        cfg = rec.get("config", {})
        pts = ok_points(rec)
        self.add(
            "### Consumers attached to one pool",
            "",
            f"{', '.join(map(str, cfg.get('consumers', [])))} consumer processes, each "
            f"opening, reading and releasing {fmt(cfg.get('size_mb'), 1)} MB leases; "
            f"{cfg.get('loop', '')}; {fmt(cfg.get('seconds_per_point'), 1)} s per point.",
            "",
        )
        self.provenance("consumers")
        if not pts:
            return
        one = num(pts[0].get("leases_per_s"))
        rows = [
            [
                str(p["consumers"]),
                fmt(p.get("median_us")),
                fmt(p.get("p99_us")),
                fmt(p.get("consumer_median_us")),
                fmt(p.get("leases_per_s")),
                ratio(p.get("leases_per_s"), one, 2),
                str(p.get("wrong_reads", "-")),
            ]
            for p in pts
        ]
        self.add(
            table(
                [
                    "consumers",
                    "latency p50 us",
                    "p99 us",
                    "consumer open+read us",
                    "leases/s (all)",
                    "vs 1 consumer",
                    "wrong reads",
                ],
                rows,
            ),
            "",
        )
        fig, ax = plt.subplots(figsize=(7, 4.5))
        xs = [p["consumers"] for p in pts]
        ax.plot(xs, [p["median_us"] for p in pts], "o-", label="latency p50")
        ax.plot(xs, [p["p99_us"] for p in pts], "s--", label="latency p99")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("consumer processes")
        ax.set_ylabel("hand-off latency (us)")
        ax2 = ax.twinx()
        ax2.plot(
            xs, [p["leases_per_s"] for p in pts], "^-", color="tab:green", label="leases/s (right)"
        )
        ax2.set_ylabel("leases/s, all consumers")
        ax2.set_ylim(bottom=0)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(f"Latency and throughput vs consumers ({self.mode} mode)")
        self.save(fig, "latency_vs_consumers", "latency vs consumers")
        last = pts[-1]
        gain = num(last.get("leases_per_s")) / one if one else math.nan
        cpus = int((rec.get("machine") or {}).get("cpu_count") or 0)
        self.findings.append(
            f"{last['consumers']} consumers: {fmt(last.get('leases_per_s'))} leases/s in all, "
            f"{fmt(gain, 2)}x one consumer's; p50 latency {fmt(pts[0].get('median_us'))} -> "
            f"{fmt(last.get('median_us'))} us. "
            + (
                "The producer's one Python thread (put + describe + send per lease) is the "
                "limit: consumers wait on it, not on each other."
                if gain < 0.5 * last["consumers"]
                else "Throughput scales with consumers: the producer is not yet the limit."
            )
            + (
                f" (This machine has {cpus} cores for the producer and all consumers.)"
                if cpus and cpus < 2 * last["consumers"]
                else ""
            )
        )

    def encoder(self) -> Json | None:
        rec = self.sw.get("encoder")
        if not rec:
            return None
        pts = ok_points(rec)
        cfg = rec.get("config", {})
        self.add(
            "### Encoder without HTTP (the ceiling)",
            "",
            f"`app.encoders.build_encoder('{cfg.get('encoder', '?')}')`, random input at "
            f"batch {cfg.get('batch', '?')}, {cfg.get('iters', '?')} calls of `encode()`, "
            f"{cfg.get('timing', '')}.",
            "",
        )
        self.provenance("encoder")
        if not pts:
            return None
        rows = [
            [
                p["variant"],
                p["encoder"],
                str(p["batch"]),
                fmt(p.get("images_per_s")),
                fmt(p.get("ms_per_batch"), 2),
                fmt(p.get("host_ms_per_call"), 2),
            ]
            for p in pts
        ]
        self.add(
            table(
                ["variant", "encoder", "batch", "images/s", "ms/batch", "host ms per call"], rows
            ),
            "",
        )
        return max(pts, key=lambda p: num(p.get("images_per_s")))

    def e2e(self, ceiling: Json | None) -> None:
        rec = self.sw.get("e2e")
        if not rec:
            return
        cfg = rec.get("config", {})
        pts = ok_points(rec)
        img = rec.get("images", {})
        self.add(
            "### End to end over HTTP vs concurrency",
            "",
            f"`{cfg.get('encoder', '?')}` on {cfg.get('device', '?')}; "
            f"{img.get('count', '?')} distinct JPEGs {img.get('size', '?')} "
            f"(mean {fmt(img.get('mean_kb'))} KB); {fmt(cfg.get('warmup'), 1)} s warm-up "
            f"+ {fmt(cfg.get('seconds'), 1)} s measured per point, "
            f"{cfg.get('client_procs', '?')} client processes "
            f"({cfg.get('client', 'httpx')} + asyncio)"  # httpx: files before the key
            + (
                f", more where a point needs them for at most {cap} connections each"
                if (cap := cfg.get("max_conns_per_proc"))
                else ""
            )
            + ". `raw` is one "
            "JPEG per request, `multipart` N images per request; concurrency is requests in "
            "flight. The naive server is the same server with one image per forward, Pillow "
            "decode, no CUDA graphs, run in the same sweep.",
            "",
        )
        for name, s in (rec.get("servers") or {}).items():
            if "command" in s:
                self.add(
                    f"- {name} server (started in {s.get('start_s', '?')} s, transport "
                    f"{s.get('transport', '?')}): `{s['command']}`"
                )
            else:
                self.add(f"- {name} server FAILED: {s.get('error', '?')}")
        self.add("")
        self.provenance("e2e")
        if not pts:
            return
        naive_best = max(
            (num(p.get("images_per_s")) for p in pts if p["server"] == "naive"), default=math.nan
        )
        ceil = num(ceiling.get("images_per_s")) if ceiling else math.nan
        rows = []
        for p in pts:
            bad = {k: v for k, v in (p.get("status") or {}).items() if k != "200"}
            rows.append(
                [
                    p["server"],
                    p["body"],
                    str(p["images_per_request"]),
                    str(p["concurrency"]),
                    fmt(p.get("images_per_s")),
                    ratio(p.get("images_per_s"), naive_best),
                    ratio(p.get("images_per_s"), ceil, 3).rstrip("x"),
                    fmt(p.get("p50_ms"), 1),
                    fmt(p.get("p99_ms"), 1),
                    fmt(p.get("mean_batch"), 1),
                    fmt(p.get("encode_ms_per_batch"), 1),
                    str(bad or "-"),
                ]
            )
        self.add(
            table(
                [
                    "server",
                    "body",
                    "img/req",
                    "conc",
                    "images/s",
                    "vs best naive",
                    "of encoder ceiling",
                    "p50 ms",
                    "p99 ms",
                    "mean batch",
                    "encode ms/batch",
                    "non-200",
                ],
                rows,
            ),
            "",
            f"Encoder ceiling (no HTTP): {fmt(ceil)} images/s"
            + (f" ({ceiling['variant']}, batch {ceiling['batch']})" if ceiling else "")
            + f"; best naive: {fmt(naive_best)} images/s.",
            "",
        )

        def series(server: str, body: str) -> list[Json]:
            return sorted(
                (p for p in pts if p["server"] == server and p["body"] == body),
                key=lambda p: p["concurrency"],
            )

        for metric, ylabel, name in (
            ("images_per_s", "images/s", "images_vs_concurrency"),
            ("p99_ms", "p99 request latency (ms)", "p99_vs_concurrency"),
        ):
            fig, ax = plt.subplots(figsize=(7, 4.5))
            for server, body, style, lab in (
                ("featpool", "raw", "o-", "featpool, 1 image/request"),
                ("featpool", "multipart", "D-", "featpool, multipart"),
                ("naive", "raw", "s--", "naive encode path, 1 image/request"),
            ):
                s = series(server, body)
                if s:
                    ax.plot(
                        [p["concurrency"] for p in s],
                        [num(p.get(metric)) for p in s],
                        style,
                        label=lab,
                        ms=7,
                    )
                    if body == "multipart":
                        for p in s:
                            ax.annotate(
                                f"{p['images_per_request']} img/req",
                                (p["concurrency"], num(p.get(metric))),
                                textcoords="offset points",
                                xytext=(6, -10),
                                fontsize=8,
                            )
            if metric == "images_per_s" and not math.isnan(ceil):
                ax.axhline(ceil, ls=":", color="k", label="encoder alone, no HTTP (ceiling)")
            ax.set_xscale("log", base=2)
            if metric == "p99_ms":
                ax.set_yscale("log")
            else:
                ax.set_ylim(bottom=0)
            ax.set_xlabel("concurrent requests")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{ylabel} vs concurrency ({self.mode} mode, {cfg.get('encoder', '')})")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
            self.save(fig, name, f"{ylabel} vs concurrency")

        fp = [p for p in pts if p["server"] == "featpool"]
        if fp:
            best = max(fp, key=lambda p: num(p.get("images_per_s")))
            frac = num(best.get("images_per_s")) / ceil if ceil else math.nan
            msg = (
                f"Best end-to-end: {fmt(best.get('images_per_s'))} images/s "
                f"({best['body']}, {best['images_per_request']} img/req, conc "
                f"{best['concurrency']}), {ratio(best.get('images_per_s'), naive_best)} the "
                f"naive path and {fmt(frac * 100, 0)} % of the encoder's own throughput "
                f"(mean batch {fmt(best.get('mean_batch'), 1)}, encode "
                f"{fmt(best.get('encode_ms_per_batch'), 1)} ms per batch)."
            )
            if not math.isnan(frac):
                msg += (
                    f" The encoder ({'GPU' if self.gpu else 'CPU'}) is mostly idle: the "
                    "next bottleneck is the host side of the server (HTTP and multipart "
                    "parsing, decode, batching and publish in one Python process), which "
                    "is what HTTP front processes address."
                    if frac < 0.5
                    else " The rest of the encoder's rate is lost in the prepare stage: its one "
                    "call per batch (JPEG decode and preprocessing) takes longer in the server "
                    "than the forward does (docs/benchmarks.md, issue 17)."
                    if self.gpu
                    else " The encoder itself is now the main limit."
                )
                if not self.gpu:
                    msg += (
                        " (Here clients, server and encoder share two cores, so this "
                        "fraction is a lower bound.)"
                    )
            self.findings.append(msg)

    def alloc(self) -> None:
        rec = self.sw.get("alloc")
        if not rec:
            return
        res = rec.get("result") or {}
        cfg = res.get("config", {})
        self.add(
            "### Allocator cost and fragmentation under lease churn (CPU)",
            "",
            f"`pool.allocator.SlabAllocator` over {fmt(num(cfg.get('pool_bytes')) / 2**20)} "
            f"MiB in {fmt(num(cfg.get('slab_bytes')) / 2**20)} MiB slabs (the server's "
            "defaults), feature sizes mixed as "
            + ", ".join(f"{num(s) / 1e6:.1f} MB x{w}" for s, w in cfg.get("mix", []))
            + f"; {cfg.get('ops_per_point', '?')} churn steps per point (free one lease at "
            "random, allocate until back at the occupancy). `FeaturePool` put/release "
            "uses a host_shm tier whose publish writes only the ready word (the copy is "
            "in the hand-off sweep). ns are medians minus the timer's own cost "
            f"({fmt(cfg.get('timer_overhead_ns'))} ns). Fragmentation = 1 - largest free "
            "extent / min(free bytes, slab); 'usable' = share of free bytes that can still "
            "hold a 9.8 MB feature.",
            "",
        )
        self.provenance("alloc")
        allocs = [r for r in res.get("allocator", []) if "allocate_ns" in r]
        pools = [r for r in res.get("pool", []) if "put_ns" in r]
        bad = [
            f"- {r}"
            for part in ("allocator", "pool", "frag_series", "pool_size")
            for r in res.get(part, [])
            if "error" in r or "skipped" in r
        ]
        if bad:
            self.add("Rows that failed or were skipped:", *bad, "")
        if not allocs:
            return
        by_occ = {round(num(r["occupancy_target"]), 2): r for r in pools}
        rows = []
        for r in allocs:
            pr = by_occ.get(round(num(r["occupancy_target"]), 2), {})
            rows.append(
                [
                    fmt(r["occupancy"] * 100, 0),
                    str(r.get("live_extents")),
                    fmt(r["allocate_ns"]["median"]),
                    fmt(r["allocate_ns"]["p99"]),
                    fmt(r["free_ns"]["median"]),
                    fmt((pr.get("put_ns") or {}).get("median")),
                    fmt((pr.get("release_ns") or {}).get("median")),
                    f"{r['fails']} ({r['frag_fails']})",
                    fmt(r["frag"], 3),
                    fmt(r["usable_for_9.8MB"], 3),
                ]
            )
        self.add(
            table(
                [
                    "occupancy %",
                    "live extents",
                    "allocate ns",
                    "allocate p99 ns",
                    "free ns",
                    "pool put ns",
                    "pool release ns",
                    "failed allocs (with enough free bytes)",
                    "fragmentation",
                    "usable for 9.8 MB",
                ],
                rows,
            ),
            "",
        )
        sizes = [r for r in res.get("pool_size", []) if "allocate_ns" in r]
        if sizes:
            self.add(
                "Against pool size (70 % occupancy):",
                "",
                table(
                    ["pool MiB", "slabs", "live extents", "allocate ns", "free ns"],
                    [
                        [
                            fmt(r["pool_bytes"] / 2**20),
                            str(r["slabs"]),
                            str(r["live_extents"]),
                            fmt(r["allocate_ns"]["median"]),
                            fmt(r["free_ns"]["median"]),
                        ]
                        for r in sizes
                    ],
                ),
                "",
            )
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
        occ = [r["occupancy"] * 100 for r in allocs]
        a1.plot(
            occ, [r["allocate_ns"]["median"] for r in allocs], "o-", label="SlabAllocator.allocate"
        )
        a1.plot(occ, [r["free_ns"]["median"] for r in allocs], "s-", label="SlabAllocator.free")
        if pools:
            po = [r["occupancy"] * 100 for r in pools]
            a1.plot(
                po, [r["put_ns"]["median"] for r in pools], "^-", label="FeaturePool.put (no copy)"
            )
            a1.plot(
                po, [r["release_ns"]["median"] for r in pools], "v-", label="FeaturePool.release"
            )
        a1.set_yscale("log")
        a1.set_xlabel("pool occupancy (%)")
        a1.set_ylabel("ns per call (median)")
        a1.set_title("Cost per operation vs occupancy")
        a1.grid(True, which="both", alpha=0.3)
        a1.legend(fontsize=8)
        for s, color in zip(
            res.get("frag_series", []), ("tab:blue", "tab:red", "tab:green"), strict=False
        ):
            if "series" not in s:
                continue
            xs = [p["op"] for p in s["series"]]
            occ_t = f"{num(s['occupancy_target']) * 100:.0f} %"
            a2.plot(
                xs,
                [p["frag"] for p in s["series"]],
                "-",
                color=color,
                label=f"fragmentation, {occ_t} full",
            )
            a2.plot(
                xs,
                [p["usable_for_9.8MB"] for p in s["series"]],
                "--",
                color=color,
                alpha=0.7,
                label=f"free bytes usable for 9.8 MB, {occ_t} full",
            )
        a2.set_ylim(-0.02, 1.02)
        a2.set_xlabel("churn steps (free one + refill)")
        a2.set_ylabel("fraction")
        a2.set_title("Fragmentation over time")
        a2.grid(True, alpha=0.3)
        a2.legend(fontsize=8)
        self.save(fig, "allocator", "allocator cost vs occupancy and fragmentation over time")
        hi = allocs[-1]
        put_hi = by_occ.get(round(num(hi["occupancy_target"]), 2), {}).get("put_ns") or {}
        a_ns = [num(r["allocate_ns"]["median"]) for r in allocs]
        first_bad = next((r for r in allocs if r["frag_fails"]), None)
        msg = (
            f"Allocator: {fmt(min(a_ns))}-{fmt(max(a_ns))} ns per allocate and "
            f"{fmt(hi['free_ns']['median'])} ns per free from "
            f"{fmt(allocs[0]['occupancy'] * 100)} to {fmt(hi['occupancy'] * 100)} % "
            "occupancy; a whole `FeaturePool.put` without "
            f"the copy costs {fmt(put_hi.get('median'))} ns, so the lease table and the Python "
            "around the allocator cost more than the allocator itself."
        )
        if first_bad is not None:
            msg += (
                f" From {fmt(first_bad['occupancy'] * 100)} % occupancy, requests fail "
                f"although enough bytes are free ({first_bad['frag_fails']} of "
                f"{first_bad['requests']}, fragmentation {fmt(first_bad['frag'], 2)}): size "
                "the pool so that it runs below that, or give large tensors slabs of "
                "their own."
            )
        else:
            msg += " No request failed for lack of contiguous space at any measured occupancy."
        self.findings.append(msg)

    def findings_section(self) -> None:
        if self.findings:
            self.add(
                f"### Where the time goes and what the next bottleneck is ({self.mode} mode)",
                "",
                "Generated from the figures above:",
                "",
                *[f"- {f}" for f in self.findings],
                "",
            )

    def render(self) -> list[str]:
        self.header()
        steps: list[Callable[[], Any]] = [self.handoff, self.consumers]
        for step in steps:
            step()
        ceiling = self.encoder()
        self.e2e(ceiling)
        self.alloc()
        self.findings_section()
        return self.lines


def machine_line(m: Json) -> str:
    parts = []
    if m.get("gpu") and m.get("gpu") != "none":
        parts.append(f"GPU {m['gpu']}")
    if m.get("cpu"):
        parts.append(f"CPU {m['cpu']} x{m.get('cpu_count', '?')}")
    for k in ("torch", "cuda_bindings", "python"):
        if m.get(k):
            parts.append(f"{k} {m[k]}")
    if m.get("loadavg"):
        parts.append(f"load average at start {m['loadavg'][0]}")
    return ", ".join(parts) or "-"


def render(results: Json, *, cpu: Json | None, md: Path, img_dir: Path) -> list[Path]:
    img_dir.mkdir(parents=True, exist_ok=True)
    md.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        "# featpool benchmark report",
        "",
        "Generated by `python3 bench/report.py` from the JSON that `bench/suite.py` wrote; "
        "do not edit by hand. Earlier hand-run results and their discussion are in "
        "[benchmarks.md](benchmarks.md).",
        "",
    ]
    sections = [Section(results, img_dir, md.parent, results.get("mode", "x"))]
    if cpu is not None:
        sections.append(Section(cpu, img_dir, md.parent, cpu.get("mode", "cpu")))
    if not any(s.gpu for s in sections):
        lines += [
            "> **GPU figures pending.** Everything below is the suite's reduced CPU mode "
            "(host_shm pool instead of cuda_vmm, tiny-test encoder instead of ViT-B/16, "
            "a 2-core machine running producer, consumers, server and clients at once). "
            "It exercises every sweep and the report, but its numbers say nothing about "
            "the H200; each sweep's line shows the machine's load average at its start "
            "(above 2 on this box, other work shared the two cores and the figures are "
            "noisy). The GPU section is added by running "
            "`python3 bench/suite.py --mode gpu --out suite-gpu.json` on the device and "
            "`python3 bench/report.py suite-gpu.json --append-cpu docs/img/suite-cpu.json`.",
            "",
        ]
    images: list[Path] = []
    for s in sections:
        lines += s.render()
        images += s.images
    md.write_text("\n".join(lines).rstrip() + "\n")
    return images


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--append-cpu", type=Path, help="a CPU-mode results file, shown after")
    ap.add_argument("--md", type=Path, default=ROOT / "docs" / "report.md")
    ap.add_argument("--img-dir", type=Path, default=ROOT / "docs" / "img")
    args = ap.parse_args(argv)
    res = json.loads(args.results.read_text())
    cpu = json.loads(args.append_cpu.read_text()) if args.append_cpu else None
    images = render(res, cpu=cpu, md=args.md, img_dir=args.img_dir)
    print(f"wrote {args.md} and {len(images)} plots in {args.img_dir}")


if __name__ == "__main__":
    main()
