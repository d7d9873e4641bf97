"""The chart on real clusters: Pod Security levels of every mode (checked against the published
Pod Security Standards, tests/pod_security.py), the emptyDir sidecar mode, per-pod sockets,
progress deadline vs startup budget, autoscaling, the model cache, the schema's refusals, and
the `helm test` hook, whose script is run against a real server."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from tests import pod_security as pss
from tests.helpers import live_server, small_settings
from tests.k8s import (
    CHART,
    CI_DIR,
    FULLNAME,
    IMAGE,
    NAMESPACE,
    ci_values,
    container_env,
    merge,
    render,
)

# The Pod Security level each example values file needs (docs in helm/featpool/README.md).
EXPECTED_LEVEL = {
    "default-values.yaml": "privileged",  # hostPath socket directory
    "daemonset-values.yaml": "privileged",
    "monitoring-values.yaml": "privileged",
    "fabric-values.yaml": "privileged",
    "hpa-values.yaml": "privileged",
    "keda-values.yaml": "privileged",
    "sidecar-values.yaml": "restricted",  # emptyDir, consumers as sidecars
}


def workload(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (w,) = [d for d in docs if d["kind"] in ("Deployment", "DaemonSet")]
    return w


def pod_spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = workload(docs)["spec"]["template"]["spec"]
    return spec


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (d,) = [d for d in docs if d["kind"] == kind]
    return d


# ---- the Pod Security checker fails where the standard says so --------------------------------


def good_pod() -> dict[str, Any]:
    """A pod that passes `restricted`, to break one rule at a time."""
    sc = {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    return {
        "metadata": {},
        "spec": {
            "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "initContainers": [{"name": "init", "image": "x", "securityContext": dict(sc)}],
            "containers": [{"name": "c", "image": "x", "securityContext": dict(sc)}],
            "volumes": [{"name": "v", "emptyDir": {}}],
        },
    }


def breaks(path: str, value: Any) -> dict[str, Any]:
    pod = copy.deepcopy(good_pod())
    node: Any = pod
    parts = path.split(".")
    for part in parts[:-1]:
        node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
    last = parts[-1]
    if last.isdigit():
        node.append(value)
    else:
        node[last] = value
    return pod


BASELINE_BREAKS = [
    ("spec.hostNetwork", True),
    ("spec.hostPID", True),
    ("spec.hostIPC", True),
    ("spec.containers.0.securityContext.privileged", True),
    ("spec.initContainers.0.securityContext.privileged", True),
    ("spec.containers.0.securityContext.capabilities.add", ["SYS_ADMIN"]),
    ("spec.volumes.1", {"name": "h", "hostPath": {"path": "/run/featpool"}}),
    ("spec.containers.0.ports", [{"containerPort": 80, "hostPort": 8080}]),
    ("spec.securityContext.seccompProfile", {"type": "Unconfined"}),
    ("spec.containers.0.securityContext.seLinuxOptions", {"type": "spc_t"}),
    ("spec.containers.0.securityContext.procMount", "Unmasked"),
    ("spec.containers.0.securityContext.appArmorProfile", {"type": "Unconfined"}),
    ("metadata.annotations", {"container.apparmor.security.beta.kubernetes.io/c": "unconfined"}),
    ("spec.securityContext.sysctls", [{"name": "kernel.msgmax", "value": "1"}]),
    ("spec.securityContext.windowsOptions", {"hostProcess": True}),
]
RESTRICTED_BREAKS = [
    ("spec.containers.0.securityContext.allowPrivilegeEscalation", True),
    ("spec.securityContext.runAsNonRoot", False),
    ("spec.initContainers.0.securityContext.runAsNonRoot", False),
    ("spec.containers.0.securityContext.runAsUser", 0),
    ("spec.containers.0.securityContext.capabilities", {"drop": ["NET_RAW"]}),
    ("spec.containers.0.securityContext.capabilities.add", ["CHOWN"]),
    ("spec.volumes.1", {"name": "n", "nfs": {"server": "x", "path": "/"}}),
]


@pytest.mark.parametrize(("path", "value"), BASELINE_BREAKS)
def test_checker_refuses_what_baseline_forbids(path: str, value: Any) -> None:
    assert pss.level(good_pod()) == "restricted"
    pod = breaks(path, value)
    assert pss.violations(pod, "baseline"), path
    assert pss.level(pod) == "privileged"


@pytest.mark.parametrize(("path", "value"), RESTRICTED_BREAKS)
def test_checker_refuses_what_restricted_forbids(path: str, value: Any) -> None:
    pod = breaks(path, value)
    assert pss.violations(pod, "restricted"), path
    assert pss.level(pod) == "baseline"


def test_checker_restricted_needs_seccomp_and_non_root_somewhere() -> None:
    pod = good_pod()
    del pod["spec"]["securityContext"]["seccompProfile"]
    del pod["spec"]["containers"][0]["securityContext"]["seccompProfile"]
    assert pss.violations(pod, "restricted") == [
        "seccomp: containers[c] has no RuntimeDefault/Localhost profile"
    ]
    pod = good_pod()
    del pod["spec"]["securityContext"]["runAsNonRoot"]
    del pod["spec"]["containers"][0]["securityContext"]["runAsNonRoot"]
    assert pss.violations(pod, "restricted") == ["running as non-root: containers[c]"]


# ---- the chart's modes and their levels -----------------------------------------------------


@pytest.mark.parametrize("values_file", sorted(EXPECTED_LEVEL))
def test_every_mode_needs_the_documented_pod_security_level(values_file: str) -> None:
    assert sorted(p.name for p in CI_DIR.glob("*.yaml")) == sorted(EXPECTED_LEVEL)
    docs = render(ci_values(values_file))
    pods = dict(pss.pod_templates(docs))
    assert f"Pod/{FULLNAME}-test-encode" in pods  # the helm test hook counts too
    levels = {name: pss.level(t) for name, t in pods.items()}
    want = EXPECTED_LEVEL[values_file]
    assert max(levels.values(), key=pss.LEVELS.index) == want, levels
    # The test hook runs in the release's namespace: it passes restricted in every mode.
    assert levels[f"Pod/{FULLNAME}-test-encode"] == "restricted"


def test_host_path_mode_needs_privileged_for_the_host_path_alone() -> None:
    """Baseline forbids hostPath volumes outright; that (and the root init container that
    prepares the node directory, which restricted forbids) is all that keeps the default
    release from `restricted`."""
    template = workload(render(IMAGE))["spec"]["template"]
    assert pss.violations(template, "baseline") == ["hostPath volumes: volume socket"]
    assert pss.violations(template, "restricted") == [
        "hostPath volumes: volume socket",
        "volume types: volume socket is ['hostPath']",
        "running as non-root: initContainers[socket-dir]",
        "running as non-root user: initContainers[socket-dir] runAsUser=0",
        "capabilities: initContainers[socket-dir] adds ['CHOWN', 'FOWNER']",
    ]
    # Host namespaces on request are baseline violations too.
    opted = workload(render(merge(IMAGE, {"hostIPC": True})))["spec"]["template"]
    assert "host namespaces: spec.hostIPC" in pss.violations(opted, "baseline")


def test_sidecar_mode_shares_an_empty_dir_with_the_consumer() -> None:
    docs = render(ci_values("sidecar-values.yaml"))
    spec = pod_spec(docs)
    assert "initContainers" not in spec
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["socket"] == {"name": "socket", "emptyDir": {"sizeLimit": "1Mi"}}
    consumer = next(c for c in spec["containers"] if c["name"] == "consumer")
    assert {"name": "socket", "mountPath": "/run/featpool"} in consumer["volumeMounts"]
    # Same GPU: both containers name the pod's one DRA claim.
    featpool = next(c for c in spec["containers"] if c["name"] == "featpool")
    assert featpool["resources"]["claims"] == consumer["resources"]["claims"] == [{"name": "gpu"}]
    env = {e["name"]: e["value"] for e in consumer["env"]}
    assert env["FEATPOOL_SOCKET_DIR"] == "/run/featpool"
    assert container_env(docs, pod_name="p-1")["FEATPOOL_SOCKET_PATH"] == "/run/featpool/p-1.sock"


def test_every_pod_gets_its_own_socket_in_the_node_directory() -> None:
    docs = render(merge(IMAGE, {"replicaCount": 8}))
    paths = {
        container_env(docs, pod_name=f"fp-featpool-6c9-{i}")["FEATPOOL_SOCKET_PATH"]
        for i in range(8)
    }
    assert len(paths) == 8 and all(p.startswith("/run/featpool/fp-featpool-6c9-") for p in paths)
    # A fixed name is still possible where one pod at a time serves a node directory.
    one_pod = {"socket": {"fileName": "featpool.sock"}, "updateStrategy": {"type": "Recreate"}}
    fixed = render(merge(IMAGE, one_pod))
    assert (
        container_env(fixed, pod_name="x")["FEATPOOL_SOCKET_PATH"] == "/run/featpool/featpool.sock"
    )


@pytest.mark.parametrize(
    "values",
    [
        {},  # the default rolling update surges a second pod, perhaps onto the same node
        {"replicaCount": 3, "updateStrategy": {"type": "Recreate"}},
        {"kind": "DaemonSet", "updateStrategy": {"rollingUpdate": {"maxSurge": 1}}},
    ],
)
def test_a_fixed_socket_name_two_pods_could_share_is_refused(values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmRenderError, match=r"fileName=featpool\.sock gives every pod"):
        render(merge(merge(IMAGE, {"socket": {"fileName": "featpool.sock"}}), values))


@pytest.mark.parametrize(
    "values",
    [
        {"kind": "DaemonSet"},  # the default rolling update stops the old pod first
        {"kind": "DaemonSet", "updateStrategy": {"rollingUpdate": {"maxSurge": 0}}},
        {"replicaCount": 3, "socket": {"volume": "emptyDir"}},  # a directory per pod
    ],
)
def test_a_fixed_socket_name_is_kept_where_no_two_pods_share_it(values: dict[str, Any]) -> None:
    docs = render(merge(merge(IMAGE, {"socket": {"fileName": "featpool.sock"}}), values))
    assert container_env(docs, pod_name="x")["FEATPOOL_SOCKET_PATH"].endswith("/featpool.sock")


# ---- rollout deadline, autoscaling, model cache ----------------------------------------------


def test_progress_deadline_covers_the_startup_budget() -> None:
    dep = workload(render(IMAGE))
    c = next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "featpool")
    budget = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
    assert budget == 900
    assert dep["spec"]["progressDeadlineSeconds"] == budget + 300
    longer = workload(render(merge(IMAGE, {"probes": {"startup": {"failureThreshold": 180}}})))
    assert longer["spec"]["progressDeadlineSeconds"] == 1800 + 300
    assert (
        workload(render(merge(IMAGE, {"progressDeadlineSeconds": 4000})))["spec"][
            "progressDeadlineSeconds"
        ]
        == 4000
    )
    with pytest.raises(helm.HelmRenderError, match="shorter than the startup probe budget"):
        render(merge(IMAGE, {"progressDeadlineSeconds": 600}))


def test_notes_wait_as_long_as_the_deadline() -> None:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(IMAGE, name="fp", namespace=NAMESPACE, is_install=True)
    notes = next(t for p, t in out.items() if p.endswith("NOTES.txt"))
    assert "rollout status deployment/fp-featpool --timeout=1200s" in notes
    assert "helm test fp -n ml" in notes


def test_hpa_scales_the_deployment_on_a_per_pod_metric() -> None:
    docs = render(ci_values("hpa-values.yaml"))
    dep = one(docs, "Deployment")
    assert "replicas" not in dep["spec"]  # the HPA owns the count
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": FULLNAME,
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 16)
    (metric,) = hpa["spec"]["metrics"]
    assert metric == {
        "type": "Pods",
        "pods": {
            "metric": {"name": "featpool_queue_depth"},
            "target": {"type": "AverageValue", "averageValue": "16"},
        },
    }
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 600


def test_keda_scales_on_the_release_queue_depth() -> None:
    docs = render(ci_values("keda-values.yaml"))
    assert "replicas" not in one(docs, "Deployment")["spec"]
    so = one(docs, "ScaledObject")
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    assert so["spec"]["scaleTargetRef"] == {"name": FULLNAME}
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (1, 8)
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"] == {
        "serverAddress": "http://kube-prometheus-stack-prometheus.monitoring.svc:9090",
        "query": 'sum(featpool_queue_depth{namespace="ml",job="fp-featpool"})',
        "threshold": "32",
    }


def test_autoscaling_needs_a_deployment() -> None:
    with pytest.raises(helm.HelmRenderError, match=r"autoscaling\.mode scales a Deployment"):
        render(merge(IMAGE, {"kind": "DaemonSet", "autoscaling": {"mode": "hpa"}}))


def test_model_cache_volume_and_hf_home() -> None:
    docs = render(ci_values("hpa-values.yaml"))
    pvc = one(docs, "PersistentVolumeClaim")
    assert pvc["metadata"]["name"] == "fp-featpool-model-cache"
    assert pvc["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert pvc["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "storageClassName": "shared-nfs",
        "resources": {"requests": {"storage": "100Gi"}},
    }
    spec = pod_spec(docs)
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["model-cache"]["persistentVolumeClaim"] == {
        "claimName": "fp-featpool-model-cache",
        "readOnly": True,
    }
    c = next(c for c in spec["containers"] if c["name"] == "featpool")
    assert {"name": "model-cache", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    env = container_env(docs, pod_name="p")
    assert env["HF_HOME"] == "/models/huggingface" and env["HF_HUB_OFFLINE"] == "1"
    assert env["FEATPOOL_ENCODER"] == "hf:google/siglip-so400m-patch14-384"

    existing = render(ci_values("keda-values.yaml"))
    assert not [d for d in existing if d["kind"] == "PersistentVolumeClaim"]
    volumes = {v["name"]: v for v in pod_spec(existing)["volumes"]}
    assert volumes["model-cache"]["persistentVolumeClaim"]["claimName"] == "models"
    assert "HF_HOME" not in container_env(render(IMAGE), pod_name="p")


# ---- the schema refuses privilege ----------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"securityContext": {"privileged": True}}, "at '/securityContext/privileged'"),
        (
            {"securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}},
            "at '/securityContext/capabilities/add'",
        ),
        (
            {"securityContext": {"allowPrivilegeEscalation": True}},
            "at '/securityContext/allowPrivilegeEscalation'",
        ),
        (
            {"extraContainers": [{"name": "c", "securityContext": {"privileged": True}}]},
            "at '/extraContainers/0/securityContext/privileged'",
        ),
        (
            {
                "extraContainers": [
                    {"name": "c", "securityContext": {"capabilities": {"add": ["NET_ADMIN"]}}}
                ]
            },
            "at '/extraContainers/0/securityContext/capabilities/add'",
        ),
        ({"socket": {"volume": "nfs"}}, "at '/socket/volume'"),
        ({"autoscaling": {"mode": "vpa"}}, "at '/autoscaling/mode'"),
        ({"config": {"gpu_uuid": "GPU-not a uuid"}}, "at '/config/gpu_uuid'"),
    ],
)
def test_schema_refuses_privileged_containers_and_added_capabilities(
    values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmValuesError) as err:
        render(merge(IMAGE, values))
    assert message in str(err.value)


# ---- the helm test hook, run for real --------------------------------------------------------


def hook_command(values: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    pod = one([d for d in render(values) if d["kind"] == "Pod"], "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (c,) = pod["spec"]["containers"]
    return c["command"], {e["name"]: e for e in c["env"]}


def run_hook(command: list[str], url: str, **env: str) -> subprocess.CompletedProcess[str]:
    assert command[:2] == ["python", "-c"]
    base = {k: v for k, v in os.environ.items() if not k.startswith("FEATPOOL_")}
    return subprocess.run(
        [sys.executable, *command[1:]],
        env={**base, "FEATPOOL_URL": url, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_helm_test_hook_encodes_through_a_real_server(tmp_path: Path) -> None:
    command, env = hook_command(IMAGE)
    assert env["FEATPOOL_URL"]["value"] == "http://fp-featpool.ml.svc:8000"
    assert "FEATPOOL_API_KEY" not in env
    with live_server(small_settings(tmp_path)) as live:
        done = run_hook(command, live.url)
        assert done.returncode == 0, done.stderr
        assert "encoded: shape [" in done.stdout and "lease released" in done.stdout
        assert live.occupancy() == (0, 0)  # the lease was given back
        # It fails when the service does not do its job (here: nothing listens there).
        bad = run_hook(command, live.url + "/nowhere")
        assert bad.returncode != 0 and "HTTP Error 404" in bad.stderr


def test_helm_test_hook_sends_the_api_key(tmp_path: Path) -> None:
    values = merge(IMAGE, {"auth": {"apiKey": {"existingSecret": "fp-auth"}}})
    command, env = hook_command(values)
    assert env["FEATPOOL_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "fp-auth",
        "key": "api-key",
    }
    with live_server(small_settings(tmp_path, api_key="s3cret")) as live:
        assert run_hook(command, live.url, FEATPOOL_API_KEY="s3cret").returncode == 0
        refused = run_hook(command, live.url, FEATPOOL_API_KEY="wrong")
        assert refused.returncode != 0 and "HTTP Error 401" in refused.stderr
