"""TrainerCore: the trainer's operations on whole batches, with no I/O of its own.

The servicer (:mod:`rlfleet.trainer.servicer`) and the in-process client call these
methods; each validates the batch first (:func:`rlfleet.trainer.batch.validate_ppo_batch`,
raising ``InvalidArgument`` before any model is touched), then hands every
data-parallel rank its rows through the :class:`~rlfleet.trainer.dispatch.Dispatcher`
and merges what comes back.

Operations return only what they add (``compute_log_prob`` -> ``old_log_probs`` and
``entropys``; ``compute_advantage`` -> ``token_level_rewards``, ``advantages``,
``returns``; ...) plus metrics; updates return metrics named as in verl
(``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/entropy``,
``actor/grad_norm``, ``actor/lr``, ``critic/vf_loss``, ``critic/vf_clipfrac``,
``critic/grad_norm``, ``critic/lr``, ...).

:meth:`TrainerCore.train_step` runs one PPO step in verl's order: old log-probs,
reference log-probs, values, KL penalty in the reward, advantages, critic update, then
(after ``trainer.critic_warmup`` steps) the actor update. It is the driver's one call per
step (``TrainStep``): the batch arrives once and stays here; each phase is timed here
(``timing_s/<phase>``) and the data metrics are computed here, once
(:func:`rlfleet.trainer.ppo.metric_utils.compute_data_metrics`).

The old-log-prob pass is skipped when its result is known without it
(``actor/old_log_prob_skipped``): when the caller says the batch is on-policy (every
sample generated with the weights held now), the actor runs one epoch over one
mini-batch and no KL penalty in the reward needs the old log-probs before the update,
the old log-probs equal the log-probs of the actor's own forward in its update, so the
loss takes those, detached (the ratio is exactly 1; the gradient is the same). During
critic warm-up without an in-reward KL nothing reads them, so the pass is skipped too.

KL coefficients: the in-reward penalty's (``algorithm.kl_ctrl``) and the KL loss's
(``actor.kl_loss_coef``, moved by ``actor.kl_loss_ctrl``) are each a fixed or adaptive
controller of ``core_algos``, updated after every step by the KL it measured, reported
(``actor/reward_kl_penalty_coeff``, ``actor/kl_coef``) and kept by checkpoints.
:meth:`TrainerCore.set_lr_scale` changes a role's lr at run time (the driver's health
guard lowers the actor's).

Counters: ``global_step`` counts training steps (``train_step``, ``update_actor``,
``sft_step``); ``weight_version`` counts actor updates, i.e. the version of the weights a
push sends.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlfleet.common import tracing
from rlfleet.common.config import GROUP_ESTIMATORS, Config
from rlfleet.common.errors import FailedPrecondition, InvalidArgument, RlfleetError
from rlfleet.trainer import batch as B
from rlfleet.trainer.backend import Backend
from rlfleet.trainer.batch import Batch
from rlfleet.trainer.dispatch import Dispatcher, RankOps
from rlfleet.trainer.ppo import core_algos
from rlfleet.trainer.ppo.metric_utils import compute_data_metrics
from rlfleet.trainer.worker import Worker, _mean_metrics

__all__ = ["TrainStepResult", "TrainerCore", "TrainerState", "build_backend"]

logger = logging.getLogger(__name__)

_MODEL_KEYS = ("input_ids", "attention_mask", "responses")


@dataclass
class TrainerState:
    """What a checkpoint restores besides the models."""

    global_step: int = 0
    weight_version: int = 0
    kl_coef: float = 0.0  # the in-reward KL penalty's (algorithm.kl_ctrl)
    kl_loss_coef: float = 0.0  # the KL loss's (actor.kl_loss_coef, moved by actor.kl_loss_ctrl)
    extra: dict[str, Any] = field(default_factory=dict)


def build_backend(config: Config, *, total_training_steps: int | None = None) -> Backend:
    """The backend named by ``actor.backend`` for this process (and its process group)."""
    if config.actor.backend == "megatron":
        from rlfleet.trainer.megatron import MegatronBackend

        return MegatronBackend(config, total_training_steps=total_training_steps)
    from rlfleet.trainer.fsdp import FSDPBackend

    return FSDPBackend(config, total_training_steps=total_training_steps)


def model_vocab_size(config: Config, roles: Sequence[str]) -> int | None:
    """The smallest ``vocab_size`` in the Hugging Face configs of the models that
    ``roles`` load (None when no config states one): a token id at or above it would
    index past an embedding."""
    from transformers import AutoConfig

    actor = config.actor.model_path
    paths = {
        "actor": actor,
        "critic": config.critic.model_path or actor,
        "ref": config.ref.model_path or actor,
    }
    sizes = []
    for path in sorted({paths[r] for r in roles if r in paths}):
        hf = AutoConfig.from_pretrained(
            path, trust_remote_code=config.actor.trust_remote_code, local_files_only=True
        )
        size = getattr(hf, "vocab_size", None)
        if size is None and hasattr(hf, "get_text_config"):
            size = getattr(hf.get_text_config(), "vocab_size", None)
        if size:
            sizes.append(int(size))
    return min(sizes) if sizes else None


@dataclass(frozen=True)
class TrainStepResult:
    """What one :meth:`TrainerCore.train_step_result` did."""

    metrics: dict[str, float]
    global_step: int  # after the step
    weight_version: int  # the actor's, after the step
    actor_updated: bool  # False during critic warm-up: no new weights to push

    @property
    def new_weight_version(self) -> int | None:
        """The version of the weights this step made; None when the actor did not update."""
        return self.weight_version if self.actor_updated else None


class TrainerCore:
    """Actor, critic and reference of one trainer (see the module docstring).

    Args:
        config: the run config (actor / critic / ref / algorithm / trainer sections).
        backend: this rank's backend; built from the config when None.
        total_training_steps: for the lr schedule; None: ``trainer.total_training_steps``.
    """

    def __init__(
        self,
        config: Config,
        backend: Backend | None = None,
        *,
        total_training_steps: int | None = None,
    ) -> None:
        self.config = config
        self.backend = backend or build_backend(config, total_training_steps=total_training_steps)
        self.worker = Worker(config, self.backend)
        self.ops = RankOps(self.worker)
        self.dispatcher = Dispatcher(self.ops)
        self.world_size = self.dispatcher.world_size
        # Rows are split over data-parallel replicas; every rank of a replica (its TP /
        # PP ranks) gets the replica's rows, and one rank per replica reports back.
        self.layout = self.backend.data_layout()
        self.dp_size = len({dp for dp, _ in self.layout})
        kl = config.algorithm.kl_ctrl
        self.kl_ctrl = core_algos.get_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        a = config.actor
        loss_kl = a.kl_loss_ctrl
        self.kl_loss_ctrl = core_algos.get_kl_controller(
            loss_kl.type, a.kl_loss_coef, loss_kl.target_kl, loss_kl.horizon
        )
        self.state = TrainerState(kl_coef=self.kl_ctrl.value, kl_loss_coef=self.kl_loss_ctrl.value)
        # The lr schedules' total (None: not known yet; a caller may give it later).
        self.total_training_steps = total_training_steps or config.trainer.total_training_steps
        # Token ids are checked against it before any model sees them.
        self.vocab_size = model_vocab_size(config, self.roles)
        # One operation at a time: gRPC serves calls on a thread pool, and the
        # followers must see the operations in one order.
        self.lock = threading.RLock()

    # ---------------------------------------------------------------- info

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(r for r in ("actor", "critic", "ref") if self.backend.has(r))

    @property
    def global_step(self) -> int:
        return self.state.global_step

    @property
    def weight_version(self) -> int:
        return self.state.weight_version

    def status(self) -> dict[str, Any]:
        return {
            "global_step": self.global_step,
            "weight_version": self.weight_version,
            "backend": self.backend.name,
            "world_size": self.world_size,
            "roles": list(self.roles),
            "model": self.config.actor.model_path,
        }

    def _need(self, role: str, op: str) -> None:
        if not self.backend.has(role):
            enabled = {
                "critic": "algorithm.adv_estimator=gae or critic.enable=true",
                "ref": "actor.use_kl_loss or algorithm.use_kl_in_reward",
            }.get(role, "")
            raise FailedPrecondition(
                f"{op} needs the {role} model, which this trainer does not hold "
                f"(roles: {list(self.roles)}; it is on with {enabled})",
                field=role,
            )

    # ---------------------------------------------------------------- dispatch helpers

    def _forward_on_ranks(self, op: str, batch: Batch) -> Batch:
        """Split rows contiguously over the ranks (padding with copies of the last row so
        that every rank runs the same number of micro-batches), run, concatenate."""
        bs = B.batch_size(batch)
        world = self.dp_size
        padded = -(-bs // world) * world
        if padded != bs:
            idx = torch.cat([torch.arange(bs), torch.full((padded - bs,), bs - 1)])
            batch = B.index_select(batch, idx)
        per = padded // world
        shards = [B.index_select(batch, torch.arange(r * per, (r + 1) * per)) for r in range(world)]
        out = B.concat(self._run_dp(op, shards))
        if padded != bs:
            out = B.index_select(out, torch.arange(bs))
        return out

    def _run_dp(self, op: str, shards: Sequence[Any], **kwargs: Any) -> list[Any]:
        """Run ``op`` with ``shards[d]`` on every rank of data-parallel replica ``d``;
        returns one result per replica, in replica order."""
        per_rank = [shards[dp] for dp, _ in self.layout]
        results = self._check(self.dispatcher.run(op, per_rank, **kwargs))
        mine: dict[int, Any] = {}
        for (dp, counts), res in zip(self.layout, results, strict=True):
            if counts:
                mine[dp] = res
        return [mine[d] for d in range(self.dp_size)]

    def run_on_ranks(self, op: str, **kwargs: Any) -> list[Any]:
        """Run ``op`` on every rank (the same arguments); the ranks' results, a rank's
        failure raised here. The caller holds :attr:`lock` when ``op`` changes state."""
        return self._check(self.dispatcher.run(op, None, **kwargs))

    def restore_state(
        self,
        *,
        global_step: int,
        weight_version: int,
        kl_coef: float,
        kl_loss_coef: float | None = None,
    ) -> None:
        """The counters a checkpoint saved (the caller holds :attr:`lock`);
        ``kl_loss_coef`` None (a checkpoint from before it was saved): left as it is."""
        self.state.global_step = global_step
        self.state.weight_version = weight_version
        self.kl_ctrl.value = kl_coef
        self.state.kl_coef = kl_coef
        if kl_loss_coef is not None:
            self.kl_loss_ctrl.value = kl_loss_coef
            self.state.kl_loss_coef = kl_loss_coef

    def set_lr_scale(self, role: str, scale: float) -> float:
        """Make the lr of ``role`` (``actor`` or ``critic``) its configured lr times
        ``scale`` from now on, under the same schedule (warm-up and decay go on where
        they are). Idempotent: the scale is absolute, not applied on the previous one.
        Checkpoints keep it (the scheduler's base lr). Returns the lr now in effect.

        Raises:
            InvalidArgument: ``scale`` not in (0, 1], or ``role`` not a trained role.
            FailedPrecondition: this trainer does not hold ``role``.
        """
        if role not in ("actor", "critic"):
            raise InvalidArgument(
                f"set_lr_scale: role must be actor or critic, got {role!r}",
                field="role",
                value=role,
            )
        if not (math.isfinite(scale) and 0.0 < scale <= 1.0):
            raise InvalidArgument(
                f"set_lr_scale: scale must be in (0, 1], got {scale}", field="scale", value=scale
            )
        base = float(getattr(self.config, role).lr)
        if base > 0 and base * scale < 1e-30:  # an lr that underflows trains nothing
            raise InvalidArgument(
                f"set_lr_scale: scale {scale} makes the {role} lr {base} x {scale} underflow",
                field="scale",
                value=scale,
            )
        self._need(role, "set_lr_scale")
        with self.lock:
            lrs = self.run_on_ranks("set_lr_scale", role=role, scale=scale)
        return float(lrs[0])

    def set_total_training_steps(self, total: int) -> None:
        """The run's total training steps for the lr schedules (``lr_warmup_steps_ratio``
        and the cosine decay to ``min_lr_ratio`` follow it), from the current step on.
        The driver sends it with every :meth:`train_step_result`; a no-op when unchanged.

        Raises:
            InvalidArgument: ``total`` not a positive integer.
        """
        if isinstance(total, bool) or not isinstance(total, int) or not 0 < total < 2**53:
            raise InvalidArgument(
                f"total_steps must be a positive integer below 2^53, got {total!r}",
                field="total_steps",
                value=total,
            )
        with self.lock:
            if total == self.total_training_steps:
                return
            self.run_on_ranks("set_total_steps", total=total)
            self.total_training_steps = total

    def _check(self, results: list[Any]) -> list[Any]:
        for r, res in enumerate(results):
            if isinstance(res, RlfleetError):
                raise res  # already classed (e.g. a refused checkpoint): keep its status
            if isinstance(res, Exception):
                raise RuntimeError(f"rank {r} failed: {type(res).__name__}: {res}") from res
        return results

    def _mini_size(self, bs: int, prompts: int, op: str) -> int:
        mini = min(prompts * self.config.rollout.n, bs)
        if bs % mini:
            raise InvalidArgument(
                f"{op}: batch size {bs} is not a multiple of the mini-batch size {mini} "
                f"(ppo_mini_batch_size {prompts} x rollout.n {self.config.rollout.n})",
                field="input_ids",
                value=bs,
            )
        if mini % self.dp_size:
            raise InvalidArgument(
                f"{op}: mini-batch size {mini} does not split over {self.dp_size} "
                "data-parallel ranks",
                field="input_ids",
                value=bs,
            )
        return mini

    def _update_on_ranks(self, op: str, batch: Batch, mini: int, **kwargs: Any) -> dict[str, float]:
        bs = B.batch_size(batch)
        order = B.interleave_for_minibatches(bs, mini, self.dp_size)
        shards = [B.index_select(batch, idx) for idx in order]
        seed = self.config.trainer.seed + self.global_step
        results = self._run_dp(op, shards, mini_per_rank=mini // self.dp_size, seed=seed, **kwargs)
        metrics = _mean_metrics(results)
        for key in ("actor/skipped_steps", "critic/skipped_steps", "actor/lr", "critic/lr"):
            if key in results[0]:
                metrics[key] = results[0][key]
        return metrics

    # ---------------------------------------------------------------- operations

    def compute_log_prob(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """``old_log_probs`` and ``entropys`` ``(bs, R)`` under the current actor."""
        self._validate(batch, "compute_log_prob", _MODEL_KEYS)
        batch = B.ensure_defaults(batch)
        with self.lock:
            out = self._forward_on_ranks("compute_log_prob", self._model_view(batch))
        ent = core_algos.masked_mean(out["entropys"], batch["response_mask"])
        return out, {"actor/entropy": float(ent)}

    def compute_ref_log_prob(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """``ref_log_prob`` ``(bs, R)`` under the reference policy."""
        self._need("ref", "compute_ref_log_prob")
        self._validate(batch, "compute_ref_log_prob", _MODEL_KEYS)
        batch = B.ensure_defaults(batch)
        with self.lock:
            return self._forward_on_ranks("compute_ref_log_prob", self._model_view(batch)), {}

    def compute_values(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """``values`` ``(bs, R)`` from the critic."""
        self._need("critic", "compute_values")
        self._validate(batch, "compute_values", _MODEL_KEYS)
        batch = B.ensure_defaults(batch)
        with self.lock:
            return self._forward_on_ranks("compute_values", self._model_view(batch)), {}

    def _validate(self, batch: Batch, op: str, required: Sequence[str]) -> None:
        B.validate_ppo_batch(batch, op, required, vocab_size=self.vocab_size)

    @staticmethod
    def _model_view(batch: Batch) -> Batch:
        keys = ("input_ids", "attention_mask", "position_ids", "responses")
        return {k: batch[k] for k in keys}

    def _advantage_keys(self, batch: Batch) -> list[str]:
        alg = self.config.algorithm
        need = ["responses"]
        if "token_level_scores" not in batch and "scores" not in batch:
            need.append("token_level_scores")
        if alg.adv_estimator == "gae":
            need.append("values")
        if alg.adv_estimator in GROUP_ESTIMATORS and "uid" not in batch and "index" not in batch:
            need.append("uid")
        if alg.adv_estimator == "remax":
            need.append("reward_baselines")
        if alg.use_kl_in_reward:
            need += ["old_log_probs", "ref_log_prob"]
        return need

    def compute_advantage(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """KL penalty in the reward (if on) and the advantages of ``adv_estimator``.

        Scores come as ``token_level_scores`` ``(bs, R)`` or ``scores`` ``(bs,)`` (placed on
        the last valid response token). Returns ``token_level_scores``,
        ``token_level_rewards``, ``advantages`` and ``returns``.
        """
        self._validate(batch, "compute_advantage", self._advantage_keys(batch))
        batch = B.ensure_defaults(batch)
        with self.lock:
            return self._advantage(batch)

    def _advantage(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        alg = self.config.algorithm
        mask = batch["response_mask"].to(torch.float32)
        if "token_level_scores" in batch:
            scores = batch["token_level_scores"].to(torch.float32)
        else:
            scores = torch.zeros_like(mask)
            last = (mask.cumsum(-1) * mask).argmax(-1)  # last valid token of each row
            scores.scatter_(1, last.unsqueeze(1), batch["scores"].to(torch.float32).unsqueeze(1))
        metrics: dict[str, float] = {}
        rewards = scores
        if alg.use_kl_in_reward:
            kld = core_algos.kl_penalty(
                batch["old_log_probs"], batch["ref_log_prob"], alg.kl_penalty
            )
            kld = kld * mask
            beta = self.kl_ctrl.value
            rewards = scores - beta * kld
            current_kl = float(core_algos.masked_mean(kld, mask, axis=-1).mean())
            self.kl_ctrl.update(current_kl, n_steps=B.batch_size(batch))
            self.state.kl_coef = self.kl_ctrl.value
            metrics["actor/reward_kl_penalty"] = current_kl
            metrics["actor/reward_kl_penalty_coeff"] = beta
        index = batch.get("uid", batch.get("index"))
        est = alg.adv_estimator
        if est == "gae":
            adv, ret = core_algos.compute_gae_advantage_return(
                rewards, batch["values"].to(torch.float32), mask, alg.gamma, alg.lam
            )
        elif est == "grpo":
            adv, ret = core_algos.compute_grpo_outcome_advantage(
                rewards, mask, index, norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo
            )
        elif est == "rloo":
            adv, ret = core_algos.compute_rloo_outcome_advantage(rewards, mask, index)
        elif est == "reinforce_plus_plus":
            adv, ret = core_algos.compute_reinforce_plus_plus_outcome_advantage(
                rewards, mask, alg.gamma
            )
        elif est == "reinforce_plus_plus_baseline":
            adv, ret = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
                rewards, mask, index
            )
        elif est == "remax":
            adv, ret = core_algos.compute_remax_outcome_advantage(
                rewards, batch["reward_baselines"].to(torch.float32), mask
            )
        else:  # pragma: no cover - the config's Literal rules this out
            raise InvalidArgument(f"unknown adv_estimator {est!r}", field="algorithm.adv_estimator")
        out = {
            "token_level_scores": scores,
            "token_level_rewards": rewards,
            "advantages": adv,
            "returns": ret,
        }
        return out, metrics

    def update_critic(self, batch: Batch) -> dict[str, float]:
        """PPO value updates on ``values`` and ``returns``."""
        self._need("critic", "update_critic")
        self._validate(batch, "update_critic", (*_MODEL_KEYS, "values", "returns"))
        batch = B.ensure_defaults(batch)
        c = self.config.critic
        mini = self._mini_size(B.batch_size(batch), c.ppo_mini_batch_size or 1, "update_critic")
        with self.lock:
            return self._update_on_ranks("update_critic", self._critic_view(batch), mini)

    @staticmethod
    def _critic_view(batch: Batch) -> Batch:
        keys = (*_MODEL_KEYS, "position_ids", "response_mask", "values", "returns")
        return {k: batch[k] for k in keys}

    def _actor_keys(self) -> tuple[str, ...]:
        keys: tuple[str, ...] = (*_MODEL_KEYS, "old_log_probs", "advantages")
        if self.config.actor.use_kl_loss:
            keys = (*keys, "ref_log_prob")
        if self.config.algorithm.rollout_correction.rollout_is is not None:
            keys = (*keys, "rollout_log_probs")  # the truncated IS weights need them
        return keys

    def _actor_view(self, batch: Batch, *, old_log_probs: bool = True) -> Batch:
        keys = (*self._actor_keys(), "position_ids", "response_mask")
        return {k: batch[k] for k in keys if old_log_probs or k != "old_log_probs"}

    def update_actor(self, batch: Batch) -> dict[str, float]:
        """PPO policy updates: ``ppo_epochs`` x mini-batches x micro-batches."""
        self._validate(batch, "update_actor", self._actor_keys())
        batch = B.ensure_defaults(batch)
        a = self.config.actor
        mini = self._mini_size(B.batch_size(batch), a.ppo_mini_batch_size, "update_actor")
        with self.lock:
            metrics = self._update_on_ranks(
                "update_actor", self._actor_view(batch), mini, **self._kl_loss_kwargs()
            )
            self._update_kl_loss_ctrl(metrics, B.batch_size(batch))
            self.state.global_step += 1
            self.state.weight_version += 1
        return metrics

    def _kl_loss_kwargs(self) -> dict[str, float]:
        """The KL-loss coefficient of this update (the controller's value)."""
        return {"kl_loss_coef": self.kl_loss_ctrl.value} if self.config.actor.use_kl_loss else {}

    def _update_kl_loss_ctrl(self, metrics: dict[str, float], samples: int) -> None:
        """After an actor update: move the KL-loss coefficient by the KL it measured
        (``actor/kl_loss``, the mean KL estimate to the reference over the update)."""
        if self.config.actor.use_kl_loss and "actor/kl_loss" in metrics:
            self.kl_loss_ctrl.update(metrics["actor/kl_loss"], n_steps=samples)
            self.state.kl_loss_coef = self.kl_loss_ctrl.value

    def sft_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of cross-entropy on the response tokens."""
        self._validate(batch, "sft_step", _MODEL_KEYS)
        batch = B.ensure_defaults(batch)
        view = {k: batch[k] for k in (*_MODEL_KEYS, "position_ids", "response_mask")}
        bs = B.batch_size(batch)
        if bs % self.dp_size:
            raise InvalidArgument(
                f"sft_step: batch size {bs} does not split over {self.dp_size} data-parallel ranks",
                field="input_ids",
                value=bs,
            )
        with self.lock:
            per = bs // self.dp_size
            shards = [
                B.index_select(view, torch.arange(r * per, (r + 1) * per))
                for r in range(self.dp_size)
            ]
            results = self._run_dp("sft_step", shards)
            metrics = _mean_metrics(results)
            self.state.global_step += 1
            self.state.weight_version += 1
        return metrics

    def _train_step_keys(self, batch: Batch) -> list[str]:
        need = [*_MODEL_KEYS]
        alg = self.config.algorithm
        if "token_level_scores" not in batch and "scores" not in batch:
            need.append("token_level_scores")
        if alg.adv_estimator in GROUP_ESTIMATORS and "uid" not in batch and "index" not in batch:
            need.append("uid")
        if alg.adv_estimator == "remax":
            need.append("reward_baselines")
        if alg.rollout_correction.rollout_is is not None:
            need.append("rollout_log_probs")
        return need

    def skips_old_log_prob(self, batch_size: int, *, on_policy: bool, actor_update: bool) -> bool:
        """Whether :meth:`train_step` skips the old-log-prob pass (see the module
        docstring): nothing reads the old log-probs, or they provably equal the actor's
        own in its update (``on_policy``, one epoch, one mini-batch of the whole batch)."""
        if self.config.algorithm.use_kl_in_reward:
            return False  # the reward needs them before any update
        if not actor_update:
            return True
        a = self.config.actor
        one_minibatch = self._mini_size(batch_size, a.ppo_mini_batch_size, "train_step") == (
            batch_size
        )
        return on_policy and a.ppo_epochs == 1 and one_minibatch

    def train_step(
        self, batch: Batch, *, on_policy: bool = False, total_steps: int = 0
    ) -> dict[str, float]:
        """One PPO step on a scored batch, in verl's order; its metrics (see
        :meth:`train_step_result`)."""
        return self.train_step_result(batch, on_policy=on_policy, total_steps=total_steps).metrics

    def train_step_result(
        self, batch: Batch, *, on_policy: bool = False, total_steps: int = 0
    ) -> TrainStepResult:
        """One PPO step on a scored batch, in verl's order (see the module docstring).

        Args:
            batch: prompts + responses and their scores (``scores`` or
                ``token_level_scores``), ``uid`` for the group estimators; any of
                ``old_log_probs``, ``ref_log_prob``, ``values`` given are used as they are.
            on_policy: every sample was generated with the weights this trainer holds
                now (the caller knows; never assumed): lets the old-log-prob pass be
                skipped when one epoch over one mini-batch makes it redundant.
            total_steps: the run's total training steps, for the lr schedules
                (:meth:`set_total_training_steps`); 0 keeps the trainer's.

        Returns:
            Metrics (the updates', the data metrics, ``timing_s/<phase>`` of each phase
            that ran, ``actor/old_log_prob_skipped``), the counters after the step, and
            whether the actor updated.
        """
        self._validate(batch, "train_step", self._train_step_keys(batch))
        batch = B.ensure_defaults(batch)
        bs = B.batch_size(batch)
        a = self.config.actor
        actor_mini = self._mini_size(bs, a.ppo_mini_batch_size, "train_step")
        critic_on = self.backend.has("critic")
        if critic_on:
            critic_mini = self._mini_size(
                bs, self.config.critic.ppo_mini_batch_size or 1, "train_step"
            )
        if total_steps:  # once the batch passed its checks: a refused step changes nothing
            self.set_total_training_steps(total_steps)
        metrics: dict[str, float] = {}

        def timed(phase: str, fn: Callable[[], Any]) -> Any:
            t0 = time.perf_counter()
            with tracing.span(f"trainer.{phase}", rows=bs):
                out = fn()
            metrics[f"timing_s/{phase}"] = time.perf_counter() - t0
            return out

        with self.lock:
            actor_update = self.global_step >= self.config.trainer.critic_warmup
            given_old = "old_log_probs" in batch
            skip_old = not given_old and self.skips_old_log_prob(
                bs, on_policy=on_policy, actor_update=actor_update
            )
            view = self._model_view(batch)
            if not given_old and not skip_old:
                out = timed(
                    "old_log_prob", lambda: self._forward_on_ranks("compute_log_prob", view)
                )
                batch["old_log_probs"] = out["old_log_probs"]
                metrics["actor/entropy_old"] = float(
                    core_algos.masked_mean(out["entropys"], batch["response_mask"])
                )
            metrics["actor/old_log_prob_skipped"] = 1.0 if skip_old else 0.0
            if self.backend.has("ref") and "ref_log_prob" not in batch:
                batch.update(
                    timed("ref", lambda: self._forward_on_ranks("compute_ref_log_prob", view))
                )
            if critic_on and "values" not in batch:
                batch.update(
                    timed("values", lambda: self._forward_on_ranks("compute_values", view))
                )
            adv, adv_metrics = timed("adv", lambda: self._advantage(batch))
            batch.update(adv)
            metrics.update(adv_metrics)
            metrics.update(self._data_metrics(batch))
            if critic_on:
                critic_view = self._critic_view(batch)
                metrics.update(
                    timed(
                        "update_critic",
                        lambda: self._update_on_ranks("update_critic", critic_view, critic_mini),
                    )
                )
            if actor_update:
                actor_view = self._actor_view(batch, old_log_probs=not skip_old)
                actor_metrics = timed(
                    "update_actor",
                    lambda: self._update_on_ranks(
                        "update_actor",
                        actor_view,
                        actor_mini,
                        old_log_probs_from_current=skip_old,
                        **self._kl_loss_kwargs(),
                    ),
                )
                metrics.update(actor_metrics)
                self._update_kl_loss_ctrl(actor_metrics, bs)
                self.state.weight_version += 1
            self.state.global_step += 1
            return TrainStepResult(
                metrics, self.state.global_step, self.state.weight_version, actor_update
            )

    def _data_metrics(self, batch: Batch) -> dict[str, float]:
        c = self.config
        return compute_data_metrics(
            batch,
            max_response_length=c.rollout.response_length or c.data.max_response_length,
            max_prompt_length=c.data.max_prompt_length,
        )

    # ---------------------------------------------------------------- lifecycle

    def shutdown(self) -> None:
        """Release the follower ranks (they leave their loop)."""
        with self.lock:
            self.dispatcher.stop()

    def gather_states(self, roles: Sequence[str]) -> list[dict[str, Any]]:
        """Full states of ``roles`` (on rank 0) and each rank's RNG state."""
        with self.lock:
            return self._check(self.dispatcher.run("state_dicts", None, roles=list(roles)))

    @property
    def lora(self) -> bool:
        """Whether the actor trains LoRA adapters (``actor.lora_rank > 0``)."""
        return self.config.actor.lora_rank > 0

    def iter_weights(
        self, dtype: torch.dtype | None = None, *, full: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The actor's parameters, gathered whole one at a time, in HF names (for a
        weight push); a LoRA actor's adapters only (:mod:`rlfleet.weightsync.lora`),
        or with ``full`` its merged model. Holds the trainer's lock until exhausted;
        every rank takes part."""
        adapter = self.lora and not full
        with self.lock:
            self.dispatcher.send("drain_full_params", None, {"role": "actor", "adapter": adapter})
            try:
                if adapter:
                    yield from self.backend.iter_adapter_params(dtype)
                else:
                    yield from self.backend.iter_full_params("actor", dtype)
            finally:
                self._check(self.dispatcher.gather(None))

    def export_hf(self, path: str) -> None:
        """Write the actor as a Hugging Face folder that AutoModelForCausalLM loads."""
        with self.lock:
            self._check(self.dispatcher.run("export_hf", None, role="actor", path=path))
        tokenizer = self.config.actor.tokenizer_path
        if tokenizer:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tokenizer, local_files_only=True).save_pretrained(path)
