"""The three models of the trainer and their forward passes on a micro-batch.

* **actor**: ``AutoModelForCausalLM``, trained.
* **critic**: the LM backbone with a scalar value head. Built, as verl does, with
  ``AutoModelForTokenClassification(num_labels=1)``: loading a causal-LM checkpoint into
  it keeps the backbone and starts a fresh head (zero-initialised here, so the first
  values are 0 and the first value loss is the returns' scale). Initialised from the
  actor's weights or from its own ``critic.model_path``.
* **ref**: ``AutoModelForCausalLM``, frozen (``requires_grad=False``, eval mode).

Sequences are ``prompt + response`` of length L, the response being the last R tokens.
The logit at position ``t`` predicts token ``t + 1``, so the response tokens are scored
by the logits at ``[L - R - 1, L - 1)``; values are read at the same positions (the value
of the state before each response token), as in verl.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rlfleet.trainer.packing import Packed, base_attn_implementation, scatter_responses
from rlfleet.trainer.ppo.core_algos import entropy_from_logits, logprobs_from_logits

__all__ = [
    "batch_to_device",
    "forward_log_prob",
    "forward_values",
    "load_actor",
    "load_critic",
    "load_ref",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def _common_kwargs(dtype: torch.dtype, trust_remote_code: bool) -> dict[str, Any]:
    return {
        "dtype": dtype,
        "trust_remote_code": trust_remote_code,
        "local_files_only": True,
        "attn_implementation": base_attn_implementation(),
    }


def load_actor(
    path: str, *, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False
) -> nn.Module:
    """The policy, trainable, in train mode (dropout is configured off by the model)."""
    from transformers import AutoModelForCausalLM

    model: nn.Module = AutoModelForCausalLM.from_pretrained(
        path, **_common_kwargs(dtype, trust_remote_code)
    )
    model.config.use_cache = False  # type: ignore[union-attr]
    return model


def load_ref(
    path: str, *, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False
) -> nn.Module:
    """The frozen reference policy."""
    model = load_actor(path, dtype=dtype, trust_remote_code=trust_remote_code)
    model.requires_grad_(False)
    model.eval()
    return model


def load_critic(
    path: str, *, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False
) -> nn.Module:
    """Backbone of ``path`` plus a scalar value head (zero-initialised when new)."""
    import logging

    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(
        path, trust_remote_code=trust_remote_code, local_files_only=True
    )
    config.num_labels = 1
    # The token-classification head applies dropout (0.1 by default) before the score:
    # values must be deterministic functions of the state.
    config.classifier_dropout = 0.0
    config.use_cache = False
    # Loading a causal-LM checkpoint leaves the head uninitialised; transformers logs a
    # warning saying so, which is expected here.
    tf_logger = logging.getLogger("transformers.modeling_utils")
    level = tf_logger.level
    tf_logger.setLevel(logging.ERROR)
    try:
        model, info = AutoModelForTokenClassification.from_pretrained(
            path,
            config=config,
            output_loading_info=True,
            **_common_kwargs(dtype, trust_remote_code),
        )
    finally:
        tf_logger.setLevel(level)
    head = _value_head(model)
    if any(k.startswith(_head_name(model)) for k in info.get("missing_keys", [])):
        with torch.no_grad():
            head.weight.zero_()
            if head.bias is not None:
                head.bias.zero_()
    result: nn.Module = model
    return result


def _head_name(model: nn.Module) -> str:
    for name in ("score", "classifier"):
        if isinstance(getattr(model, name, None), nn.Linear):
            return name
    raise TypeError(f"{type(model).__name__} has no linear 'score' or 'classifier' head")


def _value_head(model: nn.Module) -> nn.Linear:
    head = getattr(model, _head_name(model))
    assert isinstance(head, nn.Linear)
    return head


def batch_to_device(mb: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The micro-batch's tensors on ``device`` (the same dict on CPU)."""
    if device.type == "cpu":
        return mb
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
        for k, v in mb.items()
    }


def _model_inputs(mb: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {
        "input_ids": mb["input_ids"],
        "attention_mask": mb["attention_mask"],
        "position_ids": mb["position_ids"],
    }


def _packed_inputs(packed: Packed) -> dict[str, Any]:
    return {
        "input_ids": packed.input_ids,
        "position_ids": packed.position_ids,
        "rlfleet_packed": packed,
    }


def _check_packed(model: nn.Module, packed: Packed) -> None:
    if packed.calls == 0 and packed.tokens:
        raise RuntimeError(
            f"{type(model).__name__} ran a packed batch without calling the packing-aware "
            "attention, so its sequences could attend to each other: set "
            "use_remove_padding: false"
        )


_KEEPS_LOGITS: dict[type, bool] = {}


def _keep_logits(model: nn.Module, keep: int | torch.Tensor) -> dict[str, Any]:
    """``logits_to_keep=keep`` where the model's forward takes it (transformers' causal
    LMs do; remote code may not): the LM head then skips the other positions."""
    base = getattr(model, "get_base_model", None)  # a peft (LoRA) model passes it through
    cls = type(base() if callable(base) else model)
    if cls not in _KEEPS_LOGITS:
        import inspect

        _KEEPS_LOGITS[cls] = "logits_to_keep" in inspect.signature(cls.forward).parameters
    return {"logits_to_keep": keep} if _KEEPS_LOGITS[cls] else {}


def _token_scores(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    log_prob = logprobs_from_logits(logits, labels, temperature=temperature)
    entropy = entropy_from_logits(logits, temperature) if with_entropy else None
    return log_prob, entropy


def forward_log_prob(
    model: nn.Module,
    mb: dict[str, Any] | Packed,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of the response tokens of one micro-batch.

    Args:
        model: a causal LM (plain or FSDP-wrapped).
        mb: ``input_ids``, ``attention_mask``, ``position_ids`` ``(bs, L)``, ``responses``
            ``(bs, R)``; or the same micro-batch packed (:func:`~rlfleet.trainer.packing.pack`,
            the model switched with :func:`~rlfleet.trainer.packing.enable_packing`).
        temperature: logits are divided by it, as at sampling time.
        with_entropy: also return the per-token entropy of the tempered distribution
            (over the full vocabulary: only asked for when it is used).

    Returns:
        ``log_prob`` ``(bs, R)`` fp32 and ``entropy`` ``(bs, R)`` or None; packed, 0 on
        the positions that are not scored. Gradients flow if grad mode is on. The LM
        head runs only on the positions that predict a response token.
    """
    if isinstance(mb, Packed):
        keep = _keep_logits(model, mb.src)
        out = model(**_packed_inputs(mb), use_cache=False, **keep)
        _check_packed(model, mb)
        logits = out.logits[0] if keep else out.logits[0].index_select(0, mb.src)
        log_prob, entropy = _token_scores(logits, mb.labels, temperature, with_entropy)
        return (
            scatter_responses(log_prob, mb),
            scatter_responses(entropy, mb) if entropy is not None else None,
        )
    responses = mb["responses"]
    r = responses.shape[1]
    out = model(**_model_inputs(mb), use_cache=False, **_keep_logits(model, r + 1))
    logits = out.logits[:, -r - 1 : -1, :]
    return _token_scores(logits, responses, temperature, with_entropy)


def forward_values(model: nn.Module, mb: dict[str, Any] | Packed) -> torch.Tensor:
    """Critic values ``(bs, R)`` fp32 at the positions that predict the response tokens
    (packed: 0 on the positions that are not scored)."""
    if isinstance(mb, Packed):
        out = model(**_packed_inputs(mb))
        _check_packed(model, mb)
        return scatter_responses(out.logits[0, :, 0].index_select(0, mb.src).float(), mb)
    r = mb["responses"].shape[1]
    out = model(**_model_inputs(mb))
    values: torch.Tensor = out.logits[:, -r - 1 : -1, 0].float()
    return values
