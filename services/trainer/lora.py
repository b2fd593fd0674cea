"""The LoRA actor: peft adapters on the policy, and the tensors that leave the trainer.

With ``actor.lora_rank > 0`` the FSDP backend wraps the actor in a peft ``PeftModel``
(``LoraConfig(r=lora_rank, lora_alpha, target_modules, lora_dropout=0)``): the base
weights are frozen, and only the adapters (``lora_A``, ``lora_B`` of each targeted
linear layer) are trainable and in the optimizer. The reference policy is the same
model with its adapters disabled (``PeftModel.disable_adapter``), as in verl: no
second copy of the model.

What leaves the trainer, in Hugging Face names of the base model:

* a weight push: the adapters only (:func:`iter_adapter`), named and scaled as
  :mod:`rlfleet.weightsync.lora` says (``<module>.lora_A``, ``<module>.lora_B`` times
  ``lora_alpha / r``);
* a full push, the HF export and ``huggingface/`` of a checkpoint: the merged model,
  ``W = W0 + lora_alpha / r * B @ A`` (:func:`iter_merged`, :func:`merge_state`), which
  ``AutoModelForCausalLM.from_pretrained`` loads with no peft;
* a checkpoint's actor state: the adapter parameters only (peft names); the base comes
  from ``actor.model_path`` on load (:func:`adapter_names`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from rlfleet.weightsync.lora import LORA_A, LORA_B, merge

__all__ = [
    "adapter_names",
    "hf_name",
    "is_adapter_name",
    "iter_adapter",
    "iter_merged",
    "lora_layers",
    "merge_state",
    "wrap_lora",
]

#: The prefix peft puts before the base model's own names.
PEFT_PREFIX = "base_model.model."
_ADAPTER = "default"


def wrap_lora(
    model: nn.Module, *, rank: int, alpha: float, target_modules: str | Sequence[str]
) -> nn.Module:
    """``model`` with LoRA adapters on ``target_modules`` (peft; base weights frozen,
    ``B`` zero-initialised so the wrapped model starts equal to ``model``)."""
    from peft import LoraConfig, get_peft_model

    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    _check_targets(model, targets)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,  # type: ignore[arg-type]  # peft annotates int; a float scales
        target_modules=targets,
        lora_dropout=0.0,
        bias="none",
    )
    wrapped: nn.Module = get_peft_model(model, config)
    return wrapped


def _check_targets(model: nn.Module, targets: str | list[str]) -> None:
    """Adapters go on linear layers that own their weight: an embedding (peft's
    ``lora_embedding_*``, which the push and the export do not carry) or a layer tied
    to another (the output head of a model with tied embeddings: merging into it
    would change the input embeddings too, and the export drops it) is refused.

    Raises:
        FailedPrecondition: naming ``actor.target_modules`` and the module.
    """
    if isinstance(targets, str):  # "all-linear": peft leaves the output head out
        return
    from rlfleet.common.errors import FailedPrecondition

    wanted = set(targets)
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    for name, module in model.named_modules():
        if name.rpartition(".")[2] not in wanted and name not in wanted:
            continue
        why = None
        if isinstance(module, nn.Embedding):
            why = "an embedding (adapters go on linear layers)"
        elif tied and module is head:
            why = "the output head, tied to the input embeddings (tie_word_embeddings)"
        if why is not None:
            raise FailedPrecondition(
                f"actor.target_modules: {name} is {why}; leave it out",
                field="actor.target_modules",
                value=list(targets),
            )


def is_adapter_name(name: str) -> bool:
    """Whether a peft parameter / state name is an adapter tensor."""
    return ".lora_A." in name or ".lora_B." in name


def hf_name(peft_name: str) -> str:
    """``base_model.model.model.layers.0.q_proj.base_layer.weight`` ->
    ``model.layers.0.q_proj.weight`` (the base model's own name)."""
    return peft_name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def lora_layers(model: nn.Module) -> dict[str, Any]:
    """The base model's module path -> its peft ``LoraLayer``."""
    from peft.tuners.lora import LoraLayer

    return {
        hf_name(name): module
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer)
    }


def adapter_names(model: nn.Module) -> set[str]:
    """The trainable (adapter) parameter names of a peft model."""
    return {n for n, p in model.named_parameters() if p.requires_grad}


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)  # an FSDP2 shard: gather it (collective)
    return (full() if callable(full) else t).detach()


def _pair(layer: Any) -> tuple[torch.Tensor, torch.Tensor, float]:
    a = _full(layer.lora_A[_ADAPTER].weight)
    b = _full(layer.lora_B[_ADAPTER].weight)
    return a, b, float(layer.scaling[_ADAPTER])


def iter_adapter(
    model: nn.Module, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The push of a LoRA actor: per adapted module ``<module>.lora_A`` ``(r, in)`` and
    ``<module>.lora_B`` ``(out, r)`` pre-multiplied by ``lora_alpha / r``, on CPU, in
    ``dtype`` (None: the parameters'). Collective under FSDP (each half gathered)."""
    for path, layer in lora_layers(model).items():
        a, b, scale = _pair(layer)
        want = dtype or a.dtype
        yield f"{path}{LORA_A}", a.to(want).cpu()
        yield f"{path}{LORA_B}", (b.float() * scale).to(want).cpu()


def iter_merged(
    model: nn.Module, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every base-model parameter in Hugging Face names, adapted weights merged
    (``W0 + scale * B @ A`` in float32), one at a time, on CPU, in ``dtype``."""
    layers = lora_layers(model)
    for name, param in model.named_parameters():
        if is_adapter_name(name):
            continue
        hf = hf_name(name)
        t = _full(param)
        module = hf.removesuffix(".weight")
        if ".base_layer." in name and hf.endswith(".weight") and module in layers:
            a, b, scale = _pair(layers[module])
            t = merge(t, a, b.float() * scale)
        yield hf, (t if dtype is None else t.to(dtype)).cpu()


def merge_state(
    base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor], scale: float
) -> dict[str, torch.Tensor]:
    """A merged Hugging Face state from a base state (HF names, or peft names with
    ``base_layer``) and peft adapter tensors (``...<module>.lora_A.default.weight``).

    Raises:
        KeyError: an adapter names a module whose weight ``base`` lacks.
    """
    state = {hf_name(k): v for k, v in base.items() if not is_adapter_name(k)}
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in adapter.items():
        if not is_adapter_name(name):
            continue
        head, _, kind = hf_name(name).partition(".lora_")
        halves.setdefault(head, {})[kind.partition(".")[0]] = t
    for module, pair in halves.items():
        weight = f"{module}.weight"
        if weight not in state:
            raise KeyError(f"the adapter of {module!r} has no base weight {weight!r}")
        state[weight] = merge(state[weight], pair["A"], pair["B"].float() * scale)
    return state
