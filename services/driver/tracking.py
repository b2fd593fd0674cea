"""Seeing a run: console progress, a JSONL metrics file, TensorBoard / W&B, Prometheus.

:class:`Tracking` fans one ``log(metrics, step)`` call out to the loggers named in
``trainer.logger``:

* ``console`` -- a tqdm progress bar (step, reward, step time) and a one-line
  summary per validation; without a terminal, one plain line per step;
* ``jsonl`` -- ``<run dir>/metrics.jsonl``, one JSON object per step
  (``{"step", "time", "metrics", ...extra}``), appended to, so a resumed run
  continues the same file; resumed at step ``k`` (``resume_step``), the records of
  steps after ``k`` (written after the checkpoint, about to be run again) are
  dropped first, so the file holds each step once;
* ``tensorboard`` -- ``<run dir>/tensorboard`` when ``torch.utils.tensorboard``
  can be imported (the ``tensorboard`` package); skipped with a warning otherwise;
* ``wandb`` -- when ``wandb`` is installed; skipped with a warning otherwise.

:class:`SchedulerMetrics` are the scheduler's Prometheus series (prefix
``rlfleet_scheduler_``): step time by phase, tokens/s, reward mean, staleness,
global step. ``prometheus_client`` is optional: without it every series is a no-op.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from rlfleet.driver.health import CHECKS

__all__ = [
    "PHASES",
    "SchedulerMetrics",
    "Tracking",
    "drop_records_after",
    "start_metrics_server",
]

logger = logging.getLogger(__name__)

#: The phases of one PPO step, as timed by the driver (``timing_s/<phase>``).
# Trainer metric -> the `loss` label of rlfleet_scheduler_loss.
_LOSSES = {"actor/pg_loss": "policy", "critic/vf_loss": "value", "actor/kl_loss": "kl"}

PHASES: tuple[str, ...] = (
    "gen",
    "reward",
    "old_log_prob",
    "ref",
    "values",
    "adv",
    "update_critic",
    "update_actor",
    "weight_sync",
    "rollout_swap",
    "checkpoint",
    "validation",
)


def _finite(metrics: Mapping[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if isinstance(v, bool) or not isinstance(v, int | float):
            continue
        f = float(v)
        if math.isfinite(f):
            out[k] = f
    return out


class _Console:
    """A tqdm bar on a terminal; plain lines elsewhere (CI logs, pipes)."""

    def __init__(self, total: int, initial: int, stream: TextIO) -> None:
        self.stream = stream
        self.bar: Any = None
        if stream.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(
                    total=total, initial=initial, desc="ppo", unit="step", file=stream, leave=True
                )
            except ImportError:
                self.bar = None

    def step(self, step: int, total: int, metrics: Mapping[str, float]) -> None:
        reward = metrics.get("critic/score/mean", metrics.get("reward/mean", float("nan")))
        step_s = metrics.get("timing_s/step", float("nan"))
        acc = metrics.get("val/test_score/mean")
        if self.bar is not None:
            post = {"reward": f"{reward:.3f}", "step_s": f"{step_s:.2f}"}
            if acc is not None:
                post["val"] = f"{acc:.3f}"
            self.bar.set_postfix(post, refresh=False)
            self.bar.update(1)
            return
        parts = [f"step {step}/{total}", f"reward {reward:.3f}", f"step {step_s:.2f}s"]
        if "staleness/mean" in metrics:
            parts.append(f"staleness {metrics['staleness/mean']:.2f}")
        if acc is not None:
            parts.append(f"val {acc:.3f}")
        print("  ".join(parts), file=self.stream, flush=True)

    def note(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def drop_records_after(path: Path, step: int) -> int:
    """Rewrite the JSONL file at ``path`` without the records of steps after ``step``.

    Atomic: a new file in the same directory replaces the old one, so a crash
    leaves one or the other whole. A last line cut short (a run killed while
    writing it) is dropped too, as appending after it would corrupt the next
    record; other lines that are not step records are kept as they are.

    Returns:
        How many lines were dropped (0 also when the file does not exist).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return 0
    lines = text.splitlines(keepends=True)
    kept: list[str] = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError:
            if i == len(lines) - 1 and not line.endswith("\n"):
                continue  # torn last write
            kept.append(line)
            continue
        later = (
            isinstance(record, dict)
            and isinstance(record.get("step"), int)
            and not isinstance(record["step"], bool)
            and record["step"] > step
        )
        if not later:
            kept.append(line if line.endswith("\n") else line + "\n")
    dropped = len(lines) - len(kept)
    if dropped == 0 and (not lines or lines[-1].endswith("\n")):
        return 0
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return dropped


class Tracking:
    """Sends each step's metrics to the configured loggers (see the module docstring).

    Args:
        loggers: names from ``trainer.logger``.
        run_dir: where ``metrics.jsonl`` and ``tensorboard/`` go.
        project, experiment: W&B project and run name.
        config: the resolved config as a dict (recorded by W&B).
        total_steps, initial_step: for the progress bar.
        resume_step: the step of the checkpoint the run resumed from:
            ``metrics.jsonl``'s records of later steps are dropped. None (a run
            that did not resume): append to the file as it is.
        stream: console output (default ``sys.stderr``).
    """

    def __init__(
        self,
        loggers: Sequence[str],
        run_dir: str | Path,
        *,
        project: str = "rlfleet",
        experiment: str = "run",
        config: Mapping[str, Any] | None = None,
        total_steps: int = 0,
        initial_step: int = 0,
        resume_step: int | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self._console: _Console | None = None
        self._jsonl: TextIO | None = None
        self._tb: Any = None
        self._wandb: Any = None
        if "console" in loggers:
            self._console = _Console(total_steps, initial_step, stream or sys.stderr)
        if "jsonl" in loggers:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if resume_step is not None:
                dropped = drop_records_after(self.jsonl_path, resume_step)
                if dropped:
                    logger.info(
                        "%s: dropped %d records of steps after %d (to be run again)",
                        self.jsonl_path,
                        dropped,
                        resume_step,
                    )
            self._jsonl = self.jsonl_path.open("a", encoding="utf-8")
        if "tensorboard" in loggers:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
            except ImportError:
                logger.warning("logger tensorboard: the tensorboard package is not installed")
        if "wandb" in loggers:
            try:
                import wandb

                self._wandb = wandb.init(
                    project=project, name=experiment, config=dict(config or {}), resume="allow"
                )
            except ImportError:
                logger.warning("logger wandb: the wandb package is not installed")

    @property
    def jsonl_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def log(
        self, metrics: Mapping[str, Any], step: int, *, kind: str = "train", **extra: Any
    ) -> None:
        """Record one step (``kind`` "train") or a validation (``kind`` "validation",
        not a progress-bar step); ``extra`` (JSON values) goes to the JSONL record only."""
        values = _finite(metrics)
        if self._console is not None and kind == "train":
            self._console.step(step, self.total_steps, values)
        if self._jsonl is not None:
            record = {"step": step, "kind": kind, "time": time.time(), "metrics": values, **extra}
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def note(self, text: str) -> None:
        """A line for the console logger (validation results, resume, ...)."""
        if self._console is not None:
            self._console.note(text)
        else:
            logger.info("%s", text)

    def rewind(self, step: int) -> None:
        """Steps after ``step`` are run again (the trainer restored an earlier
        checkpoint within the run): their JSONL records go, as on a resume."""
        if self._jsonl is None:
            return
        self._jsonl.close()
        dropped = drop_records_after(self.jsonl_path, step)
        if dropped:
            logger.info("%s: dropped %d records of steps after %d (to be run again)",
                        self.jsonl_path, dropped, step)  # fmt: skip
        self._jsonl = self.jsonl_path.open("a", encoding="utf-8")

    def warn(self, text: str) -> None:
        """A warning (a health check firing, the guard acting): a console line, or a
        logged warning without the console logger. The step's record carries the
        matching ``health/...`` metrics."""
        if self._console is not None:
            self._console.note(text)
        else:
            logger.warning("%s", text)

    def close(self) -> None:
        if self._console is not None:
            self._console.close()
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


class _Noop:
    def labels(self, *args: Any, **kwargs: Any) -> _Noop:
        return self

    def inc(self, amount: float = 1) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def observe(self, value: float) -> None:
        pass


class SchedulerMetrics:
    """The driver's Prometheus series; each instance owns its registry."""

    registry: Any
    phase_seconds: Any
    step_seconds: Any
    tokens_per_second: Any
    reward_mean: Any
    staleness: Any
    global_step: Any
    val_score: Any
    samples: Any
    actor_kl: Any
    actor_entropy: Any
    loss: Any
    weight_sync_failures: Any
    weight_pushes: Any
    weight_push_bytes: Any
    health_firing: Any
    health_warnings: Any
    health_interventions: Any
    health_lr_scale: Any

    def __init__(self) -> None:
        try:
            import prometheus_client as prom
        except ImportError:
            self.registry = None
            noop = _Noop()
            self.phase_seconds = self.step_seconds = self.tokens_per_second = noop
            self.reward_mean = self.staleness = self.global_step = noop
            self.val_score = self.samples = noop
            self.actor_kl = self.actor_entropy = self.loss = self.weight_sync_failures = noop
            self.weight_pushes = self.weight_push_bytes = noop
            self.health_firing = self.health_warnings = noop
            self.health_interventions = self.health_lr_scale = noop
            return
        r = prom.CollectorRegistry()
        self.registry = r
        p = "rlfleet_scheduler_"
        buckets = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
        self.phase_seconds = prom.Histogram(
            p + "phase_seconds", "time of each phase of a PPO step", ["phase"],
            registry=r, buckets=buckets,
        )  # fmt: skip
        self.step_seconds = prom.Histogram(
            p + "step_seconds", "wall time of one PPO step", registry=r, buckets=buckets
        )
        self.tokens_per_second = prom.Gauge(
            p + "tokens_per_second", "generated tokens / generation time, last step", registry=r
        )
        self.reward_mean = prom.Gauge(
            p + "reward_mean", "mean sequence score, last step", registry=r
        )
        self.staleness = prom.Gauge(
            p + "staleness", "trainer version minus sample weight version, last step mean",
            registry=r,
        )  # fmt: skip
        self.global_step = prom.Gauge(p + "global_step", "PPO steps done", registry=r)
        self.val_score = prom.Gauge(
            p + "val_score", "mean validation score", ["data_source"], registry=r
        )
        self.samples = prom.Counter(p + "samples", "samples trained on", registry=r)
        self.actor_kl = prom.Gauge(
            p + "actor_kl", "approximate KL of the actor update (actor/ppo_kl), last step",
            registry=r,
        )  # fmt: skip
        self.actor_entropy = prom.Gauge(
            p + "actor_entropy", "mean token entropy of the policy, last step", registry=r
        )
        self.loss = prom.Gauge(p + "loss", "training losses, last step", ["loss"], registry=r)
        self.weight_sync_failures = prom.Counter(
            p + "weight_sync_failures", "weight pushes to the rollout replicas that failed",
            registry=r,
        )  # fmt: skip
        self.weight_pushes = prom.Counter(
            p + "weight_pushes", "weight pushes to one rollout replica, by the transport used",
            ["transport"], registry=r,
        )  # fmt: skip
        self.weight_push_bytes = prom.Counter(
            p + "weight_push_bytes", "bytes of weights pushed to the rollout replicas, by transport",
            ["transport"], registry=r,
        )  # fmt: skip
        self.health_firing = prom.Gauge(
            p + "health_firing", "1 while a health check fires (trainer.health), else 0",
            ["check"], registry=r,
        )  # fmt: skip
        self.health_warnings = prom.Counter(
            p + "health_warnings", "health warnings raised (a check that started firing)",
            ["check"], registry=r,
        )  # fmt: skip
        self.health_interventions = prom.Counter(
            p + "health_interventions", "what the health guard did: rollback, lr_cut",
            ["action"], registry=r,
        )  # fmt: skip
        self.health_lr_scale = prom.Gauge(
            p + "health_lr_scale", "the actor's lr as a fraction of actor.lr (the guard's cuts)",
            registry=r,
        )  # fmt: skip
        # Every known label value exists from the start at zero, so that rate() over a
        # short run sees the first observation as an increase.
        for phase in PHASES:
            self.phase_seconds.labels(phase)
        for name in _LOSSES.values():
            self.loss.labels(name)
        from rlfleet.weightsync.wire import AUTO

        for transport in AUTO:
            self.weight_pushes.labels(transport)
            self.weight_push_bytes.labels(transport)
        for check in CHECKS:
            self.health_firing.labels(check).set(0)
            self.health_warnings.labels(check)
        for action in ("rollback", "lr_cut"):
            self.health_interventions.labels(action)
        self.health_lr_scale.set(1.0)

    def record_step(self, metrics: Mapping[str, float], step: int, samples: int) -> None:
        for phase in PHASES:
            v = metrics.get(f"timing_s/{phase}")
            if v is not None:
                self.phase_seconds.labels(phase).observe(v)
        if "timing_s/step" in metrics:
            self.step_seconds.observe(metrics["timing_s/step"])
        if "perf/tokens_per_second" in metrics:
            self.tokens_per_second.set(metrics["perf/tokens_per_second"])
        if "critic/score/mean" in metrics:
            self.reward_mean.set(metrics["critic/score/mean"])
        if "staleness/mean" in metrics:
            self.staleness.set(metrics["staleness/mean"])
        if "actor/ppo_kl" in metrics:
            self.actor_kl.set(metrics["actor/ppo_kl"])
        # The update's entropy when its coefficient uses it, else the old-log-prob pass's.
        entropy = metrics.get("actor/entropy", metrics.get("actor/entropy_old"))
        if entropy is not None:
            self.actor_entropy.set(entropy)
        for key, name in _LOSSES.items():
            if key in metrics:
                self.loss.labels(name).set(metrics[key])
        self.global_step.set(step)
        self.samples.inc(samples)

    def record_health(
        self,
        active: Mapping[str, bool],
        new: Sequence[str],
        actions: Sequence[str],
        lr_scale: float,
    ) -> None:
        """One step's health: which checks fire, the warnings raised (check names),
        what the guard did (``rollback``, ``lr_cut``), the actor's lr scale."""
        for check, on in active.items():
            self.health_firing.labels(check).set(1.0 if on else 0.0)
        for check in new:
            self.health_warnings.labels(check).inc()
        for action in actions:
            self.health_interventions.labels(action).inc()
        self.health_lr_scale.set(lr_scale)

    def record_validation(self, scores: Mapping[str, float]) -> None:
        for source, value in scores.items():
            self.val_score.labels(source).set(value)


def start_metrics_server(metrics: SchedulerMetrics, port: int, host: str = "127.0.0.1") -> int:
    """Serve ``/metrics`` on ``host:port`` (0: a free port); returns the port (0: none)."""
    if metrics.registry is None:
        logger.warning("prometheus_client is not installed: no scheduler metrics endpoint")
        return 0
    from rlfleet.common.http import metrics_route, serve_http

    return serve_http(host, port, {"/metrics": metrics_route(metrics.registry)}).port
