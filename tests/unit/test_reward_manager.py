"""RewardManager and its worker pool: routing, validation, time-outs, crashes, tensors."""

from __future__ import annotations

import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from rlfleet.common.config import CustomRewardFunction, RewardConfig
from rlfleet.common.errors import DeadlineExceeded, InvalidArgument
from rlfleet.reward.manager import RewardManager
from rlfleet.reward.metrics import RewardMetrics
from rlfleet.reward.pool import ScoringPool
from rlfleet.reward.tensor import last_valid_positions, token_level_scores
from rlfleet.reward.types import Sample

CUSTOM = textwrap.dedent(
    """
    import os, time

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        if solution_str == "hang":
            time.sleep(1000)
        if solution_str == "exit":
            os._exit(3)
        if solution_str == "raise":
            raise ValueError("bad input")
        return {"score": float(solution_str == str(ground_truth)), "seen": data_source}
    """
)


@pytest.fixture(scope="module")
def custom_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("custom") / "my_reward.py"
    path.write_text(CUSTOM)
    return path


@pytest.fixture(scope="module")
def manager(custom_file: Path) -> Iterator[RewardManager]:
    config = RewardConfig(
        num_workers=2,
        sample_timeout_s=0.5,
        custom_function=CustomRewardFunction(path=str(custom_file)),
    )
    with RewardManager(config, metrics=RewardMetrics(), max_batch_size=1000) as m:
        yield m


def test_routes_by_data_source(manager: RewardManager) -> None:
    samples = [
        Sample("openai/gsm8k", "#### 18", "18"),
        Sample("HuggingFaceH4/MATH-500", r"\boxed{\dfrac{1}{2}}", r"\frac12"),
        Sample("Rowan/hellaswag", "Answer: A", 0),
        Sample("my_dataset", "abc", "abc"),  # unknown -> the custom function
    ]
    results = manager.score(samples)
    assert [r.scorer for r in results] == ["gsm8k", "math", "multiple_choice", "custom"]
    assert [r.score for r in results] == [1.0, 1.0, 1.0, 1.0]
    assert results[3].details == {"seen": "my_dataset"}
    assert [r.index for r in results] == [0, 1, 2, 3]


def test_hanging_and_crashing_custom_scorers_are_contained(manager: RewardManager) -> None:
    samples = [Sample("custom_ds", r, "ok") for r in ["ok", "hang", "ok", "exit", "raise", "ok"]]
    start = time.monotonic()
    results = manager.score(samples, timeout_s=20)
    assert time.monotonic() - start < 10
    by = {s.response: r for s, r in zip(samples, results, strict=True)}
    assert [r.score for r in results if r.scorer == "custom" and not r.error] == [1.0, 1.0, 1.0]
    assert by["hang"].timed_out and "timed out" in by["hang"].error and by["hang"].score == 0.0
    assert "died" in by["exit"].error and not by["exit"].timed_out
    assert "ValueError: bad input" in by["raise"].error
    text = manager.metrics.render()
    assert 'rlfleet_reward_sample_timeouts_total{scorer="custom"} 1.0' in text
    assert 'rlfleet_reward_sample_errors_total{scorer="custom"} 3.0' in text
    # The pool replaced its workers and keeps serving.
    assert manager.score([Sample("gsm8k", "#### 2", "2")])[0].score == 1.0


def test_other_callers_are_served_while_a_sample_hangs(manager: RewardManager) -> None:
    hung: list[float] = []

    def slow() -> None:
        hung.append(manager.score([Sample("x", "hang", "")])[0].score)

    thread = threading.Thread(target=slow)
    thread.start()
    time.sleep(0.05)
    start = time.monotonic()
    results = manager.score([Sample("gsm8k", f"#### {i}", str(i)) for i in range(200)])
    assert time.monotonic() - start < 0.45  # before the hung sample's time-out
    assert all(r.score == 1.0 for r in results)
    thread.join(10)
    assert hung == [0.0]


@pytest.mark.parametrize(
    ("sample", "field"),
    [
        (Sample("", "x", "1"), "samples[1].data_source"),
        (Sample("gsm8k", "x", None), "samples[1].ground_truth"),
        (Sample("gsm8k", "x", {"a": 1}), "samples[1].ground_truth"),
        (Sample("gsm8k", "x", True), "samples[1].ground_truth"),
        (Sample("gsm8k", 5, "1"), "samples[1].response"),  # type: ignore[arg-type]
        (Sample("gsm8k", "#### 1", float("nan")), "samples[1].ground_truth"),
        (Sample("math", r"\boxed{1}", [1, float("inf")]), "samples[1].ground_truth"),
    ],
)
def test_invalid_samples_name_field_and_index(
    manager: RewardManager, sample: Sample, field: str
) -> None:
    with pytest.raises(InvalidArgument) as exc:
        manager.score([Sample("gsm8k", "#### 1", "1"), sample])
    assert exc.value.field == field
    assert exc.value.sample_index == 1


def test_unknown_data_source_without_default_is_rejected() -> None:
    with RewardManager(RewardConfig(), num_workers=0) as m:
        with pytest.raises(InvalidArgument) as exc:
            m.score([Sample("nope", "x", "1")])
        assert exc.value.field == "samples[0].data_source"
        assert exc.value.code == "UNKNOWN_DATA_SOURCE"
    with RewardManager(RewardConfig(default_scorer="gsm8k_flexible"), num_workers=0) as m:
        assert m.score([Sample("nope", "it is 7", "7")])[0].score == 1.0


def test_oversized_batch_is_rejected(manager: RewardManager) -> None:
    with pytest.raises(InvalidArgument, match="over the limit of 1000") as exc:
        manager.score([Sample("gsm8k", "#### 1", "1")] * 1001)
    assert exc.value.field == "samples"


def test_bad_config_fails_at_start(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="not found"):
        RewardManager(
            RewardConfig(custom_function=CustomRewardFunction(path=str(tmp_path / "none.py")))
        )
    with pytest.raises(InvalidArgument, match="unknown scorer"):
        RewardManager(RewardConfig(default_scorer="nope"))


@pytest.mark.parametrize(
    ("declared", "match"),
    [
        ('"my/source"', "must be a list of strings"),
        ('["ok", 3]', "non-strings or empty names"),
        ('["ok", ""]', "non-strings or empty names"),
        ('[f"s{i}" for i in range(1001)]', "over the limit of 1000"),
    ],
)
def test_bad_custom_data_sources_fail_at_start(tmp_path: Path, declared: str, match: str) -> None:
    path = tmp_path / "reward_fn.py"
    path.write_text(f"DATA_SOURCES = {declared}\ndef compute_score(*args):\n    return 1.0\n")
    with pytest.raises(InvalidArgument, match=match) as exc:
        RewardManager(
            RewardConfig(custom_function=CustomRewardFunction(path=str(path))), num_workers=0
        )
    assert exc.value.field == "reward.custom_function.path"


def test_custom_data_sources_name_metric_series(tmp_path: Path) -> None:
    path = tmp_path / "reward_fn.py"
    path.write_text('DATA_SOURCES = ("team/qa",)\ndef compute_score(*args):\n    return 1.0\n')
    metrics = RewardMetrics()
    config = RewardConfig(custom_function=CustomRewardFunction(path=str(path)))
    with RewardManager(config, num_workers=0, metrics=metrics) as m:
        assert m.metrics.data_source_label("team/qa") == "team/qa"
        assert m.metrics.data_source_label("team/other") == "other"


def test_deadline_cancels_the_batch(manager: RewardManager) -> None:
    with pytest.raises(DeadlineExceeded):
        manager.score([Sample("x", "hang", "")], timeout_s=0.1)


def test_score_batch_places_scores_on_last_valid_token() -> None:
    with RewardManager(RewardConfig(), num_workers=0) as m:
        mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
        batch = m.score_batch(
            [
                Sample("gsm8k", "#### 3", "3"),
                Sample("gsm8k", "#### 2", "5"),
                Sample("gsm8k", "", "1"),
            ],
            mask,
        )
    assert batch.scores == [1.0, 0.0, 0.0]
    expected = np.zeros((3, 4), dtype=np.float32)
    expected[0, 1] = 1.0
    np.testing.assert_array_equal(batch.token_level_scores, expected)


def test_token_level_scores_numpy_and_torch() -> None:
    mask = np.array([[1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 0, 0]])
    assert last_valid_positions(mask) == [2, 3, -1]
    out = token_level_scores([0.5, -1.0, 2.0], mask)
    assert out.dtype == np.float32 and out[0, 2] == 0.5 and out[1, 3] == -1.0
    assert out.sum() == -0.5
    torch = pytest.importorskip("torch")
    t = token_level_scores([0.5, -1.0, 2.0], torch.tensor(mask))
    assert isinstance(t, torch.Tensor)
    np.testing.assert_array_equal(t.numpy(), out)


def test_inline_pool_has_no_workers() -> None:
    with ScoringPool(0, 1.0) as pool:
        assert pool.worker_pids() == []
        assert pool.score([("gsm8k", "gsm8k", "#### 1", "1", {})])[0].score == 1.0


def test_inline_scorer_errors_are_flagged_and_counted(manager: RewardManager) -> None:
    # gsm8k is scored in the caller's thread; math-verify's time-out needs a worker.
    assert "gsm8k" in manager.inline_scorers and "math" not in manager.inline_scorers

    def errors() -> float:
        line = 'rlfleet_reward_sample_errors_total{scorer="gsm8k"} '
        return float(manager.metrics.render().split(line, 1)[1].split()[0])

    before = errors()
    results = manager.score(
        [Sample("gsm8k", "#### 1", "not a number"), Sample("gsm8k", "#### 2", "2")]
    )
    assert results[0].score == 0.0 and results[0].error.startswith("ValueError: ground_truth")
    assert results[1].score == 1.0 and not results[1].error
    assert errors() == before + 1


def test_deadline_counts_scoring_in_the_callers_thread(manager: RewardManager) -> None:
    with pytest.raises(DeadlineExceeded):
        manager.score([Sample("gsm8k", "#### 1", "1")] * 100, timeout_s=0.0)
    assert manager.score([Sample("gsm8k", "#### 1", "1")], timeout_s=5.0)[0].score == 1.0
