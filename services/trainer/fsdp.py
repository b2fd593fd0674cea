"""FSDP2 backend: Hugging Face models sharded with ``torch.distributed.fsdp.fully_shard``.

Layout: each decoder layer (the model's ``_no_split_modules`` classes) is one FSDP unit,
the root (embeddings, final norm, head, tied weights) another. On one CPU process the
models stay plain ``nn.Module`` (there is nothing to shard and no process group needed);
with a process group of N ranks (gloo on CPU, NCCL on GPU) or on a GPU, they are
``fully_shard``-ed over the whole group.

Options (per role, verl's names): ``gradient_checkpointing``; ``param_offload`` and
``optimizer_offload`` (FSDP2's ``CPUOffloadPolicy``: parameters, gradients and the
optimizer step live on the CPU; either flag turns it on, GPU only); ``dtype: bfloat16``
is mixed precision on GPU (bf16 compute, fp32 parameters and gradient reduction) and
falls back to fp32 on CPU. ``fsdp.reshard_after_forward`` as in FSDP2.

Gradient reduction averages over ranks; :mod:`rlfleet.trainer.worker` scales each
micro-batch loss by its share of the global token count times the world size, so the
result is the same update as one rank computing the whole mini-batch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlfleet.common.config import ActorConfig, Config, CriticConfig
from rlfleet.trainer.backend import LossFn, Metrics, ModelRole, Outputs
from rlfleet.trainer.lora import adapter_names, iter_adapter, iter_merged, merge_state, wrap_lora
from rlfleet.trainer.models import (
    batch_to_device,
    forward_log_prob,
    forward_values,
    load_actor,
    load_critic,
    load_ref,
    torch_dtype,
)
from rlfleet.trainer.packing import Packed, enable_packing, pack

__all__ = [
    "FSDPBackend",
    "WarmupSchedule",
    "build_scheduler",
    "ensure_process_group",
    "set_base_lr",
    "set_schedule_total",
]

logger = logging.getLogger(__name__)


class WarmupSchedule:
    """lr multiplier: linear warm-up over ``warmup`` steps, then constant or cosine decay
    to ``min_lr_ratio`` at ``total`` steps. A class (not a lambda) so that LambdaLR's
    state_dict captures it. ``warmup_ratio`` (verl's ``lr_warmup_steps_ratio``, used
    when ``lr_warmup_steps`` is negative) makes the warm-up follow the total when the
    total is only known later (:meth:`set_total`)."""

    def __init__(
        self,
        warmup: int,
        total: int | None,
        kind: str,
        min_lr_ratio: float,
        warmup_ratio: float | None = None,
    ) -> None:
        self.warmup = warmup
        self.total = total
        self.kind = kind
        self.min_lr_ratio = min_lr_ratio
        self.warmup_ratio = warmup_ratio

    def set_total(self, total: int) -> None:
        """The run's total training steps from now on (the warm-up follows it when
        given as a ratio)."""
        self.total = total
        if self.warmup_ratio is not None:
            self.warmup = int(self.warmup_ratio * total)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        if self.kind == "constant" or not self.total:
            return 1.0
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine


def build_scheduler(
    optimizer: torch.optim.Optimizer, section: ActorConfig | CriticConfig, total: int | None
) -> torch.optim.lr_scheduler.LambdaLR:
    """verl's schedule: ``lr_warmup_steps`` (or ``lr_warmup_steps_ratio * total``) of
    linear warm-up, then constant or cosine (``lr_scheduler``) down to ``min_lr_ratio``."""
    ratio = None if section.lr_warmup_steps >= 0 else section.lr_warmup_steps_ratio
    warmup = section.lr_warmup_steps if ratio is None else int(ratio * (total or 0))
    schedule = WarmupSchedule(warmup, total, section.lr_scheduler, section.min_lr_ratio, ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def set_schedule_total(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, total: int
) -> None:
    """Give ``scheduler``'s schedules the run's total training steps (warm-up ratio and
    decay follow it) and put the lr for the current step into effect at once."""
    for i, group in enumerate(optimizer.param_groups):
        schedule = scheduler.lr_lambdas[i]
        if isinstance(schedule, WarmupSchedule):
            schedule.set_total(total)
        group["lr"] = scheduler.base_lrs[i] * schedule(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def set_base_lr(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, base_lr: float
) -> None:
    """Make ``base_lr`` the lr that ``scheduler`` multiplies by its schedule, from the
    current step on: the lr in effect becomes ``base_lr * schedule(step)`` at once, and
    warm-up or decay continue where they are. The scheduler's and the optimizer's
    state dicts carry it (``base_lrs``, ``initial_lr``), so a checkpoint keeps it."""
    for i, group in enumerate(optimizer.param_groups):
        factor = scheduler.lr_lambdas[i](scheduler.last_epoch)
        group["lr"] = base_lr * factor
        group["initial_lr"] = base_lr
        scheduler.base_lrs[i] = base_lr
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def ensure_process_group(device: torch.device) -> None:
    """A one-rank process group when none was started: FSDP2 on one GPU (for its
    mixed-precision and offload policies) and megatron-core need one."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


#: What a packed micro-batch replaces (the rest travels to the device for the loss).
_SEQUENCE_KEYS = frozenset({"input_ids", "attention_mask", "position_ids"})


def _decoder_layer_classes(model: nn.Module) -> set[type[nn.Module]]:
    names = set(getattr(model, "_no_split_modules", None) or ())
    return {type(m) for m in model.modules() if type(m).__name__ in names}


class FSDPBackend:
    """Models of one rank under FSDP2 (see the module docstring)."""

    name = "fsdp"

    def __init__(self, config: Config, *, total_training_steps: int | None = None) -> None:
        self.config = config
        if config.trainer.device == "cuda":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
            ensure_process_group(self.device)
        else:
            self.device = torch.device("cpu")
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.sharded = self.distributed and (self.world_size > 1 or self.device.type == "cuda")
        total = total_training_steps or config.trainer.total_training_steps
        torch.manual_seed(config.trainer.seed)
        self.models: dict[ModelRole, nn.Module] = {}
        self.optimizers: dict[ModelRole, torch.optim.Optimizer] = {}
        self.schedulers: dict[ModelRole, torch.optim.lr_scheduler.LambdaLR] = {}
        self.sections: dict[ModelRole, ActorConfig | CriticConfig] = {}
        self.trained_params: dict[ModelRole, list[nn.Parameter]] = {}

        # Roles whose micro-batches run packed (actor.use_remove_padding covers the
        # reference too, as verl's actor_rollout_ref.model does).
        self.packed: dict[ModelRole, bool] = {
            "actor": bool(config.actor.use_remove_padding),
            "ref": bool(config.actor.use_remove_padding),
            "critic": bool(config.critic.use_remove_padding),
        }

        actor = config.actor
        self.lora = actor.lora_rank > 0
        policy = self._load("actor", load_actor, actor.model_path)
        if self.lora:  # adapters only train (rlfleet.trainer.lora)
            policy = wrap_lora(
                policy,
                rank=actor.lora_rank,
                alpha=actor.lora_alpha,
                target_modules=actor.target_modules,
            )
        self._add_trained("actor", actor, policy, total)
        self._adapter_names = adapter_names(self.models["actor"]) if self.lora else set()
        if config.critic_enabled():
            critic = config.critic
            path = critic.model_path or actor.model_path
            self._add_trained("critic", critic, self._load("critic", load_critic, path), total)
        # With LoRA the reference is the actor with its adapters disabled (verl's way):
        # the same base weights, no second copy; a ref.model_path of its own loads one.
        self.ref_from_actor = False
        if config.ref_enabled():
            ref_path = config.ref.model_path or actor.model_path
            if self.lora and ref_path == actor.model_path:
                self.ref_from_actor = True
            else:
                ref = self._load("ref", load_ref, ref_path)
                self.models["ref"] = self._wrap(
                    ref, config.ref_section(), offload=config.ref.param_offload
                )

    # ---------------------------------------------------------------- building

    def _load(self, role: ModelRole, loader: Any, path: str) -> nn.Module:
        model: nn.Module = loader(path, trust_remote_code=self.config.actor.trust_remote_code)
        if self.packed[role]:
            enable_packing(model)
        return model

    def _compute_dtype(self, section: ActorConfig | CriticConfig) -> torch.dtype | None:
        if section.dtype == "float32" or self.device.type != "cuda":
            return None
        return torch_dtype(section.dtype)

    def _wrap(
        self, model: nn.Module, section: ActorConfig | CriticConfig, *, offload: bool
    ) -> nn.Module:
        if section.gradient_checkpointing and any(p.requires_grad for p in model.parameters()):
            model.gradient_checkpointing_enable(  # type: ignore[operator]
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        if not self.sharded:
            return model.to(self.device)
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        kwargs: dict[str, Any] = {"reshard_after_forward": section.fsdp.reshard_after_forward}
        compute = self._compute_dtype(section)
        if compute is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=compute, reduce_dtype=torch.float32
            )
        if offload and self.device.type == "cuda":
            kwargs["offload_policy"] = CPUOffloadPolicy()
        else:
            kwargs["offload_policy"] = OffloadPolicy()
            model.to(self.device)
        layer_classes = _decoder_layer_classes(model)
        for module in model.modules():
            if type(module) in layer_classes:
                fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)
        return model

    def _add_trained(
        self,
        role: ModelRole,
        section: ActorConfig | CriticConfig,
        model: nn.Module,
        total: int | None,
    ) -> None:
        offload = section.param_offload or section.optimizer_offload
        model = self._wrap(model, section, offload=offload)
        model.train()
        self.trained_params[role] = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            self.trained_params[role],
            lr=section.lr,
            betas=section.betas,
            weight_decay=section.weight_decay,
        )
        self.models[role] = model
        self.optimizers[role] = optimizer
        self.schedulers[role] = build_scheduler(optimizer, section, total)
        self.sections[role] = section

    # ---------------------------------------------------------------- Backend

    def has(self, role: ModelRole) -> bool:
        return role in self.models or (role == "ref" and self.ref_from_actor)

    def data_layout(self) -> list[tuple[int, bool]]:
        return [(r, True) for r in range(self.world_size)]

    def _model(self, role: ModelRole) -> nn.Module:
        if role == "ref" and self.ref_from_actor:
            return self.models["actor"]
        model = self.models.get(role)
        if model is None:
            raise KeyError(f"this trainer has no {role} model (roles: {sorted(self.models)})")
        return model

    def _prepare(self, role: ModelRole, mb: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The model's input (the micro-batch packed, for a packing role) and the
        micro-batch's other tensors, on the device."""
        if not self.packed[role]:
            on_device = batch_to_device(mb, self.device)
            return on_device, on_device
        packed = pack(
            mb["input_ids"], mb["attention_mask"], mb["position_ids"], mb["responses"].shape[1]
        ).to(self.device)
        rest = {k: v for k, v in mb.items() if k not in _SEQUENCE_KEYS}
        return packed, batch_to_device(rest, self.device)

    def _outputs(
        self,
        role: ModelRole,
        model: nn.Module,
        inputs: dict[str, Any] | Packed,
        temp: float,
        ent: bool,
    ) -> Outputs:
        if role == "critic":
            return {"values": forward_values(model, inputs)}
        log_prob, entropy = forward_log_prob(model, inputs, temperature=temp, with_entropy=ent)
        out = {"log_prob": log_prob}
        if entropy is not None:
            out["entropy"] = entropy
        return out

    def forward(
        self,
        role: ModelRole,
        micro_batches: Sequence[dict[str, Any]],
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> list[Outputs]:
        model = self._model(role)
        was_training = model.training
        model.eval()
        results: list[Outputs] = []
        base_only = (
            model.disable_adapter()  # type: ignore[operator]
            if role == "ref" and self.ref_from_actor
            else contextlib.nullcontext()
        )
        try:
            with torch.no_grad(), base_only:
                for mb in micro_batches:
                    inputs, _ = self._prepare(role, mb)
                    results.append(self._outputs(role, model, inputs, temperature, with_entropy))
        finally:
            model.train(was_training)
        if not results or self.device.type == "cpu":
            return results
        # One copy to the host per output at the end, not a sync per micro-batch.
        rows = [len(r[next(iter(r))]) for r in results]
        keys = list(results[0])
        host = {k: torch.cat([r[k] for r in results]).float().cpu().split(rows) for k in keys}
        return [{k: host[k][i] for k in keys} for i in range(len(results))]

    def forward_backward(
        self,
        role: ModelRole,
        micro_batches: Sequence[dict[str, Any]],
        loss_fn: LossFn,
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> list[Metrics]:
        model = self._model(role)
        model.train()
        metrics: list[Metrics] = []
        for mb in micro_batches:
            inputs, mb_dev = self._prepare(role, mb)
            out = self._outputs(role, model, inputs, temperature, with_entropy)
            loss, m = loss_fn(out, mb_dev)
            loss.backward()
            metrics.append(m)
        return metrics

    def optimizer_step(self, role: ModelRole) -> tuple[float, bool]:
        optimizer = self.optimizers[role]
        params = self.trained_params[role]
        norm = torch.nn.utils.clip_grad_norm_(params, self.sections[role].grad_clip)
        full = getattr(norm, "full_tensor", None)
        grad_norm = float(full() if callable(full) else norm)
        stepped = math.isfinite(grad_norm)
        if stepped:
            optimizer.step()
        else:
            logger.warning("%s: grad norm is %s, skipping the optimizer step", role, grad_norm)
        optimizer.zero_grad(set_to_none=True)
        return grad_norm, stepped

    def scheduler_step(self, role: ModelRole) -> None:
        self.schedulers[role].step()

    def lr(self, role: ModelRole) -> float:
        return float(self.optimizers[role].param_groups[0]["lr"])

    def set_lr_scale(self, role: ModelRole, scale: float) -> None:
        set_base_lr(self.optimizers[role], self.schedulers[role], self.sections[role].lr * scale)

    def set_total_steps(self, total: int) -> None:
        for role, scheduler in self.schedulers.items():
            set_schedule_total(self.optimizers[role], scheduler, total)

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        if not self.distributed or self.world_size == 1:
            return value
        out = value.to(self.device).clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out.cpu()

    def iter_full_params(
        self, role: ModelRole = "actor", dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        model = self._model(role)
        if role == "actor" and self.lora:
            yield from iter_merged(model, dtype)
            return
        for name, param in model.named_parameters():
            full = getattr(param, "full_tensor", None)
            t = (full() if callable(full) else param).detach()
            if dtype is not None:
                t = t.to(dtype)
            yield name, t.cpu()

    def iter_adapter_params(
        self, dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        if not self.lora:
            raise ValueError("iter_adapter_params: the actor has no LoRA adapters (lora_rank 0)")
        yield from iter_adapter(self.models["actor"], dtype)

    def _options(self, *, full: bool = True) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=full, cpu_offload=True)

    def state_dict(self, role: ModelRole) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        model = self._model(role)
        state: dict[str, Any] = {"model": get_model_state_dict(model, options=self._options())}
        if role == "actor" and self.lora:  # the adapters; the base is actor.model_path
            state["model"] = {k: v for k, v in state["model"].items() if k in self._adapter_names}
        if role in self.optimizers:
            state["optimizer"] = get_optimizer_state_dict(
                model, self.optimizers[role], options=self._options()
            )
            state["scheduler"] = self.schedulers[role].state_dict()
        return state

    def load_state_dict(self, role: ModelRole, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        model = self._model(role)
        options = StateDictOptions(full_state_dict=True)
        if role == "actor" and self.lora:
            self._check_adapter_state(state["model"])
            set_model_state_dict(
                model, state["model"], options=StateDictOptions(full_state_dict=True, strict=False)
            )
        else:
            set_model_state_dict(model, state["model"], options=options)
        if role in self.optimizers and "optimizer" in state:
            set_optimizer_state_dict(
                model, self.optimizers[role], state["optimizer"], options=options
            )
            self.schedulers[role].load_state_dict(state["scheduler"])

    def _check_adapter_state(self, state: dict[str, Any]) -> None:
        """A LoRA actor loads exactly its adapters (a full-model state, or another
        rank / target_modules, is refused before anything is set)."""
        got = set(state)
        if got != self._adapter_names:
            missing = sorted(self._adapter_names - got)
            unknown = sorted(got - self._adapter_names)
            raise ValueError(
                f"the actor's saved state is not this LoRA actor's adapters: missing "
                f"{missing[:3]} ({len(missing)} in all), unknown {unknown[:3]} "
                f"({len(unknown)} in all); check actor.lora_rank and actor.target_modules"
            )

    def export_hf(self, role: ModelRole, path: str) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        model = self._model(role)
        state = get_model_state_dict(model, options=self._options())
        if role == "actor" and self.lora:
            section = self.config.actor
            tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
            state = dict(merge_state(tensors, tensors, section.lora_alpha / section.lora_rank))
            model = model.get_base_model()  # type: ignore[operator]
        if self.rank == 0:
            model.save_pretrained(path, state_dict=state)  # type: ignore[operator]
