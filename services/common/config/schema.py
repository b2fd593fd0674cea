"""The configuration schema: every section and key, typed, with verl's names
(see the package docstring)."""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from rlfleet.common.roles import ROLES, Role, placement_of

DType = Literal["float32", "bfloat16", "float16"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
# "full" (KL over the whole vocabulary) is left out: only per-token log-probs of the
# sampled tokens travel between services, never full distributions.
KLPenalty = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]
PolicyLossMode = Literal["vanilla", "gspo", "cispo"]
AdvEstimator = Literal[
    "gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"
]
Backend = Literal["fsdp", "megatron"]
Logger = Literal["console", "jsonl", "tensorboard", "wandb"]

# Estimators whose baseline comes from the other responses to the same prompt.
GROUP_ESTIMATORS: frozenset[str] = frozenset({"grpo", "rloo", "reinforce_plus_plus_baseline"})

_CONFIG_FILE = "config.yaml"


# --------------------------------------------------------------------------- errors


class _NoValue:
    def __repr__(self) -> str:
        return "<no value>"


NO_VALUE: Any = _NoValue()


@dataclass(frozen=True)
class ConfigIssue:
    """One problem: the dotted path of the key, what is wrong, and the value found."""

    path: str
    message: str
    value: Any = NO_VALUE

    def __str__(self) -> str:
        if self.value is NO_VALUE:
            return f"{self.path}: {self.message}"
        return f"{self.path}: {self.message} (got {_short_repr(self.value)})"


class ConfigError(ValueError):
    """The configuration is invalid; ``issues`` lists every problem found."""

    def __init__(self, issues: Sequence[ConfigIssue]) -> None:
        self.issues: list[ConfigIssue] = list(issues)
        n = len(self.issues)
        lines = "\n".join(f"  {issue}" for issue in self.issues)
        super().__init__(f"invalid config ({n} error{'s' if n != 1 else ''}):\n{lines}")

    def lines(self, prefix: str) -> str:
        """One line per problem, each led by ``prefix`` (what a command prints)."""
        return "\n".join(f"{prefix}{issue}" for issue in self.issues)


def _short_repr(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------- schema


def _as_list(value: Any) -> Any:
    """Accept one path where a list of paths is expected (verl does the same)."""
    return [value] if isinstance(value, str) else value


def _as_nodes(value: Any) -> Any:
    """A bare integer is a one-node pool."""
    return [value] if isinstance(value, int) and not isinstance(value, bool) else value


PathList = Annotated[list[str], BeforeValidator(_as_list)]
PoolSpec = Annotated[
    list[Annotated[int, Field(ge=0)]],
    BeforeValidator(_as_nodes),
    Field(min_length=1, description="devices (GPUs, or CPU cores on cpu) per node"),
]


def _takes_bool(annotation: Any) -> bool:
    """Whether a field of this type holds ``True``/``False`` as they are (``bool``,
    ``Any``, a Literal of them), or is no number at all (where pydantic refuses them)."""
    if annotation is bool or annotation is Any:
        return True
    if annotation in (int, float, type(None)):
        return False
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return any(isinstance(v, bool) for v in typing.get_args(annotation))
    if origin is Annotated:
        return _takes_bool(typing.get_args(annotation)[0])
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_takes_bool(a) for a in args)
    return True  # str, paths, lists, dicts, models: their own validation


#: The longest duration any ``*_s`` key takes.
MAX_SECONDS = 365 * 24 * 3600.0


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value: Any, info: ValidationInfo) -> Any:
        """``true`` where a number belongs is a mistake, not 1 (pydantic would take it)."""
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, bool) and field is not None and not _takes_bool(field.annotation):
            raise ValueError("expected a number, not a boolean")
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _seconds_in_range(cls, value: Any, info: ValidationInfo) -> Any:
        """Every duration (a key ending in ``_s``) fits the waits and timers it becomes:
        at most a year (``threading`` refuses waits past ``TIMEOUT_MAX``)."""
        name = info.field_name or ""
        if name.endswith("_s") and isinstance(value, int | float) and value > MAX_SECONDS:
            raise ValueError(f"at most {MAX_SECONDS:g} seconds (a year)")
        return value


class DataConfig(_Section):
    """Datasets (verl's parquet schema) and how prompts are batched."""

    train_files: PathList = Field(
        default_factory=lambda: ["outputs/data/arithmetic/train.parquet"], min_length=1
    )
    val_files: PathList = Field(
        default_factory=lambda: ["outputs/data/arithmetic/test.parquet"],
        description="validation parquet files; empty: no validation",
    )
    train_batch_size: int = Field(default=8, ge=1, description="prompts per PPO step")
    gen_batch_size: int | None = Field(
        default=None,
        ge=1,
        description="with algorithm.filter_groups.enable: prompts per generation round of "
        "dynamic sampling (verl's DAPO key); None: train_batch_size",
    )
    val_batch_size: int | None = Field(
        default=None,
        ge=1,
        description="prompts per validation batch; None: the whole set, in pieces of at most "
        "8192 samples (a replica's default --max-samples)",
    )
    max_prompt_length: int = Field(
        default=128, ge=1, description="tokens; longer prompts: see truncation"
    )
    max_response_length: int = Field(default=64, ge=1, description="tokens generated per response")
    prompt_key: str = Field(default="prompt", min_length=1, description="column with the chat list")
    reward_fn_key: str = Field(
        default="data_source", min_length=1, description="column that picks the reward scorer"
    )
    shuffle: bool = True
    seed: int = Field(
        default=1, ge=0, lt=2**63, description="seed of the training dataloader's shuffle"
    )
    truncation: Literal["error", "left", "right"] = Field(
        default="error", description="what to do with prompts over max_prompt_length"
    )
    filter_overlong_prompts: bool = Field(
        default=False, description="drop prompts over max_prompt_length when loading"
    )
    dataloader_num_workers: int = Field(
        default=0,
        ge=0,
        description="0 only: prompts are tokenized once, in memory, when the dataset "
        "loads; there are no loader worker processes to start",
    )

    @field_validator("dataloader_num_workers")
    @classmethod
    def _no_workers(cls, value: int) -> int:
        if value != 0:
            raise ValueError(
                "loader worker processes are not implemented (prompts are tokenized once, "
                "in memory, at load): use 0"
            )
        return value


class FsdpConfig(_Section):
    """FSDP2 layout of a trained model."""

    world_size: int | None = Field(
        default=None,
        ge=1,
        description="processes training this model; None: one per device of the role's pool "
        "(on cpu: one per node); at most the pool's devices (cpu: cores)",
    )
    fsdp_size: int = Field(
        default=-1,
        ge=-1,
        description="ranks per shard group; -1 (or the world size): all ranks in one group. "
        "Smaller groups (HSDP) are not implemented and refused",
    )
    sequence_parallel_size: int = Field(
        default=1,
        ge=1,
        description="1 only: Ulysses sequence parallelism is not implemented yet",
    )

    @field_validator("sequence_parallel_size")
    @classmethod
    def _no_sequence_parallel(cls, value: int) -> int:
        if value != 1:
            raise ValueError("Ulysses sequence parallelism is not implemented yet: use 1")
        return value

    reshard_after_forward: bool = True


class MegatronConfig(_Section):
    """Megatron-core parallel layout; world size = tp * pp * cp * dp."""

    tensor_model_parallel_size: int = Field(default=1, ge=1)
    pipeline_model_parallel_size: int = Field(default=1, ge=1)
    virtual_pipeline_model_parallel_size: int | None = Field(default=None, ge=1)
    context_parallel_size: int = Field(default=1, ge=1)
    data_parallel_size: int | None = Field(
        default=None, ge=1, description="None: derived from the pool's devices"
    )
    sequence_parallel: bool = False


class PolicyLossConfig(_Section):
    """Which policy loss the actor minimises (verl's ``actor.policy_loss``)."""

    loss_mode: PolicyLossMode = Field(
        default="vanilla",
        description="vanilla: dual-clip PPO; gspo: sequence-level ratio and clipping "
        "(arXiv:2507.18071; its policy term is always seq-mean-token-mean, as in verl); "
        "cispo: clipped importance weights under a stop-gradient (arXiv:2506.13585)",
    )


class KLLossControlConfig(_Section):
    """rlfleet's key (verl's KL loss has a fixed ``kl_loss_coef`` only): how the KL-loss
    coefficient moves, starting at ``actor.kl_loss_coef``. ``adaptive`` is the
    proportional controller of ``algorithm.kl_ctrl`` (Ziegler et al. 2019) steering the
    measured KL (``actor/kl_loss``) towards ``target_kl``."""

    type: Literal["fixed", "adaptive"] = "fixed"
    target_kl: float = Field(default=0.1, gt=0, description="adaptive: KL the controller aims at")
    horizon: int = Field(
        default=10000, ge=1, description="adaptive: reaction time in samples (as kl_ctrl's)"
    )


class ActorConfig(_Section):
    """The policy being trained (served by the trainer)."""

    model_path: str = Field(
        default="outputs/models/tiny", min_length=1, description="Hugging Face model dir or hub id"
    )
    tokenizer_path: str | None = Field(default=None, description="None: model_path")
    trust_remote_code: bool = False
    lr: float = Field(default=1e-6, gt=0)
    lr_warmup_steps: int = Field(default=-1, description="< 0: use lr_warmup_steps_ratio instead")
    lr_warmup_steps_ratio: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="warm-up as a fraction of the run's total training steps (the driver "
        "sends the total to the trainer)",
    )
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = Field(
        default=0.0, ge=0, le=1, description="cosine: floor as a fraction of lr"
    )
    weight_decay: float = Field(default=0.01, ge=0)
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (
        0.9,
        0.999,
    )
    ppo_mini_batch_size: int = Field(
        default=4, ge=1, description="prompts per optimizer step; x rollout.n samples (verl's unit)"
    )
    ppo_micro_batch_size: int | None = Field(
        default=None,
        ge=1,
        description="samples per device per forward/backward (gradient accumulation); "
        "None: the whole per-device mini-batch",
    )
    ppo_epochs: int = Field(default=1, ge=1, description="passes over each batch")
    use_remove_padding: bool | None = Field(
        default=None,
        description="pack sequences without padding in the actor's and the reference's "
        "forward and backward (fsdp backend); None: on for fsdp, off for megatron",
    )
    use_dynamic_bsz: bool = Field(
        default=False,
        description="micro-batches by a token budget (ppo_max_token_len_per_gpu) instead "
        "of ppo_micro_batch_size samples",
    )
    ppo_max_token_len_per_gpu: int = Field(
        default=16384,
        ge=1,
        description="with use_dynamic_bsz: tokens per micro-batch per device (real tokens "
        "when packed, rows x padded length otherwise)",
    )
    clip_ratio: float = Field(default=0.2, gt=0, description="PPO clip epsilon")
    clip_ratio_low: float | None = Field(
        default=None,
        gt=0,
        lt=1,
        description="lower epsilon (the ratio is clipped at 1 - it, so below 1); None: clip_ratio",
    )
    clip_ratio_high: float | None = Field(
        default=None, gt=0, description="upper epsilon (DAPO clip-higher); None: clip_ratio"
    )
    clip_ratio_c: float = Field(
        default=3.0, gt=1, description="dual-clip bound for negative advantages (arXiv:1912.09729)"
    )
    policy_loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    entropy_coeff: float = 0.0
    use_kl_loss: bool = Field(
        default=False, description="KL to the reference policy in the loss (GRPO)"
    )
    kl_loss_coef: float = Field(
        default=0.001, ge=0, description="KL-loss coefficient (the initial one when adaptive)"
    )
    kl_loss_type: KLPenalty = "low_var_kl"
    kl_loss_ctrl: KLLossControlConfig = Field(default_factory=KLLossControlConfig)
    loss_agg_mode: LossAggMode = Field(
        default="token-mean",
        description="how per-token losses reduce: token-mean (every token weighs the same, "
        "DAPO's token-level loss), seq-mean-token-sum, seq-mean-token-mean",
    )
    grad_clip: float = Field(default=1.0, gt=0, description="max global gradient norm")
    shuffle: bool = Field(default=False, description="shuffle samples between mini-batches")
    gradient_checkpointing: bool = False
    param_offload: bool = False
    optimizer_offload: bool = False
    dtype: DType = Field(default="float32", description="compute dtype")
    backend: Backend = "fsdp"
    fsdp: FsdpConfig = Field(default_factory=FsdpConfig)
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    lora_rank: int = Field(
        default=0,
        ge=0,
        description="LoRA adapter rank (peft); 0: full fine-tuning. > 0: only the adapters "
        "train, and a weight push sends only them (fsdp backend; the hf engine merges "
        "them, the vllm engine serves them with its own LoRA support)",
    )
    lora_alpha: float = Field(
        default=16, gt=0, description="LoRA scale numerator: the update is alpha / rank * B @ A"
    )
    target_modules: str | list[str] = Field(
        default="all-linear",
        description="the linear modules that get adapters: 'all-linear' (every linear "
        "layer but the LM head) or a list of module names (e.g. [q_proj, v_proj])",
    )

    @model_validator(mode="after")
    def _fill_defaults(self) -> Self:
        if self.tokenizer_path is None:
            self.tokenizer_path = self.model_path
        if isinstance(self.target_modules, list) and not self.target_modules:
            raise ValueError("target_modules: give 'all-linear' or at least one module name")
        if self.clip_ratio_low is None:
            if self.clip_ratio >= 1:  # the ratio's floor 1 - clip_ratio would be <= 0
                raise ValueError(
                    f"clip_ratio: {self.clip_ratio} >= 1 leaves no lower clip (the ratio is "
                    "clipped at 1 - clip_ratio); give clip_ratio < 1, or clip_ratio_low < 1 "
                    "and clip_ratio_high for an asymmetric clip"
                )
            self.clip_ratio_low = self.clip_ratio
        if self.clip_ratio_high is None:
            self.clip_ratio_high = self.clip_ratio
        return self


class CriticConfig(_Section):
    """The value model, trained only for ``algorithm.adv_estimator: gae``."""

    enable: bool | None = Field(
        default=None, description="None: on exactly when adv_estimator is gae"
    )
    model_path: str | None = Field(default=None, description="None: the actor's model_path")
    tokenizer_path: str | None = Field(default=None, description="None: the actor's tokenizer")
    lr: float = Field(default=1e-5, gt=0)
    lr_warmup_steps: int = Field(default=-1, description="< 0: use lr_warmup_steps_ratio instead")
    lr_warmup_steps_ratio: float = Field(default=0.0, ge=0, le=1)
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    weight_decay: float = Field(default=0.01, ge=0)
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (
        0.9,
        0.999,
    )
    ppo_mini_batch_size: int | None = Field(
        default=None, ge=1, description="prompts (x rollout.n); None: the actor's"
    )
    ppo_micro_batch_size: int | None = Field(
        default=None, ge=1, description="samples per device; None: the whole per-device mini-batch"
    )
    ppo_epochs: int | None = Field(default=None, ge=1, description="None: the actor's")
    use_remove_padding: bool | None = Field(
        default=None,
        description="pack sequences without padding (fsdp backend); None: on for fsdp, "
        "off for megatron",
    )
    use_dynamic_bsz: bool | None = Field(
        default=None, description="micro-batches by a token budget; None: the actor's"
    )
    ppo_max_token_len_per_gpu: int = Field(
        default=32768, ge=1, description="with use_dynamic_bsz: tokens per update micro-batch"
    )
    forward_max_token_len_per_gpu: int | None = Field(
        default=None,
        ge=1,
        description="with use_dynamic_bsz: tokens per values micro-batch; None: "
        "ppo_max_token_len_per_gpu",
    )
    cliprange_value: float = Field(
        default=0.5, gt=0, description="value clipping around old values"
    )
    grad_clip: float = Field(default=1.0, gt=0)
    loss_agg_mode: LossAggMode = "token-mean"
    shuffle: bool = False
    gradient_checkpointing: bool = False
    param_offload: bool = False
    optimizer_offload: bool = False
    dtype: DType = "float32"
    backend: Backend | None = Field(default=None, description="None: the actor's backend")
    fsdp: FsdpConfig = Field(default_factory=FsdpConfig)
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)


class RefConfig(_Section):
    """The frozen reference policy; used when a KL term is on."""

    model_path: str | None = Field(default=None, description="None: the actor's model_path")
    log_prob_micro_batch_size: int | None = Field(
        default=None, ge=1, description="samples per device per forward; None: all at once"
    )
    log_prob_use_dynamic_bsz: bool | None = Field(
        default=None, description="micro-batches by a token budget; None: actor.use_dynamic_bsz"
    )
    log_prob_max_token_len_per_gpu: int | None = Field(
        default=None,
        ge=1,
        description="with log_prob_use_dynamic_bsz: tokens per micro-batch; None: "
        "actor.ppo_max_token_len_per_gpu",
    )
    param_offload: bool = False
    dtype: DType | None = Field(default=None, description="None: the actor's dtype")


class ValKwargs(_Section):
    """Sampling for validation (greedy, one response, by default)."""

    temperature: float = Field(default=0.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=-1, ge=-1, description="-1 or 0: off")
    n: int = Field(default=1, ge=1)
    do_sample: bool = False


class ToolSource(_Section):
    """One place a multi-turn rollout finds tools (``rollout.multi_turn.tools``)."""

    kind: Literal["builtin", "service", "grpc", "http"] = Field(
        description="builtin: a built-in tool run inside the rollout replica (name: "
        "calculator | python, limits from the tools section); service: the run's tools "
        "service (services.tools, or the one the launcher starts; in-process runs: in the "
        "driver's process); grpc: any ToolService at address; http: one tool POSTed JSON "
        "at address (a URL)"
    )
    name: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="builtin and http: the tool's name (required); service and grpc: only "
        "this one of the service's tools (None: all of them)",
    )
    address: str | None = Field(
        default=None, description="grpc: host:port; http: the URL; unused otherwise"
    )
    description: str = Field(default="", description="http: what the model is told the tool does")
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="http: JSON schema of the tool's arguments",
    )

    @model_validator(mode="after")
    def _needs(self) -> Self:
        if self.kind in ("builtin", "http") and self.name is None:
            raise ValueError(f"a {self.kind} tool needs a name")
        if self.kind == "builtin" and self.name not in ("calculator", "python"):
            raise ValueError(
                f"no built-in tool {self.name!r}; the built-ins are calculator, python"
            )
        if self.kind in ("grpc", "http") and not self.address:
            raise ValueError(f"a {self.kind} tool needs an address")
        if self.kind == "http" and not str(self.address).startswith(("http://", "https://")):
            raise ValueError("an http tool's address is an http:// or https:// URL")
        return self


class MultiTurnConfig(_Section):
    """Multi-turn rollouts with tool calls (verl's ``rollout.multi_turn``; docs/rollout.md).

    A sample is a conversation: generate, parse tool calls, run the tools, append
    their results as a tool turn, generate again, until the model answers without a
    call, ``max_turns`` model turns, or the response budget (``response_length``,
    tool turns included) is used up. Tool turns are masked out of the loss.
    """

    enable: bool = Field(default=False, description="every Generate request is a conversation")
    format: Literal["hermes"] = Field(
        default="hermes",
        description='tool-call format: hermes (Qwen, Hermes): <tool_call>{"name": ..., '
        '"arguments": {...}}</tool_call> in the model\'s turn, results as <tool_response> '
        "turns in the chat template's format",
    )
    max_turns: int = Field(
        default=4, ge=1, description="model turns per sample at most (verl: max_assistant_turns)"
    )
    max_tokens_per_turn: int | None = Field(
        default=None, ge=1, description="new tokens per model turn; None: the budget left"
    )
    max_parallel_calls: int = Field(
        default=1,
        ge=1,
        le=64,
        description="tool calls run per model turn; more are answered with an error (verl)",
    )
    max_tool_response_length: int = Field(
        default=256, ge=1, description="characters of a tool's answer the model sees (verl)"
    )
    tool_response_truncate_side: Literal["left", "middle", "right"] = Field(
        default="middle", description="which part of a longer answer is cut (verl)"
    )
    tool_timeout_s: float = Field(default=10.0, gt=0, le=600, description="per tool call")
    tool_workers: int = Field(
        default=16, ge=1, le=1024, description="tool calls run at once, across samples"
    )
    tools: list[ToolSource] = Field(default_factory=list, description="where the tools are")


class OpenAIEndpointConfig(_Section):
    """Each rollout replica's OpenAI-compatible endpoint (docs/rollout.md) and the
    trajectory store its sessions are recorded in. ``rlfleet serve rollout`` flags
    (``--openai-port`` ...) override these."""

    port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="serve /v1/chat/completions ... on this port of the replica's host "
        "(0: a free one; the serving line and the registry report openai_url); None: off",
    )
    model_name: str | None = Field(
        default=None, min_length=1, description="model id served; None: the model path"
    )
    max_body_bytes: int = Field(default=4 << 20, ge=1, description="request body at most (413)")
    max_connections: int = Field(default=128, ge=1, description="connections at once at most")
    request_timeout_s: float = Field(
        default=600.0, gt=0, description="a request's generation at most (then 504, cancelled)"
    )
    max_sessions: int = Field(default=10_000, ge=1, description="sessions recorded at most")
    max_tokens: int = Field(
        default=1 << 22,
        ge=1,
        description="tokens (prompt + generated) recorded at most over all sessions; a "
        "request whose n x (prompt + max_tokens) exceeds it is refused",
    )
    session_ttl_s: float = Field(
        default=3600.0, gt=0, description="a session idle longer is dropped, finished or not"
    )


class RolloutConfig(_Section):
    """Generation (served by the rollout service)."""

    engine: Literal["hf", "vllm"] = Field(
        default="hf", description="hf runs on CPU or GPU; vllm on GPU"
    )
    model_path: str | None = Field(default=None, description="initial weights; None: the actor's")
    n: int = Field(default=1, ge=1, description="responses per prompt")
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=-1, ge=-1, description="-1 or 0: off")
    do_sample: bool = True
    prompt_length: int | None = Field(
        default=None, ge=1, description="None: data.max_prompt_length"
    )
    response_length: int | None = Field(
        default=None, ge=1, description="max new tokens; None: data.max_response_length"
    )
    dtype: DType = "float32"
    gpu_memory_utilization: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="vllm: fraction of device memory for weights + KV cache",
    )
    kv_cache_memory_bytes: int | None = Field(
        default=None,
        ge=1,
        description="vllm: the KV cache's size in bytes, instead of gpu_memory_utilization "
        "(on vLLM's CPU build that fraction is of the host's memory: give this there)",
    )
    tensor_parallel_size: int = Field(default=1, ge=1, description="devices per rollout replica")
    max_num_batched_tokens: int | None = Field(
        default=None,
        ge=1,
        description="vllm: tokens per scheduler step (None: vLLM's default); hf: padded "
        "tokens per generation batch, rows grouped by prompt length (None: one batch)",
    )
    free_cache_engine: bool = Field(
        default=True, description="colocated: release the KV cache while the trainer works"
    )
    log_prob_micro_batch_size: int | None = Field(
        default=None,
        ge=1,
        description="samples per device when recomputing log-probs; None: "
        "actor.ppo_micro_batch_size",
    )
    log_prob_use_dynamic_bsz: bool | None = Field(
        default=None,
        description="recomputing log-probs in micro-batches by a token budget; None: "
        "actor.use_dynamic_bsz",
    )
    log_prob_max_token_len_per_gpu: int | None = Field(
        default=None,
        ge=1,
        description="with log_prob_use_dynamic_bsz: tokens per micro-batch; None: "
        "actor.ppo_max_token_len_per_gpu",
    )
    replicas: int | None = Field(
        default=None,
        ge=1,
        description="engine replicas; None: as many as fit the rollout pool "
        "(devices / tensor_parallel_size, on cpu one per node)",
    )
    replica_wait_s: float = Field(
        default=120.0,
        ge=0,
        description="rlfleet option: when every replica has failed mid-generation (or "
        "none is registered at a step's start), how long to wait for one to register "
        "again (a launcher restarting them) before the step fails; the newcomer gets the "
        "current weights and the unfinished prompts. 0: fail at once",
    )
    val_kwargs: ValKwargs = Field(default_factory=ValKwargs)
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)
    weight_transport: Literal["auto", "shm", "tcp", "grpc"] = Field(
        default="auto",
        description="rlfleet option: how the trainer pushes weights to each replica; auto: "
        "shared memory on the replica's host, else TCP, else the gRPC stream (chosen per "
        "replica, falling back when a replica does not serve the bulk plane); shm, tcp or "
        "grpc: that one only (a replica that cannot take it fails)",
    )
    openai: OpenAIEndpointConfig = Field(default_factory=OpenAIEndpointConfig)


class CustomRewardFunction(_Section):
    """verl's ``custom_reward_function``: a Python file with ``compute_score(data_source,
    solution_str, ground_truth, extra_info, **reward_kwargs)``, which then scores every
    data source."""

    path: str | None = Field(default=None, description="None: the built-in scorers by data_source")
    name: str = Field(default="compute_score", min_length=1)
    reward_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments added to every call (JSON values)"
    )
    keep_builtin_scorers: bool = Field(
        default=False,
        description="rlfleet option: data sources of the built-in table keep their scorer and "
        "the custom function scores only the others; false (verl): it scores every source",
    )


class RewardModelConfig(_Section):
    """A learned reward model (served by the reward service)."""

    enable: bool = Field(
        default=False,
        description="score with the model: as in verl, every sample (unless route_by_data_source)",
    )
    route_by_data_source: bool = Field(
        default=False,
        description="rlfleet option: the model scores only the data sources routed to it "
        "(hh-rlhf ...) and the others keep their rule or custom scorers; false: as verl, "
        "the model's score is every sample's reward",
    )
    path: str | None = Field(default=None, description="Hugging Face sequence-classification model")
    micro_batch_size: int | None = Field(
        default=None, ge=1, description="samples per device per forward"
    )
    max_tokens_per_batch: int | None = Field(
        default=None,
        ge=1,
        description="padded tokens per forward (longest x rows, rows at most micro_batch_size); "
        "None: 8192",
    )
    dtype: DType = "float32"
    device: str = Field(
        default="auto",
        pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        description="cpu, cuda, cuda:N; auto: cuda when the service sees a GPU, else cpu",
    )


class SandboxConfig(_Section):
    """How the ``code`` scorer runs a model's programs (``rlfleet.common.sandbox``).

    Each test case is one execution in a sandbox of its own: no network, a
    read-only file system but a fresh ``/tmp``, a clean environment and the limits
    below. The isolation in force is logged at start-up and exported as
    ``rlfleet_reward_sandbox_isolation{mode}``.
    """

    isolation: Literal["auto", "bwrap", "namespaces", "none"] = Field(
        default="auto",
        description="auto: bubblewrap when it works, else namespaces (unshare), else none "
        "(only with allow_unisolated); or one of them, refused when it does not work",
    )
    allow_unisolated: bool = Field(
        default=False,
        description="run code with rlimits only where no isolation works; false: code "
        "samples fail with an error instead",
    )
    python: str | None = Field(
        default=None,
        description="interpreter for the programs; None: the service's own when an "
        "unprivileged user can run it, else /usr/bin/python3 or /usr/local/bin/python3",
    )
    timeout_s: float = Field(
        default=5.0, gt=0, le=600, description="wall-clock seconds per test case"
    )
    cpu_time_s: float = Field(
        default=5.0, gt=0, le=600, description="CPU seconds per process of a test case"
    )
    memory_mb: int = Field(
        default=1024, ge=16, description="address space per process (RLIMIT_AS), MiB"
    )
    max_output_bytes: int = Field(
        default=4 << 20,
        ge=1024,
        description="bytes kept of stdout and of stderr each; more ends the case (failed)",
    )
    max_processes: int = Field(
        default=32, ge=4, le=4096, description="processes and threads a test case may hold"
    )
    tmp_mb: int = Field(default=64, ge=1, description="size of the writable /tmp, MiB")
    max_concurrent: int = Field(
        default=1,
        ge=1,
        le=64,
        description="test cases of one sample run at once (per scoring worker)",
    )
    max_test_cases: int = Field(
        default=10,
        ge=1,
        description="the first N test cases of a problem are run (verl's continuous score "
        "reads the first 10)",
    )
    partial_credit: bool = Field(
        default=True,
        description="score = fraction of the cases run that pass (verl's continuous=True "
        "for code sources); false: 1 only when all pass",
    )

    @model_validator(mode="after")
    def _unisolated_needs_consent(self) -> Self:
        if self.isolation == "none" and not self.allow_unisolated:
            raise ValueError(
                "isolation 'none' runs untrusted code unconfined: it needs allow_unisolated: true"
            )
        return self


class OverlongBufferConfig(_Section):
    """DAPO's soft overlong punishment (arXiv:2503.14476, Eq. 13), added by the driver to
    each training sample's score: 0 up to ``max_resp_len - len`` tokens, then falling
    linearly to ``-penalty_factor`` at ``max_resp_len``."""

    enable: bool = False
    len: int = Field(default=0, ge=0, description="the buffer: tokens before max_resp_len")
    penalty_factor: float = Field(default=0.0, ge=0, description="the penalty at max_resp_len")
    max_resp_len: int | None = Field(
        default=None,
        ge=1,
        description="L_max; None: rollout.response_length (else data.max_response_length)",
    )


class RewardConfig(_Section):
    """Scoring of responses (served by the reward service)."""

    reward_manager: str = Field(
        default="naive",
        description="naive only (verl's name): each sample scored on its own by its data "
        "source's scorer; verl's batch / prime / dapo managers are not implemented",
    )

    @field_validator("reward_manager")
    @classmethod
    def _naive_only(cls, value: str) -> str:
        if value != "naive":
            raise ValueError(
                "only the naive reward manager (each sample scored on its own) is "
                "implemented; verl's batch, prime and dapo managers are not"
            )
        return value

    custom_function: CustomRewardFunction = Field(default_factory=CustomRewardFunction)
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)
    overlong_buffer: OverlongBufferConfig = Field(default_factory=OverlongBufferConfig)
    sample_timeout_s: float = Field(default=30.0, gt=0, description="per-sample scoring deadline")
    retry_s: float = Field(
        default=120.0,
        ge=0,
        description="rlfleet option: how long the driver keeps retrying a reward call that "
        "failed recoverably (the service restarting, or frozen and given up by its liveness "
        "probe) before the step fails; 0: no retry",
    )
    max_error_fraction: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="rlfleet option: the share of a step's samples whose scorer may fail "
        "(a reward function that raises, a reward model that fails; each scores 0, counted "
        "in reward/error_fraction) before the run stops naming the first error; 0: any "
        "failure stops the run, as in verl. Time-outs are not failures",
    )
    num_workers: int = Field(
        default=4, ge=1, description="parallel rule-scoring workers (per server process)"
    )
    num_processes: int = Field(
        default=1,
        ge=0,
        description="server processes sharing the port (SO_REUSEPORT); 0: one per CPU core, "
        "at most 32",
    )
    default_scorer: str | None = Field(
        default=None,
        description="scorer for unknown data sources; None: an unknown source is an error",
    )
    gsm8k_lenient: bool = Field(
        default=False,
        description="rlfleet option: gsm8k compares numbers as decimals (18.00, $18, 18. "
        "match 18) in the last 1000 characters; false: verl's exact string rule, last 300",
    )
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)


class PythonToolConfig(_Section):
    """The ``python`` tool's sandbox (``rlfleet.common.sandbox``): one process per call."""

    isolation: Literal["auto", "bwrap", "namespaces", "none"] = Field(
        default="auto",
        description="as reward.sandbox.isolation: auto tries bubblewrap, then namespaces, "
        "then none (only with allow_unisolated)",
    )
    allow_unisolated: bool = Field(
        default=False, description="run code with rlimits only where no isolation works"
    )
    python: str | None = Field(default=None, description="interpreter; None: as reward.sandbox")
    cpu_time_s: float = Field(default=10.0, gt=0, le=600, description="CPU seconds per process")
    memory_mb: int = Field(default=1024, ge=16, description="address space per process, MiB")
    max_output_bytes: int = Field(
        default=64 << 10, ge=1024, description="stdout / stderr bytes; more ends the call"
    )
    max_processes: int = Field(default=32, ge=4, le=4096, description="processes and threads")
    tmp_mb: int = Field(default=64, ge=1, description="size of the writable /tmp, MiB")

    @model_validator(mode="after")
    def _unisolated_needs_consent(self) -> Self:
        if self.isolation == "none" and not self.allow_unisolated:
            raise ValueError(
                "isolation 'none' runs untrusted code unconfined: it needs allow_unisolated: true"
            )
        return self


class CalculatorToolConfig(_Section):
    """The ``calculator`` tool's bounds."""

    max_chars: int = Field(default=256, ge=1, le=1 << 16, description="expression length")
    max_ops: int = Field(default=64, ge=1, le=4096, description="operators per expression")
    max_bits: int = Field(
        default=1024, ge=64, le=1 << 16, description="bits of any integer in the calculation"
    )


BuiltinTool = Literal["calculator", "python"]
BUILTIN_TOOLS: tuple[BuiltinTool, ...] = ("calculator", "python")


class ToolsConfig(_Section):
    """The tools service (``rlfleet serve tools``, docs/tools.md) and the limits of the
    built-in tools wherever they run."""

    builtin: list[BuiltinTool] = Field(
        default_factory=lambda: list(BUILTIN_TOOLS),
        description="built-in tools the tools service offers",
    )
    default_timeout_s: float = Field(default=10.0, gt=0, le=600, description="a call's time-out")
    max_timeout_s: float = Field(default=60.0, gt=0, le=3600, description="what a caller may ask")
    max_concurrent_calls: int = Field(default=16, ge=1, le=1024, description="calls run at once")
    max_arguments_bytes: int = Field(default=64 << 10, ge=16, description="a call's arguments JSON")
    max_content_bytes: int = Field(default=16 << 10, ge=64, description="an answer is cut to this")
    python: PythonToolConfig = Field(default_factory=PythonToolConfig)
    calculator: CalculatorToolConfig = Field(default_factory=CalculatorToolConfig)

    @model_validator(mode="after")
    def _timeouts(self) -> Self:
        if self.default_timeout_s > self.max_timeout_s:
            raise ValueError(
                f"default_timeout_s {self.default_timeout_s} exceeds max_timeout_s "
                f"{self.max_timeout_s}"
            )
        return self


class KLControlConfig(_Section):
    """Coefficient of the in-reward KL penalty (fixed, or adaptive as in Ziegler et al.)."""

    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = Field(default=0.001, ge=0)
    target_kl: float = Field(default=0.1, gt=0, description="adaptive: KL the controller aims at")
    horizon: int = Field(default=10000, ge=1, description="adaptive: reaction time in samples")


class FilterGroupsConfig(_Section):
    """DAPO's dynamic sampling (arXiv:2503.14476, Sec. 3.2): prompt groups whose samples
    all have the same ``metric`` are dropped, and generation goes on with the next prompts
    until ``data.train_batch_size`` prompts are kept."""

    enable: bool = False
    metric: Literal["seq_reward", "seq_final_reward", "score", "acc"] = Field(
        default="seq_reward",
        description="seq_reward: the score the trainer gets (overlong penalty included); "
        "seq_final_reward: the same (no in-reward KL is allowed with it); score: the "
        "scorer's score before shaping; acc: the scorer's 'acc' detail",
    )
    max_num_gen_batches: int = Field(
        default=10,
        ge=1,
        description="generation rounds per step at most; a batch still short then fails "
        "the step with a message (verl's behaviour)",
    )


class RolloutCorrectionConfig(_Section):
    """Truncated importance sampling for the rollout / trainer mismatch (verl's
    ``algorithm.rollout_correction``): each token's policy loss is weighted by
    ``min(exp(old_log_prob - rollout_log_prob), rollout_is_threshold)``, the rollout
    engine's log-probs travelling with the batch."""

    rollout_is: Literal["token", "sequence"] | None = Field(
        default=None,
        description="null: off; token: a weight per token; sequence: one per sequence "
        "(the product of its token ratios)",
    )
    rollout_is_threshold: float = Field(
        default=2.0,
        ge=1,
        description="C, the truncation of the weights; at least 1 (an on-policy token's "
        "weight is 1: a C below it would shrink every token's loss)",
    )


class AlgorithmConfig(_Section):
    adv_estimator: AdvEstimator = "gae"
    gamma: float = Field(default=1.0, ge=0, le=1, description="discount")
    lam: float = Field(default=1.0, ge=0, le=1, description="GAE lambda")
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = Field(
        default=False, description="subtract a KL penalty from the reward"
    )
    kl_penalty: KLPenalty = Field(
        default="kl", description="KL estimator for the in-reward penalty"
    )
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig)


class PipelineConfig(_Section):
    """verl-pipeline's one-off pipelining: generate batch k+1 while training on k."""

    enable: bool = False
    max_staleness: int = Field(
        default=1, ge=0, description="max weight versions a sample may lag; 0: on-policy"
    )
    partial_rollout: bool = Field(
        default=False,
        description="a weight push that lands while a replica generates is applied between "
        "two decode steps: the samples keep their tokens so far and go on under the new "
        "weights (their cache rebuilt), each token tagged with its weight version "
        "(AReaL's interruptible generation; verl's async_training.partial_rollout). "
        "Off: the push waits for the running batch. Both engines (vllm: a full update; "
        "adapters served by vLLM's LoRA wait for the batch)",
    )


class ExternalRolloutConfig(_Section):
    """``trainer.rollout_source: external``: train on sessions an agent ran through the
    replicas' OpenAI endpoints (rlfleet.driver.external)."""

    batch_size: int = Field(default=8, ge=1, description="finished sessions per PPO step")
    poll_interval_s: float = Field(
        default=0.5, gt=0, description="wait between polls of the replicas when none is ready"
    )
    timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="a step waits this long for batch_size finished sessions, then fails",
    )
    max_staleness: int | None = Field(
        default=None,
        ge=0,
        description="drop sessions with a completion more than this many weight versions "
        "behind the policy; None: keep all",
    )
    max_rows_per_session: int = Field(
        default=64,
        ge=1,
        le=4096,
        description="a session whose completions do not chain (one training row each) with "
        "more rows is dropped (metric external/oversized_dropped)",
    )
    max_tokens_per_row: int | None = Field(
        default=None,
        ge=2,
        description="a session with a row (prompt + response tokens) longer than this is "
        "dropped (external/oversized_dropped); None: data.max_prompt_length + "
        "data.max_response_length",
    )
    use_rollout_log_probs: bool = Field(
        default=True,
        description="the recorded log-probs are the old log-probs (no recompute) when every "
        "completion of the batch was sampled at rollout.temperature (or greedily with "
        "rollout.temperature 1); otherwise, or false: the trainer recomputes them",
    )


class GuardConfig(_Section):
    """What the driver does itself when a health check fires (off unless ``enable``)."""

    enable: bool = Field(
        default=False,
        description="on a new health warning: roll back to the last good checkpoint "
        "(rollback) and multiply the actor's lr by lr_factor, at most max_interventions times",
    )
    lr_factor: float = Field(
        default=0.5, gt=0, lt=1, description="the actor's lr is multiplied by this each time"
    )
    rollback: bool = Field(
        default=True,
        description="first load the last checkpoint saved before the warnings started "
        "(needs trainer.save_freq; without one, the lr is cut alone)",
    )
    max_interventions: int = Field(default=3, ge=1, description="interventions per run at most")
    cooldown_steps: int = Field(
        default=5, ge=0, description="steps after an intervention in which checks stay quiet"
    )


class RecoveryConfig(_Section):
    """The run survives its trainer dying (``trainer.recovery``; docs/fault-tolerance.md).

    The launcher (``rlfleet train``'s local processes) restarts the trainer on its
    address; the driver, whose trainer call failed, waits for it, has it load the last
    checkpoint (none yet: the initial model), rewinds its own step counter and data
    order to that point, pushes the restored weights to the rollout replicas (which
    kept running) and redoes the steps since. Pipelined runs keep the batches generated
    ahead with the restored weights or older ones and drop the rest. A trainer that
    stops answering without dying is killed after ``kill_after_s`` (when the launcher
    can: the local and Ray launchers), and then restarted the same way.
    """

    enable: bool = Field(
        default=True,
        description="restart the trainer and recover the run (false: a dead trainer ends "
        "the run; resume it with trainer.resume_mode auto)",
    )
    wait_s: float = Field(
        default=300.0,
        gt=0,
        description="how long the driver waits for the trainer to serve again before the run fails",
    )
    max_recoveries: int = Field(
        default=3, ge=1, description="trainer deaths survived in one run; one more fails it"
    )
    kill_after_s: float = Field(
        default=60.0,
        gt=0,
        description="a lost trainer that has not answered for this long is killed, so "
        "that its launcher restarts it (one frozen or stuck is alive, and never restarted "
        "otherwise); longer than the trainer's start",
    )


class HealthConfig(_Section):
    """Early warnings on a run going wrong: a line on the console and ``health/...``
    metrics each time a check starts firing (docs/driver.md, "When a run goes wrong")."""

    enable: bool = Field(default=True, description="run the checks each step")
    window: int = Field(
        default=5,
        ge=1,
        description="steps of the moving averages (the reward's, the initial entropy's)",
    )
    entropy_min: float = Field(
        default=0.0, ge=0, description="warn below this entropy (nats per token); 0: off"
    )
    entropy_min_ratio: float = Field(
        default=0.1,
        ge=0,
        lt=1,
        description="warn when the entropy falls below this fraction of its mean over the "
        "first window steps; 0: off",
    )
    reward_drop_ratio: float = Field(
        default=0.5,
        ge=0,
        description="warn when the reward's moving average falls this fraction of its "
        "best value below that best; 0: off",
    )
    reward_drop_steps: int = Field(
        default=0,
        ge=0,
        description="warn when the reward's moving average fell this many steps in a row; 0: off",
    )
    val_drop_ratio: float = Field(
        default=0.25,
        ge=0,
        description="warn when the validation score (val/test_score/mean) falls this "
        "fraction of its best value below that best; 0: off",
    )
    max_ppo_kl: float = Field(
        default=0.05,
        ge=0,
        description="warn when |actor/ppo_kl| (KL of the update to the sampling policy) "
        "exceeds this; 0: off",
    )
    max_grad_norm: float = Field(
        default=100.0,
        ge=0,
        description="warn when actor/grad_norm (before clipping) exceeds this; a "
        "non-finite norm always warns; 0: only non-finite",
    )
    guard: GuardConfig = Field(default_factory=GuardConfig)


class TrainerConfig(_Section):
    project_name: str = Field(default="rlfleet", min_length=1)
    experiment_name: str = Field(default="tiny", min_length=1)
    device: Literal["cuda", "cpu"] = Field(
        default="cpu",
        description="what resource pool entries count: GPUs (cuda) or CPU cores (cpu)",
    )
    total_epochs: int = Field(default=1, ge=1)
    total_training_steps: int | None = Field(
        default=None, ge=1, description="None: epochs x batches"
    )
    critic_warmup: int = Field(default=0, ge=0, description="steps that train only the critic")
    save_freq: int = Field(default=-1, description="steps between checkpoints; -1: never")
    test_freq: int = Field(default=-1, description="steps between validations; -1: never")
    default_local_dir: str | None = Field(
        default=None,
        description="run dir (checkpoints, config.yaml, logs); "
        "None: outputs/runs/<project_name>/<experiment_name>",
    )
    resume_mode: Literal["auto", "disable", "resume_path"] = Field(
        default="auto", description="auto: latest checkpoint in the run dir, if any"
    )
    resume_from_path: str | None = Field(default=None, description="checkpoint for resume_path")
    max_actor_ckpt_to_keep: int | None = Field(default=None, ge=1, description="None: keep all")
    max_critic_ckpt_to_keep: int | None = Field(default=None, ge=1, description="None: keep all")
    save_hf: bool = Field(
        default=True,
        description="every checkpoint holds huggingface/: the actor's config, tokenizer "
        "and safetensors weights (AutoModelForCausalLM loads it)",
    )
    max_request_bytes: int = Field(
        default=4 * 2**30,
        ge=1,
        description="most bytes one batch stream sent to the trainer service may hold; "
        "a bigger one is refused (RESOURCE_EXHAUSTED) as its chunks arrive",
    )
    logger: list[Logger] = Field(default_factory=lambda: list[Logger](["console"]))
    log_val_generations: int = Field(default=0, ge=0, description="validation samples to log")
    val_before_train: bool = True
    seed: int = Field(default=42, ge=0, lt=2**63)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    rollout_source: Literal["dataset", "external"] = Field(
        default="dataset",
        description="dataset: the driver generates for the training prompts; external: it "
        "trains on finished sessions that agents ran through the rollout replicas' OpenAI "
        "endpoints (rollout.openai.port), taken from the replicas (trainer.external)",
    )
    external: ExternalRolloutConfig = Field(default_factory=ExternalRolloutConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)
    trace: bool = Field(
        default=True,
        description="rlfleet option: the driver and the services of the run write the "
        "spans of every step to <run dir>/traces (rlfleet trace --run DIR --step N)",
    )
    trace_otlp_endpoint: str | None = Field(
        default=None,
        description="rlfleet option: with trace, also send every span to this "
        "OpenTelemetry collector as OTLP/HTTP JSON (http(s)://host:4318/v1/traces), "
        "batched in a thread; the JSONL files are written as before",
    )
    nnodes: int | None = Field(
        default=None,
        ge=1,
        description="verl's key: with n_gpus_per_node and no resource_pools, one pool "
        "global_pool: [n_gpus_per_node] * nnodes serving every role (colocated); with "
        "resource_pools, no pool may span more nodes",
    )
    n_gpus_per_node: int | None = Field(
        default=None,
        ge=1,
        description="devices per node of the default pool (see nnodes); with "
        "resource_pools, no pool may ask more on one node",
    )

    @field_validator("save_freq", "test_freq")
    @classmethod
    def _freq(cls, value: int) -> int:
        if value != -1 and value <= 0:
            raise ValueError("must be -1 (never) or a positive number of steps")
        return value

    @field_validator("trace_otlp_endpoint")
    @classmethod
    def _otlp_url(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^https?://[^/\s]+(/\S*)?$", value):
            raise ValueError("must be an http:// or https:// URL (a collector's /v1/traces)")
        return value

    @field_validator("logger", mode="before")
    @classmethod
    def _one_logger(cls, value: Any) -> Any:
        """``trainer.logger=console``, as verl's command lines write it: a list of one."""
        return [value] if isinstance(value, str) else value

    @field_validator("logger")
    @classmethod
    def _unique_loggers(cls, value: list[str]) -> list[str]:
        dupes = sorted({x for x in value if value.count(x) > 1})
        if dupes:
            raise ValueError(f"duplicate logger(s) {dupes}")
        return value


class MappingConfig(_Section):
    """Which resource pool serves each role; a role that is not enabled may be None."""

    actor: str | None = None
    critic: str | None = None
    ref: str | None = None
    rollout: str | None = None
    reward_model: str | None = None


def _address(value: str) -> str:
    if value.startswith("unix:"):
        return value
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port or unix:path, got {value!r}")
    return value


Address = Annotated[str, AfterValidator(_address)]


class ServicesConfig(_Section):
    """Addresses of services already running; a role left out is launched by the scheduler."""

    scheduler: Address | None = None
    rollout: list[Address] = Field(default_factory=list, description="one address per replica")
    reward: Address | None = None
    trainer: Address | None = None
    tools: Address | None = Field(
        default=None,
        description="the tools service (rollout.multi_turn.tools of kind service); None: "
        "launched when a tool source asks for it",
    )
    max_restarts: int = Field(
        default=3,
        ge=0,
        description="times a launched service that dies is restarted (on its port, with "
        "backoff): rollout replicas, reward, tools, the scheduler, and the trainer with "
        "trainer.recovery.enable; 0: never",
    )
    restart_backoff_s: float = Field(
        default=1.0, gt=0, description="wait before the first restart; doubles each time"
    )


class TLSSection(_Section):
    """TLS material (PEM paths) every service serves and every client dials with."""

    cert: str | None = Field(default=None, description="certificate (chain)")
    key: str | None = Field(default=None, description="private key of cert")
    ca: str | None = Field(default=None, description="CA that verifies peers")
    require_client_cert: bool = Field(default=False, description="mTLS: clients need a cert")
    server_name: str | None = Field(
        default=None,
        description="the name clients verify certificates against instead of the dialed "
        "host (`rlfleet secrets tls` puts 'rlfleet' in every certificate); None: the host",
    )

    @model_validator(mode="after")
    def _pairs(self) -> Self:
        if (self.cert is None) != (self.key is None):
            raise ValueError("cert and key go together")
        if self.require_client_cert and self.ca is None:
            raise ValueError("require_client_cert needs ca")
        return self


class AutoscaleConfig(_Section):
    """The scheduler's rollout autoscaler (``scheduler.autoscale``; docs/fault-tolerance.md).

    Every ``interval_s`` it reads the fleet's signals: the rollout replicas' queue
    depth (from their heartbeats), the driver's generation share of the step time
    (``timing_s/gen / timing_s/step``, published with the training status) and the
    samples' staleness, and moves the desired rollout count one replica at a time
    (``rlfleet scale rollout N`` sets the same value by hand). The launcher (local
    processes, Ray actors) follows it; a removed replica is drained first.
    """

    enable: bool = Field(default=False, description="run the autoscaler in the scheduler")
    min_replicas: int = Field(default=1, ge=1, le=1024, description="never fewer replicas")
    max_replicas: int = Field(default=4, ge=1, le=1024, description="never more replicas")
    target_queue_depth: float = Field(
        default=8.0,
        gt=0,
        description="samples waiting per replica above which one is added (below half of "
        "it, with a low generation share, one is removed)",
    )
    target_gen_share: float = Field(
        default=0.6,
        gt=0,
        lt=1,
        description="generation's share of the step time above which a replica is added; "
        "below half of it (and a short queue) one is removed",
    )
    max_staleness: float = Field(
        default=2.0,
        ge=0,
        description="pipelined runs: no replica is added while the samples' mean staleness "
        "(staleness/mean, in weight versions) is above this (generation is already ahead)",
    )
    cooldown_s: float = Field(
        default=30.0,
        ge=0,
        description="seconds after a change before the next one; a change also waits for "
        "a training step measured with the current fleet",
    )
    interval_s: float = Field(default=2.0, gt=0, le=600, description="seconds between checks")

    @model_validator(mode="after")
    def _bounds(self) -> Self:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})"
            )
        return self


class SchedulerConfig(_Section):
    """The scheduler service's own settings."""

    autoscale: AutoscaleConfig = Field(default_factory=AutoscaleConfig)


class RayConfig(_Section):
    """Where ``launcher: ray`` runs the services (see docs/ray.md)."""

    address: str = Field(
        default="auto",
        min_length=1,
        description="auto: the running Ray cluster, else a local one started for the run; "
        "or host:port of a cluster's head",
    )

    @field_validator("address")
    @classmethod
    def _host_port(cls, value: str) -> str:
        if value == "auto":
            return value
        if "://" in value:
            raise ValueError(
                f"{value!r}: Ray Client addresses are not supported (the services run as "
                "processes next to their actors): run rlfleet on a node of the cluster and "
                "give the head's host:port (its GCS port, 6379 by default)"
            )
        host, sep, port = value.rpartition(":")
        if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{value!r}: expected auto or host:port of the head (1-65535)")
        return value

    namespace: str = Field(
        default="rlfleet", min_length=1, description="Ray namespace of the actors"
    )
    start_timeout_s: float = Field(
        default=300.0, gt=0, description="for placement groups and services to come up"
    )
    pool_strategy: Literal["STRICT_SPREAD", "SPREAD", "PACK"] = Field(
        default="STRICT_SPREAD",
        description="how a pool's node entries (its bundles) are placed across Ray nodes: "
        "STRICT_SPREAD each on a node of its own (what the entries say); SPREAD apart where "
        "the cluster allows; PACK on as few nodes as fit (verl's default). A one-entry pool "
        "is STRICT_PACK (one node) whatever this says",
    )


class SecurityConfig(_Section):
    """Authentication and TLS of the services a run starts (see docs/security.md)."""

    auth: bool = Field(
        default=True,
        description="per-role bearer tokens on every endpoint; false: NO authentication "
        "(loopback only, logged as a warning)",
    )
    credentials_dir: str | None = Field(
        default=None,
        description="a credential set from `rlfleet secrets init` to use; None: a fresh "
        "one per cluster in <run dir>/secrets",
    )
    tls: TLSSection = Field(default_factory=TLSSection)


def _default_pools() -> dict[str, list[int]]:
    return {"train_pool": [1], "rollout_pool": [1]}


def _default_mapping() -> MappingConfig:
    return MappingConfig(
        actor="train_pool",
        critic="train_pool",
        ref="train_pool",
        rollout="rollout_pool",
        reward_model="train_pool",
    )


@dataclass(frozen=True)
class Placement:
    """Where each enabled role runs."""

    mode: Literal["colocated", "disaggregated"]
    role_pool: dict[str, str]
    pool_roles: dict[str, tuple[str, ...]]


class Config(BaseModel):
    """The whole run. Build it with :func:`load_config` or :func:`config_from_dict`."""

    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)

    data: DataConfig = Field(default_factory=DataConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    ref: RefConfig = Field(default_factory=RefConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    resource_pools: dict[str, PoolSpec] = Field(
        default_factory=_default_pools,
        description="pool name -> devices per node (GPUs on cuda, CPU cores on cpu)",
    )
    mapping: MappingConfig = Field(default_factory=_default_mapping)
    services: ServicesConfig = Field(default_factory=ServicesConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    launcher: Literal["local", "ray"] = Field(
        default="local",
        description="how `rlfleet train` starts the services: local processes, or Ray actors",
    )
    ray: RayConfig = Field(default_factory=RayConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)

    @model_validator(mode="before")
    @classmethod
    def _default_pools(cls, data: Any) -> Any:
        from rlfleet.common.config.load import verl_default_pools  # imports this module

        return verl_default_pools(data)

    @model_validator(mode="after")
    def _check_and_resolve(self) -> Self:
        from rlfleet.common.config.checks import resolve, run_checks  # import this module

        issues = run_checks(self, invalid=set())
        if issues:
            raise ConfigError(issues)
        resolve(self)
        return self

    # ---- helpers for the services

    def critic_enabled(self) -> bool:
        if self.critic.enable is not None:
            return self.critic.enable
        return self.algorithm.adv_estimator == "gae"

    def ref_enabled(self) -> bool:
        return self.algorithm.use_kl_in_reward or self.actor.use_kl_loss

    def enabled_roles(self) -> tuple[Role, ...]:
        """Roles this run needs, in :data:`ROLES` order."""
        on: dict[Role, bool] = {
            "actor": True,
            "critic": self.critic_enabled(),
            "ref": self.ref_enabled(),
            "rollout": True,
            "reward_model": self.reward.reward_model.enable,
        }
        return tuple(role for role in ROLES if on[role])

    def placement(self) -> Placement:
        """Pools of the enabled roles; colocated when actor and rollout share a pool."""
        role_pool: dict[str, str] = {
            role: getattr(self.mapping, role) for role in self.enabled_roles()
        }
        pool_roles: dict[str, tuple[str, ...]] = {}
        for role, pool in role_pool.items():
            pool_roles[pool] = (*pool_roles.get(pool, ()), role)
        return Placement(placement_of(role_pool), role_pool, pool_roles)

    def pool_of(self, role: Role) -> list[int]:
        """Devices per node of the role's pool (KeyError if unmapped or unknown)."""
        pool = getattr(self.mapping, role)
        if pool is None:
            raise KeyError(f"role {role!r} has no pool in mapping")
        return self.resource_pools[pool]

    def backend_of(self, role: Literal["actor", "critic"]) -> str:
        """The training backend of ``role`` (the critic follows the actor unless set)."""
        if role == "critic":
            return self.critic.backend or self.actor.backend
        return self.actor.backend

    def world_size(self, role: Role) -> int:
        """Ranks of a role: the devices of its pool on cuda, one per node on cpu.

        For an FSDP-trained role (actor, critic), ``fsdp.world_size`` when set.
        """
        nodes = self.pool_of(role)
        if role in ("actor", "critic"):
            section = self.actor if role == "actor" else self.critic
            if self.backend_of(role) == "fsdp" and section.fsdp.world_size is not None:
                return section.fsdp.world_size
        return len(nodes) if self.trainer.device == "cpu" else sum(nodes)

    def dp_size(self, role: Literal["actor", "critic"]) -> int:
        """Data-parallel size: how many ways a mini-batch is split."""
        section = self.actor if role == "actor" else self.critic
        world = self.world_size(role)
        if self.backend_of(role) == "fsdp":
            return max(1, world // section.fsdp.sequence_parallel_size)
        m = section.megatron
        if m.data_parallel_size is not None:
            return m.data_parallel_size
        model_parallel = (
            m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
        )
        return max(1, world // model_parallel)

    def ref_section(self) -> ActorConfig:
        """The section the reference model is built and run with: the actor's, in
        ``ref.dtype`` (a frozen copy needs no optimizer, but its compute dtype is its own)."""
        return self.actor.model_copy(update={"dtype": self.ref.dtype or self.actor.dtype})

    def rollout_replicas(self) -> int:
        """Rollout replicas: the explicit count, else as many as fit the rollout pool."""
        if self.rollout.replicas is not None:
            return self.rollout.replicas
        nodes = self.pool_of("rollout")
        if self.trainer.device == "cpu":
            return len(nodes)
        return max(1, sum(nodes) // self.rollout.tensor_parallel_size)

    def run_dir(self) -> Path:
        return Path(
            self.trainer.default_local_dir
            or f"outputs/runs/{self.trainer.project_name}/{self.trainer.experiment_name}"
        )
