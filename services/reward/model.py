"""A learned reward model: ``AutoModelForSequenceClassification`` with one label.

The model re-tokenizes the text with its own tokenizer: the reward service never
sees the policy's token ids. With a chat template, the conversation is the
sample's ``prompt_messages`` (or its ``prompt`` as one user turn) plus the
response as the assistant turn; without one, it is ``prompt + response``.

Batching is by token budget: samples are sorted by length and packed so that
``longest_in_batch * batch_size <= max_tokens_per_batch`` (and at most
``micro_batch_size`` samples), which keeps padding low on mixed lengths. Long
inputs keep their end (the response), truncated from the left.

torch and transformers are imported when a :class:`RewardModelScorer` is built,
never by importing this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlfleet.reward.types import Sample, ScoreOutcome

__all__ = ["RewardModelScorer", "pack_by_token_budget", "resolve_device"]

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def pack_by_token_budget(
    lengths: Sequence[int], max_tokens: int, max_batch: int | None = None
) -> list[list[int]]:
    """Group indices (sorted by length) so each padded batch fits ``max_tokens``.

    A single sample longer than the budget gets a batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        longest_if = max(longest, lengths[i])
        full = max_batch is not None and len(current) >= max_batch
        if current and (longest_if * (len(current) + 1) > max_tokens or full):
            batches.append(current)
            current, longest_if = [], lengths[i]
        current.append(i)
        longest = longest_if
    if current:
        batches.append(current)
    return batches


def resolve_device(device: str) -> str:
    """``auto``: ``cuda`` when torch sees a GPU, else ``cpu``; anything else as given."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class RewardModelScorer:
    """Scores samples with a sequence-classification reward model (CPU or GPU).

    Args:
        path: Hugging Face model directory (model + tokenizer).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...
        dtype: ``float32`` / ``bfloat16`` / ``float16``.
        max_tokens_per_batch: padded tokens per forward.
        micro_batch_size: most samples per forward (None: only the token budget).
        max_length: tokens per sample after truncation (None: the tokenizer's
            ``model_max_length``, capped at 4096).
    """

    def __init__(
        self,
        path: str,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_tokens_per_batch: int | None = None,
        micro_batch_size: int | None = None,
        max_length: int | None = None,
    ) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.path = path
        self.device = torch.device(device)
        self.tokenizer: Any = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.tokenizer.truncation_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model: Any = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=getattr(torch, _DTYPES[dtype]), local_files_only=True
        )
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(self.device).eval()
        limit = getattr(self.tokenizer, "model_max_length", 4096) or 4096
        self.max_length = max_length or min(int(limit), 4096)
        self.max_tokens_per_batch = max_tokens_per_batch or 8192
        self.micro_batch_size = micro_batch_size

    def text_for(self, sample: Sample) -> str:
        """The text the reward model reads for one sample."""
        if getattr(self.tokenizer, "chat_template", None):
            messages: list[dict[str, str]] = [
                {"role": m.role, "content": m.content} for m in sample.prompt_messages
            ]
            if not messages and sample.prompt:
                messages = [{"role": "user", "content": sample.prompt}]
            messages.append({"role": "assistant", "content": sample.response})
            text: str = self.tokenizer.apply_chat_template(messages, tokenize=False)
            return text
        return sample.prompt + sample.response

    def score(self, samples: Sequence[Sample]) -> list[ScoreOutcome]:
        """One scalar per sample: the model's single logit."""
        import torch

        if not samples:
            return []
        encoded = self.tokenizer(
            [self.text_for(s) for s in samples],
            add_special_tokens=False,
            truncation=True,
            max_length=self.max_length,
        )["input_ids"]
        lengths = [max(1, len(ids)) for ids in encoded]
        scores: list[float] = [0.0] * len(samples)
        for batch in pack_by_token_budget(
            lengths, self.max_tokens_per_batch, self.micro_batch_size
        ):
            padded = self.tokenizer.pad(
                {"input_ids": [encoded[i] or [self.tokenizer.pad_token_id] for i in batch]},
                return_tensors="pt",
            )
            with torch.inference_mode():
                logits = self.model(
                    input_ids=padded["input_ids"].to(self.device),
                    attention_mask=padded["attention_mask"].to(self.device),
                ).logits
            for i, value in zip(batch, logits[:, 0].float().cpu().tolist(), strict=True):
                scores[i] = float(value)
        return [ScoreOutcome(s, {"tokens": n}) for s, n in zip(scores, lengths, strict=True)]
