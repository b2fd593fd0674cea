"""deploy/k8s: every manifest is valid Kubernetes (schemas shipped by the
``kubernetes-validate`` package, checked offline), and every rlfleet container runs
with authentication and mTLS on: its role's credentials from the mounted Secret
(0400), the TLS variables, no ``--insecure`` and no token on its command line.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate",
    reason="kubernetes-validate is not installed (pip install -e '.[dev]')",
)

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30"
WORKLOADS = {"Deployment", "StatefulSet", "Job", "DaemonSet", "CronJob"}
ROLES = {"driver", "trainer", "rollout", "reward", "scheduler", "observer"}
TLS_ENV = {
    "RLFLEET_TLS_CERT": "/secrets/tls/cert.pem",
    "RLFLEET_TLS_KEY": "/secrets/tls/cert.key",
    "RLFLEET_TLS_CA": "/secrets/tls/ca.pem",
    "RLFLEET_TLS_REQUIRE_CLIENT_CERT": "1",
    "RLFLEET_TLS_SERVER_NAME": "rlfleet",
}


def _kustomization() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return data


def _manifests() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for name in _kustomization()["resources"]:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            if doc is not None:
                out.append((name, doc))
    return out


def _pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    spec = doc["spec"]
    if doc["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    pod: dict[str, Any] = spec["template"]["spec"]
    return pod


def _containers(pod: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from pod.get("initContainers", [])
    yield from pod["containers"]


def _workloads() -> list[tuple[str, dict[str, Any]]]:
    return [(f, d) for f, d in _manifests() if d["kind"] in WORKLOADS]


def test_every_yaml_file_is_a_resource_of_the_kustomization() -> None:
    listed = set(_kustomization()["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


@pytest.mark.parametrize("index", range(len(_manifests())))
def test_manifest_is_valid_kubernetes(index: int) -> None:
    name, doc = _manifests()[index]
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {e.message} at {e.path}")


def test_the_workloads_are_there() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for _, d in _manifests()}
    assert {
        ("Deployment", "scheduler"),
        ("Deployment", "reward"),
        ("StatefulSet", "trainer"),
        ("Deployment", "rollout"),
        ("Job", "driver"),
        ("Service", "scheduler"),
        ("Service", "reward"),
        ("Service", "trainer"),
        ("NetworkPolicy", "rlfleet-default-deny"),
        ("NetworkPolicy", "rlfleet-cluster-only"),
    } <= kinds


def test_the_secret_holds_every_role_and_the_tls_material_but_not_the_ca_key() -> None:
    (generator,) = _kustomization()["secretGenerator"]
    assert generator["name"] == "rlfleet-credentials"
    keys = {f.partition("=")[0] if "=" in f else Path(f).name for f in generator["files"]}
    assert {f"{r}.json" for r in ROLES} | {
        "observer.token",
        "ca.pem",
        "cert.pem",
        "cert.key",
    } == keys
    assert not any("ca.key" in f for f in generator["files"])


def test_every_container_has_its_role_credentials_and_tls() -> None:
    workloads = _workloads()
    assert workloads
    for name, doc in workloads:
        pod = _pod_spec(doc)
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in _containers(pod):
            where = f"{name}: {doc['kind']}/{doc['metadata']['name']} container {c['name']}"
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            credentials = env.get("RLFLEET_CREDENTIALS")
            assert credentials, f"{where}: no RLFLEET_CREDENTIALS"
            role_file = Path(credentials).name
            assert role_file.removesuffix(".json") in ROLES - {"observer"}, where
            for key, value in TLS_ENV.items():
                assert env.get(key) == value, f"{where}: {key}={env.get(key)!r}"
            assert "RLFLEET_INSECURE" not in env, where
            assert "RLFLEET_AUTH_TOKEN" not in env, where
            assert "RLFLEET_CREDENTIALS_JSON" not in env, where
            # The files are there: a read-only mount of the Secret, 0400, with this
            # role's file only (and the TLS files).
            mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
            mount = mounts.get(str(Path(credentials).parent))
            assert mount is not None and mount.get("readOnly") is True, where
            secret = volumes[mount["name"]]["secret"]
            assert secret["secretName"] == "rlfleet-credentials", where
            assert secret["defaultMode"] == 0o400, where
            items = {i["key"]: i["path"] for i in secret["items"]}
            assert items == {
                role_file: role_file,
                "ca.pem": "tls/ca.pem",
                "cert.pem": "tls/cert.pem",
                "cert.key": "tls/cert.key",
            }, where


def test_no_container_is_insecure_or_passes_a_token_in_its_arguments() -> None:
    for name, doc in _workloads():
        for c in _containers(_pod_spec(doc)):
            argv = [str(a) for a in (*c.get("command", []), *c.get("args", []))]
            where = f"{name}: {doc['metadata']['name']}/{c['name']}: {argv}"
            assert "--insecure" not in argv, where
            assert not any("token" in a.lower() for a in argv), where
            assert not any(a.startswith("security.auth") for a in argv), where


def test_pods_run_unprivileged_without_an_api_token() -> None:
    for name, doc in _workloads():
        pod = _pod_spec(doc)
        where = f"{name}: {doc['metadata']['name']}"
        assert pod["automountServiceAccountToken"] is False, where
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        for c in _containers(pod):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, where
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], where


def test_network_policy_lets_only_the_clusters_pods_in() -> None:
    policies = {
        d["metadata"]["name"]: d["spec"] for _, d in _manifests() if d["kind"] == "NetworkPolicy"
    }
    deny = policies["rlfleet-default-deny"]
    assert deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"]
    assert "ingress" not in deny  # no rule: nothing comes in unless another policy says so
    allow = policies["rlfleet-cluster-only"]
    part_of = {"app.kubernetes.io/part-of": "rlfleet"}
    assert allow["podSelector"]["matchLabels"] == part_of
    for rule in allow["ingress"]:
        for peer in rule["from"]:
            assert "ipBlock" not in peer, rule
            if "podSelector" in peer:  # pods of this namespace's rlfleet cluster
                assert "namespaceSelector" not in peer
                assert peer["podSelector"]["matchLabels"] == part_of
            else:  # a monitoring namespace: the metrics ports only
                assert {p["port"] for p in rule["ports"]} <= {9100, 9200, 9300, 9400}, rule
    # Every rlfleet pod carries the label the policies select on.
    for name, doc in _workloads():
        labels = doc["spec"]["template"]["metadata"]["labels"]
        assert labels.get("app.kubernetes.io/part-of") == "rlfleet", name
