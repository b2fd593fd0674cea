"""Megatron-core backend: ``GPTModel`` built from a Hugging Face Llama / Qwen2 model.

Layout. ``parallel_state`` splits the process group ``tp x pp x cp x dp`` ways
(``actor.megatron``; ``cp`` must be 1 here). Each role (actor, critic, reference) is one
``GPTModel`` on the local spec (``get_gpt_layer_local_spec``: megatron-core's own
modules, no Transformer Engine or apex needed), its weights read straight from the
Hugging Face safetensors and converted by :mod:`rlfleet.trainer.megatron_convert`.
The critic is the same backbone with a replicated ``hidden -> 1`` value head in place
of the vocabulary projection.

Steps. Forward and backward go through megatron's own schedule
(``get_forward_backward_func``: plain micro-batch loop on one stage, 1F1B across
pipeline stages). The logits of the response positions are gathered across TP ranks
before the log-softmax (simple, and the memory is ``(mb, R, vocab)`` rather than the
whole sequence). Megatron's RoPE uses absolute positions ``0..L-1`` while Hugging Face
counts from the first unpadded token; attention scores depend only on the distance
between positions, so the two agree (up to rounding) on left-padded rows.

Training. Parameters stay fp32 (master weights); ``dtype: bfloat16`` runs forward and
backward under ``torch.autocast`` on GPU. Gradients are averaged over the data-parallel
group in one flat all-reduce, tied embeddings are summed across the first and last
pipeline stages, and the global gradient norm counts every parameter once (TP
duplicates and pipeline copies excluded). The optimizer is ``torch.optim.AdamW`` on this
rank's shards. ``gradient_checkpointing`` recomputes each decoder layer in backward;
parameter / optimizer offload is not available on this backend. Attention runs on
``F.scaled_dot_product_attention`` (:class:`SDPAttention`, swapped into the local spec).

States. :meth:`state_dict` gathers parameters and AdamW moments to full tensors in
Hugging Face names (complete on rank 0), so checkpoints load on any layout and on the
FSDP backend's model names alike.

Megatron's forward needs CUDA; on CPU only the construction, loading and gathering run
(tests use that, over gloo).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rlfleet.common.config import ActorConfig, Config, CriticConfig, MegatronConfig
from rlfleet.common.errors import FailedPrecondition
from rlfleet.trainer.backend import LossFn, Metrics, ModelRole, Outputs
from rlfleet.trainer.fsdp import (
    build_scheduler,
    ensure_process_group,
    set_base_lr,
    set_schedule_total,
)
from rlfleet.trainer.megatron_convert import (
    ModelShape,
    ParamSpec,
    fuse,
    iter_stage_specs,
    param_specs,
    read_hf_tensors,
    shard,
    split,
    unshard,
)
from rlfleet.trainer.models import batch_to_device, torch_dtype
from rlfleet.trainer.ppo.core_algos import entropy_from_logits, logprobs_from_logits

__all__ = ["MegatronBackend"]

logger = logging.getLogger(__name__)


class _ValueHead(nn.Module):
    """``hidden -> 1``, replicated on every TP rank, called the way ``GPTModel`` calls
    its output layer."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(
        self, x: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        return self.linear(x), None


class SDPAttention(nn.Module):
    """Megatron's ``core_attention`` on ``F.scaled_dot_product_attention``: fused kernels
    (flash when no token is padded, memory-efficient with a padding mask) where the
    local spec's ``DotProductAttention`` materialises fp32 scores of ``(b, heads, L, L)``.

    Takes megatron's layouts: query ``(sq, b, heads, d)``, key / value ``(sk, b, groups,
    d)``, a boolean mask ``(b, 1, sq, sk)`` (True: masked) or None (causal); returns
    ``(sq, b, heads * d)``."""

    def __init__(self, config: Any, softmax_scale: float | None = None, **_: Any) -> None:
        super().__init__()
        self.config = config
        self.softmax_scale = softmax_scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        heads, groups = query.shape[2], key.shape[2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if heads != groups:
            k = k.repeat_interleave(heads // groups, dim=1)
            v = v.repeat_interleave(heads // groups, dim=1)
        if attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=~attention_mask, scale=self.softmax_scale
            )
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


def _checkpoint_layers(model: nn.Module) -> None:
    """Recompute each decoder layer in backward (``torch.utils.checkpoint``, which keeps
    the autocast state; megatron's own recomputation would replay bf16 layers in fp32)."""
    from torch.utils.checkpoint import checkpoint

    for layer in model.decoder.layers:  # type: ignore[union-attr]
        inner = layer.forward

        def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        layer.forward = forward


def _check_section(role: str, section: ActorConfig | CriticConfig, layout: MegatronConfig) -> None:
    m = section.megatron
    if m.context_parallel_size != 1:
        raise FailedPrecondition(
            "context parallelism is not available on the megatron backend",
            field=f"{role}.megatron.context_parallel_size",
            value=m.context_parallel_size,
        )
    if m.virtual_pipeline_model_parallel_size is not None:
        raise FailedPrecondition(
            "virtual pipeline stages are not available on the megatron backend",
            field=f"{role}.megatron.virtual_pipeline_model_parallel_size",
            value=m.virtual_pipeline_model_parallel_size,
        )
    if m.sequence_parallel:
        raise FailedPrecondition(
            "sequence parallelism is not available on the megatron backend",
            field=f"{role}.megatron.sequence_parallel",
            value=True,
        )
    if section.param_offload or section.optimizer_offload:
        raise FailedPrecondition(
            "parameter / optimizer offload is not available on the megatron backend",
            field=f"{role}.param_offload",
            value=True,
        )
    same = (
        m.tensor_model_parallel_size == layout.tensor_model_parallel_size
        and m.pipeline_model_parallel_size == layout.pipeline_model_parallel_size
    )
    if not same:
        raise FailedPrecondition(
            f"{role}.megatron must use the actor's tp / pp layout (one process group)",
            field=f"{role}.megatron",
            value=m.model_dump(),
        )


class MegatronBackend:
    """Models of one rank on megatron-core (see the module docstring)."""

    name = "megatron"

    def __init__(
        self,
        config: Config,
        *,
        total_training_steps: int | None = None,
        device: torch.device | None = None,
    ) -> None:
        from megatron.core import parallel_state as ps

        self.config = config
        if device is None:
            if config.trainer.device == "cuda":
                device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            else:
                device = torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.device = device
        layout = config.actor.megatron
        _check_section("actor", config.actor, layout)
        if config.critic_enabled():
            if config.critic.backend != "megatron":
                raise FailedPrecondition(
                    "actor and critic must use the same backend",
                    field="critic.backend",
                    value=config.critic.backend,
                )
            _check_section("critic", config.critic, layout)
        ensure_process_group(device)
        self.tp = layout.tensor_model_parallel_size
        self.pp = layout.pipeline_model_parallel_size
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(
                tensor_model_parallel_size=self.tp,
                pipeline_model_parallel_size=self.pp,
                create_gloo_process_groups=False,
            )
        self.ps = ps
        self.rank = dist.get_rank()
        self.global_world_size = dist.get_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        # To the PPO logic the "world" is the data-parallel group: how many ways a
        # mini-batch is split and how gradients are averaged.
        self.world_size = self.dp_size
        self.is_last_stage = self.pp_rank == self.pp - 1
        seed = config.trainer.seed
        torch.manual_seed(seed)
        if device.type == "cuda":
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(seed)

        from transformers import AutoConfig

        total = total_training_steps or config.trainer.total_training_steps
        self.models: dict[ModelRole, nn.Module] = {}
        self.specs: dict[ModelRole, list[ParamSpec]] = {}
        self.shapes: dict[ModelRole, ModelShape] = {}
        self.hf_configs: dict[ModelRole, Any] = {}
        self.optimizers: dict[ModelRole, torch.optim.Optimizer] = {}
        self.schedulers: dict[ModelRole, torch.optim.lr_scheduler.LambdaLR] = {}
        self.sections: dict[ModelRole, ActorConfig | CriticConfig] = {}
        actor = config.actor
        roles: list[tuple[ModelRole, str, ActorConfig | CriticConfig]] = [
            ("actor", actor.model_path, actor)
        ]
        if config.critic_enabled():
            roles.append(("critic", config.critic.model_path or actor.model_path, config.critic))
        if config.ref_enabled():
            roles.append(("ref", config.ref.model_path or actor.model_path, config.ref_section()))
        for role, path, section in roles:
            hf_config = AutoConfig.from_pretrained(
                path, trust_remote_code=actor.trust_remote_code, local_files_only=True
            )
            shape = ModelShape.from_hf(hf_config)
            shape.check_parallel(self.tp, self.pp)
            if shape.sliding_window is not None and self.rank == 0:
                logger.warning(
                    "%s: %s has a sliding window of %d tokens; the megatron backend attends "
                    "to the whole sequence (the same for sequences up to that length)",
                    role,
                    path,
                    shape.sliding_window,
                )
            self.hf_configs[role] = hf_config
            self.shapes[role] = shape
            self.specs[role] = param_specs(shape, self.pp, role=role)
            model = self._build(role, shape, section)
            self._load_from(role, read_hf_tensors(path, self._wanted(role)))
            if role == "ref":
                model.requires_grad_(False)
                model.eval()
                self.sections[role] = section  # its compute dtype (ref.dtype), for autocast
                continue
            model.train()
            optimizer = torch.optim.AdamW(
                [p for p in model.parameters() if p.requires_grad],
                lr=section.lr,
                betas=section.betas,
                weight_decay=section.weight_decay,
            )
            self.optimizers[role] = optimizer
            self.schedulers[role] = build_scheduler(optimizer, section, total)
            self.sections[role] = section
        self._layout = self._gather_layout()

    # ---------------------------------------------------------------- building

    def _transformer_config(self, shape: ModelShape, section: ActorConfig | CriticConfig) -> Any:
        from megatron.core.transformer.transformer_config import TransformerConfig

        return TransformerConfig(
            num_layers=shape.num_layers,
            hidden_size=shape.hidden_size,
            num_attention_heads=shape.num_heads,
            num_query_groups=shape.num_kv_heads,
            kv_channels=shape.head_dim,
            ffn_hidden_size=shape.ffn_hidden_size,
            normalization="RMSNorm",
            layernorm_epsilon=shape.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=shape.qkv_bias,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            params_dtype=torch.float32,
            pipeline_dtype=self._compute_dtype(section) or torch.float32,
            use_cpu_initialization=self.device.type != "cuda",
            perform_initialization=False,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
            # The loss function scales each micro-batch itself (see rlfleet.trainer.worker).
            calculate_per_token_loss=True,
            # Micro-batches differ in shape (the last may be short): stages exchange
            # shapes first. (megatron ties that flag to its MoE dispatcher choice.)
            variable_seq_lengths=self.pp > 1,
            moe_token_dispatcher_type="alltoall",
        )

    def _build(
        self, role: ModelRole, shape: ModelShape, section: ActorConfig | CriticConfig
    ) -> nn.Module:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        critic = role == "critic"
        layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        layer_spec.submodules.self_attention.submodules.core_attention = SDPAttention
        model = GPTModel(
            config=self._transformer_config(shape, section),
            transformer_layer_spec=layer_spec,
            vocab_size=shape.padded_vocab(self.tp),
            max_sequence_length=shape.max_position_embeddings,
            pre_process=self.pp_rank == 0,
            post_process=self.is_last_stage,
            share_embeddings_and_output_weights=shape.tie_word_embeddings and not critic,
            position_embedding_type="rope",
            rotary_base=int(shape.rope_theta),
        )
        if critic and self.is_last_stage:
            model.output_layer = _ValueHead(shape.hidden_size)
        if section.gradient_checkpointing and role != "ref":
            _checkpoint_layers(model)
        model.to(self.device)
        self.models[role] = model
        return model

    def _compute_dtype(self, section: ActorConfig | CriticConfig) -> torch.dtype | None:
        if section.dtype == "float32" or self.device.type != "cuda":
            return None
        return torch_dtype(section.dtype)

    def _autocast(self, role: ModelRole) -> AbstractContextManager[Any]:
        section = self.sections.get(role, self.config.actor)
        dtype = self._compute_dtype(section)
        if dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    # ---------------------------------------------------------------- weights in

    def _my_specs(self, role: ModelRole) -> list[ParamSpec]:
        return list(iter_stage_specs(self.specs[role], self.pp_rank, self.pp))

    def _wanted(self, role: ModelRole) -> set[str]:
        names = {n for spec in self._my_specs(role) for n in spec.hf}
        if self._tied_copy(role):
            names.add("model.embed_tokens.weight")
        return names

    def _tied_copy(self, role: ModelRole) -> bool:
        """Whether this rank holds the last stage's copy of tied embeddings."""
        return (
            role != "critic"
            and self.pp > 1
            and self.is_last_stage
            and self.shapes[role].tie_word_embeddings
        )

    def _params(self, role: ModelRole) -> dict[str, nn.Parameter]:
        return dict(self.models[role].named_parameters())

    def _load_from(self, role: ModelRole, hf: dict[str, torch.Tensor]) -> None:
        """Copy this rank's shards out of full Hugging Face tensors."""
        self._convert_in(role, hf, lambda p: p.data, required=True)

    def _convert_in(
        self,
        role: ModelRole,
        hf: dict[str, torch.Tensor],
        target: Any,
        *,
        required: bool,
    ) -> None:
        shape = self.shapes[role]
        params = self._params(role)
        vocab_rows = shape.padded_vocab(self.tp)
        with torch.no_grad():
            for spec in self._my_specs(role):
                missing = [n for n in spec.hf if n not in hf]
                if missing:
                    if role == "critic" and spec.hf[0].startswith("score."):
                        continue  # a fresh value head: zero-initialised
                    if required:
                        raise FailedPrecondition(
                            f"{role}: checkpoint lacks {missing[0]}",
                            field="model_path",
                            value=missing[0],
                        )
                    continue
                full = fuse(spec, [hf[n] for n in spec.hf], shape)
                local = shard(spec.kind, full, self.tp_rank, self.tp, vocab_rows)
                target(params[spec.mcore]).copy_(local)
            if self._tied_copy(role) and "model.embed_tokens.weight" in hf:
                emb = shard(
                    "vocab", hf["model.embed_tokens.weight"], self.tp_rank, self.tp, vocab_rows
                )
                target(params["output_layer.weight"]).copy_(emb)

    # ---------------------------------------------------------------- weights out

    def _gather_specs(
        self, role: ModelRole, local: Any, dtype: torch.dtype | None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Full Hugging Face tensors, one spec at a time: gathered over the TP group on
        the owning stage, then broadcast over the pipeline group to its first stage.
        ``local(param)`` picks what to gather (the parameter, an optimizer moment)."""
        ps = self.ps
        shape = self.shapes[role]
        params = self._params(role)
        tp_group = ps.get_tensor_model_parallel_group()
        pp_group = ps.get_pipeline_model_parallel_group()
        for spec in self.specs[role]:
            owner = spec.stage if spec.stage >= 0 else self.pp - 1
            parts: list[torch.Tensor] = []
            if owner == self.pp_rank:
                mine = local(params[spec.mcore]).detach()
                if dtype is not None:
                    mine = mine.to(dtype)
                if self.tp > 1 and spec.kind != "rep":
                    pieces = [torch.empty_like(mine) for _ in range(self.tp)]
                    dist.all_gather(pieces, mine.contiguous(), group=tp_group)
                    full = unshard(spec.kind, pieces)
                else:
                    full = mine
                parts = [t.contiguous() for t in split(spec, full, shape)]
            if self.pp > 1:
                parts = self._broadcast_parts(spec, parts, owner, pp_group, dtype)
            for name, t in zip(spec.hf, parts, strict=True):
                # A copy even on CPU: states must not alias parameters trained later.
                yield name, t.to("cpu", copy=True)

    def _broadcast_parts(
        self,
        spec: ParamSpec,
        parts: list[torch.Tensor],
        owner: int,
        group: Any,
        dtype: torch.dtype | None,
    ) -> list[torch.Tensor]:
        src = dist.get_global_rank(group, owner)
        if not parts:
            meta: list[Any] = [None]
        else:
            meta = [[(tuple(t.shape), t.dtype) for t in parts]]
        dist.broadcast_object_list(meta, src=src, group=group)
        out = []
        for i, (shp, dt) in enumerate(meta[0]):
            t = parts[i] if parts else torch.empty(shp, dtype=dt, device=self.device)
            t = t.to(self.device)
            dist.broadcast(t, src=src, group=group)
            out.append(t)
        return out

    def iter_full_params(
        self, role: ModelRole = "actor", dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._gather_specs(role, lambda p: p, dtype)

    def iter_adapter_params(
        self, dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        raise ValueError("LoRA is not available on the megatron backend (actor.lora_rank)")
        yield  # a generator, like iter_full_params

    # ---------------------------------------------------------------- Backend

    def has(self, role: ModelRole) -> bool:
        return role in self.models

    def data_layout(self) -> list[tuple[int, bool]]:
        """For each global rank: its data-parallel rank and whether its outputs count
        (one rank per data-parallel replica: TP rank 0 of the last stage)."""
        return self._layout

    def _gather_layout(self) -> list[tuple[int, bool]]:
        mine = (self.dp_rank, self.tp_rank == 0 and self.is_last_stage)
        everyone: list[Any] = [None] * self.global_world_size
        dist.all_gather_object(everyone, mine)
        return [tuple(x) for x in everyone]

    def _model(self, role: ModelRole) -> nn.Module:
        model = self.models.get(role)
        if model is None:
            raise KeyError(f"this trainer has no {role} model (roles: {sorted(self.models)})")
        return model

    def _inputs(self, mb: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``input_ids``, ``position_ids`` and megatron's boolean attention mask
        ``(bs, 1, L, L)`` (True: masked) for causal attention over unpadded tokens;
        None when nothing is padded."""
        ids = mb["input_ids"]
        valid = mb["attention_mask"].bool()
        pos = mb["position_ids"]
        if bool(valid.all()):
            return ids, pos, None  # plain causal attention: the flash kernel
        length = ids.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=self.device).tril_()
        allowed = causal.unsqueeze(0) & valid.unsqueeze(1)
        # A padded query attends to itself alone: its output is never used, and a row
        # with nothing to attend to would be NaN (which 0-weights cannot stop).
        allowed |= torch.eye(length, dtype=torch.bool, device=self.device)
        return ids, pos, (~allowed).unsqueeze(1)

    def _outputs(
        self,
        role: ModelRole,
        output: torch.Tensor,
        mb: dict[str, Any],
        temperature: float,
        with_entropy: bool,
    ) -> Outputs:
        """Log-probs (and entropy) or values of the response tokens from the last
        stage's output ``(bs, L', vocab / tp)`` (``(bs, L', 1)`` for the critic)."""
        responses = mb["responses"]
        r = responses.shape[1]
        length = mb["input_ids"].shape[1]
        window = output[:, length - r - 1 : length - 1]
        if role == "critic":
            return {"values": window[..., 0].float()}
        if self.tp > 1:
            from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

            window = gather_from_tensor_model_parallel_region(window)
        logits = window[..., : self.shapes[role].vocab_size].float()
        if temperature != 1.0:
            logits = logits / temperature
        out = {"log_prob": logprobs_from_logits(logits, responses)}
        if with_entropy:
            out["entropy"] = entropy_from_logits(logits)
        return out

    def _run_schedule(
        self,
        role: ModelRole,
        micro_batches: Sequence[dict[str, Any]],
        loss_fn: LossFn | None,
        temperature: float,
        with_entropy: bool,
    ) -> list[dict[str, Any]]:
        """One pass of megatron's schedule over ``micro_batches``; returns, on the last
        stage, what each micro-batch's loss function reported."""
        model = self._model(role)
        forward_only = loss_fn is None

        def loss_func(mb: dict[str, Any], output: torch.Tensor) -> tuple[Any, Any, Any]:
            outs = self._outputs(role, output, mb, temperature, with_entropy)
            one = torch.ones((), dtype=torch.int, device=self.device)
            if loss_fn is None:
                cpu = {k: v.detach().float().cpu() for k, v in outs.items()}
                return output.new_zeros(()), one, cpu
            loss, metrics = loss_fn(outs, mb)
            return loss, one, metrics

        def step(data: Iterator[dict[str, Any]], module: nn.Module) -> tuple[Any, Any]:
            mb = batch_to_device(next(data), self.device)
            ids, pos, mask = self._inputs(mb)
            with self._autocast(role):
                output = module(ids, pos, mask)
            return output, partial(loss_func, mb)

        if self.pp == 1:
            # One stage: the plain micro-batch loop (what megatron's no-pipelining
            # schedule does, minus its CUDA-only bookkeeping).
            reported = []
            for mb in micro_batches:
                output, finish = step(iter([mb]), model)
                loss, _, metrics = finish(output)
                if not forward_only:
                    loss.backward()
                reported.append(metrics)
            return reported
        from megatron.core.pipeline_parallel import get_forward_backward_func

        length = max(mb["input_ids"].shape[1] for mb in micro_batches)
        micro = max(mb["input_ids"].shape[0] for mb in micro_batches)
        forward_backward = get_forward_backward_func()
        pipelined: list[dict[str, Any]] = forward_backward(
            forward_step_func=step,
            data_iterator=iter(micro_batches),
            model=[model],
            num_microbatches=len(micro_batches),
            seq_length=length,
            micro_batch_size=micro,
            forward_only=forward_only,
        )
        return pipelined

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
        try:
            with torch.no_grad():
                reported = self._run_schedule(role, micro_batches, None, temperature, with_entropy)
        finally:
            model.train(was_training)
        if self.is_last_stage:
            return reported
        # Earlier stages have no outputs; placeholders of the right shape keep the
        # worker's bookkeeping uniform (only the last stage's rows are kept).
        keys = (
            ["values"] if role == "critic" else ["log_prob", *(["entropy"] if with_entropy else [])]
        )
        return [
            {k: torch.zeros(mb["responses"].shape, dtype=torch.float32) for k in keys}
            for mb in micro_batches
        ]

    def forward_backward(
        self,
        role: ModelRole,
        micro_batches: Sequence[dict[str, Any]],
        loss_fn: LossFn,
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> list[Metrics]:
        self._model(role).train()
        reported = self._run_schedule(role, micro_batches, loss_fn, temperature, with_entropy)
        if self.is_last_stage:
            return reported
        return [{} for _ in micro_batches]

    def _reduce_gradients(self, role: ModelRole) -> list[nn.Parameter]:
        ps = self.ps
        params = [p for p in self._model(role).parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.dp_size > 1:
            from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

            grads = [p.grad for p in params if p.grad is not None]
            flat = _flatten_dense_tensors(grads)
            flat /= self.dp_size
            dist.all_reduce(flat, group=ps.get_data_parallel_group())
            for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
                g.copy_(synced)
        if self._tied_copy(role) or (self.pp > 1 and self.pp_rank == 0 and self._tied(role)):
            shared = self._shared_embedding(role)
            if shared is not None and shared.grad is not None:
                dist.all_reduce(shared.grad, group=ps.get_embedding_group())
        return params

    def _tied(self, role: ModelRole) -> bool:
        return role != "critic" and self.shapes[role].tie_word_embeddings

    def _shared_embedding(self, role: ModelRole) -> nn.Parameter | None:
        params = self._params(role)
        if self.pp_rank == 0:
            return params.get("embedding.word_embeddings.weight")
        return params.get("output_layer.weight")

    def _norm_params(self, role: ModelRole) -> list[nn.Parameter]:
        """The parameters the global gradient norm counts, each once over the model
        parallel group: TP shards on every TP rank, replicated tensors on TP rank 0,
        tied embeddings on the first stage only (the last stage's copy is not a spec)."""
        params = self._params(role)
        return [
            params[spec.mcore]
            for spec in self._my_specs(role)
            if (spec.kind != "rep" or self.tp_rank == 0) and params[spec.mcore].requires_grad
        ]

    def optimizer_step(self, role: ModelRole) -> tuple[float, bool]:
        params = self._reduce_gradients(role)
        counted = [p.grad.detach() for p in self._norm_params(role) if p.grad is not None]
        square = torch.zeros((), dtype=torch.float32, device=self.device)
        if counted:  # one fused kernel per dtype, not one per parameter
            square = torch.stack(torch._foreach_norm(counted)).float().pow(2).sum()
        if self.tp * self.pp > 1:
            dist.all_reduce(square, group=self.ps.get_model_parallel_group())
        grad_norm = float(square.sqrt())
        stepped = math.isfinite(grad_norm)
        if stepped:
            clip = self.sections[role].grad_clip
            if grad_norm > clip:
                coef = clip / (grad_norm + 1e-6)
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(coef)
            self.optimizers[role].step()
        else:
            logger.warning("%s: grad norm is %s, skipping the optimizer step", role, grad_norm)
        self.optimizers[role].zero_grad(set_to_none=True)
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
        if self.dp_size == 1:
            return value
        out = value.to(self.device).clone()
        dist.all_reduce(out, group=self.ps.get_data_parallel_group())
        return out.cpu()

    # ---------------------------------------------------------------- states

    def _moment(self, role: ModelRole, key: str) -> Any:
        state = self.optimizers[role].state

        def pick(p: nn.Parameter) -> torch.Tensor:
            entry = state.get(p)
            return entry[key] if entry and key in entry else torch.zeros_like(p)

        return pick

    def state_dict(self, role: ModelRole) -> dict[str, Any]:
        model = dict(self._gather_specs(role, lambda p: p, None))
        state: dict[str, Any] = {"model": model}
        if role in self.optimizers:
            optimizer = self.optimizers[role]
            steps = [float(s["step"]) for s in optimizer.state.values() if "step" in s]
            moments = {
                key: dict(self._gather_specs(role, self._moment(role, key), None))
                for key in ("exp_avg", "exp_avg_sq")
            }
            state["optimizer"] = {
                "format": "megatron-hf",
                "step": max(steps, default=0.0),
                "moments": moments,
                "param_groups": [
                    {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups
                ],
            }
            state["scheduler"] = self.schedulers[role].state_dict()
        return state

    def load_state_dict(self, role: ModelRole, state: dict[str, Any]) -> None:
        self._convert_in(role, state["model"], lambda p: p.data, required=True)
        opt_state = state.get("optimizer")
        if role not in self.optimizers or opt_state is None:
            return
        if opt_state.get("format") != "megatron-hf":
            raise FailedPrecondition(
                "this optimizer state was not written by the megatron backend",
                field="optimizer.format",
                value=opt_state.get("format"),
            )
        optimizer = self.optimizers[role]
        step = torch.tensor(float(opt_state["step"]))
        moments: dict[str, dict[str, torch.Tensor]] = opt_state["moments"]
        slots: dict[str, dict[nn.Parameter, torch.Tensor]] = {}
        for key in ("exp_avg", "exp_avg_sq"):
            slots[key] = {}
            self._convert_in(
                role,
                moments[key],
                lambda p, key=key: slots[key].setdefault(p, torch.zeros_like(p)),
                required=False,
            )
        for p in (p for group in optimizer.param_groups for p in group["params"]):
            if p in slots["exp_avg"]:
                optimizer.state[p] = {
                    "step": step.clone(),
                    "exp_avg": slots["exp_avg"][p],
                    "exp_avg_sq": slots["exp_avg_sq"][p],
                }
        for group, saved in zip(optimizer.param_groups, opt_state["param_groups"], strict=True):
            group.update(saved)
        self.schedulers[role].load_state_dict(state["scheduler"])

    def export_hf(self, role: ModelRole, path: str) -> None:
        from transformers import AutoModelForCausalLM

        state = dict(self.iter_full_params(role))
        if self.rank != 0:
            return
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.hf_configs[role])
        model.load_state_dict(state, strict=False, assign=True)
        if self.shapes[role].tie_word_embeddings:
            model.tie_weights()
        model.save_pretrained(path)
