"""Hugging Face Llama / Qwen2 weights <-> megatron-core ``GPTModel`` weights.

Pure tensor code (no process group, no megatron import), so it is tested on CPU.

Layout of the megatron model (``get_gpt_layer_local_spec``, RMSNorm, SwiGLU, RoPE):

=================================================  ==========================================
Hugging Face                                       megatron-core (local layer index ``j``)
=================================================  ==========================================
``model.embed_tokens.weight``                      ``embedding.word_embeddings.weight`` (vocab)
``model.layers.i.input_layernorm.weight``          ``decoder.layers.j.input_layernorm.weight``
``model.layers.i.self_attn.{q,k,v}_proj.weight``   ``decoder.layers.j.self_attention.linear_qkv.weight``
``model.layers.i.self_attn.{q,k,v}_proj.bias``     ``decoder.layers.j.self_attention.linear_qkv.bias``
``model.layers.i.self_attn.o_proj.weight``         ``decoder.layers.j.self_attention.linear_proj.weight``
``model.layers.i.post_attention_layernorm.weight`` ``decoder.layers.j.pre_mlp_layernorm.weight``
``model.layers.i.mlp.{gate,up}_proj.weight``       ``decoder.layers.j.mlp.linear_fc1.weight``
``model.layers.i.mlp.down_proj.weight``            ``decoder.layers.j.mlp.linear_fc2.weight``
``model.norm.weight``                              ``decoder.final_layernorm.weight``
``lm_head.weight`` (untied) / ``score.*``          ``output_layer.weight`` / ``output_layer.linear.*``
=================================================  ==========================================

Fusions: ``linear_qkv`` holds, for each of the ``g`` key/value groups in turn, that
group's ``heads / g`` query heads, then its key head, then its value head (rows of
``head_dim``); ``linear_fc1`` is ``[gate; up]``. Tensor parallelism splits each kind of
tensor its own way (:data:`KINDS`): by rows (``col``), by columns (``row``), query groups
(``qkv``: whole groups per rank), gate and up separately (``fc1``), vocabulary rows padded
to a multiple of the TP size (``vocab``), or not at all (``rep``). Optimizer moments are
element-wise, so they convert exactly like the parameters they belong to.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from rlfleet.common.errors import FailedPrecondition

__all__ = [
    "KINDS",
    "ModelShape",
    "ParamSpec",
    "fuse",
    "param_specs",
    "read_hf_tensors",
    "shard",
    "split",
    "unshard",
]

Kind = Literal["rep", "col", "row", "qkv", "fc1", "vocab"]
KINDS: tuple[Kind, ...] = ("rep", "col", "row", "qkv", "fc1", "vocab")

_SUPPORTED = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class ModelShape:
    """What the conversion needs from a Hugging Face decoder config."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    sliding_window: int | None = None

    @classmethod
    def from_hf(cls, config: Any) -> ModelShape:
        """Read a ``transformers`` config; unsupported architectures raise
        ``FailedPrecondition`` naming the offending field."""
        model_type = getattr(config, "model_type", "?")
        if model_type not in _SUPPORTED:
            raise FailedPrecondition(
                f"the megatron backend converts {', '.join(_SUPPORTED)} models, not {model_type!r}",
                field="model_type",
                value=model_type,
            )
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
        rope = dict(rope or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise FailedPrecondition(
                "the megatron backend supports plain RoPE only",
                field="rope_parameters.rope_type",
                value=rope_type,
            )
        if getattr(config, "mlp_bias", False):
            raise FailedPrecondition(
                "the megatron backend has no MLP biases", field="mlp_bias", value=True
            )
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        window = getattr(config, "sliding_window", None)
        if model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
            window = None
        heads = int(config.num_attention_heads)
        qkv_bias = model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        return cls(
            model_type=model_type,
            num_layers=int(config.num_hidden_layers),
            hidden_size=int(config.hidden_size),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            ffn_hidden_size=int(config.intermediate_size),
            vocab_size=int(config.vocab_size),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            rope_theta=float(theta),
            rms_norm_eps=float(config.rms_norm_eps),
            max_position_embeddings=int(config.max_position_embeddings),
            sliding_window=int(window) if window else None,
        )

    def padded_vocab(self, tp: int) -> int:
        """Vocabulary rows in the megatron model: a multiple of the TP size."""
        return -(-self.vocab_size // tp) * tp

    def check_parallel(self, tp: int, pp: int) -> None:
        """Raise ``FailedPrecondition`` when the model does not split ``tp`` x ``pp`` ways."""
        if self.num_kv_heads % tp:
            raise FailedPrecondition(
                f"tensor_model_parallel_size {tp} must divide num_key_value_heads "
                f"{self.num_kv_heads}",
                field="megatron.tensor_model_parallel_size",
                value=tp,
            )
        if self.num_layers % pp:
            raise FailedPrecondition(
                f"pipeline_model_parallel_size {pp} must divide num_hidden_layers "
                f"{self.num_layers}",
                field="megatron.pipeline_model_parallel_size",
                value=pp,
            )


@dataclass(frozen=True)
class ParamSpec:
    """One megatron parameter and the Hugging Face tensors it is made of.

    ``stage`` is the pipeline stage holding it (``-1``: the last); ``mcore`` is its name
    on that stage (local layer index)."""

    mcore: str
    hf: tuple[str, ...]
    kind: Kind
    stage: int


def param_specs(shape: ModelShape, pp: int = 1, *, role: str = "actor") -> list[ParamSpec]:
    """Every megatron parameter of the model, in Hugging Face order.

    ``role`` is ``actor`` / ``ref`` (causal LM) or ``critic`` (backbone + ``score`` head
    of width 1)."""
    per_stage = shape.num_layers // pp
    specs = [
        ParamSpec("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", 0)
    ]
    for i in range(shape.num_layers):
        stage, j = divmod(i, per_stage)
        hf = f"model.layers.{i}."
        mc = f"decoder.layers.{j}."
        qkv = tuple(f"{hf}self_attn.{p}_proj.weight" for p in "qkv")
        specs += [
            ParamSpec(
                f"{mc}input_layernorm.weight", (f"{hf}input_layernorm.weight",), "rep", stage
            ),
            ParamSpec(f"{mc}self_attention.linear_qkv.weight", qkv, "qkv", stage),
        ]
        if shape.qkv_bias:
            bias = tuple(f"{hf}self_attn.{p}_proj.bias" for p in "qkv")
            specs.append(ParamSpec(f"{mc}self_attention.linear_qkv.bias", bias, "qkv", stage))
        specs += [
            ParamSpec(
                f"{mc}self_attention.linear_proj.weight",
                (f"{hf}self_attn.o_proj.weight",),
                "row",
                stage,
            ),
            ParamSpec(
                f"{mc}pre_mlp_layernorm.weight",
                (f"{hf}post_attention_layernorm.weight",),
                "rep",
                stage,
            ),
            ParamSpec(
                f"{mc}mlp.linear_fc1.weight",
                (f"{hf}mlp.gate_proj.weight", f"{hf}mlp.up_proj.weight"),
                "fc1",
                stage,
            ),
            ParamSpec(f"{mc}mlp.linear_fc2.weight", (f"{hf}mlp.down_proj.weight",), "row", stage),
        ]
    specs.append(ParamSpec("decoder.final_layernorm.weight", ("model.norm.weight",), "rep", -1))
    if role == "critic":
        specs.append(ParamSpec("output_layer.linear.weight", ("score.weight",), "rep", -1))
        specs.append(ParamSpec("output_layer.linear.bias", ("score.bias",), "rep", -1))
    elif not shape.tie_word_embeddings:
        specs.append(ParamSpec("output_layer.weight", ("lm_head.weight",), "vocab", -1))
    return specs


# ------------------------------------------------------------------ fusion


def fuse(spec: ParamSpec, parts: list[torch.Tensor], shape: ModelShape) -> torch.Tensor:
    """The full (unsharded) megatron tensor of ``spec`` from its Hugging Face tensors."""
    if spec.kind == "qkv":
        g = shape.num_kv_heads
        q, k, v = (t.reshape(g, -1, *t.shape[1:]) for t in (parts[0], parts[1], parts[2]))
        return torch.cat([q, k, v], dim=1).reshape(-1, *parts[0].shape[1:])
    if spec.kind == "fc1":
        return torch.cat(parts, dim=0)
    return parts[0]


def split(spec: ParamSpec, full: torch.Tensor, shape: ModelShape) -> list[torch.Tensor]:
    """The inverse of :func:`fuse`: the Hugging Face tensors of ``spec``."""
    if spec.kind == "qkv":
        g, d = shape.num_kv_heads, shape.head_dim
        per_group = shape.num_heads // g * d
        grouped = full.reshape(g, per_group + 2 * d, *full.shape[1:])
        q, k, v = torch.split(grouped, [per_group, d, d], dim=1)
        return [t.reshape(-1, *full.shape[1:]) for t in (q, k, v)]
    if spec.kind == "fc1":
        return list(torch.chunk(full, 2, dim=0))
    if spec.kind == "vocab":
        return [full[: shape.vocab_size]]
    return [full]


# ------------------------------------------------------------------ tensor parallelism


def shard(kind: Kind, full: torch.Tensor, rank: int, tp: int, vocab_rows: int = 0) -> torch.Tensor:
    """TP rank ``rank``'s slice of a full megatron tensor (``vocab_rows``: padded vocab)."""
    if kind == "vocab" and full.shape[0] < vocab_rows:
        pad = full.new_zeros(vocab_rows - full.shape[0], *full.shape[1:])
        full = torch.cat([full, pad])
    if tp == 1 or kind == "rep":
        return full
    if kind == "row":
        return full.chunk(tp, dim=1)[rank]
    if kind == "fc1":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    return full.chunk(tp, dim=0)[rank]


def unshard(kind: Kind, pieces: list[torch.Tensor]) -> torch.Tensor:
    """The full megatron tensor from every TP rank's slice, in rank order."""
    if len(pieces) == 1 or kind == "rep":
        return pieces[0]
    if kind == "row":
        return torch.cat(pieces, dim=1)
    if kind == "fc1":
        halves = [p.chunk(2, dim=0) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(pieces, dim=0)


# ------------------------------------------------------------------ reading


def read_hf_tensors(path: str | Path, names: set[str]) -> dict[str, torch.Tensor]:
    """Read only ``names`` from a Hugging Face folder's safetensors (one file or an
    index of shards); names missing from the checkpoint are left out of the result."""
    from safetensors import safe_open

    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    elif (folder / "model.safetensors").is_file():
        weight_map = dict.fromkeys(names, "model.safetensors")
    else:
        raise FailedPrecondition(
            "the megatron backend loads safetensors checkpoints; none found",
            field="model_path",
            value=str(folder),
        )
    by_file: dict[str, list[str]] = {}
    for name in names:
        if name in weight_map:
            by_file.setdefault(weight_map[name], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for file, wanted in by_file.items():
        with safe_open(str(folder / file), framework="pt") as f:
            present = set(f.keys())
            for name in wanted:
                if name in present:
                    out[name] = f.get_tensor(name)
    return out


def iter_stage_specs(specs: list[ParamSpec], stage: int, pp: int) -> Iterator[ParamSpec]:
    """The specs held by pipeline stage ``stage``."""
    for spec in specs:
        if spec.stage == stage or (spec.stage == -1 and stage == pp - 1):
            yield spec
