"""The Kubernetes Pod Security Standards, as published on kubernetes.io
(docs/concepts/security/pod-security-standards, v1.34), written as checks on a pod spec: what
the PodSecurity admission controller (the Go package k8s.io/pod-security-admission) enforces for
the `baseline` and `restricted` levels. Only Linux pods are considered (no spec.os.name=windows
exemptions).

``violations(pod_template, level)`` lists every rule the pod breaks at that level (restricted
includes baseline); ``level(pod_template)`` is the strictest level the pod passes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# Baseline: capabilities that may be added (the container runtimes' default set).
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
# Restricted: the only volume types allowed (core types that are safe by construction).
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
LEVELS = ("restricted", "baseline", "privileged")


def containers(spec: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for field in ("initContainers", "containers", "ephemeralContainers"):
        for c in spec.get(field) or []:
            yield f"{field}[{c.get('name')}]", c


def _baseline(meta: dict[str, Any], spec: dict[str, Any]) -> Iterator[str]:
    psc = spec.get("securityContext") or {}
    for ns in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(ns):
            yield f"host namespaces: spec.{ns}"
    if (psc.get("windowsOptions") or {}).get("hostProcess"):
        yield "HostProcess: spec.securityContext.windowsOptions.hostProcess"
    for v in spec.get("volumes") or []:
        if "hostPath" in v:
            yield f"hostPath volumes: volume {v.get('name')}"
    for key, value in (meta.get("annotations") or {}).items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
            value == "runtime/default" or value.startswith("localhost/")
        ):
            yield f"AppArmor: annotation {key}={value}"
    contexts = [("spec.securityContext", psc)] + [
        (f"{where}.securityContext", c.get("securityContext") or {})
        for where, c in containers(spec)
    ]
    for where, sc in contexts:
        app_armor = (sc.get("appArmorProfile") or {}).get("type")
        if app_armor not in (None, "RuntimeDefault", "Localhost"):
            yield f"AppArmor: {where}.appArmorProfile.type={app_armor}"
        se = sc.get("seLinuxOptions") or {}
        if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            yield f"SELinux: {where}.seLinuxOptions"
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            yield f"seccomp: {where}.seccompProfile.type=Unconfined"
    for s in psc.get("sysctls") or []:
        if s.get("name") not in SAFE_SYSCTLS:
            yield f"sysctls: {s.get('name')}"
    for where, c in containers(spec):
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            yield f"privileged containers: {where}"
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            yield f"HostProcess: {where}"
        added = set((sc.get("capabilities") or {}).get("add") or [])
        if added - BASELINE_CAPABILITIES:
            yield f"capabilities: {where} adds {sorted(added - BASELINE_CAPABILITIES)}"
        if sc.get("procMount") not in (None, "Default"):
            yield f"/proc mount type: {where}"
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                yield f"host ports: {where} hostPort {port['hostPort']}"


def _restricted(spec: dict[str, Any]) -> Iterator[str]:
    psc = spec.get("securityContext") or {}
    for v in spec.get("volumes") or []:
        kinds = set(v) - {"name"}
        if kinds - RESTRICTED_VOLUMES:
            yield f"volume types: volume {v.get('name')} is {sorted(kinds)}"
    pod_non_root = psc.get("runAsNonRoot") is True
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type") in ("RuntimeDefault", "Localhost")
    if psc.get("runAsNonRoot") is False:
        yield "running as non-root: spec.securityContext.runAsNonRoot=false"
    if psc.get("runAsUser") == 0:
        yield "running as non-root user: spec.securityContext.runAsUser=0"
    for where, c in containers(spec):
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            yield f"privilege escalation: {where} does not set allowPrivilegeEscalation=false"
        non_root = sc.get("runAsNonRoot")
        if non_root is False or (non_root is None and not pod_non_root):
            yield f"running as non-root: {where}"
        if sc.get("runAsUser") == 0:
            yield f"running as non-root user: {where} runAsUser=0"
        seccomp = (sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost") and not (seccomp is None and pod_seccomp):
            yield f"seccomp: {where} has no RuntimeDefault/Localhost profile"
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            yield f"capabilities: {where} does not drop ALL"
        added = set(caps.get("add") or [])
        if added - {"NET_BIND_SERVICE"}:
            yield f"capabilities: {where} adds {sorted(added - {'NET_BIND_SERVICE'})}"


def violations(template: dict[str, Any], level: str) -> list[str]:
    """Rules of ``level`` that the pod template (``{metadata, spec}``) breaks."""
    assert level in LEVELS, level
    meta, spec = template.get("metadata") or {}, template["spec"]
    if level == "privileged":
        return []
    found = list(_baseline(meta, spec))
    if level == "restricted":
        found += _restricted(spec)
    return found


def level(template: dict[str, Any]) -> str:
    """The strictest Pod Security level the pod template passes."""
    return next(lv for lv in LEVELS if not violations(template, lv))


def pod_templates(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every pod a set of manifests creates: workload templates and bare Pods (test hooks)."""
    for d in docs:
        name = f"{d['kind']}/{d['metadata']['name']}"
        if d["kind"] == "Pod":
            yield name, d
        elif d["kind"] in ("Deployment", "DaemonSet", "StatefulSet", "ReplicaSet", "Job"):
            yield name, d["spec"]["template"]
        elif d["kind"] == "CronJob":
            yield name, d["spec"]["jobTemplate"]["spec"]["template"]
