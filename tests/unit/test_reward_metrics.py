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
    assert 'rlfleet_reward_samples_total{data_source="other",scorer="custom"} 1.0' in text
    assert 'rlfleet_reward_sample_errors_total{scorer="gsm8k"} 1.0' in text
    assert 'rlfleet_reward_sample_errors_total{scorer="custom"} 1.0' in text
    assert 'rlfleet_reward_sample_timeouts_total{scorer="custom"} 1.0' in text


def test_merged_expositions_label_each_process_and_add_up() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from rlfleet.reward.metrics import merge_expositions

    a, b = RewardMetrics(), RewardMetrics()
    a.request("Score", "OK", 0.01)
    a.request("Score", "OK", 0.2)
    b.request("Score", "OK", 0.02)
    b.request("Score", "INVALID_ARGUMENT", 0.001)
    a.samples(["gsm8k"] * 3, [ScoreResult(i, 1.0, "gsm8k") for i in range(3)])
    b.samples(["gsm8k"] * 2, [ScoreResult(i, 0.0, "gsm8k") for i in range(2)])
    text = merge_expositions([a.render(), b.render()]).decode()

    families = {f.name: f for f in text_string_to_metric_families(text)}
    # One HELP / TYPE per family, the merged series keep their types.
    assert text.count("# TYPE rlfleet_reward_requests_total counter") == 1
    assert families["rlfleet_reward_request_duration_seconds"].type == "histogram"
    requests = {
        (s.labels["process"], s.labels["code"]): s.value
        for s in families["rlfleet_reward_requests"].samples
        if s.name.endswith("_total")
    }
    assert requests == {("0", "OK"): 2.0, ("1", "OK"): 1.0, ("1", "INVALID_ARGUMENT"): 1.0}
    counts = {
        s.labels["process"]: s.value
        for s in families["rlfleet_reward_request_duration_seconds"].samples
        if s.name.endswith("_count") and s.labels["method"] == "Score"
    }
    assert counts == {"0": 2.0, "1": 2.0}
    scored = {
        s.labels["process"]: s.value
        for s in families["rlfleet_reward_score"].samples
        if s.name.endswith("_count") and s.labels["scorer"] == "gsm8k"
    }
    assert scored == {"0": 3.0, "1": 2.0}


def test_merging_refuses_a_series_that_has_the_label_already() -> None:
    from rlfleet.reward.metrics import merge_expositions

    text = '# TYPE x_total counter\nx_total{process="7"} 1.0\n'
    with pytest.raises(ValueError, match="already has a 'process' label"):
        merge_expositions([text])


def test_data_source_labels_come_from_the_known_set() -> None:
    metrics = RewardMetrics(data_sources=["my/source"])
    assert metrics.data_source_label("openai/gsm8k") == "openai/gsm8k"
    assert metrics.data_source_label("OpenAI/GSM8K") == "openai/gsm8k"  # as routing matches
    assert metrics.data_source_label("my/source") == "my/source"
    assert metrics.data_source_label("MY/Source") == "my/source"
    assert metrics.data_source_label("somebody/else") == "other"
    sources = [f"random/{i}" for i in range(50)] + ["my/source", "gsm8k"]
    results = [ScoreResult(i, 1.0, "custom") for i in range(len(sources))]
    metrics.samples(sources, results)
    text = metrics.render()
    series = [
        line for line in text.splitlines() if line.startswith("rlfleet_reward_samples_total{")
    ]
    assert sorted(series) == [
        'rlfleet_reward_samples_total{data_source="gsm8k",scorer="custom"} 1.0',
        'rlfleet_reward_samples_total{data_source="my/source",scorer="custom"} 1.0',
        'rlfleet_reward_samples_total{data_source="other",scorer="custom"} 50.0',
    ]
