"""Prometheus metrics of a rollout replica (served at ``/metrics``).

``prometheus_client`` is optional: without it every metric is a no-op, so the
rollout core runs (and tests run) in an install that lacks it. Each
:class:`RolloutMetrics` owns its registry, so several replicas in one process
(tests) do not collide.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["RolloutMetrics", "start_metrics_server"]

logger = logging.getLogger(__name__)


class _Noop:
    def labels(self, *args: Any, **kwargs: Any) -> _Noop:
        return self

    def inc(self, amount: float = 1) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def observe(self, value: float) -> None:
        pass

    def set_function(self, f: Any) -> None:
        pass


class RolloutMetrics:
    """The replica's metrics; names are prefixed ``rlfleet_rollout_``."""

    # Prometheus objects, or their no-op twin without prometheus_client.
    registry: Any
    generated_tokens: Any
    requests: Any
    samples: Any
    queue_depth: Any
    weight_version: Any
    time_to_first_sample: Any
    request_latency: Any
    weight_update_seconds: Any
    weight_update_bytes: Any
    weight_staged_bytes: Any
    weight_spare_bytes: Any
    weight_updates_aborted: Any

    def __init__(self, replica_id: str = "") -> None:
        try:
            import prometheus_client as prom
        except ImportError:
            self.registry = None
            noop = _Noop()
            self.generated_tokens = self.requests = self.samples = noop
            self.queue_depth = self.weight_version = noop
            self.time_to_first_sample = self.request_latency = noop
            self.weight_update_seconds = self.weight_update_bytes = noop
            self.weight_staged_bytes = self.weight_spare_bytes = noop
            self.weight_updates_aborted = noop
            return
        r = prom.CollectorRegistry()
        self.registry = r
        p = "rlfleet_rollout_"
        self.generated_tokens = prom.Counter(p + "generated_tokens", "tokens generated", registry=r)
        self.requests = prom.Counter(
            p + "requests", "Generate requests by outcome", ["outcome"], registry=r
        )
        self.samples = prom.Counter(
            p + "samples", "samples finished by finish reason", ["reason"], registry=r
        )
        self.queue_depth = prom.Gauge(p + "queue_depth", "samples waiting or running", registry=r)
        self.weight_version = prom.Gauge(p + "weight_version", "weight version serving", registry=r)
        buckets = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
        self.time_to_first_sample = prom.Histogram(
            p + "time_to_first_sample_seconds",
            "request start to first sample",
            buckets=buckets,
            registry=r,
        )
        self.request_latency = prom.Histogram(
            p + "request_latency_seconds",
            "request start to last sample",
            buckets=buckets,
            registry=r,
        )
        self.weight_update_seconds = prom.Histogram(
            p + "weight_update_seconds",
            "weight update: first byte to swap done",
            ["transport"],
            buckets=buckets,
            registry=r,
        )
        self.weight_update_bytes = prom.Counter(
            p + "weight_update_bytes", "weight bytes applied", ["transport"], registry=r
        )
        self.weight_staged_bytes = prom.Gauge(
            p + "weight_staged_bytes",
            "bulk plane staging bytes held by updates not applied yet",
            registry=r,
        )
        self.weight_spare_bytes = prom.Gauge(
            p + "weight_spare_bytes", "bulk plane spare staging bytes kept for reuse", registry=r
        )
        self.weight_updates_aborted = prom.Counter(
            p + "weight_updates_aborted",
            "bucketed bulk updates aborted by their sender",
            registry=r,
        )
        # Known label values exist from the start at zero, so rate() sees the first
        # update as an increase.
        for transport in ("grpc", "tcp", "shm"):
            self.weight_update_seconds.labels(transport)
            self.weight_update_bytes.labels(transport)


def start_metrics_server(metrics: RolloutMetrics, host: str, port: int) -> str | None:
    """Serve ``/metrics`` on ``host:port`` (0: a free port); returns ``host:port``,
    or None without prometheus_client."""
    if metrics.registry is None:
        logger.warning("prometheus_client is not installed: no /metrics endpoint")
        return None
    from rlfleet.common.http import metrics_route, serve_http

    endpoint = serve_http(host, port, {"/metrics": metrics_route(metrics.registry)})
    return endpoint.address
