"""LoRA weight updates: how adapter tensors are named on the wire and merged.

A LoRA actor (``actor.lora_rank > 0``, :mod:`rlfleet.trainer.lora`) pushes only its
adapters. For every adapted linear layer ``<module>`` (the Hugging Face module path of
the base model, e.g. ``model.layers.0.self_attn.q_proj``) an update carries two
tensors:

* ``<module>.lora_A``: ``A`` ``(r, in_features)``;
* ``<module>.lora_B``: ``scale * B`` ``(out_features, r)``, the scale ``lora_alpha / r``
  already applied, so a receiver needs no adapter config.

The receiver keeps the base weight ``W0`` of every module it adapted and sets
``W = W0 + lora_B @ lora_A`` (:func:`merge`, computed in float32), so the next update
merges into ``W0`` again, not into the previous merge. An update holds the whole
adapter: a module adapted before and absent from it goes back to ``W0``. A full update
(plain parameter names) replaces the base weights. The two kinds never mix in one
update.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from rlfleet.common.errors import InvalidArgument

if TYPE_CHECKING:
    import torch

__all__ = [
    "LORA_A",
    "LORA_B",
    "check_lora_update",
    "is_lora_name",
    "lora_modules",
    "merge",
    "split_lora_name",
]

LORA_A = ".lora_A"
LORA_B = ".lora_B"


def is_lora_name(name: str) -> bool:
    """Whether ``name`` is an adapter tensor of a LoRA update."""
    return name.endswith((LORA_A, LORA_B))


def split_lora_name(name: str) -> tuple[str, str]:
    """``"m.q_proj.lora_A"`` -> ``("m.q_proj", "A")``."""
    module, _, kind = name.rpartition(".lora_")
    return module, kind


def lora_modules(names: Iterable[str]) -> dict[str, set[str]]:
    """Module path -> the adapter halves (``"A"``, ``"B"``) that ``names`` carry."""
    out: dict[str, set[str]] = {}
    for name in names:
        module, kind = split_lora_name(name)
        out.setdefault(module, set()).add(kind)
    return out


def merge(base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
    """``base + lora_b @ lora_a`` in float32, returned in ``base``'s dtype and device.

    Args:
        base: ``W0`` ``(out, in)``.
        lora_a: ``A`` ``(r, in)``.
        lora_b: ``scale * B`` ``(out, r)``.
    """
    dev = base.device
    delta = lora_b.to(dev).float() @ lora_a.to(dev).float()
    return (base.float() + delta).to(base.dtype)


Spec = tuple[str, tuple[int, ...]]  # dtype name, shape


def check_lora_update(
    specs: Mapping[str, Spec], model: Mapping[str, Spec], *, complete: bool = True
) -> None:
    """Raise ``InvalidArgument`` naming the tensor unless ``specs`` is a LoRA update of
    ``model`` (parameter name -> dtype and shape): adapter names only, each pair
    ``(r, in)`` / ``(out, r)`` of a 2-D weight ``(out, in)`` of the model, in its dtype;
    ``complete``: every module has both halves, of one rank."""
    plain = [n for n in specs if not is_lora_name(n)]
    if plain:
        raise InvalidArgument(
            f"a LoRA update (adapter tensors) also names model parameters {plain[:3]}: "
            "send adapters or full weights, not both",
            field=f"weights[{plain[0]!r}]",
            value=plain[0],
            code="MIXED_UPDATE",
        )
    ranks: dict[str, int] = {}
    for name, (dtype, shape) in specs.items():
        module, kind = split_lora_name(name)
        weight = f"{module}.weight"
        target = model.get(weight)
        if target is None or len(target[1]) != 2:
            raise InvalidArgument(
                f"LoRA tensor {name!r}: the model has no 2-D weight {weight!r}",
                field=f"weights[{name!r}]",
                value=name,
                code="UNKNOWN_TENSOR",
            )
        want_dtype, (out_f, in_f) = target[0], target[1]
        if dtype != want_dtype:
            raise InvalidArgument(
                f"tensor {name!r} has dtype {dtype}, the model holds {want_dtype}",
                field=f"weights[{name!r}].dtype",
                value=dtype,
                code="DTYPE_MISMATCH",
            )
        rank = shape[0] if kind == "A" else shape[-1]
        ok = (
            len(shape) == 2
            and (shape[1] == in_f if kind == "A" else shape[0] == out_f)
            and 0 < rank <= min(out_f, in_f)
        )
        if not ok or ranks.setdefault(module, rank) != rank:
            raise InvalidArgument(
                f"LoRA tensor {name!r} has shape {list(shape)}; {weight!r} is "
                f"{[out_f, in_f]}, so lora_A is (r, {in_f}) and lora_B ({out_f}, r) "
                "with one r per module",
                field=f"weights[{name!r}].shape",
                value=list(shape),
                code="SHAPE_MISMATCH",
            )
    if complete:
        halves = [m for m, k in lora_modules(specs).items() if k != {"A", "B"}]
        if halves:
            raise InvalidArgument(
                f"LoRA update has only one of lora_A / lora_B for {halves[:3]}",
                field="weights",
                value=halves[:3],
                code="MISSING_TENSORS",
            )
