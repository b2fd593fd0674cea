"""deploy/k8s: every manifest is valid Kubernetes (schemas shipped by the
``kubernetes-validate`` package, checked offline), and every rlfleet container runs
with authentication and mTLS on: its role's credentials from the mounted Secret
(0400), the TLS variables, no ``--insecure`` and no token on its command line.

Every kustomization (the base through ``deploy/k8s``, each overlay, ``kuberay/``,
``prometheus-adapter/``) is rendered with ``kubectl kustomize`` (or ``kustomize
build``) in a copy of ``deploy/k8s`` whose ``config/`` holds placeholder files, and the
rendered objects are validated and checked. Without either binary the rendered checks
skip and the raw manifests are still validated one by one. The Ray kinds have no schema
in kubernetes-validate: their pod templates are validated as core ``PodTemplate``
objects, and the rest is a structural check of the fields KubeRay needs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
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
TLS_ITEMS = {"ca.pem": "tls/ca.pem", "cert.pem": "tls/cert.pem", "cert.key": "tls/cert.key"}
# The kustomizations a user applies, relative to deploy/k8s.
SERVICE_BUILDS = [".", "overlays/gpu", "overlays/autoscale", "overlays/gpu-scaled"]
BUILDS = [*SERVICE_BUILDS, "kuberay", "prometheus-adapter"]
GPU_BUILDS = {"overlays/gpu", "overlays/gpu-scaled"}
AUTOSCALE_BUILDS = {"overlays/autoscale", "overlays/gpu-scaled"}
QUEUE_DEPTH = "rlfleet_rollout_queue_depth"
POD_INDEX = "apps.kubernetes.io/pod-index"

Doc = dict[str, Any]


def _load(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _kustomization(directory: Path) -> Doc:
    data: Doc = yaml.safe_load((directory / "kustomization.yaml").read_text())
    return data


def _raw_manifests() -> list[tuple[str, Doc]]:
    """Every file a kustomization lists as a resource (not the generated objects)."""
    out = []
    for kustomization in sorted(K8S.rglob("kustomization.yaml")):
        directory = kustomization.parent
        for name in _kustomization(directory).get("resources", []):
            path = directory / name
            if path.is_file():
                out.extend((str(path.relative_to(K8S)), d) for d in _load(path))
    return out


def _kustomize_command() -> list[str] | None:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return None


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Doc]]:
    """Build -> the objects it renders, from a copy of deploy/k8s with placeholder
    local files (the real ones are git-ignored and never read here)."""
    command = _kustomize_command()
    if command is None:
        pytest.skip("neither kubectl nor kustomize is installed: rendered builds not checked")
    root = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, root, ignore=shutil.ignore_patterns("secrets", "run.yaml"))
    secrets = root / "config" / "secrets"
    (secrets / "tls").mkdir(parents=True)
    for role in ROLES:
        (secrets / f"{role}.json").write_text(json.dumps({"role": role, "token": "placeholder"}))
    (secrets / "observer.token").write_text("placeholder")
    for name in TLS_ITEMS:
        (secrets / "tls" / name).write_text("placeholder")
    (secrets / "tls" / "ca.key").write_text("must not be rendered")
    (root / "config" / "run.yaml").write_text("trainer:\n  device: cpu\n")
    out = {}
    for build in BUILDS:
        done = subprocess.run(
            [*command, str(root / build)], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, f"{build}: {done.stderr}"
        assert "must not be rendered" not in done.stdout, build
        out[build] = [d for d in yaml.safe_load_all(done.stdout) if d is not None]
    return out


def _find(docs: list[Doc], kind: str, name: str) -> Doc:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _pod_spec(doc: Doc) -> Doc:
    spec = doc["spec"]
    if doc["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    pod: Doc = spec["template"]["spec"]
    return pod


def _containers(pod: Doc) -> Iterator[Doc]:
    yield from pod.get("initContainers", [])
    yield from pod["containers"]


def _env(container: Doc) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def _ray_pod_templates(doc: Doc) -> list[Doc]:
    spec = doc["spec"]
    return [spec["headGroupSpec"]["template"]] + [
        g["template"] for g in spec.get("workerGroupSpecs", [])
    ]


def _validate(where: str, doc: Doc) -> None:
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"{where}: {doc['kind']}/{doc['metadata']['name']}: {e.message} at {e.path}")


def _validate_ray(where: str, doc: Doc) -> None:
    """The KubeRay CRDs' schemas are not in kubernetes-validate: the pod templates are
    checked against the core schema, the rest against what KubeRay requires."""
    assert doc["apiVersion"] == "ray.io/v1", where
    assert doc["metadata"]["name"], where
    if doc["kind"] == "RayCluster":
        spec = doc["spec"]
        assert isinstance(spec["headGroupSpec"]["rayStartParams"], dict), where
        for group in spec["workerGroupSpecs"]:
            assert group["groupName"] and isinstance(group["rayStartParams"], dict), where
            assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], where
        for template in _ray_pod_templates(doc):
            wrapped = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": doc["metadata"]["name"]},
                "template": template,
            }
            _validate(f"{where}: RayCluster pod template", wrapped)
    elif doc["kind"] == "RayJob":
        spec = doc["spec"]
        assert isinstance(spec["entrypoint"], str) and spec["entrypoint"], where
        assert spec.get("clusterSelector") or spec.get("rayClusterSpec"), where
        if spec.get("clusterSelector"):  # an existing cluster must not be deleted
            assert spec["shutdownAfterJobFinishes"] is False, where
    else:
        pytest.fail(f"{where}: unknown Ray kind {doc['kind']}")


def _check(where: str, doc: Doc) -> None:
    if doc["apiVersion"].startswith("ray.io/"):
        _validate_ray(where, doc)
    else:
        _validate(where, doc)


# ---- the raw files (with or without a kustomize binary)


def test_every_yaml_file_is_listed_by_a_kustomization() -> None:
    listed = set()
    for kustomization in K8S.rglob("kustomization.yaml"):
        data = _kustomization(kustomization.parent)
        listed |= {
            (kustomization.parent / n).resolve()
            for n in [*data.get("resources", []), *data.get("configurations", [])]
        }
        listed.add(kustomization.resolve())
    on_disk = {p.resolve() for p in K8S.rglob("*.yaml")} - {(K8S / "config" / "run.yaml").resolve()}
    assert on_disk - listed == set()


@pytest.mark.parametrize("index", range(len(_raw_manifests())))
def test_manifest_file_is_valid_kubernetes(index: int) -> None:
    name, doc = _raw_manifests()[index]
    _check(name, doc)


def test_the_secret_holds_every_role_and_the_tls_material_but_not_the_ca_key() -> None:
    (generator,) = _kustomization(K8S / "config")["secretGenerator"]
    assert generator["name"] == "rlfleet-credentials"
    keys = {f.partition("=")[0] if "=" in f else Path(f).name for f in generator["files"]}
    assert {f"{r}.json" for r in ROLES} | {"observer.token", *TLS_ITEMS} == keys
    assert not any("ca.key" in f for f in generator["files"])
    # The base and kuberay/ both take the Secret and the run config from config/.
    for build in ("base", "kuberay"):
        assert "../config" in _kustomization(K8S / build)["components"], build


# ---- every rendered build


@pytest.mark.parametrize("build", BUILDS)
def test_rendered_build_is_valid_kubernetes(build: str, rendered: dict[str, list[Doc]]) -> None:
    assert rendered[build]
    for doc in rendered[build]:
        _check(build, doc)


@pytest.mark.parametrize("build", SERVICE_BUILDS)
def test_the_workloads_are_there(build: str, rendered: dict[str, list[Doc]]) -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for d in rendered[build]}
    assert {
        ("Deployment", "scheduler"),
        ("Deployment", "reward"),
        ("StatefulSet", "trainer"),
        ("Deployment", "rollout"),
        ("Job", "driver"),
        ("Service", "scheduler"),
        ("Service", "reward"),
        ("Service", "trainer"),
        ("Service", "trainer-ranks"),
        ("NetworkPolicy", "rlfleet-default-deny"),
        ("NetworkPolicy", "rlfleet-cluster-only"),
    } <= kinds
    assert all(d["metadata"].get("namespace", "rlfleet") == "rlfleet" for d in rendered[build])
    assert (("HorizontalPodAutoscaler", "rollout") in kinds) == (build in AUTOSCALE_BUILDS)


@pytest.mark.parametrize("build", SERVICE_BUILDS)
def test_every_container_has_its_role_credentials_and_tls(
    build: str, rendered: dict[str, list[Doc]]
) -> None:
    workloads = [d for d in rendered[build] if d["kind"] in WORKLOADS]
    assert workloads
    secrets = [d for d in rendered[build] if d["kind"] == "Secret"]
    (secret_name,) = [d["metadata"]["name"] for d in secrets]
    assert secret_name.startswith("rlfleet-credentials-")  # hashed: an apply rolls pods
    for doc in workloads:
        pod = _pod_spec(doc)
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in _containers(pod):
            where = f"{build}: {doc['kind']}/{doc['metadata']['name']} container {c['name']}"
            env = _env(c)
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
            assert secret["secretName"] == secret_name, where
            assert secret["defaultMode"] == 0o400, where
            items = {i["key"]: i["path"] for i in secret["items"]}
            assert items == {role_file: role_file, **TLS_ITEMS}, where


@pytest.mark.parametrize("build", SERVICE_BUILDS)
def test_no_container_is_insecure_or_passes_a_token_in_its_arguments(
    build: str, rendered: dict[str, list[Doc]]
) -> None:
    for doc in rendered[build]:
        if doc["kind"] not in WORKLOADS:
            continue
        for c in _containers(_pod_spec(doc)):
            argv = [str(a) for a in (*c.get("command", []), *c.get("args", []))]
            where = f"{build}: {doc['metadata']['name']}/{c['name']}: {argv}"
            assert "--insecure" not in argv, where
            assert not any("token" in a.lower() for a in argv), where
            assert not any(a.startswith("security.auth") for a in argv), where


@pytest.mark.parametrize("build", SERVICE_BUILDS)
def test_pods_run_unprivileged_without_an_api_token(
    build: str, rendered: dict[str, list[Doc]]
) -> None:
    for doc in rendered[build]:
        if doc["kind"] not in WORKLOADS:
            continue
        pod = _pod_spec(doc)
        where = f"{build}: {doc['metadata']['name']}"
        assert pod["automountServiceAccountToken"] is False, where
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        for c in _containers(pod):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, where
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], where


@pytest.mark.parametrize("build", SERVICE_BUILDS)
def test_network_policy_lets_only_the_clusters_pods_in(
    build: str, rendered: dict[str, list[Doc]]
) -> None:
    docs = rendered[build]
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
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
    for doc in docs:
        if doc["kind"] in WORKLOADS:
            labels = doc["spec"]["template"]["metadata"]["labels"]
            assert labels.get("app.kubernetes.io/part-of") == "rlfleet", doc["metadata"]["name"]


@pytest.mark.parametrize("build", SERVICE_BUILDS)
def test_probes_dial_grpc_health_with_the_pods_tls(
    build: str, rendered: dict[str, list[Doc]]
) -> None:
    """The kubelet's own gRPC probe speaks plaintext, which a TLS server refuses: every
    service probes with rlfleet-healthcheck (the container's TLS), the trainer on rank 0."""
    for name, kind in (
        ("scheduler", "Deployment"),
        ("reward", "Deployment"),
        ("rollout", "Deployment"),
        ("trainer", "StatefulSet"),
    ):
        (c,) = _pod_spec(_find(rendered[build], kind, name))["containers"]
        for probe in ("readinessProbe", "livenessProbe"):
            assert "grpc" not in c[probe], (name, probe)
            command = " ".join(c[probe]["exec"]["command"])
            assert "rlfleet-healthcheck" in command, (name, probe)
            if name == "trainer":
                assert '[ "$RANK" != 0 ] ||' in command
                assert "127.0.0.1:50052" in command


@pytest.mark.parametrize("build", SERVICE_BUILDS)
def test_the_run_config_is_the_generated_config_map(
    build: str, rendered: dict[str, list[Doc]]
) -> None:
    docs = rendered[build]
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert config_map["metadata"]["name"].startswith("rlfleet-run-")
    assert set(config_map["data"]) == {"run.yaml"}
    for doc in docs:
        if doc["kind"] not in WORKLOADS:
            continue
        pod = _pod_spec(doc)
        volumes = {v["name"]: v for v in pod["volumes"]}
        (c,) = pod["containers"]
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert mounts["/config"]["readOnly"] is True, doc["metadata"]["name"]
        source = volumes[mounts["/config"]["name"]]["configMap"]["name"]
        assert source == config_map["metadata"]["name"], doc["metadata"]["name"]
        args = c.get("args", [])
        if "--config" in args:
            assert args[args.index("--config") + 1] == "/config/run.yaml"


# ---- the trainer's ranks


@pytest.mark.parametrize("build", SERVICE_BUILDS)
def test_trainer_ranks_rendezvous_at_rank_0_through_the_headless_service(
    build: str, rendered: dict[str, list[Doc]]
) -> None:
    docs = rendered[build]
    sts = _find(docs, "StatefulSet", "trainer")
    spec = sts["spec"]
    (c,) = spec["template"]["spec"]["containers"]
    env = _env(c)
    # One pod per rank: WORLD_SIZE is the replica count, RANK the pod's ordinal.
    assert env["WORLD_SIZE"] == str(spec["replicas"])
    assert env["RANK"] == {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX}']"}}
    assert env["LOCAL_RANK"] == "0"
    # Every rank starts at once (rank 0 is ready only after the others joined).
    assert spec["podManagementPolicy"] == "Parallel"
    headless = _find(docs, "Service", spec["serviceName"])
    assert env["MASTER_ADDR"] == f"{sts['metadata']['name']}-0.{spec['serviceName']}"
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    pod_labels = spec["template"]["metadata"]["labels"]
    assert headless["spec"]["selector"].items() <= pod_labels.items()
    assert int(env["MASTER_PORT"]) in {p["port"] for p in headless["spec"]["ports"]}
    assert int(env["MASTER_PORT"]) in {p["containerPort"] for p in c["ports"]}
    # The TrainerService: rank 0 only (the pod-index label the controller sets).
    grpc = _find(docs, "Service", "trainer")
    selector = dict(grpc["spec"]["selector"])
    assert selector.pop(POD_INDEX) == "0"
    assert selector.items() <= pod_labels.items()
    assert grpc["spec"].get("clusterIP") != "None"
    assert {p["port"] for p in grpc["spec"]["ports"]} == {50052}


def test_the_scaled_example_runs_four_trainer_ranks(rendered: dict[str, list[Doc]]) -> None:
    assert _find(rendered["."], "StatefulSet", "trainer")["spec"]["replicas"] == 1
    sts = _find(rendered["overlays/gpu-scaled"], "StatefulSet", "trainer")
    assert sts["spec"]["replicas"] == 4
    assert _env(sts["spec"]["template"]["spec"]["containers"][0])["WORLD_SIZE"] == "4"


# ---- GPUs


@pytest.mark.parametrize("build", SERVICE_BUILDS)
def test_gpu_overlays_give_trainer_and_rollout_a_gpu_and_cuda(
    build: str, rendered: dict[str, list[Doc]]
) -> None:
    docs = rendered[build]
    gpu = build in GPU_BUILDS
    for kind, name in (("StatefulSet", "trainer"), ("Deployment", "rollout")):
        pod = _pod_spec(_find(docs, kind, name))
        (c,) = pod["containers"]
        resources = c.get("resources", {})
        for part in ("requests", "limits"):
            assert (resources.get(part, {}).get("nvidia.com/gpu") == 1) == gpu, (name, part)
        assert c["image"].endswith(":cuda" if gpu else ":cpu"), c["image"]
        tolerated = {t["key"] for t in pod.get("tolerations", [])}
        assert ("nvidia.com/gpu" in tolerated) == gpu, name
        args = c["args"]
        if name == "rollout":
            assert args[args.index("--device") + 1] == ("cuda" if gpu else "cpu")
        else:
            assert ("trainer.device=cuda" in args) == gpu
    for kind, name in (("Deployment", "scheduler"), ("Deployment", "reward")):
        (c,) = _pod_spec(_find(docs, kind, name))["containers"]
        assert "nvidia.com/gpu" not in str(c.get("resources", {})), name


# ---- rollout autoscaling


def _adapter_rules(rendered: dict[str, list[Doc]]) -> list[Doc]:
    (config_map,) = rendered["prometheus-adapter"]
    assert config_map["kind"] == "ConfigMap"
    rules: list[Doc] = yaml.safe_load(config_map["data"]["config.yaml"])["rules"]
    return rules


@pytest.mark.parametrize("build", sorted(AUTOSCALE_BUILDS))
def test_rollout_scales_on_its_queue_depth(build: str, rendered: dict[str, list[Doc]]) -> None:
    docs = rendered[build]
    hpa = _find(docs, "HorizontalPodAutoscaler", "rollout")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    deployment = _find(docs, target["kind"], target["name"])
    assert (target["apiVersion"], deployment["metadata"]["name"]) == ("apps/v1", "rollout")
    # The autoscaler owns the replica count: a re-apply must not reset it.
    assert "replicas" not in deployment["spec"]
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == QUEUE_DEPTH
    assert metric["pods"]["target"]["type"] == "AverageValue"
    # The adapter serves that name, per pod, from the series of the same name.
    served = {r["name"]["as"]: r for r in _adapter_rules(rendered)}
    rule = served[QUEUE_DEPTH]
    assert rule["seriesQuery"].startswith(QUEUE_DEPTH + "{")
    assert rule["resources"]["overrides"] == {
        "namespace": {"resource": "namespace"},
        "pod": {"resource": "pod"},
    }
    assert "<<.Series>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]


def test_the_rollout_service_exports_the_autoscaling_metric() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from rlfleet.rollout.metrics import RolloutMetrics

    metrics = RolloutMetrics("r0")
    metrics.queue_depth.set(3)
    text = prometheus_client.generate_latest(metrics.registry).decode()
    assert f"{QUEUE_DEPTH} 3.0" in text.splitlines()


# ---- KubeRay


def test_kuberay_cluster_has_head_cpu_and_gpu_groups_with_secrets(
    rendered: dict[str, list[Doc]],
) -> None:
    docs = rendered["kuberay"]
    cluster = _find(docs, "RayCluster", "rlfleet")
    (secret_name,) = [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"]
    (config_name,) = [d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"]
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"cpu", "gpu"}
    assert _pod_spec_gpus(groups["gpu"]["template"]) == 1
    assert _pod_spec_gpus(groups["cpu"]["template"]) == 0
    assert _pod_spec_gpus(cluster["spec"]["headGroupSpec"]["template"]) == 0
    for template in _ray_pod_templates(cluster):
        pod = template["spec"]
        assert template["metadata"]["labels"]["app.kubernetes.io/part-of"] == "rlfleet"
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
        volumes = {v["name"]: v for v in pod["volumes"]}
        (c,) = pod["containers"]
        assert c["image"].startswith("rlfleet/ray:")
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        env = _env(c)
        for key, value in TLS_ENV.items():
            assert env.get(key) == value, key
        assert "RLFLEET_INSECURE" not in env
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert mounts["/secrets"]["readOnly"] is True
        secret = volumes[mounts["/secrets"]["name"]]["secret"]
        # The whole set (the launcher hands each actor its role's file), never ca.key.
        assert secret["secretName"] == secret_name
        assert secret["defaultMode"] == 0o400
        items = {i["key"]: i["path"] for i in secret["items"]}
        assert items == {**{f"{r}.json": f"{r}.json" for r in ROLES}, **TLS_ITEMS}
        assert volumes[mounts["/config"]["name"]]["configMap"]["name"] == config_name


def _pod_spec_gpus(template: Doc) -> int:
    (c,) = template["spec"]["containers"]
    limits = c.get("resources", {}).get("limits", {})
    return int(limits.get("nvidia.com/gpu", 0))


def test_kuberay_job_trains_with_the_ray_launcher(rendered: dict[str, list[Doc]]) -> None:
    from rlfleet.common.config import load_config

    docs = rendered["kuberay"]
    job = _find(docs, "RayJob", "rlfleet-train")
    cluster = _find(docs, "RayCluster", "rlfleet")
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    argv = job["spec"]["entrypoint"].split()
    assert argv[:4] == ["rlfleet", "train", "--config", "/config/run.yaml"]
    assert "--insecure" not in argv and not any("token" in a for a in argv)
    # The overrides are keys the config accepts, with auth on and mTLS.
    example = Path(__file__).resolve().parents[2] / "examples" / "arithmetic_grpo.yaml"
    config = load_config(str(example), argv[4:])
    assert config.launcher == "ray"
    assert config.security.auth is True
    assert config.security.credentials_dir == "/secrets"
    assert config.security.tls.require_client_cert is True
    assert config.security.tls.ca == TLS_ENV["RLFLEET_TLS_CA"]
