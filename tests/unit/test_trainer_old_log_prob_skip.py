"""The old-log-prob pass of ``TrainerCore.train_step`` is skipped only when it provably
equals the actor's own log-probs in its update (on-policy, one epoch, one mini-batch),
and the update is then the same as with the pass; the batch's data metrics are verl's."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from rlfleet.trainer.core import TrainerCore
from rlfleet.trainer.ppo.metric_utils import compute_data_metrics
from rlfleet.trainer.testing import make_batch, make_config

SCORES = torch.tensor([1.0, 0.0, 0.0, 1.0])


def _core(model: Path, **actor: Any) -> TrainerCore:
    # 2 prompts x rollout.n 2 = 4 samples per mini-batch: the whole 4-row batch.
    section = {"ppo_mini_batch_size": 2, "ppo_epochs": 1, "ppo_micro_batch_size": 2, **actor}
    return TrainerCore(make_config(str(model), algorithm={"adv_estimator": "grpo"}, actor=section))


def _params(core: TrainerCore) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in core.backend.iter_full_params("actor")}


def _batch(seed: int) -> dict[str, Any]:
    return {**make_batch(seed=seed), "scores": SCORES.clone()}


def test_skip_gives_the_same_update_as_the_explicit_pass(tiny_model_dir: Path) -> None:
    skipping, explicit = _core(tiny_model_dir), _core(tiny_model_dir)
    start = _params(skipping)
    assert all(torch.equal(start[k], v) for k, v in _params(explicit).items())
    for step in range(2):
        a = skipping.train_step_result(_batch(step), on_policy=True)
        b = explicit.train_step_result(_batch(step), on_policy=False)
        assert a.metrics["actor/old_log_prob_skipped"] == 1.0
        assert "timing_s/old_log_prob" not in a.metrics
        assert b.metrics["actor/old_log_prob_skipped"] == 0.0
        assert b.metrics["timing_s/old_log_prob"] >= 0.0
        assert a.metrics["actor/ppo_kl"] == 0.0 and a.metrics["actor/pg_clipfrac"] == 0.0
        assert a.metrics["actor/pg_loss"] == pytest.approx(b.metrics["actor/pg_loss"], abs=1e-6)
        assert a.new_weight_version == b.new_weight_version == step + 1
    after_a, after_b = _params(skipping), _params(explicit)
    moved = max(float((after_a[k] - start[k]).abs().max()) for k in start)
    assert moved > 1e-4  # the updates did something
    for k in start:
        torch.testing.assert_close(after_a[k], after_b[k], rtol=0.0, atol=1e-6, msg=k)


@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo", "cispo"])
def test_skip_with_rollout_correction_matches_the_explicit_pass(
    tiny_model_dir: Path, loss_mode: str
) -> None:
    """The truncated IS weights take the old log-probs of the update's own forward when
    the pass is skipped: the same weights, metrics and update as with the pass."""
    correction = {"rollout_correction": {"rollout_is": "token", "rollout_is_threshold": 1.2}}

    def core() -> TrainerCore:
        cfg = make_config(
            str(tiny_model_dir),
            algorithm={"adv_estimator": "grpo", **correction},
            actor={"ppo_mini_batch_size": 2, "policy_loss": {"loss_mode": loss_mode}},
        )
        return TrainerCore(cfg)

    skipping, explicit = core(), core()
    batch = _batch(11)
    old, _ = explicit.compute_log_prob(batch)
    g = torch.Generator().manual_seed(3)
    mask = batch["attention_mask"][:, -5:]
    batch["rollout_log_probs"] = (
        old["old_log_probs"] + 0.3 * torch.randn(4, 5, generator=g)
    ) * mask
    a = skipping.train_step(dict(batch), on_policy=True)
    b = explicit.train_step(dict(batch), on_policy=False)
    assert a["actor/old_log_prob_skipped"] == 1.0 and b["actor/old_log_prob_skipped"] == 0.0
    for key in (
        "rollout_corr/rollout_is_mean",
        "rollout_corr/rollout_is_max",
        "rollout_corr/rollout_is_ratio_fraction_high",
        "actor/pg_loss",
    ):
        assert a[key] == pytest.approx(b[key], abs=1e-6), key
    assert 0.0 < a["rollout_corr/rollout_is_ratio_fraction_high"] < 1.0
    after_a, after_b = _params(skipping), _params(explicit)
    for k in after_a:
        torch.testing.assert_close(after_a[k], after_b[k], rtol=0.0, atol=1e-6, msg=k)


@pytest.mark.parametrize(
    ("actor", "on_policy", "why"),
    [
        ({}, False, "pipelined / stale: samples not from the weights held now"),
        ({"ppo_epochs": 2}, True, "2 epochs: the second epoch's policy has moved"),
        ({"ppo_mini_batch_size": 1}, True, "2 mini-batches: the second one's policy has moved"),
    ],
    ids=["stale", "two-epochs", "two-minibatches"],
)
def test_no_skip_when_a_condition_fails(
    tiny_model_dir: Path, actor: dict[str, Any], on_policy: bool, why: str
) -> None:
    core = _core(tiny_model_dir, **actor)
    assert not core.skips_old_log_prob(4, on_policy=on_policy, actor_update=True), why
    m = core.train_step(_batch(5), on_policy=on_policy)
    assert m["actor/old_log_prob_skipped"] == 0.0, why
    assert m["timing_s/old_log_prob"] >= 0.0 and "actor/entropy_old" in m


def test_in_reward_kl_always_runs_the_pass(tiny_model_dir: Path) -> None:
    cfg = make_config(
        str(tiny_model_dir),
        algorithm={"adv_estimator": "grpo", "use_kl_in_reward": True},
        actor={"ppo_mini_batch_size": 2},
    )
    core = TrainerCore(cfg)
    m = core.train_step(_batch(6), on_policy=True)
    assert m["actor/old_log_prob_skipped"] == 0.0 and "actor/reward_kl_penalty" in m


def test_critic_warmup_reads_no_old_log_probs(tiny_model_dir: Path) -> None:
    cfg = make_config(
        str(tiny_model_dir),
        algorithm={"adv_estimator": "gae"},
        actor={"ppo_epochs": 2},
        trainer={"critic_warmup": 1},
    )
    core = TrainerCore(cfg)
    first = core.train_step_result(_batch(7), on_policy=False)
    assert first.metrics["actor/old_log_prob_skipped"] == 1.0
    assert not first.actor_updated and first.new_weight_version is None
    assert {"timing_s/values", "timing_s/update_critic"} <= set(first.metrics)
    assert "timing_s/update_actor" not in first.metrics
    second = core.train_step_result(_batch(8), on_policy=False)
    assert second.metrics["actor/old_log_prob_skipped"] == 0.0
    assert second.new_weight_version == 1 and second.global_step == 2


def test_worker_refuses_current_log_probs_over_several_minibatches(tiny_model_dir: Path) -> None:
    core = _core(tiny_model_dir, ppo_epochs=2)
    view = {**make_batch(seed=9), "advantages": torch.ones(4, 5)}
    view["response_mask"] = view["attention_mask"][:, -5:].float()
    view["position_ids"] = (view["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with pytest.raises(ValueError, match="one epoch over one mini-batch"):
        core.worker.update_actor(view, mini_per_rank=4, seed=0, old_log_probs_from_current=True)


def test_data_metrics_by_hand() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    batch = {
        "response_mask": mask,
        # prompt of 2 then the response: row 0 has 1 prompt token, row 1 has 2
        "attention_mask": torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 0, 0]]),
        "token_level_scores": torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.0]]),
        "token_level_rewards": torch.tensor([[0.0, 0.75, 0.0], [0.5, 0.0, 0.0]]),
        "advantages": torch.tensor([[1.0, 2.0, 99.0], [-1.0, 99.0, 99.0]]),
        "returns": torch.tensor([[1.0, 3.0, 99.0], [2.0, 99.0, 99.0]]),
        "values": torch.tensor([[1.0, 2.0, 99.0], [2.0, 99.0, 99.0]]),
    }
    m = compute_data_metrics(batch, max_response_length=2, max_prompt_length=2)
    assert m["critic/score/mean"] == pytest.approx(0.75)  # mean of per-sequence sums 1, 0.5
    assert (m["critic/score/max"], m["critic/score/min"]) == (1.0, 0.5)
    assert m["critic/rewards/mean"] == pytest.approx(0.625)
    assert m["critic/advantages/mean"] == pytest.approx(2.0 / 3.0)  # valid tokens 1, 2, -1
    assert (m["critic/advantages/max"], m["critic/advantages/min"]) == (2.0, -1.0)
    assert m["critic/returns/mean"] == pytest.approx(2.0)
    assert m["critic/values/mean"] == pytest.approx(5.0 / 3.0)
    # returns - values on valid tokens: 0, 1, 0 (var 1/3); returns 1, 3, 2 (var 1)
    assert m["critic/vf_explained_var"] == pytest.approx(1 - (1 / 3) / (1 + 1e-5))
    assert (m["response_length/mean"], m["response_length/max"]) == (1.5, 2.0)
    assert m["response_length/clip_ratio"] == 0.5
    assert (m["prompt_length/min"], m["prompt_length/max"]) == (1.0, 2.0)
    assert m["prompt_length/clip_ratio"] == 0.5
    assert all(math.isfinite(v) for v in m.values())
