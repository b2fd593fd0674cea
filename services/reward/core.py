"""RewardManager: the reward service's core (no sockets, no protobuf).

Per sample it picks a scorer by ``data_source``, scores the cheap bounded
built-in ones (gsm8k, multiple choice) in the caller's thread, the other rule
and custom samples in the :class:`~rlfleet.reward.pool.ScoringPool` (per-sample
time-out) and reward-model samples with the
:class:`~rlfleet.reward.model.RewardModelScorer`, and returns
per-sample :class:`ScoreResult` s; :meth:`RewardManager.score_batch` adds the
token-level reward tensor (score on the last valid response token).

Which scorer a data source gets, first match wins:

1. the reward model when one is enabled: as in verl, for every sample (with
   ``reward.reward_model.route_by_data_source``, an rlfleet option, only for the
   data sources the table routes to it: hh-rlhf);
2. the custom function when ``reward.custom_function.path`` is set: as in verl it
   replaces the built-in scorers for every data source (unless
   ``reward.custom_function.keep_builtin_scorers``, an rlfleet option: then it comes
   after 3 and 4);
3. the built-in table (:data:`rlfleet.reward.scorers.DATA_SOURCE_SCORERS`): gsm8k,
   MATH / math500, hellaswag (multiple choice), code (verl's code sources: the
   program runs in :mod:`rlfleet.common.sandbox`);
4. ``reward.default_scorer`` when set (a built-in name, ``custom`` or ``reward_model``);
5. otherwise the sample is rejected (``InvalidArgument`` naming it).

``reward.gsm8k_lenient`` (an rlfleet option) swaps verl's gsm8k rule for the
lenient one wherever gsm8k is picked.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from rlfleet.common.config import RewardConfig, SandboxConfig
from rlfleet.common.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from rlfleet.common.sandbox import IsolationReport, SandboxLimits
from rlfleet.reward.metrics import RewardMetrics
from rlfleet.reward.pool import Job, PoolEvents, ScoringPool
from rlfleet.reward.scorers import (
    BUILTIN_SCORERS,
    CODE,
    CUSTOM,
    DATA_SOURCE_SCORERS,
    INLINE_SCORERS,
    LENIENT_VARIANTS,
    REWARD_MODEL,
    CustomScorer,
    error_outcome,
    scorer_for_data_source,
)
from rlfleet.reward.scorers.code import CodeSettings
from rlfleet.reward.tensor import token_level_scores
from rlfleet.reward.types import RewardInfo, Sample, ScoreOutcome, ScoreResult

__all__ = [
    "DEFAULT_MAX_BATCH_SIZE",
    "MAX_REWARD_KWARGS_BYTES",
    "RewardBatch",
    "RewardManager",
    "code_settings",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_SIZE = 8192

MAX_REWARD_KWARGS_BYTES = 64 * 1024
"""Most bytes of ``reward_kwargs`` as JSON: they reach each scoring worker on its
command line."""

_SAMPLE_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")

_NUMBER = (int, float)
_GROUND_TRUTH_TYPES: dict[str, tuple[type, ...]] = {
    "gsm8k": (str, *_NUMBER),
    "gsm8k_flexible": (str, *_NUMBER),
    "gsm8k_lenient": (str, *_NUMBER),
    "gsm8k_flexible_lenient": (str, *_NUMBER),
    "math": (str, *_NUMBER, list),
    "multiple_choice": (str, *_NUMBER),
    CODE: (str, dict),
}


def _non_finite(ground_truth: Any) -> bool:
    """A float NaN / infinity, or a list holding one (rule scorers' references)."""
    if type(ground_truth) is float:
        return not math.isfinite(ground_truth)
    if type(ground_truth) is list:
        return any(type(g) is float and not math.isfinite(g) for g in ground_truth)
    return False


@dataclass
class RewardBatch:
    """Scores of a batch: per sample, and placed on tokens when a mask was given.

    Attributes:
        results: one :class:`ScoreResult` per sample, in order.
        scores: ``[B]`` the scalar scores.
        token_level_scores: ``[B, T]`` (torch or numpy, like the mask) or None.
    """

    results: list[ScoreResult]
    scores: list[float]
    token_level_scores: Any = None


class RewardManager:
    """Scores samples; thread-safe (the gRPC servicer calls it from many threads).

    Args:
        config: the ``reward`` section of the run config.
        max_batch_size: most samples per call.
        metrics: where to count samples, scores, time-outs and errors.
        reward_model: a ready scorer; None builds one from ``config.reward_model``
            when it is enabled (that imports torch).
        chunk_size: most samples per round trip to a worker.
        num_workers: overrides ``config.num_workers``; 0 scores inline in the
            caller's thread, with no time-out (tests, trusted scorers).
        inline_scorers: built-in scorers run in the caller's thread rather than
            the pool (no round trip, no time-out): only ones bounded by
            construction (see :data:`~rlfleet.reward.scorers.INLINE_SCORERS`).
    """

    def __init__(
        self,
        config: RewardConfig | None = None,
        *,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        metrics: RewardMetrics | None = None,
        reward_model: Any = None,
        chunk_size: int = 64,
        num_workers: int | None = None,
        inline_scorers: Collection[str] = INLINE_SCORERS,
    ) -> None:
        self.config = config or RewardConfig()
        self.max_batch_size = max_batch_size
        self.inline_scorers = frozenset(inline_scorers)
        self.metrics = metrics or RewardMetrics(enabled=False)
        cf = self.config.custom_function
        self.custom = (
            CustomScorer(cf.path, cf.name, _checked_reward_kwargs(cf.reward_kwargs))
            if cf.path
            else None
        )
        default = self.config.default_scorer
        known = {*BUILTIN_SCORERS, CODE, CUSTOM, REWARD_MODEL}
        if default is not None and default not in known:
            raise InvalidArgument(
                f"unknown scorer {default!r}; choose from {sorted(known)}",
                field="reward.default_scorer",
                value=default,
            )
        if default == CUSTOM and self.custom is None:
            raise InvalidArgument(
                "default_scorer is 'custom' but reward.custom_function.path is not set",
                field="reward.default_scorer",
                value=default,
            )
        if (
            default not in (None, CUSTOM)
            and self.custom is not None
            and not cf.keep_builtin_scorers
        ):
            raise InvalidArgument(
                f"default_scorer {default!r} would never be used: the custom function "
                "scores every data source (verl's rule); remove default_scorer, or set "
                "reward.custom_function.keep_builtin_scorers: true",
                field="reward.default_scorer",
                value=default,
            )
        if self.custom is not None:
            # Fail at start-up, not on the first request, when the file is wrong.
            from rlfleet.reward.scorers import custom_data_sources, load_custom_function

            try:
                load_custom_function(self.custom.path, self.custom.name)
                sources = custom_data_sources(cf.path)
            except (
                OSError,
                ImportError,
                AttributeError,
                SyntaxError,
                TypeError,
                ValueError,
            ) as exc:
                raise InvalidArgument(
                    str(exc), field="reward.custom_function.path", value=cf.path
                ) from exc
            self.metrics.add_data_sources(sources)
        self.reward_model = reward_model
        rm = self.config.reward_model
        if self.reward_model is None and rm.enable:
            if not rm.path:
                raise InvalidArgument(
                    "reward_model.enable is true but no path is set",
                    field="reward.reward_model.path",
                )
            from rlfleet.reward.model import RewardModelScorer, resolve_device

            self.reward_model = RewardModelScorer(
                rm.path,
                device=resolve_device(rm.device),
                dtype=rm.dtype,
                max_tokens_per_batch=rm.max_tokens_per_batch,
                micro_batch_size=rm.micro_batch_size,
            )
        self._model_lock = threading.Lock()
        self.code = code_settings(self.config)
        if self._routes_to(CODE):
            # Probed once here, in the service process; the workers get the result.
            report = self.code.resolved_report()
            self.code = dataclasses.replace(self.code, report=report)
            log = logger.info if report.mode in ("bwrap", "namespaces") else logger.warning
            log("code sandbox isolation: %s", report.describe())
            self.metrics.sandbox_isolation(report.mode)
        self.pool = ScoringPool(
            self.config.num_workers if num_workers is None else num_workers,
            self.config.sample_timeout_s,
            custom=self.custom,
            code=self.code,
            chunk_size=chunk_size,
            events=PoolEvents(on_restart=self.metrics.worker_restart),
        )

    # ---------------------------------------------------------------- routing

    def _routes_to(self, scorer: str) -> bool:
        """Whether some data source (or the default) can reach ``scorer``."""
        if self.config.default_scorer == scorer:
            return True
        return any(
            self.scorer_for(name) == scorer
            for name, target in DATA_SOURCE_SCORERS.items()
            if target == scorer
        )

    @property
    def sandbox_isolation(self) -> IsolationReport | None:
        """The code sandbox's isolation (None when no data source routes to code)."""
        return self.code.report

    def scorer_for(self, data_source: str) -> str | None:
        """The scorer a data source gets, or None when it would be rejected."""
        if self.reward_model is not None and not self.config.reward_model.route_by_data_source:
            return REWARD_MODEL  # verl: the model's score is every sample's reward
        scorer = scorer_for_data_source(data_source)
        if scorer == REWARD_MODEL and self.reward_model is None:
            scorer = None
        if (
            scorer != REWARD_MODEL
            and self.custom is not None
            and not self.config.custom_function.keep_builtin_scorers
        ):
            return CUSTOM
        if scorer is None:
            scorer = self.config.default_scorer or (CUSTOM if self.custom else None)
        if scorer == REWARD_MODEL and self.reward_model is None:
            return None
        if scorer is not None and self.config.gsm8k_lenient:
            scorer = LENIENT_VARIANTS.get(scorer, scorer)
        return scorer

    def validate(self, samples: Sequence[Sample], offset: int = 0) -> list[str]:
        """The scorer of each sample; raises InvalidArgument naming the first bad field.

        ``offset`` shifts the reported sample index (a stream's running count).
        """
        if len(samples) > self.max_batch_size:
            raise InvalidArgument(
                f"batch of {len(samples)} samples is over the limit of {self.max_batch_size}",
                field="samples",
                value=len(samples),
            )
        scorers: list[str] = []
        routes: dict[str, str | None] = {}  # per call: most batches hold one data source
        for i, sample in enumerate(samples):
            index = offset + i
            where = f"samples[{index}]"
            if not isinstance(sample.data_source, str) or not sample.data_source:
                raise InvalidArgument(
                    "data_source is missing", field=f"{where}.data_source", sample_index=index
                )
            if not isinstance(sample.response, str):
                raise InvalidArgument(
                    f"response must be a string, got {type(sample.response).__name__}",
                    field=f"{where}.response",
                    value=sample.response,
                    sample_index=index,
                )
            scorer = routes.get(sample.data_source, "")
            if scorer == "":
                scorer = routes[sample.data_source] = self.scorer_for(sample.data_source)
            if scorer is None:
                raise InvalidArgument(
                    f"unknown data source {sample.data_source!r} and no default scorer "
                    f"(known: {sorted(DATA_SOURCE_SCORERS)})",
                    field=f"{where}.data_source",
                    value=sample.data_source,
                    sample_index=index,
                    code="UNKNOWN_DATA_SOURCE",
                )
            expected = _GROUND_TRUTH_TYPES.get(scorer)
            if expected is not None:
                gt = sample.ground_truth
                if gt is None:
                    raise InvalidArgument(
                        f"ground_truth is missing (scorer {scorer!r} needs one)",
                        field=f"{where}.ground_truth",
                        sample_index=index,
                    )
                if isinstance(gt, bool) or not isinstance(gt, expected):
                    names = "/".join(t.__name__ for t in expected)
                    raise InvalidArgument(
                        f"ground_truth for scorer {scorer!r} must be {names}, "
                        f"got {type(gt).__name__}",
                        field=f"{where}.ground_truth",
                        value=gt,
                        sample_index=index,
                    )
                if _non_finite(gt):
                    # A NaN is usually a missing value read from a data frame.
                    raise InvalidArgument(
                        f"ground_truth for scorer {scorer!r} must be a finite number, got {gt!r}",
                        field=f"{where}.ground_truth",
                        value=gt,
                        sample_index=index,
                    )
            scorers.append(scorer)
        return scorers

    # ---------------------------------------------------------------- scoring

    def score(
        self,
        samples: Sequence[Sample],
        *,
        timeout_s: float | None = None,
        on_result: Callable[[ScoreResult], None] | None = None,
        offset: int = 0,
        scorers: Sequence[str] | None = None,
    ) -> list[ScoreResult]:
        """Score a batch.

        Args:
            samples: what to score.
            timeout_s: the whole call's deadline (None: none); past it the batch is
                cancelled and DeadlineExceeded raised. Each sample is bounded by
                ``reward.sample_timeout_s`` regardless.
            on_result: called with each result as it finishes, in any order (from
                a pool thread).
            offset: added to each result's ``index`` (a stream's running count).
            scorers: from :meth:`validate`, when already called.

        Returns:
            One result per sample, in order.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if scorers is None:
            scorers = self.validate(samples, offset)
        results: list[ScoreResult | None] = [None] * len(samples)
        inline_idx: list[int] = []
        pool_idx: list[int] = []
        model_idx: list[int] = []
        inline = self.inline_scorers
        for i, scorer in enumerate(scorers):
            if scorer in inline:
                inline_idx.append(i)
            elif scorer == REWARD_MODEL:
                model_idx.append(i)
            else:
                pool_idx.append(i)

        def finish(i: int, outcome: ScoreOutcome) -> None:
            error = outcome.error
            result = ScoreResult(
                offset + i,
                0.0 if error else outcome.score,
                scorers[i],
                outcome.details,
                error,
                outcome.timed_out,
                samples[i].id,
            )
            results[i] = result
            if on_result is not None:
                on_result(result)

        # Pool first, so its workers score while this thread does the rest.
        jobs: list[Job] = [
            (
                scorers[i],
                samples[i].data_source,
                samples[i].response,
                samples[i].ground_truth,
                samples[i].extra_info,
            )
            for i in pool_idx
        ]
        batch = self.pool.submit(jobs, lambda k, outcome: finish(pool_idx[k], outcome))
        for i in inline_idx:
            sample = samples[i]
            try:
                outcome = BUILTIN_SCORERS[scorers[i]](
                    sample.data_source, sample.response, sample.ground_truth, sample.extra_info
                )
            except Exception as exc:  # a scorer bug fails this sample, not the call
                outcome = error_outcome(exc)
            finish(i, outcome)
        if model_idx:
            for i, outcome in zip(
                model_idx, self._score_model([samples[i] for i in model_idx]), strict=True
            ):
                finish(i, outcome)
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        # Also when the pool had nothing to do: scoring here may have used up the time.
        if not batch.wait(remaining) or (deadline is not None and time.monotonic() > deadline):
            batch.cancel()
            raise DeadlineExceeded(
                f"scoring {len(samples)} samples did not finish within {timeout_s:g}s",
                value=timeout_s,
            )
        done = [r for r in results if r is not None]
        if len(done) != len(samples):  # pool contract: every job delivered once
            raise FailedPrecondition(f"{len(samples) - len(done)} samples got no result")
        self.metrics.samples([s.data_source for s in samples], done)
        return done

    def _score_model(self, samples: Sequence[Sample]) -> list[ScoreOutcome]:
        try:
            with self._model_lock:  # one forward at a time: the model is not re-entrant
                return list(self.reward_model.score(samples))
        except Exception as exc:  # a model failure fails these samples, not the service
            error = f"reward model failed: {type(exc).__name__}: {exc}"
            return [ScoreOutcome(0.0, {}, error=error) for _ in samples]

    def score_batch(
        self,
        samples: Sequence[Sample],
        response_mask: Any = None,
        *,
        timeout_s: float | None = None,
    ) -> RewardBatch:
        """Score and, given ``response_mask`` ``[B, T]``, place scores on the last valid token."""
        results = self.score(samples, timeout_s=timeout_s)
        scores = [r.score for r in results]
        tokens = None if response_mask is None else token_level_scores(scores, response_mask)
        return RewardBatch(results, scores, tokens)

    def info(self) -> RewardInfo:
        sources: dict[str, str] = {}
        for name in DATA_SOURCE_SCORERS:
            scorer = self.scorer_for(name)
            if scorer is not None:
                sources[name] = scorer
        scorers = [*BUILTIN_SCORERS, CODE]
        if self.custom:
            scorers.append(CUSTOM)
        if self.reward_model is not None:
            scorers.append(REWARD_MODEL)
        default = self.config.default_scorer or (CUSTOM if self.custom else "")
        return RewardInfo(
            scorers=tuple(scorers),
            data_sources=sources,
            default_scorer=default,
            reward_model=getattr(self.reward_model, "path", "") if self.reward_model else "",
            max_batch_size=self.max_batch_size,
            sample_timeout_s=self.config.sample_timeout_s,
        )

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def code_settings(config: RewardConfig) -> CodeSettings:
    """The ``code`` scorer's settings from ``reward.sandbox`` (isolation not probed yet)."""
    sb: SandboxConfig = config.sandbox
    limits = SandboxLimits(
        timeout_s=sb.timeout_s,
        cpu_time_s=sb.cpu_time_s,
        memory_mb=sb.memory_mb,
        max_output_bytes=sb.max_output_bytes,
        max_processes=sb.max_processes,
        tmp_mb=sb.tmp_mb,
    )
    return CodeSettings(
        limits=limits,
        isolation=sb.isolation,
        python=sb.python,
        allow_unisolated=sb.allow_unisolated,
        max_concurrent=sb.max_concurrent,
        max_test_cases=sb.max_test_cases,
        partial_credit=sb.partial_credit,
        # The pool kills a sample at sample_timeout_s; stop starting cases a little
        # before, so the sample ends with a score rather than a time-out.
        sample_budget_s=max(0.0, config.sample_timeout_s - 0.5),
    )


def _checked_reward_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``reward_kwargs``, refused at start-up when a call could not take them."""
    field = "reward.custom_function.reward_kwargs"
    clash = sorted(set(kwargs) & set(_SAMPLE_ARGUMENTS))
    if clash:
        raise InvalidArgument(
            f"reward_kwargs may not set {clash}: every call passes them per sample",
            field=field,
            value=clash,
        )
    try:
        encoded = json.dumps(kwargs, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(
            f"reward_kwargs must be JSON values (they reach the scoring workers): {exc}",
            field=field,
        ) from exc
    size = len(encoded.encode())
    if size > MAX_REWARD_KWARGS_BYTES:
        raise InvalidArgument(
            f"reward_kwargs take {size} bytes as JSON, over the limit of {MAX_REWARD_KWARGS_BYTES}",
            field=field,
            value=size,
        )
    return kwargs


def decode_responses(tokenizer: Any, response_ids: Any, response_mask: Any) -> list[str]:
    """Decode ``[B, T]`` response ids, keeping only the masked-in tokens (verl's step)."""
    texts: list[str] = []
    for ids, mask in zip(response_ids, response_mask, strict=True):
        ids_list = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        mask_list = mask.tolist() if hasattr(mask, "tolist") else list(mask)
        kept = [t for t, m in zip(ids_list, mask_list, strict=True) if m]
        texts.append(tokenizer.decode(kept, skip_special_tokens=True))
    return texts
