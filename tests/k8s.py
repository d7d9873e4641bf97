"""What a pod of the chart gets, computed the way Kubernetes does it: the chart rendered by Helm's
own engine (helm-python-sdk), and a container's environment built as the kubelet builds it
(envFrom first, then env in order, downward-API fields filled in, ``$(VAR)`` references expanded,
``$$`` escaping). Shared by the tests that start servers from the rendered chart."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "featpool"
CI_DIR = CHART / "ci"
RELEASE, NAMESPACE = "fp", "ml"
FULLNAME = "fp-featpool"
IMAGE = {"image": {"repository": "registry.example.com/featpool"}}

_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def ci_values(name: str) -> dict[str, Any]:
    """One of the chart's example values files (``helm/featpool/ci/``), parsed."""
    data = yaml.safe_load((CI_DIR / name).read_text())
    assert isinstance(data, dict)
    return data


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` laid on ``base`` as Helm merges values files: dicts key by key, the rest
    replaced."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    """``helm template fp helm/featpool -n ml`` with these values, parsed (NOTES left out)."""
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs: list[dict[str, Any]] = []
    for path, text in sorted(out.items()):
        if not path.endswith(".txt"):
            docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def expand(value: str, env: dict[str, str]) -> str:
    """The kubelet's ``$(VAR)`` expansion: defined names are replaced, undefined ones kept as
    written, ``$$`` is a literal ``$``."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env.get(name, m.group(0))

    return _REF.sub(sub, value)


def container_env(
    docs: list[dict[str, Any]],
    container: str = "featpool",
    *,
    pod_name: str,
    pod_ip: str = "10.0.3.17",
    secrets: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment of ``container`` in the rendered workload's pod named ``pod_name``."""
    work = next(d for d in docs if d["kind"] in ("Deployment", "DaemonSet"))
    spec = work["spec"]["template"]["spec"]
    c = next(c for c in spec["containers"] if c["name"] == container)
    configmaps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    fields = {"metadata.name": pod_name, "metadata.namespace": NAMESPACE, "status.podIP": pod_ip}
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        env.update(configmaps[source["configMapRef"]["name"]])
    for var in c.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(str(var["value"]), env)
        elif "fieldRef" in var["valueFrom"]:
            env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = (secrets or {})[f"{ref['name']}/{ref['key']}"]
    return env
