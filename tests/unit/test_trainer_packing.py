"""Packed (padding-free) micro-batches and token-budget micro-batches against the padded
path, on the tiny Llama built locally, with rows of varied lengths: log-probs,
entropies, values, losses, gradients and the weights after an update agree within
1e-5."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlfleet.trainer import batch as B
from rlfleet.trainer.core import TrainerCore
from rlfleet.trainer.packing import ATTN_IMPLEMENTATION, Packed, enable_packing, pack
from rlfleet.trainer.ppo import core_algos
from rlfleet.trainer.testing import make_config, make_varied_batch

TOL = 1e-5
P, R = 12, 10  # prompt and response columns of the test batches


def _config(model_dir: Path, packed: bool, **sections: Any) -> Any:
    """GRPO-shaped mini-batches of 8 rows in micro-batches of 4. lr 1e-4: AdamW's first
    step moves a weight by about lr * sign(gradient), so where a gradient is ~0 its
    float noise alone moves the weight by up to lr; the gradients themselves are
    compared to 1e-5 directly."""
    actor = {"use_remove_padding": packed, "ppo_micro_batch_size": 4, "lr": 1e-4}
    actor.update(sections.pop("actor", {}))
    critic = {"use_remove_padding": packed, "ppo_micro_batch_size": 4, "lr": 1e-4}
    critic.update(sections.pop("critic", {}))
    return make_config(
        str(model_dir),
        data={"train_batch_size": 2, "max_prompt_length": P, "max_response_length": R},
        actor=actor,
        critic=critic,
        rollout={"n": 4},
        **sections,
    )


def _cores(model_dir: Path, **sections: Any) -> tuple[TrainerCore, TrainerCore]:
    """A padded and a packed core on the same weights (the critic's head set alike)."""
    padded = TrainerCore(_config(model_dir, False, **sections))
    packed = TrainerCore(_config(model_dir, True, **sections))
    for core in (padded, packed):
        critic = core.backend.models.get("critic")  # type: ignore[attr-defined]
        if critic is not None:
            with torch.no_grad():
                g = torch.Generator().manual_seed(7)
                critic.score.weight.copy_(torch.randn(critic.score.weight.shape, generator=g))
    return padded, packed


def _params(core: TrainerCore, role: str = "actor") -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in core.backend.iter_full_params(role)}  # type: ignore[arg-type]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _close_metrics(a: dict[str, float], b: dict[str, float]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if abs(a[k] - b[k]) > TOL * max(1.0, abs(a[k]))]


def _scored(seed: int, bs: int = 8) -> dict[str, Any]:
    batch = make_varied_batch(bs, P, R, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    mask = batch["attention_mask"][:, -R:].float()
    batch["advantages"] = torch.randn(bs, R, generator=g) * mask
    batch["returns"] = torch.randn(bs, R, generator=g) * mask
    return batch


# --------------------------------------------------------------------------- pack()


def test_pack_drops_every_pad_and_restarts_positions() -> None:
    #        prompt (3)   response (3)
    ids = torch.tensor([[0, 11, 12, 13, 14, 0], [21, 22, 23, 24, 0, 0], [0, 0, 0, 31, 32, 33]])
    am = (ids != 0).to(torch.int64)
    pos = B.ensure_defaults({"attention_mask": am})["position_ids"]
    p = pack(ids, am, pos, 3)
    assert p.input_ids.tolist() == [[11, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2]]
    assert p.cu_seqlens.tolist() == [0, 4, 8, 11] and p.max_len == 4
    # row 0: 13 and 14 are scored by 12 and 13; row 1: 24 by 23; row 2 has no prompt,
    # so its first response token (31) has nothing before it and is not scored
    assert p.labels.tolist() == [13, 14, 24, 32, 33]
    assert p.src.tolist() == [1, 2, 6, 8, 9]
    assert p.dst.tolist() == [0, 1, 3, 7, 8]  # flat (row * 3 + column) in (3, 3)
    # each token's place in the left-aligned (3 sequences x 4) layout
    assert p.seq_index.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]


def test_a_model_without_the_attention_interface_cannot_pack() -> None:
    with pytest.raises(ValueError, match="use_remove_padding: false"):
        enable_packing(torch.nn.Linear(2, 2))


# --------------------------------------------------------------------------- actor, ref


def test_log_probs_entropy_and_ref_match_padded(tiny_model_dir: Path) -> None:
    padded, packed = _cores(tiny_model_dir, actor={"use_kl_loss": True})
    model = packed.backend.models["actor"]  # type: ignore[attr-defined]
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    batch = make_varied_batch(12, P, R, seed=1)
    mask = B.ensure_defaults(batch)["response_mask"].bool()
    want, m_want = padded.compute_log_prob(batch)
    got, m_got = packed.compute_log_prob(batch)
    for key in ("old_log_probs", "entropys"):
        assert (got[key] - want[key])[mask].abs().max() < TOL, key
        assert got[key][~mask].abs().max() == 0  # nothing scored on padding
    assert m_got["actor/entropy"] == pytest.approx(m_want["actor/entropy"], abs=TOL)
    ref_want, _ = padded.compute_ref_log_prob(batch)
    ref_got, _ = packed.compute_ref_log_prob(batch)
    assert (ref_got["ref_log_prob"] - ref_want["ref_log_prob"])[mask].abs().max() < TOL


@pytest.mark.parametrize("checkpointing", [False, True])
def test_actor_gradients_and_update_match_padded(tiny_model_dir: Path, checkpointing: bool) -> None:
    actor = {"use_kl_loss": True, "entropy_coeff": 0.01, "gradient_checkpointing": checkpointing}
    padded, packed = _cores(tiny_model_dir, actor=actor)
    batch = _scored(seed=2)
    batch["old_log_probs"] = padded.compute_log_prob(batch)[0]["old_log_probs"]
    batch["ref_log_prob"] = batch["old_log_probs"] + 0.1 * batch["advantages"]

    # gradients of one forward/backward of the whole batch, the PPO loss with entropy
    grads = []
    for core in (padded, packed):
        mb = B.ensure_defaults(batch)

        def loss_fn(out: dict[str, torch.Tensor], mb: dict[str, Any]) -> Any:
            mask = mb["response_mask"]
            pg, *_ = core_algos.compute_policy_loss(
                mb["old_log_probs"], out["log_prob"], mb["advantages"], mask, 0.2, 0.2
            )
            loss = pg - 0.01 * core_algos.agg_loss(out["entropy"], mask, "token-mean")
            return loss, {"loss": loss.detach()}

        core.backend.forward_backward("actor", [mb], loss_fn, with_entropy=True)
        model = core.backend.models["actor"]  # type: ignore[attr-defined]
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        core.backend.optimizers["actor"].zero_grad(set_to_none=True)  # type: ignore[attr-defined]
    scale = max(g.abs().max().item() for g in grads[0].values())
    assert _max_diff(*grads) < TOL * max(1.0, scale)

    m_want = padded.update_actor(dict(batch))
    m_got = packed.update_actor(dict(batch))
    assert not _close_metrics(m_want, m_got), {k: (m_want[k], m_got[k]) for k in m_want}
    assert "actor/entropy" in m_got and "actor/kl_loss" in m_got
    assert _max_diff(_params(padded), _params(packed)) < TOL


# --------------------------------------------------------------------------- critic


def test_critic_values_gradients_and_update_match_padded(tiny_model_dir: Path) -> None:
    gae = {"adv_estimator": "gae"}
    padded, packed = _cores(tiny_model_dir, algorithm=gae)
    batch = _scored(seed=3)
    mask = B.ensure_defaults(batch)["response_mask"].bool()
    want = padded.compute_values(batch)[0]["values"]
    got = packed.compute_values(batch)[0]["values"]
    assert want[mask].abs().mean() > 0.1  # a random head: values are not trivially 0
    assert (got - want)[mask].abs().max() < TOL
    batch["values"] = want

    # gradients of one forward/backward of the clipped value loss
    grads = []
    for core in (padded, packed):

        def loss_fn(out: dict[str, torch.Tensor], mb: dict[str, Any]) -> Any:
            vf_loss, _ = core_algos.compute_value_loss(
                out["values"], mb["returns"], mb["values"], mb["response_mask"], 0.5
            )
            return vf_loss, {}

        core.backend.forward_backward("critic", [B.ensure_defaults(batch)], loss_fn)
        model = core.backend.models["critic"]  # type: ignore[attr-defined]
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        core.backend.optimizers["critic"].zero_grad(set_to_none=True)  # type: ignore[attr-defined]
    scale = max(g.abs().max().item() for g in grads[0].values())
    assert _max_diff(*grads) < TOL * max(1.0, scale)

    m_want = padded.update_critic(dict(batch))
    m_got = packed.update_critic(dict(batch))
    assert not _close_metrics(m_want, m_got), {k: (m_want[k], m_got[k]) for k in m_want}
    assert m_got["critic/grad_norm"] > 0
    assert _max_diff(_params(padded, "critic"), _params(packed, "critic")) < TOL


# --------------------------------------------------------------------------- other models


def _tiny_arch(tmp: Path, arch: str) -> Path:
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

    common = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    if arch == "mistral":  # a window shorter than the sequences: banded attention
        config: Any = MistralConfig(**common, sliding_window=5)
    else:  # q/k/v biases
        config = Qwen2Config(**common)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp / arch)
    return tmp / arch


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_other_architectures_match_padded(tmp_path: Path, arch: str) -> None:
    from rlfleet.trainer.models import forward_log_prob, load_actor

    path = _tiny_arch(tmp_path, arch)
    plain, packing = load_actor(str(path)), load_actor(str(path))
    enable_packing(packing)
    batch = B.ensure_defaults(make_varied_batch(6, P, R, vocab=256, seed=4))
    mask = batch["response_mask"].bool()
    want, _ = forward_log_prob(plain, batch)
    p = pack(batch["input_ids"], batch["attention_mask"], batch["position_ids"], R)
    got, _ = forward_log_prob(packing, p)
    assert isinstance(p, Packed) and p.calls == 2  # every layer's attention saw the batch
    assert (got - want)[mask].abs().max() < TOL
    # the padded forward of the switched model is the loaded one
    again, _ = forward_log_prob(packing, batch)
    assert torch.equal(again, want)


# --------------------------------------------------------------------------- token budgets


def test_token_budget_groups_fit_and_cover_every_row() -> None:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 40, (50,), generator=g)
    groups = B.token_budget_groups(lengths, 64)
    rows = torch.cat(groups).sort().values
    assert torch.equal(rows, torch.arange(50))
    assert all(int(lengths[i].sum()) <= 64 for i in groups)
    fewest = -(-int(lengths.sum()) // 64)
    assert fewest <= len(groups) <= fewest + 3  # balanced, close to the fewest possible
    more = B.token_budget_groups(lengths, 64, at_least=len(groups) + 5)
    assert len(more) == len(groups) + 5 and all(int(lengths[i].sum()) <= 64 for i in more)
    # a row over the budget is a group alone; never more groups than rows
    assert [t.tolist() for t in B.token_budget_groups(torch.tensor([100, 3]), 10)] == [[0], [1]]
    assert len(B.token_budget_groups(torch.tensor([1, 1]), 10, at_least=5)) == 2


@pytest.mark.parametrize("packed", [False, True])
def test_dynamic_batches_match_fixed_micro_batches(tiny_model_dir: Path, packed: bool) -> None:
    budget = 48  # tokens per micro-batch (a row is at most P + R = 22)
    fixed = TrainerCore(_config(tiny_model_dir, packed))
    dynamic_cfg = _config(
        tiny_model_dir, packed, actor={"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": budget}
    )
    dynamic = TrainerCore(dynamic_cfg)
    batch = _scored(seed=5)
    prepared = B.ensure_defaults(batch)
    micro, groups = dynamic.worker._micro(prepared, dynamic.worker.batching("update_actor"))
    assert groups is not None and len(micro) > 1
    for mb in micro:
        am = mb["attention_mask"]
        cost = int(am.sum()) if packed else am.numel()
        assert cost <= budget
    mask = prepared["response_mask"].bool()
    want = fixed.compute_log_prob(batch)[0]["old_log_probs"]
    got = dynamic.compute_log_prob(batch)[0]["old_log_probs"]  # rows back in order
    assert (got - want)[mask].abs().max() < TOL
    batch["old_log_probs"] = want
    m_want = fixed.update_actor(dict(batch))
    m_got = dynamic.update_actor(dict(batch))
    # each micro-batch's loss and metrics are its share of the mini-batch's tokens, so
    # any grouping gives the same gradient and the same metrics
    assert not _close_metrics(m_want, m_got), {k: (m_want[k], m_got[k]) for k in m_want}
    assert _max_diff(_params(fixed), _params(dynamic)) < TOL


# --------------------------------------------------------------------------- policy losses

# GSPO's per-sequence mean and the importance weights see whole rows, packed or padded,
# however the rows are cut into micro-batches.
POLICY_LOSSES = [
    pytest.param(
        {"policy_loss": {"loss_mode": "gspo"}, "clip_ratio_low": 3e-3, "clip_ratio_high": 4e-3},
        None,
        id="gspo",
    ),
    pytest.param(
        {"policy_loss": {"loss_mode": "gspo"}, "use_kl_loss": True, "entropy_coeff": 0.01},
        "sequence",
        id="gspo-kl-entropy-seq-is",
    ),
    pytest.param({"policy_loss": {"loss_mode": "cispo"}}, "token", id="cispo-token-is"),
    pytest.param({}, "token", id="vanilla-token-is"),
]


@pytest.mark.parametrize(("actor", "rollout_is"), POLICY_LOSSES)
def test_policy_losses_match_padded_and_token_budgets(
    tiny_model_dir: Path, actor: dict[str, Any], rollout_is: str | None
) -> None:
    algorithm: dict[str, Any] = {"adv_estimator": "grpo"}
    if rollout_is is not None:
        algorithm["rollout_correction"] = {"rollout_is": rollout_is, "rollout_is_threshold": 1.5}
    budget = {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 48}
    cores = [
        TrainerCore(_config(tiny_model_dir, False, actor=actor, algorithm=algorithm)),
        TrainerCore(_config(tiny_model_dir, True, actor=actor, algorithm=algorithm)),
        TrainerCore(_config(tiny_model_dir, True, actor={**actor, **budget}, algorithm=algorithm)),
    ]
    batch = _scored(seed=6)
    mask = B.ensure_defaults(batch)["response_mask"].float()
    g = torch.Generator().manual_seed(16)
    current = cores[0].compute_log_prob(batch)[0]["old_log_probs"]
    # old and rollout log-probs off the current policy, so that ratios clip and some
    # importance weights are truncated
    batch["old_log_probs"] = current + 0.05 * torch.randn(current.shape, generator=g) * mask
    rollout = batch["old_log_probs"] - 0.4 * torch.randn(current.shape, generator=g)
    batch["rollout_log_probs"] = rollout * mask
    batch["ref_log_prob"] = current + 0.1 * batch["advantages"]
    metrics = [core.update_actor(dict(batch)) for core in cores]
    for m in metrics[1:]:
        assert not _close_metrics(metrics[0], m), {k: (metrics[0][k], m[k]) for k in m}
    params = [_params(core) for core in cores]
    assert _max_diff(params[0], params[1]) < TOL
    assert _max_diff(params[0], params[2]) < TOL
    if rollout_is is not None:
        assert 0.05 < metrics[0]["rollout_corr/rollout_is_ratio_fraction_high"] < 0.95
        assert (
            metrics[0]["rollout_corr/rollout_is_max"]
            > 1.5
            > metrics[0]["rollout_corr/rollout_is_mean"]
        )
    else:
        assert not any(k.startswith("rollout_corr/") for k in metrics[0])
