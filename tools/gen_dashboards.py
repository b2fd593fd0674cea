"""Write deploy/grafana/dashboards/{training,rollout,reward}.json.

The dashboards are data; this script is their one source so panels stay uniform
(datasource, sizes, legends). Run it after changing a panel, and commit the JSON:

    python tools/gen_dashboards.py          # rewrite the files
    python tools/gen_dashboards.py --check  # exit 1 if a file differs (CI)

Queries use only metric names the services export (tests/integration/
test_prometheus.py evaluates every one against a real Prometheus scraping a real
run); ``$__rate_interval`` is Grafana's.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "rlfleet-prometheus"}
RI = "$__rate_interval"


@dataclass
class Panel:
    title: str
    queries: list[tuple[str, str]]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"
    width: int = 12
    description: str = ""
    stack: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def _panel(pid: int, p: Panel, x: int, y: int) -> dict[str, Any]:
    height = 4 if p.kind == "stat" else 8
    custom: dict[str, Any] = {}
    if p.kind == "timeseries":
        custom = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 20 if p.stack else 0,
            "showPoints": "auto",
            "spanNulls": True,
            "stacking": {"mode": "normal" if p.stack else "none", "group": "A"},
        }
    options: dict[str, Any]
    if p.kind == "stat":
        options = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "textMode": "auto",
        }
    else:
        options = {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "none"},
        }
    return {
        "id": pid,
        "type": p.kind,
        "title": p.title,
        "description": p.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": height, "w": p.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": p.unit, "custom": custom}, "overrides": []},
        "options": options,
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": q, "legendFormat": lg}
            for i, (q, lg) in enumerate(p.queries)
        ],
        **p.extra,
    }


@dataclass
class Annotation:
    """Events drawn on every panel's time axis: where ``expr`` has a value."""

    name: str
    expr: str
    title: str
    color: str = "orange"


def _annotation(a: Annotation) -> dict[str, Any]:
    return {
        "name": a.name,
        "datasource": DATASOURCE,
        "enable": True,
        "iconColor": a.color,
        "expr": a.expr,
        "step": "10s",
        "titleFormat": a.title,
        "useValueForTime": False,
    }


def dashboard(
    uid: str,
    title: str,
    description: str,
    panels: list[Panel],
    annotations: list[Annotation] | None = None,
) -> dict[str, Any]:
    out, x, y, row_h = [], 0, 0, 0
    for i, p in enumerate(panels, start=1):
        if x + p.width > 24:
            x, y, row_h = 0, y + row_h, 0
        d = _panel(i, p, x, y)
        out.append(d)
        x += p.width
        row_h = max(row_h, d["gridPos"]["h"])
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["rlfleet"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "5s",
        "time": {"from": "now-30m", "to": "now"},
        "annotations": {"list": [_annotation(a) for a in annotations or []]},
        "templating": {"list": []},
        "links": [
            {"type": "dashboards", "tags": ["rlfleet"], "asDropdown": True, "title": "rlfleet"}
        ],
        "panels": out,
    }


AUTOSCALE = Annotation(
    "autoscale",
    "sum by (direction) (changes(rlfleet_autoscale_decisions_total[1m])) > 0",
    "autoscale: rollout {{direction}}",
)


def training() -> dict[str, Any]:
    s = "rlfleet_scheduler_"
    return dashboard(
        "rlfleet-training",
        "rlfleet / training",
        "The PPO driver: reward, KL, entropy, losses, step time by phase.",
        [
            Panel("Global step", [(f"max({s}global_step)", "step")], kind="stat", width=6),
            Panel(
                "Samples trained / s",
                [(f"sum(rate({s}samples_total[{RI}]))", "samples/s")],
                kind="stat",
                width=6,
            ),
            Panel(
                "Mean step time",
                [
                    (
                        f"sum(rate({s}step_seconds_sum[{RI}])) / sum(rate({s}step_seconds_count[{RI}]))",
                        "step",
                    )
                ],
                unit="s",
                kind="stat",
                width=6,
            ),
            Panel("Staleness", [(f"max({s}staleness)", "versions behind")], kind="stat", width=6),
            Panel(
                "Reward (mean sequence score)",
                [(f"{s}reward_mean", "train"), (f"{s}val_score", "val {{data_source}}")],
            ),
            Panel(
                "KL",
                [(f"{s}actor_kl", "actor ppo_kl")],
                description="actor/ppo_kl of the last step",
            ),
            Panel("Entropy", [(f"{s}actor_entropy", "actor entropy")]),
            Panel(
                "Losses",
                [(f"{s}loss", "{{loss}}")],
                description="policy (actor/pg_loss), value (critic/vf_loss), kl (actor/kl_loss)",
            ),
            Panel(
                "Step time by phase (mean per step)",
                [
                    (
                        f"sum by (phase) (rate({s}phase_seconds_sum[{RI}]))"
                        f" / sum by (phase) (rate({s}phase_seconds_count[{RI}]))",
                        "{{phase}}",
                    )
                ],
                unit="s",
                stack=True,
                width=24,
            ),
            Panel(
                "Step time p50 / p90",
                [
                    (
                        f"histogram_quantile(0.5, sum by (le) (rate({s}step_seconds_bucket[{RI}])))",
                        "p50",
                    ),
                    (
                        f"histogram_quantile(0.9, sum by (le) (rate({s}step_seconds_bucket[{RI}])))",
                        "p90",
                    ),
                ],
                unit="s",
            ),
            Panel(
                "Generation throughput (driver)",
                [(f"{s}tokens_per_second", "tokens/s")],
                unit="short",
            ),
            Panel(
                "Health checks firing",
                [(f"max by (check) ({s}health_firing)", "{{check}}")],
                description="trainer.health: 1 while a check fires (docs/driver.md, "
                "'When a run goes wrong')",
            ),
            Panel(
                "Health warnings and guard interventions",
                [
                    (f"sum by (check) ({s}health_warnings_total)", "warnings {{check}}"),
                    (f"sum by (action) ({s}health_interventions_total)", "guard {{action}}"),
                    (f"min({s}health_lr_scale)", "actor lr scale"),
                ],
            ),
        ],
        [AUTOSCALE],
    )


def rollout() -> dict[str, Any]:
    r = "rlfleet_rollout_"
    return dashboard(
        "rlfleet-rollout",
        "rlfleet / rollout",
        "Rollout replicas: throughput, queue depth, replicas, weight version.",
        [
            Panel(
                "Alive replicas",
                [
                    (
                        'sum(rlfleet_scheduler_registered_services{role="rollout", state="alive"})',
                        "alive",
                    )
                ],
                kind="stat",
                width=8,
            ),
            Panel(
                "Tokens / s (all replicas)",
                [(f"sum(rate({r}generated_tokens_total[{RI}]))", "tokens/s")],
                kind="stat",
                width=8,
            ),
            Panel(
                "Newest weight version",
                [(f"max({r}weight_version)", "version")],
                kind="stat",
                width=8,
            ),
            Panel(
                "Tokens / s per replica",
                [(f"sum by (replica) (rate({r}generated_tokens_total[{RI}]))", "{{replica}}")],
                stack=True,
            ),
            Panel(
                "Queue depth",
                [(f"{r}queue_depth", "{{replica}}")],
                description="samples waiting or running",
            ),
            Panel(
                "Replicas by state",
                [
                    (
                        'sum by (state) (rlfleet_scheduler_registered_services{role="rollout"})',
                        "{{state}}",
                    )
                ],
            ),
            Panel("Weight version", [(f"{r}weight_version", "{{replica}}")]),
            Panel(
                "Request latency p50 / p90",
                [
                    (
                        f"histogram_quantile(0.5, sum by (le) (rate({r}request_latency_seconds_bucket[{RI}])))",
                        "p50",
                    ),
                    (
                        f"histogram_quantile(0.9, sum by (le) (rate({r}request_latency_seconds_bucket[{RI}])))",
                        "p90",
                    ),
                    (
                        f"histogram_quantile(0.5, sum by (le) (rate({r}time_to_first_sample_seconds_bucket[{RI}])))",
                        "first sample p50",
                    ),
                ],
                unit="s",
            ),
            Panel(
                "Weight update time p90",
                [
                    (
                        f"histogram_quantile(0.9, sum by (le, transport) (rate({r}weight_update_seconds_bucket[{RI}])))",
                        "{{transport}}",
                    )
                ],
                unit="s",
            ),
            Panel(
                "Weight staging memory (bulk plane)",
                [
                    (f"sum({r}weight_staged_bytes)", "staged, not applied"),
                    (f"sum({r}weight_spare_bytes)", "spare buffers"),
                ],
                unit="bytes",
            ),
            Panel(
                "Samples / s by finish reason",
                [(f"sum by (reason) (rate({r}samples_total[{RI}]))", "{{reason}}")],
                stack=True,
            ),
            Panel(
                "Requests / s by outcome",
                [(f"sum by (outcome) (rate({r}requests_total[{RI}]))", "{{outcome}}")],
            ),
            Panel(
                "Replicas: desired and alive",
                [
                    ("max(rlfleet_autoscale_desired_replicas)", "desired"),
                    (
                        'sum(rlfleet_scheduler_registered_services{role="rollout", state="alive"})',
                        "alive",
                    ),
                ],
                description="desired: the scheduler's count (rlfleet scale, or the "
                "autoscaler when scheduler.autoscale.enable)",
            ),
            Panel(
                "Autoscale decisions",
                [
                    (
                        f"sum by (direction) (increase(rlfleet_autoscale_decisions_total[{RI}]))",
                        "{{direction}}",
                    )
                ],
            ),
        ],
        [AUTOSCALE],
    )


def reward() -> dict[str, Any]:
    w = "rlfleet_reward_"
    return dashboard(
        "rlfleet-reward",
        "rlfleet / reward",
        "The reward service: samples/s, latency, time-outs, errors, scores.",
        [
            Panel(
                "Samples / s by data source",
                [(f"sum by (data_source) (rate({w}samples_total[{RI}]))", "{{data_source}}")],
                stack=True,
            ),
            Panel(
                "Request latency",
                [
                    (
                        f"histogram_quantile(0.5, sum by (le, method) (rate({w}request_duration_seconds_bucket[{RI}])))",
                        "p50 {{method}}",
                    ),
                    (
                        f"histogram_quantile(0.99, sum by (le, method) (rate({w}request_duration_seconds_bucket[{RI}])))",
                        "p99 {{method}}",
                    ),
                ],
                unit="s",
            ),
            Panel(
                "Time-outs / s",
                [
                    (
                        f"sum by (scorer) (rate({w}sample_timeouts_total[{RI}])) or on () vector(0)",
                        "{{scorer}}",
                    )
                ],
                description="samples stopped at the per-sample time-out (0 when none ever timed out)",
            ),
            Panel(
                "Errors / s",
                [
                    (
                        f"sum by (scorer) (rate({w}sample_errors_total[{RI}])) or on () vector(0)",
                        "{{scorer}}",
                    )
                ],
                description="samples whose scoring failed, time-outs included (0 when none ever failed)",
            ),
            Panel(
                "Requests / s by code",
                [(f"sum by (method, code) (rate({w}requests_total[{RI}]))", "{{method}} {{code}}")],
            ),
            Panel(
                "Score p50 by scorer",
                [
                    (
                        f"histogram_quantile(0.5, sum by (le, scorer) (rate({w}score_bucket[{RI}])))",
                        "{{scorer}}",
                    )
                ],
            ),
            Panel(
                "Worker restarts",
                [(f"sum(increase({w}worker_restarts_total[{RI}]))", "restarts")],
                width=24,
            ),
        ],
    )


DASHBOARDS = {"training": training, "rollout": rollout, "reward": reward}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a file is out of date")
    args = parser.parse_args(argv)
    stale = []
    for name, build in DASHBOARDS.items():
        path = OUT / f"{name}.json"
        text = json.dumps(build(), indent=2) + "\n"
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(
            "out of date (run python tools/gen_dashboards.py):", *stale, sep="\n  ", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
