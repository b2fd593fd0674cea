"""Prometheus against a real run: targets discovered through the scheduler's ``/sd``
are up, every Grafana panel's query returns data, and the alert rules load.

One module-scoped run: a LocalCluster (scheduler, reward, trainer, one rollout
replica, each its own process, tiny model), Debian's ``prometheus`` started on
127.0.0.1 with a config derived from ``deploy/prometheus/prometheus.yml`` (1 s
scrapes, SD pointed at this cluster's scheduler, the driver's metrics port in the
file_sd targets, the secrets paths pointed at this cluster's credential set and TLS
material: every endpoint is HTTPS with mTLS and needs the observer's token, as in
docker compose), then three PPO steps with a validation, so every series a panel
reads has been written. Each panel is its own test case.

Panels whose metrics no service exports yet are listed in :data:`PENDING`: their
case is an ``xfail`` that names the missing series, until the series shows up in a
scrape (then the case runs like any other and the entry must go).

Skips with a reason when no ``prometheus`` binary is on PATH (Debian / Ubuntu:
``apt-get install -y prometheus``).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
NO_PROMETHEUS = "no `prometheus` binary on PATH (Debian/Ubuntu: apt-get install -y prometheus)"

#: Metric names the dashboards read that no service exports yet, with who should.
PENDING: dict[str, str] = {}

# Grafana's interval variables, as Prometheus durations. The whole run lies inside
# the window, so rate() sees at least two samples of every series.
GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "5s", "$__range": "10m"}
METRIC_NAME = re.compile(r"\b(rlfleet_[a-z0-9_]+|up)\b")
SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    ref: str
    expr: str

    @property
    def id(self) -> str:
        return f"{self.dashboard}/{self.panel}/{self.ref}"

    def metrics(self) -> set[str]:
        """Family names the query reads (see :func:`family`)."""
        return {family(name) for name in METRIC_NAME.findall(self.expr)}


def family(name: str) -> str:
    """A series name without ``_total``, ``_bucket``, ... (metadata names vary on these)."""
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def panel_queries() -> list[PanelQuery]:
    """Every panel target, and every annotation (panel ``annotation:<name>``)."""
    out = []
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                out.append(PanelQuery(path.stem, panel["title"], target["refId"], target["expr"]))
        for a in board["annotations"]["list"]:
            out.append(PanelQuery(path.stem, f"annotation:{a['name']}", "A", a["expr"]))
    return out


QUERIES = panel_queries()


# --------------------------------------------------------------------------- helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def http_json(url: str, timeout_s: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read())


def wait_for(what: str, check: Any, timeout_s: float, interval_s: float = 0.5) -> Any:
    """Poll ``check()`` until it returns a truthy value; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except OSError as e:  # not listening yet
            last = e
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}; last: {last!r}")


class Prometheus:
    """A prometheus process on 127.0.0.1 (stopped by PID)."""

    def __init__(self, config: Path, data_dir: Path, log: Path) -> None:
        assert PROMETHEUS is not None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={data_dir}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"prometheus exited with {self.proc.returncode}:\n{self.log.read_text()}")
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        body = http_json(f"{self.url}/api/v1/{path}" + (f"?{query}" if query else ""))
        assert body["status"] == "success", body
        return body["data"]

    def active_targets(self) -> list[dict[str, Any]]:
        targets: list[dict[str, Any]] = self.api("targets", state="active")["activeTargets"]
        return targets

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def prometheus_config(scheduler_metrics: str, targets_dir: Path, secrets: Path) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml, pointed at this test's cluster; its /secrets
    paths (the compose mount) at ``secrets`` (the same layout)."""
    raw = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    cfg: dict[str, Any] = json.loads(json.dumps(raw))  # YAML aliases become copies
    cfg["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    cfg["rule_files"] = [str(DEPLOY / "prometheus" / p) for p in cfg["rule_files"]]
    jobs = {job["job_name"]: job for job in cfg["scrape_configs"]}
    (sd,) = jobs["rlfleet"]["http_sd_configs"]
    assert sd["url"] == "https://scheduler:9200/sd", sd
    sd.update(url=f"https://{scheduler_metrics}/sd", refresh_interval="1s")

    def local(path: str) -> str:
        return str(secrets / Path(path).relative_to("/secrets"))

    for c in (*jobs.values(), sd):  # the observer's token, the cluster CA, mTLS
        assert c["authorization"] == {
            "type": "Bearer",
            "credentials_file": "/secrets/observer.token",
        }, c
        c["authorization"]["credentials_file"] = local("/secrets/observer.token")
        tls = c["tls_config"]
        assert tls["server_name"] == "rlfleet", tls
        for key in ("ca_file", "cert_file", "key_file"):
            tls[key] = local(tls[key])
    assert all(job["scheme"] == "https" for job in jobs.values()), jobs
    (files,) = jobs["rlfleet-static"]["file_sd_configs"]
    files.update(files=[str(targets_dir / "*.json")], refresh_interval="1s")
    return cfg


# --------------------------------------------------------------------------- the run


@dataclass
class Run:
    prometheus: Prometheus
    steps: int
    exported: set[str]  # metric family names Prometheus scraped (metadata)


def _raw_config(model: Path, data: Path, run_dir: Path) -> dict[str, Any]:
    return {
        "data": {
            "train_files": str(data / "train.parquet"),
            "val_files": str(data / "test.parquet"),
            "train_batch_size": 4,
            "max_prompt_length": 64,
            "max_response_length": 8,
        },
        "actor": {"model_path": str(model), "lr": 1e-4, "ppo_mini_batch_size": 4},
        "critic": {"ppo_mini_batch_size": 4},
        "rollout": {"n": 2},
        "algorithm": {"adv_estimator": "gae"},
        "reward": {"num_workers": 1},
        "trainer": {
            "total_training_steps": 3,
            "test_freq": 3,
            "save_freq": -1,
            "default_local_dir": str(run_dir),
            "resume_mode": "disable",
            "logger": ["jsonl"],
            "val_before_train": False,
        },
        "resource_pools": {"train_pool": [1], "rollout_pool": [1]},
        "mapping": {"actor": "train_pool", "critic": "train_pool", "rollout": "rollout_pool"},
        # On, with nowhere to go: its series exist, the fleet stays at one replica.
        "scheduler": {"autoscale": {"enable": True, "min_replicas": 1, "max_replicas": 1}},
    }


@pytest.fixture(scope="module")
def run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    if PROMETHEUS is None:
        pytest.skip(NO_PROMETHEUS)
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPU cores for the train and rollout pools")
    driver = pytest.importorskip("rlfleet.driver.loop", reason="the PPO driver is missing")
    from rlfleet.common.auth import write_credential_set
    from rlfleet.common.config import config_from_dict
    from rlfleet.common.secrets_cli import make_tls
    from rlfleet.driver.clients import remote_workers
    from rlfleet.driver.data.preprocess import preprocess
    from rlfleet.launch.cluster import LocalCluster

    tmp = tmp_path_factory.mktemp("prometheus")
    preprocess("arithmetic", None, tmp / "data", n=32, n_test=4, digits=1, ops="+-*", seed=0)
    # What `rlfleet secrets init --tls-host ...` writes, in the layout compose mounts.
    secrets = write_credential_set(tmp / "secrets")
    try:
        tls = make_tls(secrets / "tls", [])
    except OSError as e:
        pytest.skip(f"no TLS material: {e}")
    security = {
        "credentials_dir": str(secrets),
        "tls": {
            "cert": str(tls["cert"]),
            "key": str(tls["key"]),
            "ca": str(tls["ca"]),
            "require_client_cert": True,
        },
    }
    config = config_from_dict(
        {**_raw_config(tiny_model_dir, tmp / "data", tmp / "run"), "security": security}
    )
    with LocalCluster(config, tmp / "run", heartbeat_interval_s=0.5) as cluster:
        handle = cluster.start(timeout_s=180)
        assert handle.scheduler is not None
        scheduler_metrics = handle.metrics["scheduler"]
        mapping = remote_workers(handle.trainer, handle.rollout, handle.reward)
        with driver.PPOTrainer(config, role_worker_mapping=mapping, metrics_port=0) as trainer:
            assert trainer.metrics_port, "the driver serves no /metrics (prometheus_client?)"
            targets = tmp / "targets"
            targets.mkdir()
            (targets / "driver.json").write_text(
                json.dumps(
                    [
                        {
                            "targets": [f"127.0.0.1:{trainer.metrics_port}"],
                            "labels": {"role": "driver", "service_id": "driver"},
                        }
                    ]
                )
            )
            cfg_path = tmp / "prometheus.yml"
            cfg_path.write_text(
                yaml.safe_dump(prometheus_config(scheduler_metrics, targets, secrets))
            )
            prom = Prometheus(cfg_path, tmp / "tsdb", tmp / "prometheus.log")
            try:
                wait_for("prometheus /-/ready", prom.ready, 60)
                roles = {"scheduler", "reward", "rollout", "driver"}

                def all_up() -> bool:
                    up = {
                        t["labels"].get("role")
                        for t in prom.active_targets()
                        if t["health"] == "up"
                    }
                    return roles <= up

                wait_for(f"targets {sorted(roles)} up", all_up, 60)
                trainer.init_workers()
                records = trainer.fit()
                # A few scrapes after the last step, so every series has >= 2 samples.
                time.sleep(4)
                meta = prom.api("metadata")
                yield Run(prom, len(records), {family(m) for m in meta})
            finally:
                prom.stop()


# --------------------------------------------------------------------------- tests


def test_dashboards_are_valid_grafana_models() -> None:
    """What Grafana's provisioning needs: uid, title, schemaVersion, panels with unique
    ids, grid positions inside 24 columns, and targets on the provisioned datasource."""
    ds = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )
    (source,) = ds["datasources"]
    assert {p.stem for p in DASHBOARDS} == {"training", "rollout", "reward"}
    uids = set()
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        assert board["uid"] not in uids and len(board["uid"]) <= 40
        uids.add(board["uid"])
        assert board["title"] and isinstance(board["schemaVersion"], int)
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), path
        for panel in board["panels"]:
            g = panel["gridPos"]
            assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, (path, panel["title"])
            assert panel["datasource"]["uid"] == source["uid"]
            assert panel["targets"], (path, panel["title"])
            for t in panel["targets"]:
                assert t["expr"] and t["refId"] and t["datasource"]["uid"] == source["uid"]


def test_alert_rules_pass_promtool() -> None:
    if PROMTOOL is None:
        pytest.skip("no `promtool` on PATH (Debian: it comes with the prometheus package)")
    for args in (
        ["check", "rules", str(DEPLOY / "prometheus" / "alerts.yml")],
        # --syntax-only: the secrets it names exist only where compose mounts them.
        ["check", "config", "--syntax-only", str(DEPLOY / "prometheus" / "prometheus.yml")],
    ):
        out = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr


def test_targets_discovered_and_up(run: Run) -> None:
    targets = run.prometheus.active_targets()
    by_role: dict[str, list[dict[str, Any]]] = {}
    for t in targets:
        by_role.setdefault(t["labels"].get("role", ""), []).append(t)
    # scheduler, reward and rollout come from the scheduler's /sd, the driver from file_sd.
    for role, job in (
        ("scheduler", "rlfleet"),
        ("reward", "rlfleet"),
        ("rollout", "rlfleet"),
        ("driver", "rlfleet-static"),
    ):
        assert role in by_role, f"no {role} target; active: {[t['labels'] for t in targets]}"
        for t in by_role[role]:
            assert t["health"] == "up", t
            assert t["labels"]["job"] == job, t
    (replica,) = by_role["rollout"]
    assert replica["labels"]["replica"] == replica["labels"]["service_id"] != ""
    assert run.steps == 3


def test_alert_rules_load_and_evaluate(run: Run) -> None:
    groups = run.prometheus.api("rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    expected = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    names = {r["alert"] for g in expected["groups"] for r in g["rules"]}
    assert {r["name"] for r in rules} == names

    def evaluated() -> bool:
        return all(r.get("lastEvaluation", "").startswith("20") for r in rules)

    deadline = time.monotonic() + 10
    while not evaluated() and time.monotonic() < deadline:
        time.sleep(0.5)
        rules = [r for g in run.prometheus.api("rules")["groups"] for r in g["rules"]]
    bad = {r["name"]: r.get("lastError") for r in rules if r["health"] != "ok"}
    assert not bad, bad
    # A healthy run: nothing dead, lagging or stalled, not even pending.
    active = {r["name"]: r["state"] for r in rules if r["state"] != "inactive"}
    assert not active, active


@pytest.mark.parametrize("query", QUERIES, ids=[q.id for q in QUERIES])
def test_panel_query_returns_data(run: Run, query: PanelQuery) -> None:
    missing = sorted(query.metrics() - run.exported - {"up"})
    pending = [m for m in missing if m in PENDING]
    if pending:
        pytest.xfail("not exported yet: " + "; ".join(f"{m} ({PENDING[m]})" for m in pending))
    assert not missing, f"{query.id} reads metrics no service exported: {missing}"
    expr = query.expr
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    data = run.prometheus.api("query", query=expr)
    if query.panel.startswith("annotation:"):
        return  # an event marker: valid and reading exported series; empty when no event
    values = [float(r["value"][1]) for r in data["result"]]
    finite = [v for v in values if math.isfinite(v)]
    assert finite, f"{query.id}: {expr!r} returned {data['result']!r}"


def test_pending_metrics_are_still_pending(run: Run) -> None:
    """An entry of PENDING whose series now exists must leave the list."""
    arrived = sorted(set(PENDING) & run.exported)
    assert not arrived, f"now exported, remove from PENDING: {arrived}"
