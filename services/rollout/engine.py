"""The engine plug point: what a generation backend (HF, vLLM) must provide.

Everything here is plain Python (no torch, no grpc), so the servicer, the client
and the scheduler can import the types without pulling in a model runtime.

**Log-prob definition.** For every sampled token the engine returns
``log softmax(logits / T)[token]`` with ``T = temperature`` when ``temperature > 0``
and the raw ``log softmax(logits)[token]`` when ``temperature == 0`` (greedy). This
is the distribution the sampler draws from *before* top-k / top-p truncation; it is
what verl's actor recomputes as ``old_log_prob`` (logits divided by the rollout
temperature, no truncation), so rollout log-probs and trainer log-probs agree up to
numerics. Top-k / top-p change which tokens can be drawn but are not reflected in
the log-prob (renormalising over the kept set would make them disagree with the
trainer's recompute). The vLLM engine reports the same quantity (its
``processed_logprobs`` mode with truncation off, see ``vllm_engine``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from rlfleet.common.errors import InvalidArgument

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "Engine",
    "EngineInfo",
    "FinishReason",
    "GenerationRequest",
    "SampleCallback",
    "SampleOutput",
    "SamplingParams",
]

#: ``max_tokens`` when a request leaves it at 0 (vLLM's default too).
DEFAULT_MAX_TOKENS = 16


class FinishReason(enum.IntEnum):
    """Why a sample ended; values equal ``rollout_pb2.FinishReason``."""

    STOP = 1  # an eos id or a stop id was sampled (and is the last returned token)
    LENGTH = 2  # max_tokens reached
    ABORT = 3


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample. Field meanings follow vLLM's ``SamplingParams``.

    Attributes:
        n: samples per prompt (>= 1).
        temperature: 0 is greedy (argmax); > 0 divides the logits.
        top_p: nucleus mass in (0, 1]; 1 disables.
        top_k: keep the k most likely tokens; <= 0 disables.
        max_tokens: new tokens per sample at most (>= 1).
        stop_token_ids: extra ids that end a sample, besides the model's eos ids.
        seed: makes the request's sampling reproducible; None: fresh randomness.
        logprobs: return the sampled tokens' log-probs (module docstring).
        ignore_eos: do not stop on the model's eos ids (stop_token_ids still stop).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: bool = True
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        problems = []
        if self.n < 1:
            problems.append(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            problems.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One caller's prompts (token ids) with its sampling parameters."""

    prompts: Sequence[Sequence[int]]
    params: SamplingParams


@dataclass(slots=True)
class SampleOutput:
    """One finished sample.

    Attributes:
        prompt_index: index of the prompt in its request.
        sample_index: 0 .. n-1.
        token_ids: the response tokens (a final stop/eos token included).
        logprobs: one per token (empty when not requested).
        finish_reason: why it ended.
        weight_version: the weights it was generated with.
        text: the decoded response, when asked for (filled at the service edge).
    """

    prompt_index: int
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int = 0
    text: str = ""


#: ``(request index in the batch, sample)``, called as soon as a sample finishes.
SampleCallback = Callable[[int, SampleOutput], None]


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What an engine serves."""

    engine: str  # "hf" | "vllm"
    model: str
    dtype: str
    device: str
    weight_version: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    extra: Mapping[str, str] = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    """A generation backend. Implementations: ``HFEngine``, ``VLLMEngine``.

    Calls come from one thread at a time (the core's batching thread, or the caller
    of an in-process client); implementations need no locking of their own beyond
    keeping ``update_weights`` atomic.
    """

    def validate(self, requests: Sequence[GenerationRequest]) -> None:
        """Raise ``InvalidArgument`` naming the field if a request cannot be served
        (empty prompt, token id outside the vocabulary, prompt + max_tokens over
        the model's length limit). Called before a request joins a batch."""
        ...

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        on_sample: SampleCallback | None = None,
    ) -> list[list[SampleOutput]]:
        """Generate for several requests as one batch.

        Returns, per request, its samples ordered by (prompt_index, sample_index);
        ``on_sample`` is also called for each sample as soon as it finishes.
        """
        ...

    def update_weights(
        self,
        named_tensors: Mapping[str, Any],
        version: int,
        *,
        on_release: Callable[[], None] | None = None,
    ) -> bool:
        """Replace the weights; all-or-nothing. Raises ``InvalidArgument`` naming the
        first tensor whose name, shape or dtype does not match the model.

        Without ``on_release`` the tensors may view a staging buffer that the next
        update reuses: copy them, never keep references to them. With it, the caller
        hands them over: the engine may *adopt* them as its weights (no copy) and
        return True; it then calls ``on_release()`` once, when it stops using them (a
        later adopted update replaced them, or ``sleep(2)`` dropped them), and the
        caller reuses their memory only after that. An engine that copies returns
        False and never calls it."""
        ...

    def check_weights(
        self, specs: Mapping[str, tuple[str, tuple[int, ...]]], *, complete: bool = True
    ) -> None:
        """Validate ``name -> (torch dtype name, shape)`` against the model without
        applying anything (lets a receiver refuse a transfer before the bytes move).
        ``complete=False`` skips the coverage check (``MISSING_TENSORS``): one bucket
        of a bucketed update names only part of the model."""
        ...

    def sleep(self, level: int = 1) -> int:
        """Release accelerator memory (1: offload weights, drop cache; 2: drop the
        weights too, the next ``update_weights`` restores them). Returns bytes freed."""
        ...

    def wake_up(self) -> None:
        """Take the memory back after :meth:`sleep`."""
        ...

    def info(self) -> EngineInfo:
        """Model, dtype, device, weight version, limits."""
        ...


def validate_requests(requests: Sequence[GenerationRequest], vocab_size: int, max_len: int) -> None:
    """Raise ``InvalidArgument`` naming the field of the first bad request: no prompts,
    an empty prompt, token or stop ids outside ``[0, vocab_size)``, or a prompt that
    with ``max_tokens`` would exceed the model's ``max_len``. Shared by every engine;
    the id ranges are checked in numpy, not token by token."""
    for r, req in enumerate(requests):
        if not req.prompts:
            raise InvalidArgument("no prompts", field=f"requests[{r}].prompts")
        for i, p in enumerate(req.prompts):
            if len(p) == 0:
                raise InvalidArgument(
                    "prompt has no tokens", field=f"prompts[{i}].token_ids", sample_index=i
                )
            bad = _out_of_vocab(p, vocab_size)
            if bad:
                raise InvalidArgument(
                    f"token ids {bad} outside the vocabulary [0, {vocab_size})",
                    field=f"prompts[{i}].token_ids",
                    value=bad,
                    sample_index=i,
                )
            total = len(p) + req.params.max_tokens
            if total > max_len:
                raise InvalidArgument(
                    f"prompt of {len(p)} tokens + max_tokens {req.params.max_tokens} = "
                    f"{total} exceeds the model's limit of {max_len} tokens",
                    field="sampling.max_tokens",
                    value=req.params.max_tokens,
                    sample_index=i,
                )
        bad_stop = _out_of_vocab(req.params.stop_token_ids, vocab_size)
        if bad_stop:
            raise InvalidArgument(
                f"stop ids {bad_stop} outside the vocabulary [0, {vocab_size})",
                field="sampling.stop_token_ids",
                value=bad_stop,
            )


def _out_of_vocab(ids: Sequence[int], vocab_size: int) -> list[int]:
    """Up to five ids outside ``[0, vocab_size)``, in order."""
    a = np.asarray(ids, dtype=np.int64)
    return [int(x) for x in a[(a < 0) | (a >= vocab_size)][:5]]
