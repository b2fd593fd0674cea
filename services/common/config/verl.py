"""verl's config layout, translated in one place into rlfleet's.

A config is *verl-shaped* when it has an ``actor_rollout_ref`` section (in the file or
in the overrides). Such a config, and verl-style overrides on it, are read as verl
reads them: every key starts at verl's default (``ppo_trainer.yaml``), the file and
then the overrides replace values, ``${a.b}`` interpolations are resolved, and each
verl key is then handled by one row of :data:`ROWS`:

* **mapped**: the value lands on an rlfleet key (converted where the names differ);
* **ignored**: the value does not change the result on this deployment (profilers,
  Ray arguments, vLLM memory knobs on the HF engine, ...); a key given in the input
  is listed once at start-up with the reason;
* **refused**: a value that asks for behaviour rlfleet lacks is one
  :class:`~rlfleet.common.config.ConfigIssue` naming the key, the value and what is
  missing. Every row accepts verl's default, so verl's own file loads.

Keys that are not verl's but are rlfleet's (``resource_pools``, ``mapping``,
``trainer.pipeline``, ...) pass through unchanged; a key that is neither is an error.
The table is data, so ``docs/verl.md`` is generated from it (``tools/gen_verl_doc.py``).

Nothing here imports torch.
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from rlfleet.common.config.load import (
    OverrideValueError,
    _check_key,
    parse_override_value,
)
from rlfleet.common.config.schema import ConfigIssue

__all__ = [
    "REPORT_FILE",
    "ROWS",
    "Entry",
    "Row",
    "Rule",
    "Translation",
    "doc_table",
    "is_verl_shaped",
    "load_translation",
    "translate",
    "verl_overrides_on_rlfleet_layout",
]

REPORT_FILE = "verl_translation.yaml"

Verl = Mapping[str, Any]  # the whole verl config: defaults, file, overrides, resolved


class _Skip:
    def __repr__(self) -> str:
        return "<skip>"


#: A converter's answer for "leave the rlfleet key at its default" (verl's ``null``).
SKIP: Any = _Skip()


@dataclass(frozen=True)
class Rule:
    """What one verl key does here.

    ``to`` set: mapped to that rlfleet key (only when ``when`` holds, if given;
    otherwise ignored for ``why``), converted by ``convert`` (the value) or
    ``convert_with`` (the value and the whole verl config); a mapped value also sets
    the rlfleet keys of ``sets`` to their values. ``to`` None: ignored for ``why``. A
    value for which ``accepts`` is false is refused: rlfleet lacks ``missing``.
    """

    to: str | None = None
    why: str = ""
    convert: Callable[[Any], Any] | None = None
    convert_with: Callable[[Any, Verl], Any] | None = None
    sets: Mapping[str, Any] = field(default_factory=dict)
    accepts: Callable[[Any, Verl], bool] | None = None
    accepted: str = ""
    missing: str = ""
    when: Callable[[Verl], bool] | None = None
    when_doc: str = ""


@dataclass(frozen=True)
class Row:
    """One verl key (dotted; ``*`` one segment, ``**`` a whole subtree), its verl
    default (:data:`NO_DEFAULT`: absent unless given), and its rule."""

    key: str
    default: Any
    rule: Rule


class _NoDefault:
    def __repr__(self) -> str:
        return "<absent>"


NO_DEFAULT: Any = _NoDefault()


# --------------------------------------------------------------------------- row helpers


def _values(values: Sequence[Any]) -> Callable[[Any, Verl], bool]:
    return lambda v, _cfg: any((v == x and type(v) is type(x)) or v is x for x in values)


def _fmt(values: Sequence[Any]) -> str:
    return ", ".join(
        "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v) for v in values
    )


def _map(
    key: str,
    default: Any,
    to: str,
    *,
    convert: Callable[[Any], Any] | None = None,
    convert_with: Callable[[Any, Verl], Any] | None = None,
    sets: Mapping[str, Any] | None = None,
    only: Sequence[Any] | None = None,
    accepts: Callable[[Any, Verl], bool] | None = None,
    accepted: str = "",
    missing: str = "",
    when: Callable[[Verl], bool] | None = None,
    when_doc: str = "",
    why: str = "",
    note: str = "",
) -> Row:
    if only is not None:
        accepts, accepted = _values(only), _fmt(only)
    return Row(
        key,
        default,
        Rule(
            to=to,
            why=why or note,
            convert=convert,
            convert_with=convert_with,
            sets=dict(sets or {}),
            accepts=accepts,
            accepted=accepted,
            missing=missing,
            when=when,
            when_doc=when_doc,
        ),
    )


def _ign(
    key: str,
    default: Any,
    why: str,
    *,
    only: Sequence[Any] | None = None,
    accepts: Callable[[Any, Verl], bool] | None = None,
    accepted: str = "",
    missing: str = "",
) -> Row:
    if only is not None:
        accepts, accepted = _values(only), _fmt(only)
    return Row(key, default, Rule(why=why, accepts=accepts, accepted=accepted, missing=missing))


def _empty(value: Any, _cfg: Verl) -> bool:
    return value is None or value == {} or value == [] or value == ""


def _get(cfg: Verl, key: str, default: Any = None) -> Any:
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def _is(key: str, *values: Any) -> Callable[[Verl], bool]:
    return lambda cfg: _get(cfg, key) in values


def _none_skips(value: Any) -> Any:
    return SKIP if value is None else value


_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
_STRATEGIES = {"fsdp": "fsdp", "fsdp2": "fsdp", "megatron": "megatron"}
_LOGGERS = {
    "console": "console",
    "wandb": "wandb",
    "tensorboard": "tensorboard",
    "file": "jsonl",
    "jsonl": "jsonl",  # rlfleet's own name for it, mixed into a verl config
}
_KL = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
_AGG = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
_ADV = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax")


def _dtype(value: Any) -> Any:
    return _DTYPES.get(value, value) if isinstance(value, str) else value


def _param_dtype(value: Any) -> Any:
    """verl's ``fsdp_config.mixed_precision`` -> the compute dtype: its ``param_dtype``,
    bf16 when null or not given (verl's FSDP workers' default)."""
    if isinstance(value, Mapping):
        return _dtype(value.get("param_dtype", "bf16"))
    return "bfloat16"


def _mixed_precision_ok(value: Any, cfg: Verl) -> bool:
    if _empty(value, cfg):
        return True
    if not isinstance(value, Mapping) or set(value) - {
        "param_dtype",
        "reduce_dtype",
        "buffer_dtype",
    }:
        return False
    if value.get("param_dtype", "bf16") not in _DTYPES:
        return False
    return all(_dtype(value.get(k, "fp32")) == "float32" for k in ("reduce_dtype", "buffer_dtype"))


def _strategy(value: Any) -> Any:
    return _STRATEGIES.get(value, value) if isinstance(value, str) else value


def _loggers(value: Any) -> Any:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list):
        return value
    out: list[Any] = []
    for name in names:
        name = _LOGGERS.get(name, name) if isinstance(name, str) else name
        if name not in out:
            out.append(name)
    return out


def _loggers_ok(value: Any, _cfg: Verl) -> bool:
    names = [value] if isinstance(value, str) else value
    return isinstance(names, list) and all(n in _LOGGERS for n in names)


def _freq(value: Any) -> Any:
    """verl saves / validates when ``freq > 0``; rlfleet spells "never" -1."""
    if isinstance(value, int) and not isinstance(value, bool) and value <= 0:
        return -1
    return value


_DTYPE_ONLY = tuple(_DTYPES)
_DTYPE_MISSING = "compute dtypes other than float32, bfloat16 and float16"
_STRATEGY_MISSING = "training strategies other than fsdp, fsdp2 (both run as FSDP2) and megatron"
_NO_GLOBAL_MICRO = (
    "verl's deprecated global micro-batch (divided by the world size): use the "
    "*_per_gpu key, which rlfleet implements"
)
_SPEED = "a kernel / memory choice: the same math, so the same result"
_WRAP = "FSDP wrapping and prefetch: memory and speed only (rlfleet wraps each decoder layer)"
_PROFILE = "profiler settings: no effect on training"
_CKPT = "rlfleet checkpoints always hold model, optimizer and extra (data, RNG) state"
_VLLM_HF = "a vLLM engine knob; the hf engine (rollout.name hf) has no such setting"
_VLLM_ONLY = "a vLLM scheduler / memory knob: speed and memory only"


def _lora_rows(prefix: str, role: str) -> list[Row]:
    """LoRA keys: the actor's map to ``actor.lora_*`` (fsdp backend, hf engine); the
    critic trains in full."""
    exclude = _ign(
        f"{prefix}.model.exclude_modules",
        None,
        "null: no module is excluded from target_modules",
        accepts=_empty,
        accepted="null",
        missing="excluding modules from LoRA (list the wanted ones in target_modules)",
    )
    if role != "actor":
        return [
            _ign(
                f"{prefix}.model.lora_rank",
                0,
                "0: the critic trains in full",
                only=(0,),
                missing="a LoRA critic (lora_rank > 0)",
            ),
            _ign(f"{prefix}.model.lora_alpha", 16, "read only with lora_rank > 0"),
            _ign(f"{prefix}.model.target_modules", "all-linear", "read only with lora_rank > 0"),
            exclude,
        ]
    return [
        _map(f"{prefix}.model.lora_rank", 0, "actor.lora_rank"),
        _map(f"{prefix}.model.lora_alpha", 16, "actor.lora_alpha"),
        _map(
            f"{prefix}.model.target_modules",
            "all-linear",
            "actor.target_modules",
            convert=lambda v: list(v) if isinstance(v, (list, tuple)) else v,
        ),
        exclude,
    ]


def _model_rows(prefix: str, role: str, strategy: str) -> list[Row]:
    """``<prefix>.model.*`` keys shared by actor_rollout_ref and critic (``strategy``:
    the key naming the role's training backend)."""
    return [
        _ign(
            f"{prefix}.model.external_lib",
            None,
            "null: no extra model library is imported",
            accepts=_empty,
            accepted="null",
            missing="importing an extra model library (register it in the model folder "
            "with trust_remote_code instead)",
        ),
        _ign(
            f"{prefix}.model.override_config",
            {},
            "empty: the model's own config.json is used",
            accepts=_empty,
            accepted="{}",
            missing="overriding the model's config.json at load (edit the model folder)",
        ),
        _map(
            f"{prefix}.model.enable_gradient_checkpointing", True, f"{role}.gradient_checkpointing"
        ),
        _ign(f"{prefix}.model.enable_activation_offload", False, _SPEED),
        _map(
            f"{prefix}.model.use_remove_padding",
            False,
            f"{role}.use_remove_padding",
            when=lambda cfg: _get(cfg, strategy) != "megatron",
            when_doc=f"{strategy} fsdp or fsdp2",
            why="rlfleet's megatron backend runs padded batches, with the same result",
        ),
        _ign(f"{prefix}.model.use_shm", False, "copying the model to shared memory: speed only"),
        *_lora_rows(prefix, role),
        _ign(f"{prefix}.model.use_liger", False, _SPEED),
        _ign(f"{prefix}.model.use_fused_kernels", False, _SPEED),
        _ign(f"{prefix}.model.fused_kernel_options.**", NO_DEFAULT, _SPEED),
    ]


def _fsdp_rows(prefix: str, role: str, *, optimizer: bool = True) -> list[Row]:
    """``<prefix>.fsdp_config.*``."""
    rows = [
        _map(f"{prefix}.fsdp_config.param_offload", False, f"{role}.param_offload"),
        _ign(f"{prefix}.fsdp_config.wrap_policy.**", NO_DEFAULT, _WRAP),
        _ign(f"{prefix}.fsdp_config.forward_prefetch", False, _WRAP),
        _ign(
            f"{prefix}.fsdp_config.offload_policy", False, "FSDP2 CPU offload policy: memory only"
        ),
    ]
    if optimizer:
        rows.append(
            _map(f"{prefix}.fsdp_config.optimizer_offload", False, f"{role}.optimizer_offload")
        )
    if role in ("actor", "critic"):
        rows += [
            _map(f"{prefix}.fsdp_config.fsdp_size", -1, f"{role}.fsdp.fsdp_size"),
            _map(
                f"{prefix}.fsdp_config.reshard_after_forward",
                True,
                f"{role}.fsdp.reshard_after_forward",
            ),
            _ign(
                f"{prefix}.fsdp_config.model_dtype",
                "fp32",
                "rlfleet keeps the trained weights and the optimizer state in float32 and "
                "computes in fsdp_config.mixed_precision's param_dtype (bf16 when null, as "
                "verl); with a bf16 model_dtype verl keeps them in bf16",
                only=_DTYPE_ONLY,
                missing="model dtypes other than float32, bfloat16 and float16",
            ),
        ]
    else:
        rows.append(_ign(f"{prefix}.fsdp_config.reshard_after_forward", True, _WRAP))
    rows.append(
        _map(
            f"{prefix}.fsdp_config.mixed_precision",
            None,
            f"{role}.dtype",
            convert=_param_dtype,
            accepts=_mixed_precision_ok,
            accepted="null (bf16 compute, fp32 reduction), or {param_dtype, reduce_dtype: "
            "fp32, buffer_dtype: fp32}",
            missing="FSDP mixed precision with reductions or buffers in a dtype other than fp32",
            note="the compute dtype on cuda, param_dtype (verl's default bf16); on cpu the "
            "trainer computes in float32 whatever it says",
        )
    )
    return rows


def _optim_rows(
    prefix: str, role: str, *, min_lr_ratio: Any, warmup_steps: bool = True
) -> list[Row]:
    """``<prefix>.optim.*`` (AdamW with an optional warm-up and cosine decay)."""
    sched_missing = "learning-rate schedules other than constant and cosine"
    rows = [
        _map(f"{prefix}.optim.lr", 1e-6 if role == "actor" else 1e-5, f"{role}.lr"),
        _map(f"{prefix}.optim.lr_warmup_steps_ratio", 0.0, f"{role}.lr_warmup_steps_ratio"),
        _map(
            f"{prefix}.optim.min_lr_ratio",
            min_lr_ratio,
            f"{role}.min_lr_ratio",
            convert=_none_skips,
            note="null: rlfleet's 0.0",
        ),
        _map(
            f"{prefix}.optim.warmup_style",
            "constant",
            f"{role}.lr_scheduler",
            only=("constant", "cosine"),
            missing=sched_missing,
        ),
        _map(
            f"{prefix}.optim.lr_scheduler_type",
            NO_DEFAULT,
            f"{role}.lr_scheduler",
            only=("constant", "cosine"),
            missing=sched_missing,
        ),
        _ign(
            f"{prefix}.optim.num_cycles",
            0.5,
            "0.5: rlfleet's cosine is the half cycle from lr down to min_lr_ratio",
            only=(0.5,),
            missing="cosine schedules other than one half cycle (num_cycles 0.5)",
        ),
        _ign(
            f"{prefix}.optim.total_training_steps",
            -1,
            "verl fills it in at run time from the run's total steps; so does rlfleet (the driver "
            "sends it to the trainer with every step)",
        ),
        _map(f"{prefix}.optim.weight_decay", 0.01, f"{role}.weight_decay"),
        _map(f"{prefix}.optim.betas", NO_DEFAULT, f"{role}.betas", convert=_tuple),
        _map(f"{prefix}.optim.clip_grad", NO_DEFAULT, f"{role}.grad_clip"),
        _ign(
            f"{prefix}.optim.optimizer",
            NO_DEFAULT,
            "AdamW: rlfleet's optimizer",
            only=("AdamW",),
            missing="optimizers other than AdamW",
        ),
        _ign(f"{prefix}.optim.optimizer_impl", NO_DEFAULT, "where AdamW comes from: the same math"),
        _ign(
            f"{prefix}.optim.override_optimizer_config",
            NO_DEFAULT,
            "null: AdamW's defaults",
            accepts=_empty,
            accepted="null",
            missing="extra optimizer arguments",
        ),
    ]
    if warmup_steps:
        rows.insert(1, _map(f"{prefix}.optim.lr_warmup_steps", -1, f"{role}.lr_warmup_steps"))
    return rows


def _tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _ulysses(key: str, default: Any, to: str | None) -> Row:
    missing = "Ulysses sequence parallelism (ulysses_sequence_parallel_size > 1)"
    if to is None:
        return _ign(key, default, "1: no sequence parallelism", only=(1,), missing=missing)
    return _map(key, default, to, only=(1,), missing=missing)


def _global_micro(key: str) -> Row:
    return _ign(
        key, None, "null: the *_per_gpu key is used", only=(None,), missing=_NO_GLOBAL_MICRO
    )


_AR = "actor_rollout_ref"
_A = f"{_AR}.actor"
_R = f"{_AR}.rollout"
_REF = f"{_AR}.ref"
_VLLM = _is(f"{_R}.name", "vllm")
_RM_ON = _is("reward_model.enable", True)
_RM_DYN = _is("reward_model.use_dynamic_bsz", True)

_LOSS_MODES = ("vanilla", "gspo", "cispo")
_RC = "algorithm.rollout_correction"
_FG = "algorithm.filter_groups"
_OB = "reward.overlong_buffer"


def _number(value: Any) -> float | None:
    """A float from a number or a float-like string (verl reads both); None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _positive(value: Any, _cfg: Verl) -> bool:
    number = _number(value)
    return number is not None and number > 0


def _positive_int(value: Any, _cfg: Verl) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _threshold(value: Any) -> Any:
    number = _number(value)
    return value if number is None else number


def _tis_cap(value: Any) -> Any:
    """verl 0.5's ``tis_imp_ratio_cap``: <= 0 (its default -1) is off."""
    number = _number(value)
    return number if number is not None and number > 0 else SKIP


def _tis_cap_ok(value: Any, _cfg: Verl) -> bool:
    return _number(value) is not None


def _legacy_is_on(cfg: Verl) -> bool:
    """verl 0.6's flat keys apply weights when ``rollout_is`` and a threshold are set."""
    return (
        _get(cfg, "algorithm.rollout_is") is True
        and _get(cfg, "algorithm.rollout_is_threshold") is not None
    )


def _legacy_level(value: Any, cfg: Verl) -> Any:
    level = _get(cfg, "algorithm.rollout_is_level", "token")
    # geometric is refused by the rollout_is_level row, once.
    return level if _legacy_is_on(cfg) and level in ("token", "sequence") else SKIP


def _legacy_only(*values: Any) -> Callable[[Any, Verl], bool]:
    """Accept anything while verl 0.6's weights are off, else only ``values``."""
    allowed = _values(values)
    return lambda v, cfg: not _legacy_is_on(cfg) or allowed(v, cfg)


def _dapo_manager(value: Any) -> Any:
    return "naive" if value == "dapo" else value


_CRITIC_TRC = "critic.model.trust_remote_code"


def _same_trust(value: Any, cfg: Verl) -> bool:
    return value == _get(cfg, f"{_AR}.model.trust_remote_code", False)


ROWS: tuple[Row, ...] = (
    # ------------------------------------------------------------------ data
    _map(
        "data.tokenizer",
        None,
        "actor.tokenizer_path",
        convert=_none_skips,
        note="null: the model's tokenizer",
    ),
    _ign("data.use_shm", False, "copying the data to shared memory: speed only"),
    _map("data.train_files", "~/data/rlhf/gsm8k/train.parquet", "data.train_files"),
    _map("data.val_files", "~/data/rlhf/gsm8k/test.parquet", "data.val_files"),
    _map("data.prompt_key", "prompt", "data.prompt_key"),
    _map("data.reward_fn_key", "data_source", "data.reward_fn_key"),
    _map("data.max_prompt_length", 512, "data.max_prompt_length"),
    _map("data.max_response_length", 512, "data.max_response_length"),
    _map("data.train_batch_size", 1024, "data.train_batch_size"),
    _map(
        "data.gen_batch_size",
        NO_DEFAULT,
        "data.gen_batch_size",
        note="verl's DAPO recipe: prompts per generation round of dynamic sampling",
        when=lambda cfg: (
            _get(cfg, f"{_FG}.enable") is True
            or _get(cfg, "data.gen_batch_size") != _get(cfg, "data.train_batch_size")
        ),
        when_doc="algorithm.filter_groups.enable, or a value other than "
        "data.train_batch_size (the DAPO recipe's default, which then does nothing)",
    ),
    _map("data.val_batch_size", None, "data.val_batch_size"),
    _ign("data.return_raw_input_ids", False, "what verl's dataset returns; no effect on training"),
    _ign("data.return_raw_chat", False, "what verl's dataset returns; no effect on training"),
    _ign("data.return_full_prompt", False, "what verl's dataset returns; no effect on training"),
    _map("data.shuffle", True, "data.shuffle"),
    _map("data.seed", 1, "data.seed"),
    _ign(
        "data.dataloader_num_workers",
        8,
        "prompts are tokenized once, in memory, when the dataset loads: no loader workers",
    ),
    _ign("data.validation_shuffle", False, "the order of validation prompts: same scores"),
    _map("data.filter_overlong_prompts", False, "data.filter_overlong_prompts"),
    _ign("data.filter_overlong_prompts_workers", 1, "parallelism of the filter: speed only"),
    _map(
        "data.truncation",
        "error",
        "data.truncation",
        only=("error", "left", "right"),
        missing="truncation modes other than error, left and right",
    ),
    _ign("data.image_key", "images", "column of images; rlfleet's datasets are text-only"),
    _ign("data.video_key", "videos", "column of videos; rlfleet's datasets are text-only"),
    _ign("data.return_multi_modal_inputs", True, "rlfleet's datasets are text-only"),
    _ign("data.trust_remote_code", False, "the data tokenizer is the actor's"),
    _ign(
        "data.custom_cls.path",
        None,
        "null: verl's parquet dataset",
        accepts=_empty,
        accepted="null",
        missing="custom dataset classes",
    ),
    _ign("data.custom_cls.name", None, "read only with data.custom_cls.path"),
    _ign(
        "data.sampler.class_path",
        None,
        "null: the seeded shuffle (data.shuffle, data.seed)",
        accepts=_empty,
        accepted="null",
        missing="custom (curriculum) samplers",
    ),
    _ign("data.sampler.class_name", None, "read only with data.sampler.class_path"),
    _ign(
        "data.datagen.path",
        None,
        "null: no generated data",
        accepts=_empty,
        accepted="null",
        missing="dynamic data generation",
    ),
    _ign("data.datagen.name", None, "read only with data.datagen.path"),
    _ign(
        "data.apply_chat_template_kwargs.**",
        NO_DEFAULT,
        "chat-template arguments",
        accepts=_empty,
        accepted="{}",
        missing="extra chat-template arguments",
    ),
    # ------------------------------------------------------------------ actor_rollout_ref
    _ign(
        f"{_AR}.nccl_timeout",
        600,
        "the time-out of verl's NCCL collectives; rlfleet's ranks use torch's default",
    ),
    _ign(
        f"{_AR}.hybrid_engine",
        True,
        "placement comes from trainer.nnodes x n_gpus_per_node (one colocated pool, as "
        "verl's hybrid engine) or from resource_pools and mapping",
    ),
    _map(f"{_AR}.model.path", "~/models/deepseek-llm-7b-chat", "actor.model_path"),
    _ign(
        f"{_AR}.model.custom_chat_template",
        None,
        "null: the tokenizer's chat template",
        accepts=_empty,
        accepted="null",
        missing="a chat template other than the tokenizer's (put it in tokenizer_config.json)",
    ),
    _map(f"{_AR}.model.trust_remote_code", False, "actor.trust_remote_code"),
    *_model_rows(f"{_AR}", "actor", f"{_A}.strategy"),
    # Keys of older verl releases (about v0.3).
    _ign(
        f"{_AR}.model.return_last_hidden_state",
        False,
        "false: no hidden states are returned",
        only=(False,),
        missing="returning the last layer's hidden states with the log-probs",
    ),
    _ign(f"{_AR}.model.use_fused_loss", False, _SPEED),
    # actor
    _map(
        f"{_A}.strategy",
        "fsdp",
        "actor.backend",
        convert=_strategy,
        only=tuple(_STRATEGIES),
        missing=_STRATEGY_MISSING,
    ),
    _map(f"{_A}.ppo_mini_batch_size", 256, "actor.ppo_mini_batch_size"),
    _global_micro(f"{_A}.ppo_micro_batch_size"),
    _map(f"{_A}.ppo_micro_batch_size_per_gpu", None, "actor.ppo_micro_batch_size"),
    _map(f"{_A}.use_dynamic_bsz", False, "actor.use_dynamic_bsz"),
    _map(f"{_A}.ppo_max_token_len_per_gpu", 16384, "actor.ppo_max_token_len_per_gpu"),
    _map(f"{_A}.grad_clip", 1.0, "actor.grad_clip"),
    _map(f"{_A}.clip_ratio", 0.2, "actor.clip_ratio"),
    _map(f"{_A}.clip_ratio_low", 0.2, "actor.clip_ratio_low"),
    _map(f"{_A}.clip_ratio_high", 0.2, "actor.clip_ratio_high"),
    _map(f"{_A}.clip_ratio_c", 3.0, "actor.clip_ratio_c"),
    _map(
        f"{_A}.loss_agg_mode",
        "token-mean",
        "actor.loss_agg_mode",
        only=_AGG,
        missing="loss aggregations other than " + ", ".join(_AGG),
    ),
    _map(
        f"{_A}.policy_loss.loss_mode",
        "vanilla",
        "actor.policy_loss.loss_mode",
        only=_LOSS_MODES,
        missing="policy losses other than " + ", ".join(_LOSS_MODES) + " (clip_cov, kl_cov, "
        "gpg, geo_mean, sapo, ...)",
    ),
    _ign(f"{_A}.policy_loss.**", NO_DEFAULT, "read only by clip_cov / kl_cov (refused)"),
    _map(
        f"{_A}.tis_imp_ratio_cap",
        NO_DEFAULT,
        f"{_RC}.rollout_is_threshold",
        convert=_tis_cap,
        sets={f"{_RC}.rollout_is": "token"},
        accepts=_tis_cap_ok,
        accepted="a number",
        missing="a non-numeric importance-ratio cap",
        note="verl 0.5's truncated importance sampling: > 0 turns token-level weights on, "
        "capped there; <= 0 (its -1) is off",
    ),
    _ign(
        f"{_A}.loss_scale_factor",
        None,
        "null: the loss is not rescaled",
        only=(None,),
        missing="a constant loss scale factor",
    ),
    _map(f"{_A}.entropy_coeff", 0, "actor.entropy_coeff"),
    _map(f"{_A}.use_kl_loss", False, "actor.use_kl_loss"),
    _ign(f"{_A}.use_torch_compile", True, _SPEED),
    _map(f"{_A}.kl_loss_coef", 0.001, "actor.kl_loss_coef"),
    _map(
        f"{_A}.kl_loss_type",
        "low_var_kl",
        "actor.kl_loss_type",
        only=_KL,
        missing="KL estimators other than " + ", ".join(_KL) + " (only the sampled "
        "tokens' log-probs travel between services)",
    ),
    _map(f"{_A}.ppo_epochs", 1, "actor.ppo_epochs"),
    _map(f"{_A}.shuffle", False, "actor.shuffle"),
    _ulysses(f"{_A}.ulysses_sequence_parallel_size", 1, "actor.fsdp.sequence_parallel_size"),
    _ign(f"{_A}.entropy_from_logits_with_chunking", False, _SPEED),
    _ign(f"{_A}.entropy_checkpointing", False, _SPEED),
    _ign(f"{_A}.use_fused_kernels", "${" + _AR + ".model.use_fused_kernels}", _SPEED),
    _ign(
        f"{_A}.use_remove_padding",
        "${" + _AR + ".model.use_remove_padding}",
        f"verl copies {_AR}.model.use_remove_padding here; that key sets it",
        accepts=lambda v, cfg: v == _get(cfg, f"{_AR}.model.use_remove_padding", False),
        accepted=f"the value of {_AR}.model.use_remove_padding",
        missing=f"an actor padding setting other than {_AR}.model.use_remove_padding",
    ),
    _ign(f"{_A}.checkpoint.**", NO_DEFAULT, _CKPT),
    *_optim_rows(_A, "actor", min_lr_ratio=0.0),
    *_fsdp_rows(_A, "actor"),
    _ign(f"{_A}.profiler.**", NO_DEFAULT, _PROFILE),
    # ref
    _ign(f"{_REF}.strategy", "${" + _A + ".strategy}", "the reference runs on the actor's backend"),
    *_fsdp_rows(_REF, "ref", optimizer=False),
    _ign(f"{_REF}.use_torch_compile", "${" + _A + ".use_torch_compile}", _SPEED),
    _ign(
        f"{_REF}.model",
        None,
        "null: the reference is the actor's initial model",
        only=(None,),
        missing="a reference model section of its own (rlfleet's ref.model_path names "
        "another model)",
    ),
    _global_micro(f"{_REF}.log_prob_micro_batch_size"),
    _map(f"{_REF}.log_prob_micro_batch_size_per_gpu", None, "ref.log_prob_micro_batch_size"),
    _map(
        f"{_REF}.log_prob_use_dynamic_bsz",
        "${" + _A + ".use_dynamic_bsz}",
        "ref.log_prob_use_dynamic_bsz",
    ),
    _map(
        f"{_REF}.log_prob_max_token_len_per_gpu",
        "${" + _A + ".ppo_max_token_len_per_gpu}",
        "ref.log_prob_max_token_len_per_gpu",
    ),
    _ulysses(
        f"{_REF}.ulysses_sequence_parallel_size",
        "${" + _A + ".ulysses_sequence_parallel_size}",
        None,
    ),
    _ign(f"{_REF}.entropy_from_logits_with_chunking", False, _SPEED),
    _ign(f"{_REF}.entropy_checkpointing", False, _SPEED),
    _ign(f"{_REF}.profiler.**", NO_DEFAULT, _PROFILE),
    # rollout
    _map(
        f"{_R}.name",
        "vllm",
        "rollout.engine",
        only=("hf", "vllm"),
        missing="rollout engines other than hf and vllm",
    ),
    _ign(
        f"{_R}.mode",
        "sync",
        "how verl's driver calls its engine; rlfleet's rollout service generates each "
        "batch the same way in both",
        only=("sync", "async"),
        missing="rollout modes other than sync and async",
    ),
    _ign(
        f"{_R}.chat_scheduler",
        None,
        "an older verl's chat scheduler class for rollout.mode async; rlfleet's rollout "
        "service schedules the requests of every conversation itself",
    ),
    _ign(
        f"{_R}.use_fire_sampling",
        False,
        "false: every token sampled at rollout.temperature",
        only=(False,),
        missing="FIRE sampling (a higher temperature for the first token)",
    ),
    _map(f"{_R}.temperature", 1.0, "rollout.temperature"),
    _map(f"{_R}.top_k", -1, "rollout.top_k"),
    _map(f"{_R}.top_p", 1, "rollout.top_p"),
    _map(f"{_R}.do_sample", True, "rollout.do_sample"),
    _map(f"{_R}.n", 1, "rollout.n"),
    _map(f"{_R}.prompt_length", "${data.max_prompt_length}", "rollout.prompt_length"),
    _map(f"{_R}.response_length", "${data.max_response_length}", "rollout.response_length"),
    _map(
        f"{_R}.dtype",
        "bfloat16",
        "rollout.dtype",
        convert=_dtype,
        only=_DTYPE_ONLY,
        missing=_DTYPE_MISSING,
    ),
    _map(
        f"{_R}.gpu_memory_utilization",
        0.5,
        "rollout.gpu_memory_utilization",
        when=_VLLM,
        when_doc="rollout.name vllm",
        why=_VLLM_HF,
    ),
    _ign(
        f"{_R}.ignore_eos",
        False,
        "false: generation stops at the end token",
        only=(False,),
        missing="generating past the end token (ignore_eos)",
    ),
    _ign(f"{_R}.enforce_eager", True, "CUDA graphs in vLLM: speed only"),
    _map(f"{_R}.free_cache_engine", True, "rollout.free_cache_engine"),
    _ign(
        f"{_R}.load_format",
        "dummy_dtensor",
        "how verl's vLLM gets its first weights; rlfleet's engine loads the model path "
        "and then receives the actor's weights",
    ),
    _ign(f"{_R}.layered_summon", False, "memory of verl's weight gathering: no effect here"),
    _map(f"{_R}.tensor_model_parallel_size", 2, "rollout.tensor_parallel_size"),
    _map(
        f"{_R}.max_num_batched_tokens",
        8192,
        "rollout.max_num_batched_tokens",
        when=_VLLM,
        when_doc="rollout.name vllm",
        why="verl's value is a vLLM scheduler knob (verl's hf rollout has none); rlfleet's "
        "hf engine reads rollout.max_num_batched_tokens as its generation batch budget, "
        "set in rlfleet's config",
    ),
    _ign(f"{_R}.max_model_len", None, "rlfleet sizes vLLM's context to prompt + response length"),
    _ign(f"{_R}.max_num_seqs", 1024, _VLLM_ONLY),
    _ign(f"{_R}.cudagraph_capture_sizes", None, _VLLM_ONLY),
    _ign(
        f"{_R}.over_sample_rate",
        0,
        "0: every prompt's generation is awaited",
        only=(0, 0.0),
        missing="over-sampling prompts and aborting the slowest generations",
    ),
    _ign(
        f"{_R}.skip_rollout",
        False,
        "false: every step generates",
        only=(False,),
        missing="replaying dumped rollouts instead of generating",
    ),
    _ign(f"{_R}.skip_dump_dir", NO_DEFAULT, "read only with skip_rollout"),
    _global_micro(f"{_R}.log_prob_micro_batch_size"),
    _map(f"{_R}.log_prob_micro_batch_size_per_gpu", None, "rollout.log_prob_micro_batch_size"),
    _map(
        f"{_R}.log_prob_use_dynamic_bsz",
        "${" + _A + ".use_dynamic_bsz}",
        "rollout.log_prob_use_dynamic_bsz",
    ),
    _map(
        f"{_R}.log_prob_max_token_len_per_gpu",
        "${" + _A + ".ppo_max_token_len_per_gpu}",
        "rollout.log_prob_max_token_len_per_gpu",
    ),
    _ign(f"{_R}.disable_log_stats", True, "vLLM's own logging"),
    _ign(f"{_R}.enable_chunked_prefill", True, _VLLM_ONLY),
    _ign(
        f"{_R}.engine_kwargs.**",
        NO_DEFAULT,
        "extra vLLM / SGLang engine arguments (memory, caching, kernels)",
    ),
    _map(f"{_R}.val_kwargs.top_k", -1, "rollout.val_kwargs.top_k"),
    _map(f"{_R}.val_kwargs.top_p", 1.0, "rollout.val_kwargs.top_p"),
    _map(f"{_R}.val_kwargs.temperature", 0, "rollout.val_kwargs.temperature"),
    _map(f"{_R}.val_kwargs.n", 1, "rollout.val_kwargs.n"),
    _map(f"{_R}.val_kwargs.do_sample", False, "rollout.val_kwargs.do_sample"),
    _map(f"{_R}.multi_turn.enable", False, "rollout.multi_turn.enable"),
    _map(
        f"{_R}.multi_turn.max_assistant_turns",
        None,
        "rollout.multi_turn.max_turns",
        convert=_none_skips,
        note="null: rlfleet's default (4)",
    ),
    _map(
        f"{_R}.multi_turn.max_turns",
        None,
        "rollout.multi_turn.max_turns",
        convert=_none_skips,
        note="an older verl's name for max_assistant_turns; null: rlfleet's default (4)",
    ),
    _ign(
        f"{_R}.multi_turn.max_user_turns",
        None,
        "null: tool turns bounded by max_assistant_turns (one follows each model turn but "
        "the last)",
        only=(None,),
        missing="a tool-turn limit of its own; set max_assistant_turns to max_user_turns + 1",
    ),
    _map(f"{_R}.multi_turn.max_parallel_calls", 1, "rollout.multi_turn.max_parallel_calls"),
    _map(
        f"{_R}.multi_turn.max_tool_response_length",
        256,
        "rollout.multi_turn.max_tool_response_length",
    ),
    _map(
        f"{_R}.multi_turn.tool_response_truncate_side",
        "middle",
        "rollout.multi_turn.tool_response_truncate_side",
    ),
    _map(
        f"{_R}.multi_turn.format",
        "hermes",
        "rollout.multi_turn.format",
        convert=lambda v: "hermes",
        only=("hermes", "chatml"),
        missing="tool-call formats other than hermes",
        note="chatml (an older verl's default) is the same <tool_call> JSON in ChatML "
        "turns: read as hermes",
    ),
    _ign(
        f"{_R}.multi_turn.tool_config_path",
        None,
        "null: the tools are rlfleet's tool sources (rollout.multi_turn.tools)",
        only=(None,),
        missing="verl's tool classes; give the tools as rollout.multi_turn.tools (built-in, a "
        "ToolService or an HTTP endpoint, docs/tools.md)",
    ),
    _ign(
        f"{_R}.multi_turn.interaction_config_path",
        None,
        "null: no simulated user turns",
        only=(None,),
        missing="verl's interactions (simulated user turns)",
    ),
    _ign(
        f"{_R}.multi_turn.completion_callback",
        None,
        "null: no completion callback",
        only=(None,),
        missing="verl's completion callbacks",
    ),
    _ign(
        f"{_R}.multi_turn.use_inference_chat_template",
        False,
        "false: the turns are the token ids the model generated (rlfleet always trains on those)",
        only=(False,),
        missing="re-rendering past turns with the chat template",
    ),
    _ign(
        f"{_R}.multi_turn.tokenization_sanity_check_mode",
        "strict",
        "rlfleet never re-tokenizes a conversation: there is nothing to check",
    ),
    _ign(f"{_R}.multi_turn.**", NO_DEFAULT, "not used by rlfleet's multi-turn rollouts"),
    _ign(
        f"{_R}.calculate_log_probs",
        False,
        "rlfleet's rollout always returns the sampled tokens' log-probs (the batch carries "
        "them as rollout_log_probs for algorithm.rollout_correction)",
    ),
    _ign(
        f"{_R}.agent.**",
        NO_DEFAULT,
        "verl's agent loop (async, multi-turn): not used for single-turn",
    ),
    _ign(
        f"{_R}.update_weights_bucket_megabytes",
        512,
        "bucket size of verl's weight sync: speed only",
    ),
    _ign(f"{_R}.trace.**", NO_DEFAULT, "rollout tracing: no effect on training"),
    _ign(f"{_R}.multi_stage_wake_up", False, "memory of waking verl's engine: no effect here"),
    _ign(f"{_R}.profiler.**", NO_DEFAULT, _PROFILE),
    # ------------------------------------------------------------------ critic
    _map("critic.enable", None, "critic.enable", note="null: on exactly for adv_estimator gae"),
    _ign("critic.rollout_n", "${" + _R + ".n}", "verl's copy of actor_rollout_ref.rollout.n"),
    _map(
        "critic.strategy",
        "${" + _A + ".strategy}",
        "critic.backend",
        convert=_strategy,
        only=tuple(_STRATEGIES),
        missing=_STRATEGY_MISSING,
    ),
    *_optim_rows("critic", "critic", min_lr_ratio=None),
    _map("critic.model.path", "~/models/deepseek-llm-7b-chat", "critic.model_path"),
    _map(
        "critic.model.tokenizer_path",
        "${" + _AR + ".model.path}",
        "critic.tokenizer_path",
        # verl's default follows the actor's model path, not data.tokenizer: at that
        # value it says nothing the actor's tokenizer does not
        convert_with=lambda v, cfg: SKIP if v == _get(cfg, f"{_AR}.model.path") else v,
        note="the critic scores the actor's token ids: only the actor's tokenizer is accepted",
    ),
    *[
        r
        for r in _model_rows("critic", "critic", "critic.strategy")
        if not r.key.endswith(("model.external_lib",))
    ],
    _ign(
        "critic.model.external_lib",
        "${" + _AR + ".model.external_lib}",
        "null: no extra model library is imported",
        accepts=_empty,
        accepted="null",
        missing="importing an extra model library",
    ),
    _ign(
        _CRITIC_TRC,
        "${" + _AR + ".model.trust_remote_code}",
        "rlfleet loads every model with actor_rollout_ref.model.trust_remote_code",
        accepts=_same_trust,
        accepted="actor_rollout_ref.model.trust_remote_code's value",
        missing="a trust_remote_code for the critic different from the actor's",
    ),
    *_fsdp_rows("critic.model", "critic"),
    _map(
        "critic.ppo_mini_batch_size",
        "${" + _A + ".ppo_mini_batch_size}",
        "critic.ppo_mini_batch_size",
    ),
    _global_micro("critic.ppo_micro_batch_size"),
    _map("critic.ppo_micro_batch_size_per_gpu", None, "critic.ppo_micro_batch_size"),
    _global_micro("critic.forward_micro_batch_size"),
    _ign(
        "critic.forward_micro_batch_size_per_gpu",
        "${critic.ppo_micro_batch_size_per_gpu}",
        "micro-batch of the value forward pass: memory only",
    ),
    _map("critic.use_dynamic_bsz", "${" + _A + ".use_dynamic_bsz}", "critic.use_dynamic_bsz"),
    _map("critic.ppo_max_token_len_per_gpu", 32768, "critic.ppo_max_token_len_per_gpu"),
    _map(
        "critic.forward_max_token_len_per_gpu",
        "${critic.ppo_max_token_len_per_gpu}",
        "critic.forward_max_token_len_per_gpu",
    ),
    _ulysses("critic.ulysses_sequence_parallel_size", 1, "critic.fsdp.sequence_parallel_size"),
    _map("critic.ppo_epochs", "${" + _A + ".ppo_epochs}", "critic.ppo_epochs"),
    _map("critic.shuffle", "${" + _A + ".shuffle}", "critic.shuffle"),
    _map("critic.grad_clip", 1.0, "critic.grad_clip"),
    _map("critic.cliprange_value", 0.5, "critic.cliprange_value"),
    _map(
        "critic.loss_agg_mode",
        "${" + _A + ".loss_agg_mode}",
        "critic.loss_agg_mode",
        only=_AGG,
        missing="loss aggregations other than " + ", ".join(_AGG),
    ),
    _ign("critic.checkpoint.**", NO_DEFAULT, _CKPT),
    _ign("critic.profiler.**", NO_DEFAULT, _PROFILE),
    # ------------------------------------------------------------------ reward_model
    _map("reward_model.enable", False, "reward.reward_model.enable"),
    _ign(
        "reward_model.strategy",
        "fsdp",
        "the reward service runs the model on one device per process",
    ),
    _ign(
        "reward_model.model.input_tokenizer",
        "${" + _AR + ".model.path}",
        "the reward service re-tokenizes the decoded text with the reward model's own "
        "tokenizer (what verl does when the tokenizers differ)",
    ),
    _map(
        "reward_model.model.path",
        "~/models/FsfairX-LLaMA3-RM-v0.1",
        "reward.reward_model.path",
        when=_RM_ON,
        when_doc="reward_model.enable",
        why="read only with reward_model.enable",
    ),
    _ign("reward_model.model.use_shm", False, "copying the model to shared memory: speed only"),
    _ign(
        "reward_model.model.external_lib",
        "${" + _AR + ".model.external_lib}",
        "null: no extra model library is imported",
        accepts=_empty,
        accepted="null",
        missing="importing an extra model library",
    ),
    _ign("reward_model.model.use_remove_padding", False, _SPEED),
    _ign("reward_model.model.use_fused_kernels", "${" + _AR + ".model.use_fused_kernels}", _SPEED),
    _ign(
        "reward_model.model.trust_remote_code",
        False,
        "false: the reward model's own code is not run",
        only=(False,),
        missing="trust_remote_code for the reward model",
    ),
    _ign(
        "reward_model.model.fsdp_config.**",
        NO_DEFAULT,
        "the reward model is not sharded: memory only",
    ),
    _global_micro("reward_model.micro_batch_size"),
    _map("reward_model.micro_batch_size_per_gpu", None, "reward.reward_model.micro_batch_size"),
    _ign(
        "reward_model.max_length",
        None,
        "null: inputs are not cut to a fixed length",
        only=(None,),
        missing="cutting reward-model inputs to a fixed length",
    ),
    _ulysses("reward_model.ulysses_sequence_parallel_size", 1, None),
    _ign(
        "reward_model.use_dynamic_bsz",
        "${critic.use_dynamic_bsz}",
        "batching of reward-model forwards: with true, forward_max_token_len_per_gpu is "
        "the token budget",
    ),
    _map(
        "reward_model.forward_max_token_len_per_gpu",
        "${critic.forward_max_token_len_per_gpu}",
        "reward.reward_model.max_tokens_per_batch",
        when=_RM_DYN,
        when_doc="reward_model.use_dynamic_bsz",
        why="read only with reward_model.use_dynamic_bsz",
    ),
    _map(
        "reward_model.reward_manager",
        "naive",
        "reward.reward_manager",
        convert=_dapo_manager,
        only=("naive", "dapo"),
        missing="reward managers other than naive and dapo (batch, prime)",
        note="dapo scores each sample as naive does; its overlong buffer is "
        "reward.overlong_buffer, applied by the driver",
    ),
    _map("reward_model.overlong_buffer.enable", NO_DEFAULT, f"{_OB}.enable"),
    _map("reward_model.overlong_buffer.len", NO_DEFAULT, f"{_OB}.len"),
    _map("reward_model.overlong_buffer.penalty_factor", NO_DEFAULT, f"{_OB}.penalty_factor"),
    _ign(
        "reward_model.overlong_buffer.log",
        NO_DEFAULT,
        "rlfleet always reports reward/overlong_reward/mean and reward/overlong/mean",
    ),
    _map("reward_model.reward_kwargs.overlong_buffer_cfg.enable", NO_DEFAULT, f"{_OB}.enable"),
    _map("reward_model.reward_kwargs.overlong_buffer_cfg.len", NO_DEFAULT, f"{_OB}.len"),
    _map(
        "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor",
        NO_DEFAULT,
        f"{_OB}.penalty_factor",
    ),
    _ign(
        "reward_model.reward_kwargs.overlong_buffer_cfg.log",
        NO_DEFAULT,
        "rlfleet always reports reward/overlong_reward/mean and reward/overlong/mean",
    ),
    _map("reward_model.reward_kwargs.max_resp_len", NO_DEFAULT, f"{_OB}.max_resp_len"),
    _ign(
        "reward_model.launch_reward_fn_async",
        False,
        "rlfleet's reward service always scores apart from the driver",
    ),
    _ign(
        "reward_model.sandbox_fusion.url",
        None,
        "null: code data sources run in rlfleet's own sandbox (reward.sandbox.*), as "
        "verl's prime_code does without a url",
        only=(None,),
        missing="the Sandbox Fusion code-execution scorer",
    ),
    _ign("reward_model.sandbox_fusion.**", NO_DEFAULT, "read only with sandbox_fusion.url"),
    _ign("reward_model.profiler.**", NO_DEFAULT, _PROFILE),
    # ------------------------------------------------------------------ custom_reward_function
    _map("custom_reward_function.path", None, "reward.custom_function.path"),
    _map("custom_reward_function.name", "compute_score", "reward.custom_function.name"),
    _map(
        "custom_reward_function.reward_kwargs",
        {},
        "reward.custom_function.reward_kwargs",
        convert=_none_skips,
        note="keyword arguments added to every compute_score call",
    ),
    # ------------------------------------------------------------------ algorithm
    _map("algorithm.gamma", 1.0, "algorithm.gamma"),
    _map("algorithm.lam", 1.0, "algorithm.lam"),
    _map(
        "algorithm.adv_estimator",
        "gae",
        "algorithm.adv_estimator",
        only=_ADV,
        missing="advantage estimators other than " + ", ".join(_ADV),
    ),
    _map("algorithm.norm_adv_by_std_in_grpo", True, "algorithm.norm_adv_by_std_in_grpo"),
    _map("algorithm.use_kl_in_reward", False, "algorithm.use_kl_in_reward"),
    _map(
        "algorithm.kl_penalty",
        "kl",
        "algorithm.kl_penalty",
        only=_KL,
        missing="KL estimators other than " + ", ".join(_KL),
    ),
    _map(
        "algorithm.kl_ctrl.type",
        "fixed",
        "algorithm.kl_ctrl.type",
        only=("fixed", "adaptive"),
        missing="KL controllers other than fixed and adaptive",
    ),
    _map("algorithm.kl_ctrl.kl_coef", 0.001, "algorithm.kl_ctrl.kl_coef"),
    _map("algorithm.kl_ctrl.horizon", 10000, "algorithm.kl_ctrl.horizon"),
    _map("algorithm.kl_ctrl.target_kl", 0.1, "algorithm.kl_ctrl.target_kl"),
    _ign(
        "algorithm.use_pf_ppo",
        False,
        "false: no preference-feedback reweighting",
        only=(False,),
        missing="PF-PPO sample reweighting",
    ),
    _ign("algorithm.pf_ppo.**", NO_DEFAULT, "read only with algorithm.use_pf_ppo"),
    _map(f"{_FG}.enable", NO_DEFAULT, f"{_FG}.enable"),
    _map(
        f"{_FG}.metric",
        NO_DEFAULT,
        f"{_FG}.metric",
        only=("seq_reward", "seq_final_reward", "score", "acc"),
        missing="filter metrics other than seq_reward, seq_final_reward, score and acc",
        when=_is(f"{_FG}.enable", True),
        when_doc="algorithm.filter_groups.enable (the DAPO recipe's null then does nothing)",
    ),
    _map(
        f"{_FG}.max_num_gen_batches",
        NO_DEFAULT,
        f"{_FG}.max_num_gen_batches",
        accepts=_positive_int,
        accepted="a positive number",
        missing="unbounded generation rounds (max_num_gen_batches <= 0): every loop is bounded",
        when=_is(f"{_FG}.enable", True),
        when_doc="algorithm.filter_groups.enable (the DAPO recipe's 0 then does nothing)",
    ),
    _ign(
        f"{_FG}.filter_type",
        NO_DEFAULT,
        "same_value: DAPO's filter (drop groups whose samples all score the same)",
        only=("same_value",),
        missing="filter types other than same_value (band_pass)",
    ),
    _ign(
        f"{_FG}.lower_bound",
        NO_DEFAULT,
        "read only by band_pass",
        only=(None,),
        missing="band_pass bounds",
    ),
    _ign(
        f"{_FG}.upper_bound",
        NO_DEFAULT,
        "read only by band_pass",
        only=(None,),
        missing="band_pass bounds",
    ),
    _map(
        f"{_RC}.rollout_is",
        None,
        f"{_RC}.rollout_is",
        convert=_none_skips,
        only=(None, "token", "sequence"),
        missing="rollout importance-sampling levels other than token and sequence",
        note="null: off",
    ),
    _map(
        f"{_RC}.rollout_is_threshold",
        2.0,
        f"{_RC}.rollout_is_threshold",
        convert=_threshold,
        accepts=_positive,
        accepted="a positive number",
        missing="two-sided (IcePop, 'lower_upper') importance-weight bounds",
    ),
    _ign(
        f"{_RC}.rollout_rs",
        None,
        "null: no rejection sampling",
        only=(None,),
        missing="rejection sampling of mismatched tokens or sequences (rollout_rs)",
    ),
    _ign(f"{_RC}.rollout_rs_threshold", None, "read only with rollout_rs"),
    _ign(
        f"{_RC}.bypass_mode",
        False,
        "false: the decoupled mode (rollout, old and current policies)",
        only=(False,),
        missing="bypass mode (the rollout's log-probs as the old policy)",
    ),
    _ign(f"{_RC}.loss_type", "ppo_clip", "read only with bypass_mode"),
    _ign(
        f"{_RC}.rollout_is_batch_normalize",
        False,
        "false: raw truncated weights",
        only=(False,),
        missing="normalising the importance weights to mean 1",
    ),
    _ign(f"{_RC}.debug_rollout_actor_probs", False, "a diagnostic of bypass mode"),
    _map(
        "algorithm.rollout_is",
        NO_DEFAULT,
        f"{_RC}.rollout_is",
        convert_with=_legacy_level,
        only=(True, False),
        missing="a non-boolean rollout_is",
        note="verl 0.6: true with rollout_is_threshold set applies weights at "
        "rollout_is_level (default token); false: verl computes metrics only",
    ),
    _map(
        "algorithm.rollout_is_threshold",
        NO_DEFAULT,
        f"{_RC}.rollout_is_threshold",
        convert=_threshold,
        when=_legacy_is_on,
        when_doc="algorithm.rollout_is true",
        why="verl 0.6: null is off",
        accepts=lambda v, cfg: v is None or _positive(v, cfg),
        accepted="null or a positive number",
        missing="a non-numeric importance-weight threshold",
    ),
    _ign(
        "algorithm.rollout_is_level",
        NO_DEFAULT,
        "verl 0.6: read with algorithm.rollout_is",
        accepts=_legacy_only("token", "sequence"),
        accepted="token, sequence",
        missing="geometric-mean importance weights",
    ),
    _ign(
        "algorithm.rollout_is_mode",
        NO_DEFAULT,
        "verl 0.6: truncate caps the weights from above",
        accepts=_legacy_only("truncate"),
        accepted="truncate",
        missing="masking tokens outside the bounds (mask mode)",
    ),
    _ign(
        "algorithm.rollout_is_threshold_lower",
        NO_DEFAULT,
        "verl 0.6: read only in mask mode",
    ),
    _ign(
        "algorithm.rollout_is_veto_threshold",
        NO_DEFAULT,
        "verl 0.6: null is no veto",
        accepts=_legacy_only(None),
        accepted="null",
        missing="vetoing sequences with a catastrophic token ratio",
    ),
    # ------------------------------------------------------------------ trainer
    _ign(
        "trainer.balance_batch",
        True,
        "reorders samples across data-parallel ranks to balance tokens: speed only",
    ),
    _map("trainer.total_epochs", 30, "trainer.total_epochs"),
    _map("trainer.total_training_steps", None, "trainer.total_training_steps"),
    _ign("trainer.profile_steps", None, _PROFILE),
    _ign("trainer.controller_nsight_options.**", NO_DEFAULT, _PROFILE),
    _ign("trainer.worker_nsight_options.**", NO_DEFAULT, _PROFILE),
    _ign("trainer.npu_profile.**", NO_DEFAULT, _PROFILE),
    _map("trainer.project_name", "verl_examples", "trainer.project_name"),
    _map("trainer.experiment_name", "gsm8k", "trainer.experiment_name"),
    Row(
        "trainer.logger",
        ["console", "wandb"],
        Rule(
            to="trainer.logger",
            why="a string or a list; verl's file logger is rlfleet's jsonl (metrics.jsonl "
            "in the run dir)",
            convert=_loggers,
            accepts=_loggers_ok,
            accepted=", ".join(_LOGGERS),
            missing="loggers other than " + ", ".join(_LOGGERS),
        ),
    ),
    _map("trainer.log_val_generations", 0, "trainer.log_val_generations"),
    _ign(
        "trainer.rollout_data_dir",
        None,
        "null: generations are not dumped",
        only=(None,),
        missing="dumping training generations to a folder",
    ),
    _ign(
        "trainer.validation_data_dir",
        None,
        "null: validation generations are not dumped",
        only=(None,),
        missing="dumping validation generations to a folder",
    ),
    _map("trainer.nnodes", 1, "trainer.nnodes"),
    _map("trainer.n_gpus_per_node", 8, "trainer.n_gpus_per_node"),
    _map("trainer.save_freq", -1, "trainer.save_freq", convert=_freq, note="<= 0: never (-1)"),
    _ign(
        "trainer.esi_redundant_time",
        0,
        "checkpointing before a cloud instance expires: not relevant here",
    ),
    _map(
        "trainer.resume_mode",
        "auto",
        "trainer.resume_mode",
        only=("auto", "disable", "resume_path"),
        missing="resume modes other than auto, disable and resume_path",
    ),
    _map("trainer.resume_from_path", None, "trainer.resume_from_path"),
    _map("trainer.val_before_train", True, "trainer.val_before_train"),
    _ign(
        "trainer.val_only",
        False,
        "false: training runs",
        only=(False,),
        missing="validation-only runs",
    ),
    _map("trainer.test_freq", -1, "trainer.test_freq", convert=_freq, note="<= 0: never (-1)"),
    _map("trainer.critic_warmup", 0, "trainer.critic_warmup"),
    _ign(
        "trainer.default_hdfs_dir",
        None,
        "null: checkpoints stay in the run dir",
        only=(None,),
        missing="copying checkpoints to HDFS",
    ),
    _ign(
        "trainer.del_local_ckpt_after_load", False, "disk housekeeping after a resume: same result"
    ),
    _map(
        "trainer.default_local_dir",
        "checkpoints/${trainer.project_name}/${trainer.experiment_name}",
        "trainer.default_local_dir",
        note="the run dir: config.yaml, metrics, and checkpoints in its checkpoints/ "
        "(global_step_N/ with actor and critic .safetensors + .json, huggingface/ and "
        "trainer_state.json; verl writes global_step_N/actor/... straight into this "
        "folder, so verl's tools read rlfleet's checkpoints through huggingface/)",
    ),
    _map("trainer.max_actor_ckpt_to_keep", None, "trainer.max_actor_ckpt_to_keep"),
    _map("trainer.max_critic_ckpt_to_keep", None, "trainer.max_critic_ckpt_to_keep"),
    _ign("trainer.ray_wait_register_center_timeout", 300, "verl's Ray start-up time-out"),
    _map(
        "trainer.device",
        "cuda",
        "trainer.device",
        only=("cuda", "cpu"),
        missing="devices other than cuda and cpu",
    ),
    _ign("trainer.use_legacy_worker_impl", NO_DEFAULT, "which of verl's worker classes runs"),
    # ------------------------------------------------------------------ the rest
    _map(
        "async_training.partial_rollout",
        NO_DEFAULT,
        "trainer.pipeline.partial_rollout",
        note="verl's fully_async recipe resumes a generation interrupted by a weight sync; "
        "here a push lands between two decode steps of rlfleet's pipelined mode "
        "(trainer.pipeline.enable; hf or vllm engine)",
    ),
    _ign(
        "ray_init.**",
        NO_DEFAULT,
        "Ray's start-up arguments; rlfleet's launcher has its own ray section",
    ),
    _ign(
        "ray_kwargs.**",
        NO_DEFAULT,
        "Ray's start-up arguments and timeline dump; rlfleet's launcher has its own ray "
        "section (ray.address, ray.namespace)",
    ),
    _ign("global_profiler.**", NO_DEFAULT, _PROFILE),
    _ign(
        "defaults", NO_DEFAULT, "Hydra's composition list: missing keys take verl's defaults here"
    ),
    _ign("hydra.**", NO_DEFAULT, "Hydra's own settings"),
    _ign("**._target_", NO_DEFAULT, "the class Hydra would build; rlfleet's sections are its own"),
)


# --------------------------------------------------------------------------- matching

_EXACT: dict[str, Row] = {r.key: r for r in ROWS if "*" not in r.key}
_PATTERNS: tuple[Row, ...] = tuple(r for r in ROWS if "*" in r.key)


def _match_parts(pattern: Sequence[str], path: Sequence[str]) -> bool:
    """``*`` matches one segment, ``**`` any number (zero included)."""
    if not pattern:
        return not path
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_match_parts(rest, path[i:]) for i in range(len(path) + 1))
    return bool(path) and head in ("*", path[0]) and _match_parts(rest, path[1:])


def _row_for(path: str) -> Row | None:
    row = _EXACT.get(path)
    if row is not None:
        return row
    parts = path.split(".")
    for candidate in _PATTERNS:
        if _match_parts(candidate.key.split("."), parts):
            return candidate
    return None


def _is_unit(path: str) -> bool:
    """A mapping at ``path`` is handled whole: a row names it, or ``path.**`` does and
    no row names a key inside it."""
    if path in _EXACT:
        return True
    if f"{path}.**" not in {r.key for r in _PATTERNS}:
        return False
    return not any(k.startswith(path + ".") for k in _EXACT)


def _known_prefix(path: str) -> bool:
    """``path`` is a verl key, a section holding verl keys, or a key inside a mapping a
    row takes whole (``custom_reward_function.reward_kwargs.bonus``, as Hydra's
    ``+custom_reward_function.reward_kwargs.bonus=0.5`` adds one)."""
    if _row_for(path) is not None or any(r.key.startswith(path + ".") for r in ROWS):
        return True
    parts = path.split(".")
    return any(
        isinstance(getattr(_EXACT.get(".".join(parts[:i])), "default", None), Mapping)
        for i in range(1, len(parts))
    )


# --------------------------------------------------------------------------- translating


@dataclass(frozen=True)
class Entry:
    """What happened to one verl key: ``mapped`` (to ``to``), ``ignored`` (``reason``)
    or ``rlfleet`` (not verl's, passed through as rlfleet's own key); ``given`` is
    false for a verl default the input did not set."""

    key: str
    value: Any
    kind: Literal["mapped", "ignored", "rlfleet"]
    to: str | None = None
    reason: str = ""
    given: bool = True


@dataclass
class Translation:
    """The rlfleet config a verl-shaped one means, with every key's fate."""

    raw: dict[str, Any]
    overrides: list[str]
    entries: list[Entry] = field(default_factory=list)
    issues: list[ConfigIssue] = field(default_factory=list)

    @functools.cached_property
    def source_keys(self) -> dict[str, str]:
        """rlfleet key -> the verl key that set it (one the input gave wins over a verl
        default mapped to the same place): how errors about it name it."""
        keys: dict[str, str] = {}
        for e in sorted(self.entries, key=lambda e: e.given):
            if e.kind == "mapped" and e.to and e.to != e.key:
                keys[e.to] = e.key
        return keys

    def named_as_given(self, issue: ConfigIssue) -> ConfigIssue:
        """``issue`` about an rlfleet key, named by the verl key that set it."""
        verl_key = self.source_keys.get(issue.path)
        if verl_key is None:
            return issue
        return ConfigIssue(verl_key, f"{issue.message} (as rlfleet's {issue.path})", issue.value)

    def ignored(self) -> list[Entry]:
        """The ignored keys the input gave (verl defaults that change nothing are not listed)."""
        return [e for e in self.entries if e.kind == "ignored" and e.given]

    def startup_lines(self) -> list[str]:
        mapped = sum(1 for e in self.entries if e.kind == "mapped" and e.given)
        ignored = self.ignored()
        lines = [
            f"verl config: {mapped} keys mapped, {len(ignored)} ignored (no effect on this "
            f"deployment), the rest at verl's defaults; see {REPORT_FILE} in the run dir"
        ]
        lines += [f"  ignored {e.key}={_show(e.value)}: {e.reason}" for e in ignored]
        return lines

    def report(self) -> dict[str, Any]:
        """The translation as plain data (what :meth:`write` saves)."""

        def item(e: Entry) -> dict[str, Any]:
            out: dict[str, Any] = {"verl": e.key, "value": _plain(e.value)}
            if e.to is not None:
                out["rlfleet"] = e.to
            if e.reason:
                out["reason"] = e.reason
            return out

        return {
            "mapped": [item(e) for e in self.entries if e.kind == "mapped" and e.given],
            "mapped_from_verl_defaults": [
                item(e) for e in self.entries if e.kind == "mapped" and not e.given
            ],
            "ignored": [item(e) for e in self.ignored()],
            "rlfleet_keys": [item(e) for e in self.entries if e.kind == "rlfleet"],
            "rlfleet_overrides": list(self.overrides),
        }

    def write(self, run_dir: str | Path) -> Path:
        """Save :meth:`report` as ``run_dir/verl_translation.yaml`` (next to config.yaml)."""
        out = Path(run_dir)
        out.mkdir(parents=True, exist_ok=True)
        target = out / REPORT_FILE
        body = yaml.safe_dump(self.report(), sort_keys=False, allow_unicode=True)
        tmp = target.with_suffix(".yaml.tmp")
        tmp.write_text(
            "# how rlfleet read this run's verl-shaped config\n" + body, encoding="utf-8"
        )
        tmp.replace(target)
        return target


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def is_verl_shaped(raw: Mapping[str, Any] | None, overrides: Sequence[str] = ()) -> bool:
    """Whether the config (file or overrides) has verl's ``actor_rollout_ref``."""
    if isinstance(raw, Mapping) and "actor_rollout_ref" in raw:
        return True
    return any(_override_key(o).split(".")[0] == "actor_rollout_ref" for o in overrides)


#: Sections only rlfleet's layout has: a file with one of them and no
#: ``actor_rollout_ref`` is an rlfleet config, whatever its overrides.
_RLFLEET_MODEL_SECTIONS = ("actor", "ref", "rollout", "reward")


def verl_overrides_on_rlfleet_layout(
    raw: Mapping[str, Any] | None, overrides: Sequence[str]
) -> list[ConfigIssue]:
    """One issue per ``actor_rollout_ref.*`` override given to a file in rlfleet's
    layout (which the override would otherwise turn, whole, into a verl config),
    naming rlfleet's key for it where there is one."""
    if not isinstance(raw, Mapping) or "actor_rollout_ref" in raw:
        return []
    if not any(k in raw for k in _RLFLEET_MODEL_SECTIONS):
        return []
    issues = []
    for text in overrides:
        key = _override_key(text)
        if key.split(".")[0] != "actor_rollout_ref":
            continue
        target = next(
            (r.rule.to for r in ROWS if r.key == key and r.rule.to and r.rule.when is None),
            None,
        )
        hint = f"; use {target}" if target else ""
        issues.append(ConfigIssue(key, f"a verl key, on a config in rlfleet's layout{hint}", text))
    return issues


def _override_key(text: str) -> str:
    return text.partition("=")[0].strip().lstrip("+~")


def _defaults() -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for row in ROWS:
        if row.default is not NO_DEFAULT and "*" not in row.key:
            _set(tree, row.key.split("."), _deep(row.default))
    return tree


def _deep(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _deep(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep(v) for v in value]
    return value


def _set(tree: dict[str, Any], parts: Sequence[str], value: Any) -> str | None:
    """Set ``parts`` in ``tree``; returns the path of a non-mapping in the way, if any."""
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            return ".".join(parts[: i + 1])
        node = child
    node[parts[-1]] = value
    return None


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> None:
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = _deep(v)


def _leaves(tree: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """Dotted paths of the values to translate: leaves, and mappings a row takes whole
    (an empty mapping that no row names holds nothing)."""
    for k, v in tree.items():
        path = f"{prefix}{k}"
        if isinstance(v, Mapping) and not _is_unit(path):
            yield from _leaves(v, path + ".")
        else:
            yield path


_INTERP = re.compile(r"\$\{([^${}]+)\}")


def _resolve(tree: dict[str, Any], issues: list[ConfigIssue]) -> None:
    """Replace ``${a.b}`` and ``${oc.select:a.b,default}`` in string values."""

    def value_of(expr: str, where: str, depth: int) -> Any:
        expr = expr.strip()
        default: Any = None
        has_default = False
        if expr.startswith("oc.select:"):
            expr, _, rest = expr.removeprefix("oc.select:").partition(",")
            default, has_default = (parse_override_value(rest) if rest else None), True
        elif ":" in expr:
            raise _InterpError(f"interpolation resolver {expr.split(':')[0]!r} is not supported")
        key = _absolute(expr, where)
        missing = object()
        found = _get(tree, key, missing) if key else missing
        if found is missing:
            if has_default:
                return default
            raise _InterpError(f"interpolation ${{{expr}}} names no key")
        return resolve(found, key, depth + 1)  # its own interpolations are relative to it

    def resolve(value: Any, where: str, depth: int) -> Any:
        if not isinstance(value, str) or "${" not in value:
            return value
        if depth > 32:
            raise _InterpError("interpolations nest too deep (a cycle?)")
        whole = _INTERP.fullmatch(value)
        if whole:
            return value_of(whole.group(1), where, depth)
        return _INTERP.sub(lambda m: str(value_of(m.group(1), where, depth)), value)

    def walk(node: dict[str, Any], prefix: str) -> None:
        for k, v in node.items():
            path = f"{prefix}{k}"
            if isinstance(v, dict):
                walk(v, path + ".")
            elif isinstance(v, str) and "${" in v:
                try:
                    node[k] = resolve(v, path, 0)
                except _InterpError as e:
                    issues.append(ConfigIssue(path, str(e), v))

    walk(tree, "")


class _InterpError(ValueError):
    pass


def _absolute(expr: str, where: str) -> str:
    """The dotted key ``expr`` names from the key ``where`` (OmegaConf's relative
    form: ``.x`` is a sibling of ``where``, ``..x`` a sibling of its parent); "" when
    it climbs above the root."""
    dots = len(expr) - len(expr.lstrip("."))
    if not dots:
        return expr
    parents = where.split(".")[:-1]
    if dots - 1 > len(parents):
        return ""
    base = parents[: len(parents) - (dots - 1)]
    return ".".join([*base, expr[dots:]])


def _unknown(path: str, value: Any) -> ConfigIssue:
    close = difflib.get_close_matches(path, list(_EXACT), n=3, cutoff=0.75)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return ConfigIssue(
        path, f"unknown key: neither verl's (see docs/verl.md) nor rlfleet's{hint}", value
    )


def _refusal(row: Row, path: str, value: Any) -> ConfigIssue:
    accepted = f" (accepted: {row.rule.accepted})" if row.rule.accepted else ""
    return ConfigIssue(path, f"rlfleet does not implement {row.rule.missing}{accepted}", value)


def translate(raw: Mapping[str, Any] | None, overrides: Sequence[str] = ()) -> Translation:
    """Translate a verl-shaped config plus verl-style overrides into rlfleet's raw config.

    Overrides on verl's keys (``a.b=v``, Hydra's ``+a.b=v`` and ``~a.b`` too) apply to
    the verl config; overrides on keys only rlfleet has are returned in
    :attr:`Translation.overrides` for rlfleet's own override rules. Problems are
    returned in :attr:`Translation.issues`, not raised.
    """
    issues: list[ConfigIssue] = []
    given: dict[str, Any] = _deep(raw) if isinstance(raw, Mapping) else {}
    rlfleet_overrides: list[str] = []
    for text in overrides:
        key, sep, value_text = text.partition("=")
        key = key.strip()
        delete = key.startswith("~")
        key = key.lstrip("+~")
        parts = key.split(".")
        if (not sep and not delete) or not all(parts):
            issues.append(ConfigIssue("overrides", "expected key.path=value", text))
            continue
        if not _known_prefix(key):
            if _check_key(parts) is None:
                rlfleet_overrides.append(f"{key}={value_text}")
            else:
                issues.append(_unknown(key, value_text if sep else text))
            continue
        if delete:
            parent = _get(given, ".".join(parts[:-1])) if len(parts) > 1 else given
            if isinstance(parent, dict):
                parent.pop(parts[-1], None)
            continue
        try:
            value = parse_override_value(value_text)
        except OverrideValueError as exc:
            issues.append(ConfigIssue(key, f"override value is {exc}", value_text))
            continue
        blocked = _set(given, parts, value)
        if blocked is not None:
            issues.append(ConfigIssue(blocked, f"is not a mapping, cannot set {key}", text))

    explicit = set(_leaves(given))
    merged = _defaults()
    _merge(merged, given)
    _resolve(merged, issues)

    entries: list[Entry] = []
    assigned: dict[str, tuple[Any, str, bool]] = {}
    out: dict[str, Any] = {}

    def assign(target: str, value: Any, source: str, is_given: bool) -> None:
        previous = assigned.get(target)
        if previous is not None:
            old, old_source, old_given = previous
            if old_given and is_given and old != value:
                issues.append(
                    ConfigIssue(
                        source,
                        f"sets {target}, which {old_source} already set to {old!r}",
                        value,
                    )
                )
                return
            if old_given and not is_given:
                return
        assigned[target] = (value, source, is_given)
        blocked = _set(out, target.split("."), value)
        if blocked is not None:
            issues.append(ConfigIssue(source, f"{blocked} is not a mapping", value))

    # Defaults first, so that a given key always wins over a verl default.
    paths = sorted(_leaves(merged), key=lambda p: p in explicit)
    for path in paths:
        value = _get(merged, path)
        is_given = path in explicit
        row = _row_for(path)
        if row is None:
            if _check_key(path.split(".")) is None:
                assign(path, value, path, True)
                entries.append(Entry(path, value, "rlfleet", to=path))
            else:
                issues.append(_unknown(path, value))
            continue
        rule = row.rule
        if value == "???":  # OmegaConf's mandatory-value marker, left unset
            issues.append(
                ConfigIssue(path, "is required and not set (??? in the config): give it", value)
            )
            continue
        if rule.to is not None and rule.when is not None and not rule.when(merged):
            # Ignored, as the docs say, whatever its value: it does nothing here.
            reason = rule.why or f"read only with {rule.when_doc}"
            entries.append(Entry(path, value, "ignored", reason=reason, given=is_given))
            continue
        if rule.accepts is not None and not rule.accepts(value, merged):
            # A default that follows a refused key (``${...}``) is not refused again.
            if is_given:
                issues.append(_refusal(row, path, value))
            continue
        if rule.to is None:
            entries.append(Entry(path, value, "ignored", reason=rule.why, given=is_given))
            continue
        if rule.convert_with is not None:
            converted = rule.convert_with(value, merged)
        else:
            converted = rule.convert(value) if rule.convert is not None else value
        if converted is SKIP:
            entries.append(
                Entry(path, value, "mapped", to=rule.to, reason=rule.why, given=is_given)
            )
            continue
        assign(rule.to, converted, path, is_given)
        for target, also in rule.sets.items():
            assign(target, also, path, is_given)
        entries.append(Entry(path, converted, "mapped", to=rule.to, given=is_given))
    entries.sort(key=lambda e: e.key)
    return Translation(out, rlfleet_overrides, entries, issues)


def load_translation(path: str | Path | None, overrides: Sequence[str] = ()) -> Translation | None:
    """The translation of a config file plus overrides; None when it is not verl-shaped.

    Call it after :func:`rlfleet.common.config.load_config` accepted the same input
    (that reports YAML and translation errors).
    """
    raw: Any = None
    if path is not None:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    if not is_verl_shaped(raw if isinstance(raw, Mapping) else None, overrides):
        return None
    return translate(raw, overrides)


# --------------------------------------------------------------------------- docs


def _doc_default(value: Any) -> str:
    if value is NO_DEFAULT:
        return ""
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    text = text.removesuffix("\n...").removesuffix("...").strip()
    return f"`{text}`".replace("|", "\\|")


def doc_table() -> str:
    """A Markdown table of every verl key: default, and mapped / ignored / refused."""
    lines = [
        "| verl key | verl default | here | notes |",
        "|---|---|---|---|",
    ]
    for row in sorted(ROWS, key=lambda r: r.key):
        rule = row.rule
        if rule.to is not None and rule.when is not None:
            here = f"mapped to `{rule.to}` with {rule.when_doc}; otherwise ignored"
        elif rule.to is not None:
            here = f"mapped to `{rule.to}`"
        else:
            here = "ignored"
        if rule.sets:
            here += " (also sets " + ", ".join(f"`{k}: {v}`" for k, v in rule.sets.items()) + ")"
        notes = [rule.why] if rule.why else []
        if rule.accepts is not None:
            here += f" when {rule.accepted}; other values refused"
            notes.append(f"refused: rlfleet lacks {rule.missing}")
        cells = [f"`{row.key}`", _doc_default(row.default), here]
        cells.append("; ".join(notes).replace("|", "\\|"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
