"""RewardManager and its worker pool: routing, validation, time-outs, crashes, tensors."""

from __future__ import annotations

import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rlfleet.common.config import CustomRewardFunction, RewardConfig, RewardModelConfig
from rlfleet.common.errors import DeadlineExceeded, InvalidArgument
from rlfleet.reward.core import RewardManager
from rlfleet.reward.metrics import RewardMetrics
from rlfleet.reward.pool import ScoringPool
from rlfleet.reward.tensor import last_valid_positions, token_level_scores
from rlfleet.reward.types import Sample, ScoreOutcome

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
    # rlfleet's routing: the table's sources keep their built-in scorers.
    config = RewardConfig(
        num_workers=2,
        sample_timeout_s=0.5,
        custom_function=CustomRewardFunction(path=str(custom_file), keep_builtin_scorers=True),
    )
    with RewardManager(config, metrics=RewardMetrics(), max_batch_size=1000) as m:
        yield m


def test_keep_builtin_scorers_routes_by_data_source(manager: RewardManager) -> None:
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


VERL_CUSTOM = textwrap.dedent(
    """
    def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0,
                      bonus=0.0):
        right = solution_str.strip().endswith(str(ground_truth))
        return {"score": scale * right + bonus, "source": data_source,
                "split": (extra_info or {}).get("split")}
    """
)


def _verl_config(tmp_path: Path, **custom: Any) -> RewardConfig:
    path = tmp_path / "verl_reward.py"
    path.write_text(VERL_CUSTOM)
    return RewardConfig(
        num_workers=1,
        custom_function=CustomRewardFunction(
            path=str(path), reward_kwargs={"scale": 2.0, "bonus": 0.5}, **custom
        ),
    )


@pytest.mark.parametrize("num_workers", [0, 1])
def test_custom_function_replaces_every_scorer_with_reward_kwargs(
    tmp_path: Path, num_workers: int
) -> None:
    """verl: custom_reward_function.path scores every data source, gsm8k included."""
    samples = [
        Sample("openai/gsm8k", "#### 18", "18", extra_info={"split": "test"}),
        Sample("openai/gsm8k", "#### $18", "18"),  # built-in: 0; here: ends in "18"
        Sample("openai/gsm8k", "#### 17", "18"),
        Sample("HuggingFaceH4/MATH-500", r"\boxed{2}", "3"),
        Sample("hh-rlhf", "fine", "fine"),  # no reward model: the custom function
        Sample("my/source", "abc", "abc"),
    ]
    with RewardManager(_verl_config(tmp_path), num_workers=num_workers) as m:
        results = m.score(samples)
        assert m.scorer_for("openai/gsm8k") == "custom"
        assert m.info().data_sources["openai/gsm8k"] == "custom"
    assert [r.scorer for r in results] == ["custom"] * 6
    assert [r.score for r in results] == [2.5, 2.5, 0.5, 0.5, 2.5, 2.5]
    assert results[0].details == {"source": "openai/gsm8k", "split": "test"}


def test_keep_builtin_scorers_leaves_the_table_to_the_built_ins(tmp_path: Path) -> None:
    config = _verl_config(tmp_path, keep_builtin_scorers=True)
    with RewardManager(config, num_workers=0) as m:
        gsm, other = m.score([Sample("openai/gsm8k", "#### 18", "18"), Sample("x", "a", "a")])
    assert (gsm.scorer, gsm.score) == ("gsm8k", 1.0)
    assert (other.scorer, other.score) == ("custom", 2.5)


class _FakeRewardModel:
    path = "fake-rm"

    def score(self, samples: list[Sample]) -> list[ScoreOutcome]:
        return [ScoreOutcome(-1.0) for _ in samples]


def test_an_enabled_reward_model_scores_every_sample_as_in_verl(tmp_path: Path) -> None:
    with RewardManager(_verl_config(tmp_path), num_workers=0, reward_model=_FakeRewardModel()) as m:
        rm, gsm = m.score([Sample("hh-rlhf", "hi", None), Sample("gsm8k", "#### 1", "1")])
    assert (rm.scorer, rm.score) == ("reward_model", -1.0)
    assert (gsm.scorer, gsm.score) == ("reward_model", -1.0)


def test_a_reward_model_routed_by_data_source_keeps_its_data_sources(tmp_path: Path) -> None:
    config = _verl_config(tmp_path)
    routed = config.model_copy(
        update={"reward_model": RewardModelConfig(route_by_data_source=True)}
    )
    with RewardManager(routed, num_workers=0, reward_model=_FakeRewardModel()) as m:
        rm, gsm = m.score([Sample("hh-rlhf", "hi", None), Sample("gsm8k", "#### 1", "1")])
    assert (rm.scorer, rm.score) == ("reward_model", -1.0)
    assert (gsm.scorer, gsm.score) == ("custom", 2.5)


def test_a_default_scorer_the_custom_function_would_hide_is_refused(tmp_path: Path) -> None:
    config = _verl_config(tmp_path)
    with pytest.raises(InvalidArgument, match="would never be used") as exc:
        RewardManager(config.model_copy(update={"default_scorer": "gsm8k"}), num_workers=0)
    assert exc.value.field == "reward.default_scorer"
    with RewardManager(config.model_copy(update={"default_scorer": "custom"}), num_workers=0):
        pass
    kept = _verl_config(tmp_path, keep_builtin_scorers=True)
    with RewardManager(kept.model_copy(update={"default_scorer": "gsm8k"}), num_workers=0) as m:
        assert m.score([Sample("x", "#### 4", "4")])[0].scorer == "gsm8k"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ground_truth": "1"}, "may not set"),
        ({"when": object()}, "must be JSON values"),
        ({"x": float("nan")}, "must be JSON values"),
        ({"big": "x" * 70_000}, "over the limit"),
    ],
)
def test_bad_reward_kwargs_fail_at_start(
    tmp_path: Path, kwargs: dict[str, Any], match: str
) -> None:
    path = tmp_path / "verl_reward.py"
    path.write_text(VERL_CUSTOM)
    config = RewardConfig(
        custom_function=CustomRewardFunction(path=str(path), reward_kwargs=kwargs)
    )
    with pytest.raises(InvalidArgument, match=match) as exc:
        RewardManager(config, num_workers=0)
    assert exc.value.field == "reward.custom_function.reward_kwargs"


def test_gsm8k_lenient_is_an_option(tmp_path: Path) -> None:
    samples = [Sample("openai/gsm8k", "#### 18.00", "18"), Sample("x", "it is $18.", "18")]
    config = RewardConfig(default_scorer="gsm8k_flexible")
    with RewardManager(config, num_workers=0) as m:
        assert [(r.scorer, r.score) for r in m.score(samples)] == [
            ("gsm8k", 0.0),
            ("gsm8k_flexible", 0.0),
        ]
    lenient = config.model_copy(update={"gsm8k_lenient": True})
    with RewardManager(lenient, num_workers=1) as m:
        assert [(r.scorer, r.score) for r in m.score(samples)] == [
            ("gsm8k_lenient", 1.0),
            ("gsm8k_flexible_lenient", 1.0),
        ]
        assert m.info().data_sources["openai/gsm8k"] == "gsm8k_lenient"


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
        line = 'rlfleet_reward_sample_errors_total{scorer="multiple_choice"} '
        text = manager.metrics.render()
        return float(text.split(line, 1)[1].split()[0]) if line in text else 0.0

    before = errors()
    results = manager.score(
        [Sample("hellaswag", "A", "not an option"), Sample("gsm8k", "#### 2", "2")]
    )
    assert results[0].score == 0.0 and results[0].error.startswith("ValueError: ground_truth")
    assert results[1].score == 1.0 and not results[1].error
    assert errors() == before + 1


def test_deadline_counts_scoring_in_the_callers_thread(manager: RewardManager) -> None:
    with pytest.raises(DeadlineExceeded):
        manager.score([Sample("gsm8k", "#### 1", "1")] * 100, timeout_s=0.0)
    assert manager.score([Sample("gsm8k", "#### 1", "1")], timeout_s=5.0)[0].score == 1.0
