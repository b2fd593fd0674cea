"""TrainerCore on one CPU process with the tiny model: PPO, GAE + critic, GRPO, KL, SFT,
and bad batches refused before any update."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlfleet.common.errors import FailedPrecondition, InvalidArgument
from rlfleet.trainer.core import TrainerCore
from rlfleet.trainer.testing import make_batch, make_config

ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax")


def _params(core: TrainerCore, role: str = "actor") -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in core.backend.iter_full_params(role)}  # type: ignore[arg-type]


def _response_log_prob(core: TrainerCore, batch: dict[str, Any]) -> torch.Tensor:
    out, _ = core.compute_log_prob(batch)
    return out["old_log_probs"]


@pytest.fixture(scope="module")
def grpo_core(tiny_model_dir: Path) -> TrainerCore:
    cfg = make_config(
        str(tiny_model_dir),
        algorithm={"adv_estimator": "grpo"},
        actor={"ppo_micro_batch_size": 2, "ppo_epochs": 2},
    )
    return TrainerCore(cfg)


@pytest.fixture(scope="module")
def gae_core(tiny_model_dir: Path) -> TrainerCore:
    cfg = make_config(str(tiny_model_dir), algorithm={"adv_estimator": "gae"})
    return TrainerCore(cfg)


def test_roles_follow_config(grpo_core: TrainerCore, gae_core: TrainerCore) -> None:
    assert grpo_core.roles == ("actor",)
    assert gae_core.roles == ("actor", "critic")
    with pytest.raises(FailedPrecondition, match="critic"):
        grpo_core.compute_values(make_batch())


def test_positive_advantages_raise_log_probs(grpo_core: TrainerCore) -> None:
    batch = make_batch(seed=1)
    before = _response_log_prob(grpo_core, batch)
    mask = batch["attention_mask"][:, -5:].float()
    metrics = grpo_core.update_actor({**batch, "old_log_probs": before, "advantages": mask.clone()})
    after = _response_log_prob(grpo_core, batch)
    valid = mask.bool()
    assert (after[valid] - before[valid]).mean() > 0.05
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl"):
        assert key in metrics
    # entropy_coeff is 0: no pass over the full vocabulary for the entropy
    assert "actor/entropy" not in metrics
    assert metrics["actor/grad_norm"] > 0
    assert metrics["actor/lr"] == pytest.approx(1e-3)


def test_entropy_bonus_is_computed_and_trained(tiny_model_dir: Path) -> None:
    """With entropy_coeff > 0 the update reports the entropy of the batch it trained on
    (the forward before the step, so compute_log_prob's), and the bonus raises it."""
    cfg = make_config(
        str(tiny_model_dir),
        algorithm={"adv_estimator": "grpo"},
        actor={"entropy_coeff": 1.0, "lr": 1e-4},
    )
    core = TrainerCore(cfg)
    batch = make_batch(seed=4)
    mask = batch["attention_mask"][:, -5:].float()
    first, m = core.compute_log_prob(batch)
    zero = torch.zeros_like(mask)
    metrics = core.update_actor(
        {**batch, "old_log_probs": first["old_log_probs"], "advantages": zero}
    )
    assert metrics["actor/entropy"] == pytest.approx(m["actor/entropy"], abs=1e-5)
    _, after = core.compute_log_prob(batch)
    assert after["actor/entropy"] > m["actor/entropy"]


def test_grpo_train_steps_favour_rewarded_token(grpo_core: TrainerCore) -> None:
    """Responses ending in the favoured token score 1, their group mates 0: a few PPO steps
    raise the favoured token's log-prob where it occurs."""
    batch = make_batch(bs=4, seed=2, pad_rows=0)
    target = 7
    batch["responses"][0::2, -1] = target
    batch["input_ids"][:, -5:] = batch["responses"]
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0])
    before = _response_log_prob(grpo_core, batch)[0::2, -1]
    step0 = grpo_core.global_step
    for _ in range(3):
        metrics = grpo_core.train_step({**batch, "scores": scores})
    after = _response_log_prob(grpo_core, batch)[0::2, -1]
    assert (after > before).all(), (before, after)
    assert grpo_core.global_step == step0 + 3
    assert metrics["critic/score/mean"] == pytest.approx(0.5)


def test_gae_critic_updates_lower_value_loss(gae_core: TrainerCore) -> None:
    batch = make_batch(seed=3)
    values, _ = gae_core.compute_values(batch)
    returns = torch.full_like(values["values"], 0.7)
    losses = [
        gae_core.update_critic({**batch, "values": values["values"], "returns": returns})[
            "critic/vf_loss"
        ]
        for _ in range(4)
    ]
    assert losses[-1] < losses[0]


def test_gae_train_step_runs_critic_and_actor(gae_core: TrainerCore) -> None:
    batch = make_batch(seed=4)
    version = gae_core.weight_version
    m = gae_core.train_step({**batch, "scores": torch.tensor([1.0, 0.0, 0.5, 0.2])})
    assert {"critic/vf_loss", "critic/vf_clipfrac", "actor/pg_loss", "actor/ppo_kl"} <= set(m)
    assert gae_core.weight_version == version + 1


def test_critic_warmup_skips_actor(tiny_model_dir: Path) -> None:
    core = TrainerCore(
        make_config(
            str(tiny_model_dir), algorithm={"adv_estimator": "gae"}, trainer={"critic_warmup": 1}
        )
    )
    m = core.train_step({**make_batch(), "scores": torch.ones(4)})
    assert "critic/vf_loss" in m and "actor/pg_loss" not in m
    assert core.weight_version == 0 and core.global_step == 1


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_every_estimator(grpo_core: TrainerCore, estimator: str) -> None:
    batch = make_batch(seed=5)
    batch.update(
        scores=torch.tensor([1.0, 0.0, 0.3, 0.9]),
        values=torch.zeros(4, 5),
        reward_baselines=torch.tensor([0.5, 0.5, 0.1, 0.1]),
    )
    alg = grpo_core.config.algorithm
    old = alg.adv_estimator
    alg.adv_estimator = estimator  # type: ignore[assignment]
    try:
        out, _ = grpo_core.compute_advantage(batch)
    finally:
        alg.adv_estimator = old
    mask = batch["attention_mask"][:, -5:].bool()
    assert out["advantages"].shape == (4, 5)
    assert torch.isfinite(out["advantages"]).all()
    assert (out["advantages"][~mask] == 0).all()
    # The score sits on the last valid response token.
    assert out["token_level_scores"][0, 3] == 1.0 and out["token_level_scores"][0, 4] == 0.0


def test_kl_loss_is_zero_when_actor_equals_ref(tiny_model_dir: Path) -> None:
    cfg = make_config(
        str(tiny_model_dir),
        algorithm={"adv_estimator": "grpo"},
        actor={"use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl"},
    )
    core = TrainerCore(cfg)
    assert core.roles == ("actor", "ref")
    batch = make_batch(seed=6)
    ref, _ = core.compute_ref_log_prob(batch)
    old = _response_log_prob(core, batch)
    torch.testing.assert_close(ref["ref_log_prob"], old, rtol=0, atol=0)
    m1 = core.train_step({**batch, "scores": torch.tensor([1.0, 0.0, 0.0, 1.0])})
    assert m1["actor/kl_loss"] == 0.0
    m2 = core.train_step({**batch, "scores": torch.tensor([1.0, 0.0, 0.0, 1.0])})
    assert m2["actor/kl_loss"] > 0.0


def test_kl_in_reward(tiny_model_dir: Path) -> None:
    cfg = make_config(
        str(tiny_model_dir),
        algorithm={
            "adv_estimator": "reinforce_plus_plus",
            "use_kl_in_reward": True,
            "kl_ctrl": {"type": "adaptive", "kl_coef": 0.05, "target_kl": 0.01, "horizon": 100},
        },
    )
    core = TrainerCore(cfg)
    batch = {**make_batch(seed=7), "scores": torch.tensor([1.0, 0.0, 0.0, 1.0])}
    m1 = core.train_step(dict(batch))
    assert m1["actor/reward_kl_penalty"] == 0.0
    assert m1["actor/reward_kl_penalty_coeff"] == pytest.approx(0.05)
    m2 = core.train_step(dict(batch))
    assert m2["actor/reward_kl_penalty"] > 0.0
    assert m2["critic/rewards/mean"] != m2["critic/score/mean"]


def test_sft_step_lowers_loss(tiny_model_dir: Path) -> None:
    core = TrainerCore(make_config(str(tiny_model_dir), actor={"ppo_micro_batch_size": 2}))
    batch = make_batch(seed=8)
    losses = [core.sft_step(batch)["sft/loss"] for _ in range(4)]
    assert losses[-1] < losses[0]
    assert core.global_step == 4 and core.weight_version == 4


def _bad_batches() -> list[tuple[str, dict[str, Any], str]]:
    good = make_batch(seed=9)
    lp = torch.zeros(4, 5)
    cases = []
    missing = {**good, "scores": torch.ones(4)}
    del missing["responses"]
    cases.append(("missing key", missing, "responses"))
    cases.append(
        (
            "shape mismatch",
            {**good, "token_level_scores": torch.ones(4, 6)},
            r"token_level_scores.*\(4, 6\).*\(4, 5\)",
        )
    )
    nan = torch.tensor([1.0, float("nan"), 0.0, 1.0])
    cases.append(("NaN reward", {**good, "scores": nan}, r"scores.*NaN.*rows \[1\]"))
    cases.append(
        (
            "mask shape",
            {**good, "scores": torch.ones(4), "attention_mask": good["attention_mask"][:, :-1]},
            "attention_mask",
        )
    )
    cases.append(("uid length", {**good, "scores": torch.ones(4), "uid": ["a"]}, "uid"))
    cases.append(
        (
            "NaN old log-prob",
            {**good, "scores": torch.ones(4), "old_log_probs": lp.fill_(float("nan"))},
            "old_log_probs",
        )
    )
    return cases


@pytest.mark.parametrize("case", _bad_batches(), ids=lambda c: c[0])
def test_bad_batch_is_refused_without_update(
    grpo_core: TrainerCore, case: tuple[str, dict[str, Any], str]
) -> None:
    _, batch, pattern = case
    before = _params(grpo_core)
    step, version = grpo_core.global_step, grpo_core.weight_version
    with pytest.raises(InvalidArgument, match=pattern) as info:
        grpo_core.train_step(batch)
    assert info.value.field
    after = _params(grpo_core)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert (grpo_core.global_step, grpo_core.weight_version) == (step, version)


def test_update_actor_refuses_bad_minibatch_split(grpo_core: TrainerCore) -> None:
    batch = make_batch(bs=6, seed=10)
    lp = torch.zeros(6, 5)
    with pytest.raises(InvalidArgument, match="mini-batch size 4"):
        grpo_core.update_actor({**batch, "old_log_probs": lp, "advantages": lp})


# --------------------------------------------------------------------------- policy losses


@pytest.mark.parametrize(
    "actor",
    [
        {"policy_loss": {"loss_mode": "gspo"}, "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4},
        {"policy_loss": {"loss_mode": "cispo"}, "clip_ratio_high": 0.28},
    ],
    ids=["gspo", "cispo"],
)
def test_policy_losses_favour_rewarded_token(tiny_model_dir: Path, actor: dict[str, Any]) -> None:
    """GSPO and CISPO train steps raise the log-prob of the token that earns the reward,
    as PPO's do (the GRPO test above)."""
    cfg = make_config(
        str(tiny_model_dir),
        algorithm={"adv_estimator": "grpo"},
        actor={"ppo_micro_batch_size": 2, "ppo_epochs": 2, **actor},
    )
    core = TrainerCore(cfg)
    batch = make_batch(bs=4, seed=2, pad_rows=0)
    batch["responses"][0::2, -1] = 7
    batch["input_ids"][:, -5:] = batch["responses"]
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0])
    before = _response_log_prob(core, batch)[0::2, -1]
    for _ in range(3):
        metrics = core.train_step({**batch, "scores": scores})
    after = _response_log_prob(core, batch)[0::2, -1]
    assert (after > before).all(), (before, after)
    assert {"actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl"} <= metrics.keys()


def test_rollout_correction_weights_and_metrics(tiny_model_dir: Path) -> None:
    """Token-level truncated IS: the update reports the weights of the whole batch (the
    mean over tokens, the largest ratio of any micro-batch, the truncated fraction), and
    a batch without the rollout's log-probs is refused before any update."""
    cfg = make_config(
        str(tiny_model_dir),
        algorithm={
            "adv_estimator": "grpo",
            "rollout_correction": {"rollout_is": "token", "rollout_is_threshold": 2.0},
        },
        actor={"ppo_micro_batch_size": 2},  # 2 micro-batches of the one mini-batch
    )
    core = TrainerCore(cfg)
    batch = make_batch(bs=4, seed=3)
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0])
    with pytest.raises(InvalidArgument, match="rollout_log_probs"):
        core.train_step({**batch, "scores": scores})
    assert core.global_step == 0
    old = _response_log_prob(core, batch)
    mask = batch["attention_mask"][:, -5:].bool()
    ratio = torch.ones(4, 5)
    ratio[0, 0] = 2.5  # first micro-batch: truncated to 2
    ratio[3, 1] = 3.0  # second micro-batch: the largest, truncated to 2
    ratio[1, 2] = 0.5
    rollout = (old - torch.log(ratio)) * mask
    m = core.train_step(
        {**batch, "scores": scores, "old_log_probs": old, "rollout_log_probs": rollout}
    )
    n = int(mask.sum())  # 19 valid tokens: 16 weigh 1, one 0.5, two 2
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((n - 3 + 0.5 + 4.0) / n, abs=1e-5)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(3.0, abs=1e-5)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(2 / n, abs=1e-6)


def test_the_reference_is_built_in_its_own_dtype(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ref.dtype`` is the section the reference model is wrapped (FSDP: its mixed
    precision on cuda) and run with; without it, the actor's dtype."""
    from rlfleet.trainer.fsdp import FSDPBackend

    wrapped: dict[int, str] = {}
    real = FSDPBackend._wrap

    def record(self: Any, model: Any, section: Any, *, offload: bool) -> Any:
        wrapped[id(model)] = section.dtype
        return real(self, model, section, offload=offload)

    monkeypatch.setattr(FSDPBackend, "_wrap", record)
    for ref_dtype, expected in (("float16", "float16"), (None, "bfloat16")):
        cfg = make_config(
            str(tiny_model_dir),
            algorithm={"adv_estimator": "grpo", "use_kl_in_reward": True},
            actor={"dtype": "bfloat16"},
            ref={"dtype": ref_dtype},
        )
        assert cfg.ref_section().dtype == expected and cfg.actor.dtype == "bfloat16"
        core = TrainerCore(cfg)
        assert wrapped[id(core.backend.models["ref"])] == expected  # type: ignore[attr-defined]
        assert wrapped[id(core.backend.models["actor"])] == "bfloat16"  # type: ignore[attr-defined]
        wrapped.clear()
