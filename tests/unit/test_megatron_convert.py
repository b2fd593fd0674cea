"""Hugging Face <-> megatron-core tensor conversion: fusions, TP sharding, name tables."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlfleet.common.errors import FailedPrecondition
from rlfleet.trainer.megatron_convert import (
    KINDS,
    ModelShape,
    fuse,
    iter_stage_specs,
    param_specs,
    shard,
    split,
    unshard,
)


def _hf_config(**overrides: Any) -> SimpleNamespace:
    raw: dict[str, Any] = {
        "model_type": "llama",
        "num_hidden_layers": 4,
        "hidden_size": 16,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 4,
        "intermediate_size": 24,
        "vocab_size": 37,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 64,
    }
    raw.update(overrides)
    return SimpleNamespace(**raw)


SHAPE = ModelShape.from_hf(_hf_config())


def test_shape_reads_the_config() -> None:
    assert SHAPE.num_kv_heads == 2 and SHAPE.head_dim == 4 and SHAPE.rope_theta == 500000.0
    assert not SHAPE.qkv_bias
    assert ModelShape.from_hf(_hf_config(model_type="qwen2")).qkv_bias
    assert SHAPE.sliding_window is None
    qwen = _hf_config(model_type="qwen2", sliding_window=4096, use_sliding_window=False)
    assert ModelShape.from_hf(qwen).sliding_window is None  # Qwen2 ignores it unless asked
    mistral = _hf_config(model_type="mistral", sliding_window=4096)
    assert ModelShape.from_hf(mistral).sliding_window == 4096
    assert SHAPE.padded_vocab(1) == 37 and SHAPE.padded_vocab(4) == 40


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope_parameters.rope_type"),
        ({"mlp_bias": True}, "mlp_bias"),
    ],
)
def test_unsupported_models_are_refused_naming_the_field(
    overrides: dict[str, Any], field: str
) -> None:
    with pytest.raises(FailedPrecondition) as err:
        ModelShape.from_hf(_hf_config(**overrides))
    assert err.value.field == field


def test_parallel_layout_must_divide_the_model() -> None:
    SHAPE.check_parallel(2, 4)
    with pytest.raises(FailedPrecondition, match="num_key_value_heads 2"):
        SHAPE.check_parallel(4, 1)
    with pytest.raises(FailedPrecondition, match="num_hidden_layers 4"):
        SHAPE.check_parallel(1, 3)


def test_qkv_fusion_groups_query_heads_with_their_key_and_value() -> None:
    # Rows labelled by head: q heads 0..3 (value 10+h), k heads 0..1 (20+h), v (30+h).
    d, h = SHAPE.head_dim, SHAPE.hidden_size
    q = torch.arange(10, 14).repeat_interleave(d)[:, None].expand(-1, h).float()
    k = torch.arange(20, 22).repeat_interleave(d)[:, None].expand(-1, h).float()
    v = torch.arange(30, 32).repeat_interleave(d)[:, None].expand(-1, h).float()
    spec = param_specs(SHAPE)[2]
    assert spec.kind == "qkv"
    fused = fuse(spec, [q, k, v], SHAPE)
    heads = fused[::d, 0].tolist()
    # group 0: q0 q1 k0 v0, group 1: q2 q3 k1 v1 (megatron's layout)
    assert heads == [10, 11, 20, 30, 12, 13, 21, 31]
    back = split(spec, fused, SHAPE)
    for a, b in zip(back, (q, k, v), strict=True):
        assert torch.equal(a, b)


def test_every_spec_round_trips_through_fuse_and_split() -> None:
    shape = ModelShape.from_hf(_hf_config(model_type="qwen2"))
    g = torch.Generator().manual_seed(0)
    sizes = {
        "q_proj.weight": (16, 16),
        "k_proj.weight": (8, 16),
        "v_proj.weight": (8, 16),
        "q_proj.bias": (16,),
        "k_proj.bias": (8,),
        "v_proj.bias": (8,),
        "o_proj.weight": (16, 16),
        "gate_proj.weight": (24, 16),
        "up_proj.weight": (24, 16),
        "down_proj.weight": (16, 24),
        "layernorm.weight": (16,),
        "norm.weight": (16,),
        "embed_tokens.weight": (37, 16),
        "lm_head.weight": (37, 16),
    }
    for spec in param_specs(shape):
        parts = [torch.randn(sizes[_suffix(n)], generator=g) for n in spec.hf]
        back = split(spec, fuse(spec, parts, shape), shape)
        assert all(torch.equal(a, b) for a, b in zip(back, parts, strict=True)), spec


def _suffix(name: str) -> str:
    tail = ".".join(name.split(".")[-2:])
    return "layernorm.weight" if "layernorm" in tail else tail


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_tp_shards_reassemble_exactly(kind: str, tp: int) -> None:
    full = torch.randn(8 if kind != "vocab" else 37, 12)
    rows = SHAPE.padded_vocab(tp) if kind == "vocab" else 0
    pieces = [shard(kind, full, r, tp, rows) for r in range(tp)]  # type: ignore[arg-type]
    whole = unshard(kind, pieces)  # type: ignore[arg-type]
    assert torch.equal(whole[: full.shape[0]], full)
    if kind == "vocab":
        assert whole.shape[0] == rows and not whole[full.shape[0] :].any()


def test_fc1_shards_keep_gate_before_up_on_each_rank() -> None:
    gate = torch.zeros(8, 2)
    up = torch.ones(8, 2)
    local = shard("fc1", torch.cat([gate, up]), 1, 2)
    # rank 1: its half of gate, then its half of up (what megatron's SwiGLU chunks)
    assert local[:4].eq(0).all() and local[4:].eq(1).all()


def test_specs_cover_the_hf_model_once_and_split_over_stages() -> None:
    specs = param_specs(SHAPE, pp=2)
    names = [n for s in specs for n in s.hf]
    assert len(names) == len(set(names)) == 2 + 9 * 4 + 1
    assert "lm_head.weight" in names
    tied = param_specs(ModelShape.from_hf(_hf_config(tie_word_embeddings=True)))
    assert "lm_head.weight" not in {n for s in tied for n in s.hf}
    critic = param_specs(SHAPE, role="critic")
    assert {"score.weight", "score.bias"} <= {n for s in critic for n in s.hf}
    first = list(iter_stage_specs(specs, 0, 2))
    last = list(iter_stage_specs(specs, 1, 2))
    assert first[0].mcore == "embedding.word_embeddings.weight"
    assert last[-1].mcore == "output_layer.weight"
    # stage 1 holds HF layers 2 and 3 as its local layers 0 and 1
    assert any(s.hf[0] == "model.layers.2.input_layernorm.weight" for s in last)
    assert all(".layers.0." in s.mcore or ".layers.1." in s.mcore for s in last[:-2])
    assert len(first) + len(last) == len(specs)
