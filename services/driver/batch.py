"""The driver's batches: what one step generated and scored, and the trainer's batch
built from it (verl's layout), plus the metrics only the driver knows.

With dynamic sampling (DAPO) a step's batch is assembled from several generation rounds:
:func:`select_prompts` keeps the prompt groups that stay and :func:`concat_prompts` joins
the rounds' prompts, so the trainer's batch is built as from one loader batch."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rlfleet.rollout.engine import SampleOutput

__all__ = [
    "Batch",
    "GeneratedBatch",
    "concat_prompts",
    "multi_turn_metrics",
    "prompt_ids",
    "rollout_metrics",
    "select_prompts",
    "token_staleness_metrics",
    "trainer_batch",
]

Batch = dict[str, Any]
"""Named tensors ``[B, ...]`` and length-``B`` lists (the loader's and the trainer's)."""


@dataclass
class GeneratedBatch:
    """One step's prompts with their responses and scores (what the trainer needs)."""

    step: int
    prompts: Batch  # the loader's batch (tensors + columns)
    loader_state: dict[str, Any]  # the loader position after this batch
    epoch: int
    samples: list[SampleOutput]  # ordered (prompt, sample)
    scores: list[float]
    timing: dict[str, float]
    min_weight_version: int = 0
    requeued_samples: int = 0  # samples re-generated after their replica failed
    sampling: dict[str, float] = field(default_factory=dict)  # dynamic sampling, shaping
    # Built by the source already (external rollouts: rlfleet.driver.external); None:
    # trainer_batch() builds it from prompts and samples.
    trainer_batch: Batch | None = None
    extra_metrics: dict[str, float] = field(default_factory=dict)


def prompt_ids(batch: Batch) -> list[list[int]]:
    """Each prompt's token ids without padding (the dataset's ``raw_prompt_ids``)."""
    ids: list[list[int]] = batch["raw_prompt_ids"]
    return ids


def select_prompts(batch: Batch, rows: Sequence[int]) -> Batch:
    """The loader batch's ``rows`` (tensors and per-prompt lists), in that order."""
    index = torch.as_tensor(list(rows), dtype=torch.long)
    size = len(batch["raw_prompt_ids"])
    out: Batch = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            out[key] = value.index_select(0, index)
        elif isinstance(value, list) and len(value) == size:
            out[key] = [value[i] for i in rows]
        else:
            raise ValueError(f"prompt batch column {key!r} is not per prompt: {type(value)}")
    return out


def concat_prompts(batches: Sequence[Batch]) -> Batch:
    """Loader batches joined row-wise (their tensors have the same width: the dataset
    pads every prompt to ``max_prompt_length``)."""
    first = batches[0]
    if any(b.keys() != first.keys() for b in batches):
        raise ValueError("prompt batches with different columns cannot be joined")
    return {
        key: torch.cat([b[key] for b in batches])
        if isinstance(first[key], torch.Tensor)
        else [x for b in batches for x in b[key]]
        for key in first
    }


def trainer_batch(gb: GeneratedBatch, n: int, pad_token_id: int) -> Batch:
    """verl's batch: prompts left-padded, responses right-padded, ``n`` rows per prompt.

    Returns ``input_ids`` / ``attention_mask`` ``[B, P + R]``, ``responses`` /
    ``response_mask`` ``[B, R]``, ``scores`` ``[B]`` and ``uid`` (one group id per
    prompt, ``"<step>-<prompt>"``), ``B = prompts x n``.

    ``attention_mask`` covers every real token; ``response_mask`` only the tokens the
    model generated: a multi-turn sample's tool turns (``loss_mask`` 0) are attended
    to but left out of every loss, advantage and metric (verl's ``response_mask``).

    ``rollout_log_probs`` ``[B, R]`` (the engine's log-prob of each response token, 0
    on padding) is there when every sample carries one per token.
    """
    p = gb.prompts
    mask = p["attention_mask"]
    width = max(1, int(mask.sum(-1).max()))
    prompt_tokens = p["input_ids"][:, -width:].repeat_interleave(n, dim=0)
    prompt_mask = mask[:, -width:].repeat_interleave(n, dim=0)
    lengths = torch.tensor([len(s.token_ids) for s in gb.samples], dtype=torch.long)
    r_len = max(1, int(lengths.max()))
    flat = torch.tensor(
        list(itertools.chain.from_iterable(s.token_ids for s in gb.samples)), dtype=torch.long
    )  # chained in C, one conversion
    responses = torch.full((len(gb.samples), r_len), pad_token_id, dtype=torch.long)
    real = (torch.arange(r_len).unsqueeze(0) < lengths.unsqueeze(1)).long()
    responses[real.bool()] = flat
    response_mask = real
    if any(s.loss_mask for s in gb.samples):
        response_mask = torch.zeros_like(real)
        response_mask[real.bool()] = torch.tensor(
            list(itertools.chain.from_iterable(_loss_mask(s) for s in gb.samples)),
            dtype=torch.long,
        )
    uid = [f"{gb.step}-{i}" for i in range(prompt_tokens.shape[0] // n) for _ in range(n)]
    out = {
        "input_ids": torch.cat([prompt_tokens, responses], dim=1),
        "attention_mask": torch.cat([prompt_mask, real], dim=1),
        "responses": responses,
        "response_mask": response_mask,
        "scores": torch.tensor(gb.scores, dtype=torch.float32),
        "uid": uid,
    }
    if all(len(s.logprobs) == len(s.token_ids) for s in gb.samples):
        rollout_log_probs = torch.zeros((len(gb.samples), r_len), dtype=torch.float32)
        rollout_log_probs[real.bool()] = torch.tensor(
            list(itertools.chain.from_iterable(s.logprobs for s in gb.samples)),
            dtype=torch.float32,
        )
        out["rollout_log_probs"] = rollout_log_probs
    return out


def _loss_mask(s: SampleOutput) -> Iterable[int]:
    """A sample's loss mask; a single-turn sample's (empty) is all ones."""
    if s.loss_mask:
        if len(s.loss_mask) != len(s.token_ids):
            raise ValueError(
                f"sample {s.prompt_index}/{s.sample_index}: loss_mask has {len(s.loss_mask)} "
                f"entries for {len(s.token_ids)} tokens"
            )
        return s.loss_mask
    return itertools.repeat(1, len(s.token_ids))


def rollout_metrics(gb: GeneratedBatch, policy_version: int) -> dict[str, float]:
    """What only the driver knows about a batch: the weight versions its samples were
    generated with against the policy's. The batch's data metrics (scores, advantages,
    lengths, ...) come from the trainer, defined once
    (:func:`rlfleet.trainer.ppo.metric_utils.compute_data_metrics`).

    ``staleness/*`` count samples (each at its oldest version); the token metrics
    (:func:`token_staleness_metrics`) count the model's tokens, each at the version
    that produced it, which is what partial rollouts change."""
    versions = np.array([s.weight_version for s in gb.samples], dtype=np.float64)
    stale = policy_version - versions
    out = {
        "staleness/mean": float(stale.mean()),
        "staleness/max": float(stale.max()),
        "rollout/weight_version": float(versions.min()),
    }
    out.update(token_staleness_metrics(gb.samples, policy_version))
    if any(s.loss_mask for s in gb.samples):
        out.update(multi_turn_metrics(gb.samples))
    return out


def token_staleness_metrics(
    samples: Sequence[SampleOutput], policy_version: int
) -> dict[str, float]:
    """Staleness per generated token: ``policy_version`` minus the version of the
    weights that produced it (``SampleOutput.token_weight_versions``, or the sample's
    ``weight_version`` for every token when it has none); tokens the replica inserted
    (multi-turn ``loss_mask`` 0) are not counted.

    Returns ``rollout/stale_token_frac`` (share of tokens from older weights than the
    policy's), ``rollout/token_staleness_mean`` and ``_max``, and
    ``rollout/partial_sample_frac`` (share of samples whose tokens span more than one
    version: continued across a weight update)."""
    lengths = np.fromiter((len(s.token_ids) for s in samples), np.int64, len(samples))
    tagged = np.fromiter((bool(s.token_weight_versions) for s in samples), bool, len(samples))
    whole = np.array([s.weight_version for s in samples], dtype=np.int64)
    # Tokens in sample order: a tagged sample's own list, else its version repeated.
    per_sample = [
        np.asarray(s.token_weight_versions, dtype=np.int64) if t else np.full(n, v, dtype=np.int64)
        for s, t, n, v in zip(samples, tagged, lengths.tolist(), whole.tolist(), strict=True)
    ]
    versions = np.concatenate(per_sample) if per_sample else np.zeros(0, np.int64)
    if any(s.loss_mask for s in samples):
        mask = np.concatenate(
            [
                np.asarray(s.loss_mask, dtype=bool) if s.loss_mask else np.ones(n, dtype=bool)
                for s, n in zip(samples, lengths.tolist(), strict=True)
            ]
        )
        versions = versions[mask]
    partial = sum(int(v.size > 0 and v.min() != v.max()) for v in per_sample)
    out = {"rollout/partial_sample_frac": partial / max(1, len(samples))}
    if versions.size == 0:
        return out
    stale = policy_version - versions
    out.update(
        {
            "rollout/stale_token_frac": float(np.count_nonzero(stale > 0) / stale.size),
            "rollout/token_staleness_mean": float(stale.mean()),
            "rollout/token_staleness_max": float(stale.max()),
        }
    )
    return out


def multi_turn_metrics(samples: Sequence[SampleOutput]) -> dict[str, float]:
    """Of multi-turn samples: model turns per sample (``multi_turn/turns/*``, runs of
    loss-mask 1s) and tokens the replica inserted (``multi_turn/tool_tokens/mean``:
    tool turns and turn markers, masked out of the loss)."""
    turns, inserted = [], []
    for s in samples:
        m = np.asarray(s.loss_mask if s.loss_mask else [1] * min(1, len(s.token_ids)), np.int8)
        turns.append(int(m[0]) + int(np.count_nonzero(np.diff(m) == 1)) if m.size else 0)
        inserted.append(int(m.size - np.count_nonzero(m)))
    t = np.asarray(turns, dtype=np.float64)
    return {
        "multi_turn/turns/mean": float(t.mean()),
        "multi_turn/turns/max": float(t.max()),
        "multi_turn/turns/min": float(t.min()),
        "multi_turn/tool_tokens/mean": float(np.mean(inserted)),
    }
