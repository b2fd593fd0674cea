"""External rollouts: sessions -> trainer rows (multi-turn masks), the batch, the source's
polling, staleness, rewards, and the config that selects it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rlfleet.common.config import ConfigError, load_config
from rlfleet.common.errors import DeadlineExceeded
from rlfleet.driver.external import (
    ExternalRollouts,
    InProcessTrajectorySource,
    rows_batch,
    trajectory_rows,
)
from rlfleet.rollout.engine import FinishReason
from rlfleet.rollout.trajectories import Completion, Trajectory, TrajectoryStore

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ppo_tiny.yaml"


def comp(
    prompt: list[int], tokens: list[int], version: int = 0, temperature: float = 1.0
) -> Completion:
    return Completion.of(
        prompt,
        tokens,
        [-(t / 10.0) for t in tokens],
        weight_version=version,
        finish_reason=FinishReason.STOP,
        temperature=temperature,
    )


def config(*overrides: str) -> Any:
    return load_config(
        EXAMPLE,
        [
            "trainer.rollout_source=external",
            "trainer.total_training_steps=2",
            "trainer.external.batch_size=2",
            "trainer.external.poll_interval_s=0.01",
            *overrides,
        ],
    )


def test_a_chained_multi_turn_session_is_one_row_with_the_model_tokens_in_the_loss() -> None:
    p1 = [1, 2, 3]
    t1 = [10, 11]  # the model's first turn
    ctx = [20, 21, 22]  # the agent's tool result, rendered
    t2 = [12, 13, 14]
    t = Trajectory(
        "s",
        [comp(p1, t1, version=4), comp(p1 + t1 + ctx, t2, version=5)],
        finished=True,
        reward=1.0,
    )
    (row,) = trajectory_rows(t)
    assert row.prompt_ids.tolist() == p1
    assert row.response_ids.tolist() == t1 + ctx + t2
    assert row.loss_mask.tolist() == [1, 1, 0, 0, 0, 1, 1, 1]
    assert row.logprobs.tolist() == pytest.approx([-1.0, -1.1, 0, 0, 0, -1.2, -1.3, -1.4])
    assert row.weight_version == 4  # the oldest of its tokens


def test_completions_that_do_not_chain_are_rows_of_their_own() -> None:
    a = comp([1, 2], [5, 6])
    b = comp([1, 2], [7])  # n > 1: same prompt
    c = comp([1, 2, 9, 9, 9], [8])  # re-rendered: the earlier answer changed
    rows = trajectory_rows(Trajectory("s", [a, b, c]))
    assert [r.response_ids.tolist() for r in rows] == [[5, 6], [7], [8]]
    assert all(r.loss_mask.all() for r in rows)
    assert trajectory_rows(Trajectory("empty")) == []


def test_rows_batch_pads_prompts_left_and_responses_right() -> None:
    rows = [
        *trajectory_rows(
            Trajectory("a", [comp([1, 2, 3], [10, 11]), comp([1, 2, 3, 10, 11, 7], [12])])
        ),
        *trajectory_rows(Trajectory("b", [comp([4], [13])])),
    ]
    b = rows_batch(rows, [1.0, 0.5], ["g", "g"], pad_token_id=0, old_log_probs=True)
    assert b["input_ids"].tolist() == [[1, 2, 3, 10, 11, 7, 12], [0, 0, 4, 13, 0, 0, 0]]
    assert b["attention_mask"].tolist() == [[1] * 7, [0, 0, 1, 1, 0, 0, 0]]
    assert b["responses"].tolist() == [[10, 11, 7, 12], [13, 0, 0, 0]]
    assert b["response_mask"].tolist() == [[1, 1, 0, 1], [1, 0, 0, 0]]
    assert torch.allclose(
        b["old_log_probs"], torch.tensor([[-1.0, -1.1, 0.0, -1.2], [-1.3, 0, 0, 0]])
    )
    assert b["scores"].tolist() == [1.0, 0.5] and b["uid"] == ["g", "g"]
    assert "old_log_probs" not in rows_batch(rows, [0, 0], ["a", "b"], 0, old_log_probs=False)


def finished(store: TrajectoryStore, sid: str, reward: float | None, version: int = 0,
             temperature: float = 1.0, **info: str) -> None:  # fmt: skip
    store.record(sid, comp([1, 2], [3, 4 + len(sid)], version=version, temperature=temperature))
    store.finish(sid, reward, info)


def test_the_source_takes_finished_sessions_into_a_step_batch() -> None:
    cfg = config("trainer.external.batch_size=3")
    stores = [TrajectoryStore(), TrajectoryStore()]
    finished(stores[0], "a", 1.0, group="t1")
    finished(stores[1], "b", 0.0, group="t1")
    finished(stores[1], "c", 0.5)
    stores[0].record("open", comp([1], [2]))  # not finished: not taken
    ext = ExternalRollouts(
        [InProcessTrajectorySource(s, f"r{i}") for i, s in enumerate(stores)], cfg, pad_token_id=0
    )
    gb = ext.next_batch(step=1, policy_version=0)
    assert sorted(gb.scores) == [0.0, 0.5, 1.0]
    batch = gb.trainer_batch
    assert batch is not None and batch["input_ids"].shape[0] == 3
    by_score = dict(zip(gb.scores, batch["uid"], strict=True))
    assert by_score == {1.0: "t1", 0.0: "t1", 0.5: "session:c"}  # group, else the session
    assert "old_log_probs" in batch  # sampled at rollout.temperature 1.0
    m = gb.extra_metrics
    assert m["external/sessions"] == 3 and m["external/rows"] == 3
    assert m["external/rollout_log_probs"] == 1.0
    assert [len(s.token_ids) for s in gb.samples] == [2, 2, 2]
    assert stores[0].state("open") == "open"


def test_stale_sessions_are_dropped_and_a_short_step_keeps_what_it_took() -> None:
    cfg = config("trainer.external.max_staleness=1", "trainer.external.timeout_s=0.05")
    store = TrajectoryStore()
    finished(store, "old", 1.0, version=1)  # policy 3: 2 versions behind
    finished(store, "ok", 1.0, version=2)
    ext = ExternalRollouts([InProcessTrajectorySource(store)], cfg, pad_token_id=0)
    with pytest.raises(DeadlineExceeded):
        ext.next_batch(step=1, policy_version=3)
    finished(store, "ok2", 0.0, version=3)
    gb = ext.next_batch(step=1, policy_version=3)  # "ok" was kept from the failed try
    assert sorted(gb.scores) == [0.0, 1.0]
    assert min(s.weight_version for s in gb.samples) == 2


def test_sessions_that_would_blow_up_the_batch_are_dropped() -> None:
    """An agent's session cannot make the padded batch huge: more rows than
    max_rows_per_session (completions that do not chain), or a row longer than
    max_tokens_per_row, drops that session alone, counted."""
    cfg = config(
        "trainer.external.batch_size=3",
        "trainer.external.max_rows_per_session=2",
        "trainer.external.max_tokens_per_row=8",
    )
    store = TrajectoryStore()
    finished(store, "ok", 1.0)
    for k in range(3):  # three completions that do not chain: three rows
        store.record("many", comp([50 + k], [60 + k]))
    store.finish("many", 1.0)
    store.record("long", comp([1] * 6, [2] * 3))  # 9 tokens
    store.finish("long", 0.0)
    ext = ExternalRollouts([InProcessTrajectorySource(store)], cfg, pad_token_id=0)
    gb = ext.next_batch(step=1, policy_version=0)
    assert gb.scores == [1.0]
    assert gb.extra_metrics["external/oversized_dropped"] == 2
    assert gb.trainer_batch is not None and gb.trainer_batch["input_ids"].shape[0] == 1


def test_another_temperature_means_the_trainer_recomputes_log_probs() -> None:
    store = TrajectoryStore()
    finished(store, "a", 1.0, temperature=0.7)
    finished(store, "b", 1.0, temperature=0.0)  # greedy: raw log-softmax, as T = 1
    ext = ExternalRollouts([InProcessTrajectorySource(store)], config(), pad_token_id=0)
    gb = ext.next_batch(step=1, policy_version=0)
    assert gb.trainer_batch is not None and "old_log_probs" not in gb.trainer_batch
    assert gb.extra_metrics["external/rollout_log_probs"] == 0.0
    # Greedy sessions alone match a trainer at temperature 1.
    finished(store, "c", 1.0, temperature=0.0)
    finished(store, "d", 1.0, temperature=0.0)
    gb2 = ext.next_batch(step=2, policy_version=0)
    assert gb2.trainer_batch is not None and "old_log_probs" in gb2.trainer_batch


class Scorer:
    """A reward function: records what it was asked to score."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def __call__(self, samples: list[Any]) -> list[float]:
        self.seen.extend(samples)
        return [float(len(s.response_ids)) for s in samples]


def test_sessions_finished_without_a_reward_are_scored_by_the_reward_function() -> None:
    from rlfleet.common.tiny_model import train_tokenizer
    from rlfleet.driver.reward import RewardAdapter

    tok = train_tokenizer()
    store = TrajectoryStore()
    finished(store, "a", None, data_source="calc", ground_truth="7")
    finished(store, "b", 0.25)
    scorer = Scorer()
    cfg = config()
    ext = ExternalRollouts(
        [InProcessTrajectorySource(store)],
        cfg,
        pad_token_id=0,
        reward=RewardAdapter(scorer, tok, cfg.data.reward_fn_key),
    )
    gb = ext.next_batch(step=1, policy_version=0)
    assert sorted(gb.scores) == [0.25, 2.0]
    (sample,) = scorer.seen
    assert sample.data_source == "calc" and sample.ground_truth == "7"
    assert sample.prompt_ids == [1, 2] and sample.response_ids == [3, 5]
    assert gb.extra_metrics["external/scored_by_reward_fn"] == 1
    # Without a reward function such sessions are dropped, counted.
    finished(store, "c", None)
    finished(store, "d", 1.0)
    finished(store, "e", 1.0)
    bare = ExternalRollouts([InProcessTrajectorySource(store)], cfg, pad_token_id=0)
    gb2 = bare.next_batch(step=2, policy_version=0)
    assert gb2.extra_metrics["external/unscored_dropped"] == 1 and len(gb2.scores) == 1


def test_external_mode_needs_a_step_count_and_no_pipeline() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(
            EXAMPLE, ["trainer.rollout_source=external", "trainer.total_training_steps=null"]
        )
    assert "trainer.total_training_steps" in str(info.value)
    with pytest.raises(ConfigError) as info:
        config("trainer.pipeline.enable=true")
    assert "trainer.pipeline.enable" in str(info.value)
    cfg = config("rollout.openai.port=0", "rollout.openai.max_sessions=5")
    assert cfg.rollout.openai.port == 0 and cfg.rollout.openai.max_sessions == 5
    assert np.isclose(cfg.trainer.external.poll_interval_s, 0.01)


def test_sources_are_the_replicas_with_an_address() -> None:
    from rlfleet.driver.clients import RolloutReplica
    from rlfleet.driver.external import sources_for

    replicas = [RolloutReplica("a", object(), "127.0.0.1:1"), RolloutReplica("b", object(), None)]  # type: ignore[arg-type]
    sources = sources_for(replicas)
    assert [s.name for s in sources] == ["127.0.0.1:1"]
    for s in sources:
        s.close()
    with pytest.raises(ValueError, match="trajectory_sources"):
        ExternalRollouts([], config(), pad_token_id=0)


def test_rlfleet_train_preflight_for_external_rollouts(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """No training set is needed; the launched replicas need an OpenAI port; the
    in-process mode cannot serve one."""
    from rlfleet.launch.preflight import preflight

    base = [
        f"actor.model_path={tiny_model_dir}",
        "data.train_files=[does/not/exist.parquet]",
        "data.val_files=[]",
        f"trainer.default_local_dir={tmp_path}",
        "resource_pools={train_pool: [1], rollout_pool: [1]}",
    ]
    ext = load_config(
        EXAMPLE, [*base, "trainer.rollout_source=external", "trainer.total_training_steps=2"]
    )
    assert [i.path for i in preflight(ext)] == ["rollout.openai.port"]
    with_port = ext.model_copy(
        update={
            "rollout": ext.rollout.model_copy(
                update={"openai": ext.rollout.openai.model_copy(update={"port": 0})}
            )
        }
    )
    assert preflight(with_port) == []
    assert [i.path for i in preflight(with_port, in_process=True)] == ["trainer.rollout_source"]
    dataset = load_config(EXAMPLE, base)
    assert [i.path for i in preflight(dataset)] == ["data.train_files"]
