"""Rule scorers and the table that picks one per ``data_source``.

A scorer is a function ``(data_source, response, ground_truth, extra_info) ->
ScoreOutcome``. The built-in ones are pure, torch-free and bounded on hostile
input; a custom one is verl's ``compute_score(data_source, solution_str,
ground_truth, extra_info, **reward_kwargs) -> float | dict`` loaded from a file and
called with keyword arguments, as verl calls it.

Three names are not functions here: ``"reward_model"`` (scored by
:mod:`rlfleet.reward.model` in the service process), ``"custom"`` (the
configured file) and ``"code"`` (:mod:`rlfleet.reward.scorers.code`: runs the
response's program in the sandbox, with the ``reward.sandbox`` settings).
"""

from __future__ import annotations

import importlib.util
import math as _math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from rlfleet.reward.scorers import gsm8k, math, multiple_choice
from rlfleet.reward.types import ScoreOutcome

if TYPE_CHECKING:
    from rlfleet.reward.scorers.code import CodeSettings

__all__ = [
    "BUILTIN_SCORERS",
    "CODE",
    "CUSTOM",
    "DATA_SOURCE_SCORERS",
    "INLINE_SCORERS",
    "LENIENT_VARIANTS",
    "MAX_CUSTOM_DATA_SOURCES",
    "REWARD_MODEL",
    "CustomFunction",
    "CustomScorer",
    "ScorerFn",
    "custom_data_sources",
    "error_outcome",
    "load_custom_function",
    "outcome_from_custom",
    "run_scorer",
    "scorer_for_data_source",
]

ScorerFn = Callable[[str, str, Any, dict[str, Any]], ScoreOutcome]
CUSTOM = "custom"
REWARD_MODEL = "reward_model"
CODE = "code"


def _gsm8k(
    data_source: str, response: str, ground_truth: Any, extra: dict[str, Any]
) -> ScoreOutcome:
    return gsm8k.compute_score(response, ground_truth, method="strict")


def _gsm8k_flexible(
    data_source: str, response: str, ground_truth: Any, extra: dict[str, Any]
) -> ScoreOutcome:
    return gsm8k.compute_score(response, ground_truth, method="flexible")


def _gsm8k_lenient(
    data_source: str, response: str, ground_truth: Any, extra: dict[str, Any]
) -> ScoreOutcome:
    return gsm8k.compute_score(response, ground_truth, method="strict", lenient=True)


def _gsm8k_flexible_lenient(
    data_source: str, response: str, ground_truth: Any, extra: dict[str, Any]
) -> ScoreOutcome:
    return gsm8k.compute_score(response, ground_truth, method="flexible", lenient=True)


def _math_answer(
    data_source: str, response: str, ground_truth: Any, extra: dict[str, Any]
) -> ScoreOutcome:
    return math.compute_score(response, ground_truth)


def _multiple_choice(
    data_source: str, response: str, ground_truth: Any, extra: dict[str, Any]
) -> ScoreOutcome:
    return multiple_choice.compute_score(response, ground_truth, extra)


BUILTIN_SCORERS: dict[str, ScorerFn] = {
    "gsm8k": _gsm8k,
    "gsm8k_flexible": _gsm8k_flexible,
    "gsm8k_lenient": _gsm8k_lenient,
    "gsm8k_flexible_lenient": _gsm8k_flexible_lenient,
    "math": _math_answer,
    "multiple_choice": _multiple_choice,
}

LENIENT_VARIANTS: dict[str, str] = {
    "gsm8k": "gsm8k_lenient",
    "gsm8k_flexible": "gsm8k_flexible_lenient",
}
"""The scorer ``reward.gsm8k_lenient`` puts in place of verl's gsm8k rule."""

INLINE_SCORERS = frozenset(
    {"gsm8k", "gsm8k_flexible", "gsm8k_lenient", "gsm8k_flexible_lenient", "multiple_choice"}
)
"""Built-in scorers cheap and bounded enough to run in the caller's thread, with no
worker round trip and no time-out: linear-time patterns over a clipped tail, a
few microseconds a sample. ``math`` is not one of them: its math-verify fallback
(sympy) is bounded only by a ``signal.alarm`` time-out, which works in a process's
main thread (a pool worker), not in a gRPC handler thread."""

# verl's data_source names (and short forms) -> scorer. Lookup is exact, then
# case-insensitive.
DATA_SOURCE_SCORERS: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    "gsm8k": "gsm8k",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math": "math",
    "math500": "math",
    "math-500": "math",
    "hendrycks_math": "math",
    "Rowan/hellaswag": "multiple_choice",
    "hellaswag": "multiple_choice",
    "multiple_choice": "multiple_choice",
    # The demo's synthetic arithmetic set is written in GSM8K's `#### N` format.
    "rlfleet/arithmetic": "gsm8k",
    # The multi-turn calculator task (`rlfleet preprocess calculator`): the same format.
    "rlfleet/calculator": "gsm8k",
    # verl's code data sources (default_compute_score: prime_code / sandbox_fusion),
    # the hub names of APPS, TACO and CodeContests, LiveCodeBench, and "code".
    "codecontests": CODE,
    "apps": CODE,
    "codeforces": CODE,
    "taco": CODE,
    "livecodebench": CODE,
    "code": CODE,
    "codeparrot/apps": CODE,
    "BAAI/TACO": CODE,
    "deepmind/code_contests": CODE,
    "Anthropic/hh-rlhf": REWARD_MODEL,
    "Dahoas/full-hh-rlhf": REWARD_MODEL,
    "hh-rlhf": REWARD_MODEL,
    "hh_rlhf": REWARD_MODEL,
}
_LOWER = {k.lower(): v for k, v in DATA_SOURCE_SCORERS.items()}


def scorer_for_data_source(data_source: str) -> str | None:
    """The built-in scorer name for a data source, or None when it has none."""
    found = DATA_SOURCE_SCORERS.get(data_source)
    return found if found is not None else _LOWER.get(data_source.lower())


CustomFunction = Callable[..., Any]


@dataclass(frozen=True)
class CustomScorer:
    """verl's ``custom_reward_function``: which function, and the keyword arguments
    (``reward_kwargs``, JSON values: they travel to the scoring workers) it gets."""

    path: str
    name: str = "compute_score"
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "name": self.name, "kwargs": dict(self.kwargs)}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> CustomScorer:
        return cls(str(value["path"]), str(value["name"]), dict(value["kwargs"]))


MAX_CUSTOM_DATA_SOURCES = 1000
"""Most names a custom file may declare in ``DATA_SOURCES`` (each is a metric label)."""


@cache
def _load_custom_module(path: str) -> ModuleType:
    """The Python file at ``path`` as a module (executed once per process)."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"custom reward file not found: {path!r}")
    module_name = f"rlfleet_custom_reward_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load custom reward file {path!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


@cache
def load_custom_function(path: str, name: str) -> CustomFunction:
    """Load ``name`` from the Python file at ``path`` (once per process)."""
    fn = getattr(_load_custom_module(path), name, None)
    if not callable(fn):
        raise AttributeError(f"custom reward file {path!r} has no function {name!r}")
    return fn


def custom_data_sources(path: str) -> tuple[str, ...]:
    """The data sources a custom file declares it scores: its ``DATA_SOURCES``.

    Optional (``()`` when absent). They only name metric series: samples of any
    other source the custom function gets are still scored, counted as ``"other"``.
    """
    declared = getattr(_load_custom_module(path), "DATA_SOURCES", ())
    if isinstance(declared, str) or not isinstance(declared, list | tuple | set | frozenset):
        raise TypeError(
            f"custom reward file {path!r}: DATA_SOURCES must be a list of strings, "
            f"got {type(declared).__name__}"
        )
    names = tuple(declared)
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise TypeError(
            f"custom reward file {path!r}: DATA_SOURCES holds non-strings or empty names: "
            f"{bad[:5]!r}"
        )
    if len(names) > MAX_CUSTOM_DATA_SOURCES:
        raise ValueError(
            f"custom reward file {path!r}: DATA_SOURCES names {len(names)} sources, "
            f"over the limit of {MAX_CUSTOM_DATA_SOURCES}"
        )
    return names


def _json_safe(value: Any, depth: int = 0) -> Any:
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int | float):
        f = float(value)
        return f if _math.isfinite(f) else str(value)
    if depth < 4 and isinstance(value, dict):
        return {str(k): _json_safe(v, depth + 1) for k, v in value.items()}
    if depth < 4 and isinstance(value, list | tuple):
        return [_json_safe(v, depth + 1) for v in value]
    item = getattr(value, "item", None)  # numpy / torch scalars
    if callable(item):
        try:
            return _json_safe(item(), depth + 1)
        except (TypeError, ValueError):
            pass
    return str(value)


def outcome_from_custom(value: Any) -> ScoreOutcome:
    """verl's return convention: a number, or a dict with ``"score"`` plus extras."""
    details: dict[str, Any] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"custom reward returned a dict without 'score': keys {sorted(value)}")
        details = {k: _json_safe(v) for k, v in value.items() if k != "score"}
        value = value["score"]
    item = getattr(value, "item", None)
    if callable(item) and not isinstance(value, int | float):
        value = item()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"custom reward returned {type(value).__name__}, not a number: {value!r}")
    score = float(value)
    if not _math.isfinite(score):
        raise ValueError(f"custom reward returned a non-finite score: {score}")
    return ScoreOutcome(score, details)


def error_outcome(exc: BaseException) -> ScoreOutcome:
    """Score 0 with the exception as the error (clipped to 1,000 characters)."""
    text = f"{type(exc).__name__}: {exc}"
    if len(text) > 1000:
        text = text[:985] + "...[truncated]"
    return ScoreOutcome(0.0, {}, error=text)


def run_scorer(
    scorer: str,
    data_source: str,
    response: str,
    ground_truth: Any,
    extra_info: dict[str, Any],
    custom: CustomScorer | None = None,
    *,
    code: CodeSettings | None = None,
) -> ScoreOutcome:
    """Score one sample with a rule scorer, the code scorer or the custom function.

    The custom function is called as verl calls it: keyword arguments only, its
    ``reward_kwargs`` after the four sample fields. The code scorer runs with
    ``code`` (None: the defaults, isolation probed on first use).
    """
    if scorer == CODE:
        from rlfleet.reward.scorers import code as code_scorer

        return code_scorer.compute_score(response, ground_truth, code)
    if scorer == CUSTOM:
        if custom is None:
            raise ValueError("scorer 'custom' requested but no custom function is configured")
        fn = load_custom_function(custom.path, custom.name)
        value = fn(
            data_source=data_source,
            solution_str=response,
            ground_truth=ground_truth,
            extra_info=extra_info,
            **custom.kwargs,
        )
        return outcome_from_custom(value)
    return BUILTIN_SCORERS[scorer](data_source, response, ground_truth, extra_info)
