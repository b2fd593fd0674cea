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

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["LORA_A", "LORA_B", "is_lora_name", "lora_modules", "merge", "split_lora_name"]

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
