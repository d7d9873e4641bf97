"""The Grafana dashboard and the alert rules shipped in the chart name only metrics (and labels)
that the service really exports.

The exported names come from the real thing: a FeaturePool on a host shared-memory tier driven
through a short scenario (a lease, an oversize fallback to inline, an expiry, a release), the
service's Metrics() watching it, every other metric touched once, and the exposition text parsed
back with prometheus_client's parser.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from prometheus_client import generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from app.metrics import Metrics
from pool.backends.host_shm import HostShmBackend
from pool.featurepool import FeaturePool

CHART = Path(__file__).resolve().parents[1] / "helm" / "featpool"
DASHBOARD = CHART / "files" / "dashboard.json"
ALERTS = CHART / "files" / "alerts.yaml"

# Labels Prometheus attaches to every series of a scraped target (ServiceMonitor defaults).
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "container", "endpoint"}
# Sample names of a family with no samples yet (`_created` only counts when actually exposed).
SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count"),
    "gauge": ("",),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}

# The service's own families, and the process collector's on its registry (process_open_fds...).
METRIC = re.compile(r"\b(?:featpool|process)_[A-Za-z0-9_:]*")
# `up` is not exported: Prometheus writes it for every target it scrapes (1 when the scrape
# worked), with the target's labels only.
SYNTHETIC = re.compile(r"\bup\s*\{")
STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
SELECTOR = re.compile(r"\b((?:featpool|process)_[A-Za-z0-9_:]*)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")


def exported() -> dict[str, set[str]]:
    """Every sample name /metrics can show, to the label names its samples carry."""
    now = [1000.0]
    pool = FeaturePool([HostShmBackend([1 << 20])], max_leases=8, clock=lambda: now[0])
    try:
        kept = pool.put(torch.ones(64, 8))  # host tier
        pool.put(torch.zeros(300_000))  # 1.2 MB > the 1 MiB slab: oversize -> inline
        pool.put(torch.ones(16), ttl_s=1.0)
        now[0] += 2.0
        pool.put(torch.ones(16), ttl_s=1.0)  # keeps one short lease alive
        pool.reap()  # the short lease that is overdue expires
        pool.release(kept.id)
        pool.note_refused("unix", "bad_token")
        stats = pool.stats()
        assert stats["fallbacks"] and stats["expired"] and stats["released"]
        assert stats["alloc_failures"] and stats["created"]

        m = Metrics()
        m.watch_pool(pool.stats)
        touch_every_metric(m)
        text = generate_latest(m.registry).decode()
    finally:
        pool.close()

    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for suffix in SUFFIXES.get(family.type, ("",)):
            names.setdefault(family.name + suffix, set())
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def touch_every_metric(m: Metrics) -> None:
    """Give each metric of Metrics() a sample, whatever metrics it grows later."""
    metrics = [v for v in vars(m).values() if isinstance(v, MetricWrapperBase)]
    assert metrics, "Metrics() has no prometheus_client metrics"
    for metric in metrics:
        labelnames = metric._labelnames
        child: Any = metric.labels(*["sample"] * len(labelnames)) if labelnames else metric
        kind = metric._type
        if kind == "counter":
            child.inc()
        elif kind == "gauge":
            child.set(1)
        elif kind in ("histogram", "summary"):
            child.observe(0.01)
        elif kind == "info":
            child.info({"k": "v"})
        elif kind == "stateset":
            child.state(child._states[0])
        else:
            pytest.fail(f"unknown metric type {kind} of {metric._name}")


@pytest.fixture(scope="module")
def names() -> dict[str, set[str]]:
    return exported()


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                exprs.append(node["expr"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(dash["panels"])
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def all_exprs() -> list[tuple[str, str]]:
    return [("dashboard", e) for e in dashboard_exprs()] + [
        (r["alert"], r["expr"]) for r in alert_rules()
    ]


EXPR_IDS = [f"{where}-{i}" for i, (where, _) in enumerate(all_exprs())]


def metrics_in(expr: str) -> list[str]:
    return METRIC.findall(STRING.sub('""', expr))


def grouping_labels(expr: str) -> set[str]:
    return {
        label.strip()
        for group in GROUPING.findall(expr)
        for label in group.split(",")
        if label.strip()
    }


# ---- the exported names are real --------------------------------------------------------------


def test_scenario_exports_the_pool_and_service_families(names: dict[str, set[str]]) -> None:
    for name in (
        "featpool_pool_used_bytes",
        "featpool_pool_capacity_bytes",
        "featpool_fallbacks_total",
        "featpool_leases_expired_total",
        "featpool_request_duration_seconds_bucket",
        "featpool_ready",
    ):
        assert name in names, name
    assert {"reason", "tier"} <= names["featpool_fallbacks_total"]
    assert "tier" in names["featpool_pool_used_bytes"]


# ---- every name in the dashboard and the alerts ----------------------------------------------


def test_expressions_were_found() -> None:
    assert len(dashboard_exprs()) >= 20
    assert len(alert_rules()) >= 5


@pytest.mark.parametrize(("where", "expr"), all_exprs(), ids=EXPR_IDS)
def test_expression_names_exported_metrics(
    names: dict[str, set[str]], where: str, expr: str
) -> None:
    used = metrics_in(expr)
    assert used or SYNTHETIC.search(expr), f"{where}: no featpool_ metric nor up in {expr!r}"
    unknown = sorted(set(used) - set(names))
    assert not unknown, f"{where}: {unknown} are not exported (in {expr!r})"


@pytest.mark.parametrize(("where", "expr"), all_exprs(), ids=EXPR_IDS)
def test_expression_labels_exist(names: dict[str, set[str]], where: str, expr: str) -> None:
    stripped = STRING.sub('""', expr)
    available = set(TARGET_LABELS)
    for name in metrics_in(expr):
        available |= names[name]
        if name.endswith("_bucket"):
            available.add("le")
    for metric, body in SELECTOR.findall(stripped):
        for label in MATCHER.findall(body):
            assert label in names[metric] | TARGET_LABELS, f"{where}: {metric} has no {label}"
    for body in re.findall(r"\bup\s*\{([^}]*)\}", stripped):
        for label in MATCHER.findall(body):
            assert label in TARGET_LABELS, f"{where}: up has no {label}"
    for label in grouping_labels(stripped):
        assert label in available, f"{where}: no metric in {expr!r} has the label {label}"


def test_quantiles_come_from_histogram_buckets() -> None:
    for where, expr in all_exprs():
        for m in re.finditer(r"histogram_quantile\(\s*([0-9.]+)\s*,", expr):
            assert 0 < float(m.group(1)) < 1, where
        n = expr.count("histogram_quantile(")
        assert n == len(re.findall(r"_bucket\{", expr)), f"{where}: {expr!r}"
        assert n == len(re.findall(r"by \(le\b", expr)), f"{where}: quantile without `by (le`"


# ---- what the dashboard shows -----------------------------------------------------------------


def test_dashboard_covers_what_operators_need() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = dashboard_exprs()
    used = {name for e in exprs for name in metrics_in(e)}
    for name in (
        "featpool_pool_used_bytes",
        "featpool_pool_capacity_bytes",  # occupancy
        "featpool_fallbacks_total",  # fallback rate by reason
        "featpool_request_duration_seconds_bucket",  # latency quantiles
        "featpool_images_total",  # throughput
        "featpool_batch_size_bucket",  # batch size
        "featpool_leases_expired_total",  # lease expiries
        "featpool_queue_depth",
        "featpool_consumers_attached",
    ):
        assert name in used, name
    assert any("histogram_quantile(0.5," in e for e in exprs)
    assert any("histogram_quantile(0.99," in e for e in exprs)
    assert any("by (reason" in e and "featpool_fallbacks_total" in e for e in exprs)
    assert any("by (tier)" in e and "featpool_pool_used_bytes" in e for e in exprs)

    panels = [p for p in dash["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in panels:
        assert p["title"] and p["targets"] and "gridPos" in p, p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
    assert dash["uid"] and dash["title"] == "featpool"
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "namespace", "pod"} <= variables


# ---- the alert rules --------------------------------------------------------------------------


def test_alert_rules_are_complete() -> None:
    rules = alert_rules()
    assert len({r["alert"] for r in rules}) == len(rules)
    for rule in rules:
        where = rule["alert"]
        assert re.fullmatch(r"Featpool[A-Z][A-Za-z0-9]+", where)
        assert re.fullmatch(r"[0-9]+[smh]", rule["for"]), f"{where}: `for` missing or odd"
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, where
        assert rule["annotations"]["summary"].strip(), where
        assert rule["annotations"]["description"].strip(), where
        # A label quoted in the text must survive the aggregation of the expression.
        text = rule["annotations"]["summary"] + rule["annotations"]["description"]
        quoted = set(re.findall(r"\$labels\.([A-Za-z_][A-Za-z0-9_]*)", text))
        kept = grouping_labels(STRING.sub('""', rule["expr"]))
        assert quoted <= kept, f"{where}: {quoted - kept} is aggregated away"


def test_alerts_cover_the_failure_modes() -> None:
    by_name = {r["alert"]: r for r in alert_rules()}
    full = by_name["FeatpoolPoolNearFull"]
    assert "featpool_pool_used_bytes" in full["expr"] and "> 0.9" in full["expr"]
    assert full["for"] == "5m"
    assert "featpool_fallbacks_total" in by_name["FeatpoolSustainedFallbacks"]["expr"]
    assert "featpool_leases_expired_total" in by_name["FeatpoolLeasesExpiring"]["expr"]
    assert "featpool_ready" in by_name["FeatpoolNotReady"]["expr"]
    assert by_name["FeatpoolNotReady"]["labels"]["severity"] == "critical"
    assert 'status_class="5xx"' in by_name["FeatpoolHigh5xxRate"]["expr"]
