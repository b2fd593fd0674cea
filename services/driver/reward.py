"""How the driver scores: one typed adapter over whatever scores samples.

A run's reward is either a reward client (:class:`rlfleet.reward.client.RewardClient`:
the service in this process or over gRPC; anything with ``score(samples)``) or a
verl-style callable ``fn(list[Sample]) -> list[float | dict | ScoreResult]``.
:class:`RewardAdapter` turns either into ``score(batch, samples) -> (scores,
details)``: it builds the reward samples (prompt and response, text and ids),
normalises what comes back, and retries a recoverable failure (the service
restarting) with backoff.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rlfleet.common.errors import RlfleetError
from rlfleet.driver.batch import Batch, prompt_ids
from rlfleet.rollout.engine import SampleOutput

if TYPE_CHECKING:
    from rlfleet.reward.types import Sample

__all__ = [
    "RETRY_S",
    "RewardAdapter",
    "RewardFailed",
    "RewardFn",
    "RewardScorer",
    "reward_error_fractions",
    "reward_error_metrics",
    "reward_samples",
]

logger = logging.getLogger(__name__)

RETRY_S = 120.0
"""How long a recoverable failure is retried (``reward.retry_s``): a reward service
restarting needs a few seconds; one frozen is given up by its client's liveness probe
each try and may answer again later."""


@runtime_checkable
class RewardScorer(Protocol):
    """Anything that scores reward samples: the reward clients, a RewardManager."""

    def score(self, samples: Sequence[Sample]) -> Sequence[Any]: ...


ScoreLike = float | int | Mapping[str, Any] | Any  # a number, {"score": ...}, a ScoreResult
RewardFn = RewardScorer | Callable[[list["Sample"]], Sequence[ScoreLike]]
"""What ``PPOTrainer(reward_fn=...)`` takes."""


class RewardAdapter:
    """Scores a batch's samples with ``source`` (see the module docstring).

    Args:
        source: a :class:`RewardScorer` or a callable over a list of samples.
        tokenizer: the policy's tokenizer (decodes prompts and responses).
        reward_fn_key: the batch column that names each row's data source.
        retry_s: how long a recoverable failure is retried, with backoff (0: never).
    """

    def __init__(
        self, source: RewardFn, tokenizer: Any, reward_fn_key: str, *, retry_s: float = RETRY_S
    ) -> None:
        if not (isinstance(source, RewardScorer) or callable(source)):
            raise TypeError(
                f"reward_fn must have score(samples) or be callable, got {type(source).__name__}"
            )
        self.source = source
        self.tokenizer = tokenizer
        self.reward_fn_key = reward_fn_key
        self.retry_s = retry_s

    def score(
        self, batch: Batch, samples: Sequence[SampleOutput]
    ) -> tuple[list[float], list[dict[str, Any]]]:
        """Scores and the scorers' details of ``samples`` of ``batch``'s prompts, in order."""
        items = reward_samples(batch, samples, self.tokenizer, self.reward_fn_key)
        results = self._call(items)
        scores: list[float] = []
        details: list[dict[str, Any]] = []
        for r in results:
            if isinstance(r, int | float):
                scores.append(float(r))
                details.append({})
            elif isinstance(r, Mapping):
                scores.append(float(r["score"]))
                details.append(dict(r))
            else:  # a ScoreResult: the scorer's details (a verl compute_score's extra
                # keys, e.g. DAPO's "acc"), with the result's own error and time-out
                scores.append(float(r.score))
                detail: dict[str, Any] = {
                    k: v
                    for k, v in (getattr(r, "details", None) or {}).items()
                    if k not in ("error", "timed_out")
                }
                if getattr(r, "error", ""):
                    detail["error"] = r.error
                if getattr(r, "timed_out", False):
                    detail["timed_out"] = True
                details.append(detail)
        if len(scores) != len(items):
            raise RuntimeError(f"reward returned {len(scores)} scores for {len(items)} samples")
        return scores, details

    def _call(self, items: list[Sample]) -> Sequence[Any]:
        """A recoverable failure (the service restarting, frozen, a dropped connection)
        is retried with backoff for ``retry_s``; others propagate."""
        source = self.source
        deadline = time.monotonic() + self.retry_s
        attempt = 0
        while True:
            try:
                if isinstance(source, RewardScorer):
                    return source.score(items)
                return source(items)
            except RlfleetError as e:
                pause = min(2.0**attempt, 5.0)
                if not e.recoverable or time.monotonic() + pause > deadline:
                    raise
                attempt += 1
                left = deadline - time.monotonic()
                logger.warning("reward: %s; retrying in %.0fs (attempt %d, %.0fs of "
                               "reward.retry_s left)", e, pause, attempt + 1, left)  # fmt: skip
                time.sleep(pause)


class RewardFailed(RuntimeError):
    """More of a step's samples failed to score than ``reward.max_error_fraction``."""


def reward_error_metrics(
    details: Sequence[Mapping[str, Any]], max_error_fraction: float
) -> dict[str, float]:
    """``reward/error_fraction`` and ``reward/timeout_fraction`` of a step's samples.

    A sample whose scorer raised (a reward function's exception, a failed reward
    model) scored 0 with its ``error``; a time-out is not such an error. Beyond
    ``max_error_fraction`` of the samples the run stops, naming the first error (verl
    stops at any); below it each step with errors says so once in the log.

    Raises:
        RewardFailed: too many errors.
    """
    failed = _failures(details)
    total = max(len(details), 1)
    if failed and len(failed) / total > max_error_fraction:
        raise RewardFailed(
            f"{len(failed)} of {len(details)} samples failed to score (over "
            f"reward.max_error_fraction={max_error_fraction:g}); the first: {failed[0]}"
        )
    if failed:
        logger.warning(
            "reward: %d of %d samples failed to score and count as 0 "
            "(reward.max_error_fraction=%g); the first: %s",
            len(failed), len(details), max_error_fraction, failed[0],
        )  # fmt: skip
    return reward_error_fractions(details)


def _failures(details: Sequence[Mapping[str, Any]]) -> list[str]:
    return [str(d["error"]) for d in details if d.get("error") and not d.get("timed_out")]


def reward_error_fractions(details: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The share of samples whose scorer failed, and of those that timed out."""
    total = max(len(details), 1)
    return {
        "reward/error_fraction": len(_failures(details)) / total,
        "reward/timeout_fraction": sum(1 for d in details if d.get("timed_out")) / total,
    }


def reward_samples(
    batch: Batch, samples: Sequence[SampleOutput], tokenizer: Any, reward_fn_key: str
) -> list[Sample]:
    """The reward service's samples for ``samples`` of ``batch``'s prompts.

    Each carries its prompt as the policy saw it (text and token ids, decoded once
    per prompt: its n samples share it), the prompt's chat turns when the dataset
    kept them (``raw_prompt``: a reward model with a chat template reads the
    conversation, not the policy's rendering of it), and the response as text and
    token ids (DESIGN: reward is prompt and response in).
    """
    from rlfleet.reward.types import ChatMessage, Sample

    texts = tokenizer.batch_decode([s.token_ids for s in samples], skip_special_tokens=True)
    used = sorted({s.prompt_index for s in samples})
    ids = prompt_ids(batch)
    decoded = tokenizer.batch_decode([ids[i] for i in used], skip_special_tokens=True)
    prompts = dict(zip(used, decoded, strict=True))
    chats = batch.get("raw_prompt")
    items: list[Sample] = []
    for s, text in zip(samples, texts, strict=True):
        i = s.prompt_index
        rm = batch["reward_model"][i] if "reward_model" in batch else None
        extra = batch["extra_info"][i] if "extra_info" in batch else None
        turns = chats[i] if chats is not None else ()
        items.append(
            Sample(
                data_source=str(batch[reward_fn_key][i]),
                response=text,
                ground_truth=rm.get("ground_truth") if isinstance(rm, dict) else None,
                prompt=prompts[i],
                prompt_messages=[ChatMessage(str(m["role"]), str(m["content"])) for m in turns],
                extra_info=dict(extra) if isinstance(extra, dict) else {},
                prompt_ids=list(ids[i]),
                response_ids=list(s.token_ids),
            )
        )
    return items
