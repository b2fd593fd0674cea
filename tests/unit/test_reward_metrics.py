"""The reward service's Prometheus metrics."""

from __future__ import annotations

import pytest

from rlfleet.reward.metrics import _SCORE_BUCKETS, RewardMetrics, prometheus_available
from rlfleet.reward.types import ScoreResult

pytestmark = pytest.mark.skipif(
    not prometheus_available(), reason="prometheus-client not installed"
)


def test_score_histogram_exposes_what_a_prometheus_histogram_would() -> None:
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    scores = [0.0, 1.0, 1.0, 0.5, -3.0, 7.0, 0.1, 1.0]
    registry = CollectorRegistry()
    reference = Histogram(
        "rlfleet_reward_score",
        "scores given",
        ["scorer"],
        buckets=_SCORE_BUCKETS,
        registry=registry,
    )
    for s in scores:
        reference.labels("gsm8k").observe(s)
    expected = [
        line
        for line in generate_latest(registry).decode().splitlines()
        if line.startswith("rlfleet_reward_score_") and "created" not in line
    ]
    metrics = RewardMetrics()
    for batch in (scores[:3], scores[3:]):
        results = [ScoreResult(i, s, "gsm8k") for i, s in enumerate(batch)]
        metrics.samples(["gsm8k"] * len(batch), results)
    got = [
        line
        for line in metrics.render().splitlines()
        if line.startswith("rlfleet_reward_score_") and 'scorer="gsm8k"' in line
    ]
    assert got == expected
    # Known scorers exist at zero before their first sample.
    assert 'rlfleet_reward_score_count{scorer="math"} 0.0' in metrics.render()


def test_batch_counts_per_label() -> None:
    metrics = RewardMetrics()
    results = [
        ScoreResult(0, 1.0, "gsm8k"),
        ScoreResult(1, 0.0, "gsm8k", error="ValueError: x"),
        ScoreResult(2, 0.0, "custom", error="timed out after 1s", timed_out=True),
    ]
    metrics.samples(["openai/gsm8k", "openai/gsm8k", "x" * 100], results)
    text = metrics.render()
    assert 'rlfleet_reward_samples_total{data_source="openai/gsm8k",scorer="gsm8k"} 2.0' in text
    assert f'rlfleet_reward_samples_total{{data_source="{"x" * 64}",scorer="custom"}} 1.0' in text
    assert 'rlfleet_reward_sample_errors_total{scorer="gsm8k"} 1.0' in text
    assert 'rlfleet_reward_sample_errors_total{scorer="custom"} 1.0' in text
    assert 'rlfleet_reward_sample_timeouts_total{scorer="custom"} 1.0' in text
