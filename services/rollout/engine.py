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
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from rlfleet.common.errors import InvalidArgument

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "MIN_TEMPERATURE",
    "CancelCheck",
    "Engine",
    "EngineInfo",
    "FinishReason",
    "GenerateLimits",
    "GenerationRequest",
    "SampleCallback",
    "SampleOutput",
    "SamplingParams",
    "WeightHandOver",
    "validate_requests",
    "validate_sampling",
]

#: ``max_tokens`` when a request leaves it at 0 (vLLM's default too).
DEFAULT_MAX_TOKENS = 16
#: The smallest temperature above 0 (greedy): below it ``logits / T`` overflows fp32
#: (``1e-45`` gives NaN log-probs) and sampling is greedy anyway.
MIN_TEMPERATURE = 1e-2


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
    """One caller's prompts (token ids) with its sampling parameters.

    ``seed_indices``: with a seed, each prompt's index for its sampling noise (None:
    its index in the request). A caller that splits one batch of prompts over several
    requests (the driver over its replicas, a re-queue after a replica fails) gives
    each prompt its index in the whole batch, and a seeded prompt then gets the same
    samples whichever request carries it.
    """

    prompts: Sequence[Sequence[int]]
    params: SamplingParams
    seed_indices: Sequence[int] | None = None

    def seed_index(self, i: int) -> int:
        """Prompt ``i``'s index for its sampling noise."""
        return i if self.seed_indices is None else int(self.seed_indices[i])


_M64 = (1 << 64) - 1


def mix_seed(*values: int) -> int:
    """A 63-bit seed from integers (SplitMix64-style; not a per-token path): a prompt's
    own seed from its request's and its seed index (vLLM takes one per prompt), a
    conversation turn's (multi-turn rollouts)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = ((h ^ (v & _M64)) * 0xBF58476D1CE4E5B9) & _M64
        h ^= h >> 31
        h = (h * 0x94D049BB133111EB) & _M64
        h ^= h >> 29
    return h & ((1 << 63) - 1)


@dataclass(slots=True)
class SampleOutput:
    """One finished sample.

    Attributes:
        prompt_index: index of the prompt in its request.
        sample_index: 0 .. n-1.
        token_ids: the response tokens (a final stop/eos token included).
        logprobs: one per token (empty when not requested).
        finish_reason: why it ended.
        weight_version: the weights it was generated with (a multi-turn sample
            whose turns saw several versions, or a partial rollout continued under
            newer weights: the oldest).
        text: the decoded response, when asked for (filled at the service edge).
        loss_mask: multi-turn samples: one 0/1 per token, 1 where the model
            generated it, 0 where the replica inserted it (tool results, the chat
            template's turn markers); ``logprobs`` are 0.0 where it is 0. Empty:
            every token is the model's (single-turn).
        token_weight_versions: one per token, the weight version that produced it
            (a partial rollout: a weight update landed while the sample was being
            generated and its later tokens came from the new weights). Empty: every
            token is ``weight_version``'s.
    """

    prompt_index: int
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int = 0
    text: str = ""
    loss_mask: list[int] = field(default_factory=list)
    token_weight_versions: list[int] = field(default_factory=list)


#: ``(request index in the batch, sample)``, called as soon as a sample finishes.
SampleCallback = Callable[[int, SampleOutput], None]
#: ``request index in the batch -> True`` once its caller gave up (cancelled, past
#: its deadline): the engine stops generating for it at the next decode step.
CancelCheck = Callable[[int], bool]


@dataclass(frozen=True, slots=True)
class GenerateLimits:
    """What one ``Generate`` request may ask of a replica, checked before it queues.

    The engine's own limit (prompt + ``max_tokens`` within the model's positions) is
    checked by ``Engine.validate``; these bound the work and memory of one request
    (the HF engine runs a request larger than a batch alone, all rows at once).

    Attributes:
        max_n: samples per prompt.
        max_prompts: prompts per request.
        max_samples: prompts x n per request.
        max_new_tokens: ``max_tokens`` of a request.
        max_request_tokens: sum over its samples of prompt length + ``max_tokens``
            (the tokens the engine may hold for the request).
        max_stop_token_ids: ``stop_token_ids`` of a request.
    """

    max_n: int = 64
    max_prompts: int = 8192
    max_samples: int = 8192
    max_new_tokens: int = 32768
    max_request_tokens: int = 1 << 24
    max_stop_token_ids: int = 256

    def __post_init__(self) -> None:
        bad = [f"{k}={getattr(self, k)}" for k in self.__slots__ if getattr(self, k) < 1]
        if bad:
            raise ValueError(f"generate limits must be >= 1: {', '.join(bad)}")

    def covering(self, config: Any) -> GenerateLimits:
        """These limits, each raised where a run of ``config`` needs more (a step's
        prompts x ``rollout.n`` on one replica, the response length, ``val_kwargs.n``):
        what a replica started with the run's config accepts, so that a config the
        checks took is not refused by its own replicas."""
        r, d = config.rollout, config.data
        prompts = max(d.train_batch_size, d.gen_batch_size or 0)
        samples = prompts * r.n
        max_tokens = r.response_length or d.max_response_length
        return GenerateLimits(
            max_n=max(self.max_n, r.n, r.val_kwargs.n),
            max_prompts=max(self.max_prompts, prompts),
            max_samples=max(self.max_samples, samples),
            max_new_tokens=max(self.max_new_tokens, max_tokens),
            max_request_tokens=max(
                self.max_request_tokens, samples * (d.max_prompt_length + max_tokens)
            ),
            max_stop_token_ids=self.max_stop_token_ids,
        )

    def check(self, request: GenerationRequest) -> None:
        """Raise ``InvalidArgument`` (code ``LIMIT_EXCEEDED``) naming the first field
        over its limit, with the value and the limit."""
        p = request.params
        n_prompts = len(request.prompts)
        samples = n_prompts * p.n
        prompt_tokens = sum(len(x) for x in request.prompts)
        checks: list[tuple[str, int, int, str]] = [
            ("sampling.n", p.n, self.max_n, "samples per prompt"),
            ("prompts", n_prompts, self.max_prompts, "prompts per request"),
            ("sampling.n", samples, self.max_samples, f"samples per request ({n_prompts} x n)"),
            ("sampling.max_tokens", p.max_tokens, self.max_new_tokens, "max_tokens"),
            (
                "sampling.stop_token_ids",
                len(p.stop_token_ids),
                self.max_stop_token_ids,
                "stop ids",
            ),
            (
                "prompts",
                p.n * (prompt_tokens + n_prompts * p.max_tokens),
                self.max_request_tokens,
                "tokens per request (n x (prompt tokens + prompts x max_tokens))",
            ),
        ]
        for field_name, value, limit, what in checks:
            if value > limit:
                raise InvalidArgument(
                    f"{what} {value} exceeds this replica's limit of {limit}",
                    field=field_name,
                    value=value,
                    code="LIMIT_EXCEEDED",
                )


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
        cancelled: CancelCheck | None = None,
    ) -> list[list[SampleOutput]]:
        """Generate for several requests as one batch.

        Returns, per request, its samples ordered by (prompt_index, sample_index);
        ``on_sample`` is also called for each sample as soon as it finishes. A request
        for which ``cancelled(r)`` turns True stops as soon as the engine can look
        (HF: between decode steps): its unfinished samples are dropped, and once every
        request of the batch is cancelled the batch ends.
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


def validate_sampling(p: SamplingParams) -> None:
    """Raise ``InvalidArgument`` naming the ``sampling.*`` field no engine can take:
    a temperature that is not 0 (greedy) or a finite number >= ``MIN_TEMPERATURE``,
    ``top_p`` outside (0, 1], ``top_k`` below -1 (-1 and 0 disable it)."""
    t = p.temperature
    # Compared in float32: the proto field's precision (0.01 arrives as 0.0099999998).
    if not (t == 0 or (math.isfinite(t) and t >= float(np.float32(MIN_TEMPERATURE)))):
        raise InvalidArgument(
            f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {t}",
            field="sampling.temperature",
            value=t,
        )
    if not (math.isfinite(p.top_p) and 0 < p.top_p <= 1):
        raise InvalidArgument(
            f"top_p must be in (0, 1], got {p.top_p}", field="sampling.top_p", value=p.top_p
        )
    if p.top_k < -1:
        raise InvalidArgument(
            f"top_k must be >= -1 (-1 or 0: off), got {p.top_k}",
            field="sampling.top_k",
            value=p.top_k,
        )


def validate_requests(requests: Sequence[GenerationRequest], vocab_size: int, max_len: int) -> None:
    """Raise ``InvalidArgument`` naming the field of the first bad request: sampling
    parameters no engine can take (:func:`validate_sampling`), no prompts, an empty
    prompt, token or stop ids outside ``[0, vocab_size)``, or a prompt that with
    ``max_tokens`` would exceed the model's ``max_len``. Shared by every engine; the
    id ranges are checked in numpy, not token by token."""
    for r, req in enumerate(requests):
        validate_sampling(req.params)
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


class WeightHandOver:
    """Partial rollouts: a weight update handed from the thread that received it to
    the thread that generates, which applies it between two decode steps.

    The engine's ``lock`` is held by the generating thread for a whole batch. The
    poster (:meth:`post`) leaves the update here and returns once it is applied:
    by the generating thread, which looks at every step (:meth:`take`), or by the
    poster itself as soon as it gets the lock (no batch running). One update at a
    time; a second poster waits for the first.
    """

    #: How often a waiting poster looks for a free engine (the generating thread
    #: wakes it at once when it applies the update).
    POLL_S = 0.05

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self._cond = threading.Condition()
        self._posted: _Posted | None = None

    @property
    def pending(self) -> bool:
        """An update waits for the running batch's next step."""
        return self._posted is not None

    def post(self, apply: Callable[[], None]) -> None:
        """Hand ``apply`` over and return once it ran (its exception raised here)."""
        item = _Posted(apply)
        with self._cond:
            while self._posted is not None:
                self._cond.wait(self.POLL_S)
            self._posted = item
            try:
                while not item.done:
                    if self._lock.acquire(blocking=False):
                        try:
                            if not item.done:
                                item.done = True
                                apply()
                        finally:
                            self._lock.release()
                        break
                    # Woken by the generating thread once applied; the time-out covers
                    # a lock held by something that does not look (sleep, wake_up).
                    self._cond.wait(self.POLL_S)
            finally:
                self._posted = None
                self._cond.notify_all()
        if item.error is not None:
            raise item.error

    def take(self) -> bool:
        """On the generating thread (which holds the lock): run a posted update now.
        Returns whether one ran; its exception is raised to the poster and here."""
        if self._posted is None:  # unlocked read: one is seen at the next step at worst
            return False
        with self._cond:
            item = self._posted
            if item is None or item.done:
                return False
            try:
                item.apply()
            except BaseException as e:
                item.error = e
                raise
            finally:
                item.done = True
                self._cond.notify_all()
        return True


@dataclass(slots=True, eq=False)
class _Posted:
    apply: Callable[[], None]
    done: bool = False
    error: BaseException | None = None
