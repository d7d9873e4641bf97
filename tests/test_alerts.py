"""The alert rules against Prometheus itself: `promtool check rules` on the shipped file and on the
PrometheusRule the chart renders, `promtool test rules` on tests/prometheus/alerts_test.yaml, and
a real Prometheus server scraping a running featpool (and a pod that does not answer), queried
over its HTTP API: the featpool series Grafana users see, and the rules evaluated on them.

promtool and prometheus come from Debian's `prometheus` package; `make test` installs it (as root).
Without it these tests skip, except under CI (CI=true), where its absence is a failure."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bench.appserver import free_port
from tests.conftest import image_bytes
from tests.helpers import ROOT, server_process
from tests.k8s import render

ALERTS = ROOT / "helm" / "featpool" / "files" / "alerts.yaml"
UNIT_TESTS = ROOT / "tests" / "prometheus" / "alerts_test.yaml"


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        message = f"{name} not found: `make test` installs Debian's prometheus package"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("promtool"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def shipped_rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def test_promtool_checks_the_shipped_rules() -> None:
    done = promtool("check", "rules", str(ALERTS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(shipped_rules())} rules found" in done.stdout


def test_promtool_checks_the_rendered_prometheus_rule(tmp_path: Path) -> None:
    docs = render(
        {
            "image": {"repository": "registry.example.com/featpool"},
            "metrics": {"prometheusRule": {"enabled": True}},
        }
    )
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    # Every selector names this release's Service (the job) and namespace.
    assert all('job="fp-featpool",namespace="ml"' in e for e in exprs), exprs
    assert not any('job="featpool"' in e for e in exprs)
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    done = promtool("check", "rules", str(path))
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_unit_tests_of_the_alerts() -> None:
    done = promtool("test", "rules", str(UNIT_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


# ---- a real Prometheus scraping a running featpool -------------------------------------------


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """featpool (``python -m app``) and Prometheus scraping it every second, plus a second
    target where nothing listens: a pod still loading its model. Yields (featpool, prometheus)
    URLs."""
    binary = tool("prometheus")
    with server_process(tmp_path / "featpool.sock", tmp_path / "featpool.log") as (url, _):
        port = url.rsplit(":", 1)[1]
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ALERTS)],
            "scrape_configs": [
                {
                    "job_name": "featpool",
                    "static_configs": [
                        {
                            "targets": [f"127.0.0.1:{port}"],
                            "labels": {"namespace": "ml", "pod": "fp-featpool-serving"},
                        },
                        {
                            "targets": [f"127.0.0.1:{free_port()}"],
                            "labels": {"namespace": "ml", "pod": "fp-featpool-loading"},
                        },
                    ],
                }
            ],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        prom_url = f"http://127.0.0.1:{free_port()}"
        with open(tmp_path / "prometheus.log", "wb") as log:
            proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={tmp_path / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp_path / 'data'}",
                    f"--web.listen-address={prom_url.removeprefix('http://')}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
                try:
                    if httpx.get(f"{prom_url}/-/ready", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "prometheus did not become ready"
                time.sleep(0.2)
            yield url, prom_url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def query(prom: str, promql: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": promql}, timeout=10)
    r.raise_for_status()
    body = r.json()
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def eventually(
    prom: str, promql: str, count: int = 1, timeout_s: float = 30.0
) -> list[dict[str, Any]]:
    """The query's result once it has ``count`` series (or whatever it has after the wait)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = query(prom, promql)
        if len(result) >= count or time.monotonic() > deadline:
            return result
        time.sleep(0.5)


def by_pod(result: list[dict[str, Any]]) -> dict[str, float]:
    return {r["metric"]["pod"]: float(r["value"][1]) for r in result}


def test_prometheus_scrapes_featpool_and_evaluates_the_alerts(
    prometheus: tuple[str, str],
) -> None:
    url, prom = prometheus
    r = httpx.post(
        f"{url}/v1/encode",
        files=[("image", ("a.png", image_bytes("PNG", size=(40, 30)), "image/png"))],
        timeout=60,
    )
    assert r.status_code == 200, r.text

    # The scraper's view of the two targets: one serves, one does not answer.
    assert by_pod(eventually(prom, 'up{job="featpool"}', count=2)) == {
        "fp-featpool-serving": 1.0,
        "fp-featpool-loading": 0.0,
    }
    build = eventually(prom, 'featpool_build_info{job="featpool"}')
    assert len(build) == 1 and build[0]["metric"]["transport"] == "host_shm"
    assert by_pod(eventually(prom, 'featpool_ready{job="featpool"}')) == {
        "fp-featpool-serving": 1.0
    }
    fds = eventually(prom, 'process_open_fds{job="featpool"}')
    assert fds and float(fds[0]["value"][1]) > 0  # the process collector is on /metrics
    assert float(query(prom, 'process_max_fds{job="featpool"}')[0]["value"][1]) > 0
    encoded = eventually(
        prom,
        'featpool_http_requests_total{job="featpool",endpoint="/v1/encode",status_class="2xx"}',
    )
    assert float(encoded[0]["value"][1]) >= 1
    assert eventually(prom, 'featpool_pool_capacity_bytes{job="featpool",tier="host"}')

    # Every rule evaluates on the real series without error...
    deadline = time.monotonic() + 30
    while True:
        groups = httpx.get(f"{prom}/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = [rule for g in groups for rule in g["rules"]]
        # (A rule not evaluated yet reports the zero time, 0001-01-01.)
        if len(rules) == len(shipped_rules()) and all(r["lastEvaluation"] > "2000" for r in rules):
            break
        assert time.monotonic() < deadline, rules
        time.sleep(0.5)
    assert {rule["name"]: rule["health"] for rule in rules} == {
        rule["name"]: "ok" for rule in rules
    }, [(rule["name"], rule.get("lastError")) for rule in rules]
    # ...and, once both targets have been scraped (an evaluation before the serving pod's first
    # scrape sees every target down), the pod that does not answer scrapes is on its way to
    # FeatpoolNotReady (pending for 15 minutes before it fires), the serving one is not, and no
    # target-down alert is pending.
    deadline = time.monotonic() + 30
    while True:
        alerts = httpx.get(f"{prom}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
        not_ready = {
            a["labels"]["pod"]: a["state"]
            for a in alerts
            if a["labels"]["alertname"] == "FeatpoolNotReady"
        }
        names = {a["labels"]["alertname"] for a in alerts}
        down = names & {"FeatpoolTargetAbsent", "FeatpoolAllTargetsDown"}
        if (not_ready and not down) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not_ready == {"fp-featpool-loading": "pending"}
    assert not down, down
