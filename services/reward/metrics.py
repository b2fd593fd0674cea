"""Prometheus metrics of the reward service, on their own registry.

``prometheus_client`` is optional: without it every method is a no-op and
:func:`start_metrics_server` refuses with a clear message. Each
:class:`RewardMetrics` has its own ``CollectorRegistry``, so several services in
one process (tests) do not collide.

Names (Prometheus conventions: ``_total`` counters, ``_seconds`` durations):

* ``rlfleet_reward_requests_total{method, code}``
* ``rlfleet_reward_request_duration_seconds{method}`` (histogram)
* ``rlfleet_reward_samples_total{data_source, scorer}``
* ``rlfleet_reward_score{scorer}`` (histogram of scores)
* ``rlfleet_reward_sample_timeouts_total{scorer}``
* ``rlfleet_reward_sample_errors_total{scorer}``
* ``rlfleet_reward_worker_restarts_total``
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

from rlfleet.reward.types import ScoreResult

__all__ = ["RewardMetrics", "prometheus_available", "start_metrics_server"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_SCORE_BUCKETS = (-1.0, -0.5, 0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 2.0, 5.0)
_MAX_LABEL_CHARS = 64


def prometheus_available() -> bool:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


def _label(value: str) -> str:
    return value[:_MAX_LABEL_CHARS] if value else "unknown"


class RewardMetrics:
    """The service's counters and histograms (no-ops without ``prometheus_client``)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled and prometheus_available()
        self.registry: Any = None
        if not self.enabled:
            return
        from prometheus_client import CollectorRegistry, Counter, Histogram

        r = CollectorRegistry(auto_describe=True)
        self.registry = r
        self._requests = Counter(
            "rlfleet_reward_requests_total", "RPCs handled", ["method", "code"], registry=r
        )
        self._latency = Histogram(
            "rlfleet_reward_request_duration_seconds",
            "RPC latency",
            ["method"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._samples = Counter(
            "rlfleet_reward_samples_total",
            "samples scored",
            ["data_source", "scorer"],
            registry=r,
        )
        self._scores = Histogram(
            "rlfleet_reward_score", "scores given", ["scorer"], buckets=_SCORE_BUCKETS, registry=r
        )
        self._timeouts = Counter(
            "rlfleet_reward_sample_timeouts_total",
            "samples stopped at the per-sample time-out",
            ["scorer"],
            registry=r,
        )
        self._errors = Counter(
            "rlfleet_reward_sample_errors_total",
            "samples whose scoring failed (time-outs included)",
            ["scorer"],
            registry=r,
        )
        self._restarts = Counter(
            "rlfleet_reward_worker_restarts_total", "scoring workers replaced", registry=r
        )
        # Known label values exist from the start at zero, so rate() over a short run
        # sees the first request as an increase.
        from rlfleet.reward.scorers import BUILTIN_SCORERS

        for method in ("Score", "ScoreStream"):
            self._latency.labels(method)
        for scorer in BUILTIN_SCORERS:
            self._scores.labels(scorer)
            self._timeouts.labels(scorer)
            self._errors.labels(scorer)

    def request(self, method: str, code: str, seconds: float) -> None:
        if self.enabled:
            self._requests.labels(method, code).inc()
            self._latency.labels(method).observe(seconds)

    def samples(self, data_sources: Sequence[str], results: Sequence[ScoreResult]) -> None:
        """Record one batch of results (aggregated per label set: cheap per sample)."""
        if not self.enabled:
            return
        counts: collections.Counter[tuple[str, str]] = collections.Counter()
        per_scorer: dict[str, list[float]] = collections.defaultdict(list)
        timeouts: collections.Counter[str] = collections.Counter()
        errors: collections.Counter[str] = collections.Counter()
        for source, result in zip(data_sources, results, strict=True):
            counts[(_label(source), result.scorer)] += 1
            per_scorer[result.scorer].append(result.score)
            if result.timed_out:
                timeouts[result.scorer] += 1
            if result.error:
                errors[result.scorer] += 1
        for (source, scorer), n in counts.items():
            self._samples.labels(source, scorer).inc(n)
        for scorer, scores in per_scorer.items():
            child = self._scores.labels(scorer)
            for s in scores:
                child.observe(s)
        for scorer, n in timeouts.items():
            self._timeouts.labels(scorer).inc(n)
        for scorer, n in errors.items():
            self._errors.labels(scorer).inc(n)

    def worker_restart(self) -> None:
        if self.enabled:
            self._restarts.inc()

    def render(self) -> str:
        """The text exposition format (what ``/metrics`` serves)."""
        if not self.enabled:
            return ""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()


def start_metrics_server(metrics: RewardMetrics, host: str, port: int) -> tuple[Any, int]:
    """Serve ``/metrics`` over HTTP on ``host:port`` (0: a free port).

    Returns:
        ``(server, port)``; stop it with ``server.shutdown()``.
    """
    if not metrics.enabled:
        raise RuntimeError(
            "metrics need the prometheus-client package: pip install prometheus-client"
        )
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host, registry=metrics.registry)
    return server, int(server.server_address[1])
