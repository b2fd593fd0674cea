"""Token-level staleness (partial rollouts): hand-computed values."""

from __future__ import annotations

import pytest

from rlfleet.driver.batch import token_staleness_metrics
from rlfleet.rollout.engine import FinishReason, SampleOutput


def sample(n: int, version: int, tokens: list[int] | None = None, **kw: object) -> SampleOutput:
    return SampleOutput(
        0, 0, list(range(n)), [0.0] * n, FinishReason.LENGTH, version,
        token_weight_versions=tokens or [], **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def test_tokens_count_at_the_version_that_produced_them() -> None:
    samples = [
        sample(4, 3, [3, 3, 4, 4]),  # continued across the push of v4
        sample(2, 4),  # all v4 (no per-token list: every token the sample's version)
        sample(4, 2),  # all v2
    ]
    m = token_staleness_metrics(samples, policy_version=4)
    # staleness per token: [1, 1, 0, 0], [0, 0], [2, 2, 2, 2] -> 10 tokens, 6 stale
    assert m["rollout/stale_token_frac"] == pytest.approx(0.6)
    assert m["rollout/token_staleness_mean"] == pytest.approx(10 / 10)
    assert m["rollout/token_staleness_max"] == 2.0
    assert m["rollout/partial_sample_frac"] == pytest.approx(1 / 3)


def test_inserted_tokens_are_not_counted() -> None:
    # Multi-turn: tokens 1 and 2 are a tool result (loss_mask 0), not the model's.
    s = sample(4, 1, [1, 1, 1, 2], loss_mask=[1, 0, 0, 1])
    m = token_staleness_metrics([s, sample(2, 2)], policy_version=2)
    # counted: [1 (v1), 0 (v2)] and [0, 0] -> 4 tokens, 1 stale
    assert m["rollout/stale_token_frac"] == pytest.approx(0.25)
    assert m["rollout/token_staleness_mean"] == pytest.approx(0.25)
    assert m["rollout/token_staleness_max"] == 1.0


def test_on_policy_batch_has_no_stale_tokens() -> None:
    m = token_staleness_metrics([sample(3, 5), sample(1, 5)], policy_version=5)
    assert m == {
        "rollout/partial_sample_frac": 0.0,
        "rollout/stale_token_frac": 0.0,
        "rollout/token_staleness_mean": 0.0,
        "rollout/token_staleness_max": 0.0,
    }
