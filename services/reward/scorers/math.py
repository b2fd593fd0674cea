r"""MATH: the last ``\boxed{...}`` of a response against the reference answer.

Extraction takes the last ``\boxed{...}`` or ``\fbox{...}`` (nested braces
balanced), or ``\boxed x`` without braces. Both the extracted and the reference
answer are then normalised (see :func:`normalize`) and compared:

1. as normalised strings;
2. element-wise for tuples, intervals and lists (``(1, 2)``, ``[0, \infty)``),
   keeping the bracket kinds (an open interval is not a closed one);
3. as numbers (``0.5 == \frac{1}{2}``; percent signs and units are dropped
   first, so ``50\% == 50``), exactly for fractions, within 1e-9 relative otherwise;
4. with ``math-verify`` (symbolic equivalence via sympy) when it is installed and
   :data:`USE_MATH_VERIFY` is on: this catches ``\sqrt{8} == 2\sqrt{2}``, ``x^2+2x
   == 2x+x^2`` and the like.

Bounds on hostile input: extraction scans only the last :data:`TAIL_CHARS`
characters with a linear brace matcher, answers longer than
:data:`MAX_ANSWER_CHARS` are compared as strings only, and ``math-verify`` runs
with its own time-out when called from a process's main thread (the reward
service's workers), on top of the worker pool's per-sample time-out.

The full list of what is matched is in ``docs/reward.md``.
"""

from __future__ import annotations

import math as _pymath
import re
import threading
from fractions import Fraction
from typing import Any

from rlfleet.reward.types import ScoreOutcome

__all__ = [
    "MAX_ANSWER_CHARS",
    "TAIL_CHARS",
    "USE_MATH_VERIFY",
    "compute_score",
    "is_equiv",
    "last_boxed",
    "normalize",
]

TAIL_CHARS = 20_000
MAX_ANSWER_CHARS = 500
USE_MATH_VERIFY = True
_MATH_VERIFY_TIMEOUT_S = 3

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` / ``\fbox{...}`` in ``text``, or None.

    Unbalanced braces: the box runs to the end of the text. ``\boxed 5`` (no
    braces) gives ``"5"``. Work is linear in the text's tail.
    """
    tail = text[-TAIL_CHARS:]
    start = max(tail.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = "\\boxed" if tail.startswith("\\boxed", start) else "\\fbox"
    i = start + len(cmd)
    if i < len(tail) and tail[i] == " ":
        # "\boxed 5$" form: up to the next "$" or whitespace.
        m = re.match(r" +([^\s$]+)", tail[i:])
        return m.group(1) if m else None
    while i < len(tail) and tail[i] in " \t\n":
        i += 1
    if i >= len(tail) or tail[i] != "{":
        return None
    depth = 0
    for j in range(i, len(tail)):
        c = tail[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return tail[i + 1 : j]
    return tail[i + 1 :]


_UNITS = (
    "square units",
    "square feet",
    "square inches",
    "square meters",
    "square centimeters",
    "sq units",
    "units",
    "unit",
    "cm",
    "mm",
    "km",
    "m",
    "meters",
    "meter",
    "centimeters",
    "inches",
    "inch",
    "feet",
    "foot",
    "ft",
    "yards",
    "miles",
    "mph",
    "degrees",
    "degree",
    "dollars",
    "cents",
    "seconds",
    "minutes",
    "hours",
    "days",
    "weeks",
    "years",
    "pounds",
    "ounces",
    "students",
    "people",
    "ways",
    "points",
)
_UNIT_RE = re.compile(
    r"^(.*?\d)\s*(?:\^?\{?\\circ\}?\s*)?(?:"
    + "|".join(re.escape(u) for u in sorted(_UNITS, key=len, reverse=True))
    + r")(?:\^\{?[23]\}?)?\.?$"
)
_TEXT_WRAP = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_SPACES = re.compile(r"\\[,;:! ]|~|\\quad|\\qquad")
_LEFT_RIGHT = re.compile(r"\\(?:left|right|big|Big|bigg|Bigg)(?![a-zA-Z])")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree")
_FRAC_SHORT = re.compile(r"\\frac\s*(\d)\s*(\d)")
_FRAC_SHORT_ARG = re.compile(r"\\frac\s*\{([^{}]*)\}\s*(\w)")
_SQRT_SHORT = re.compile(r"\\sqrt\s*(\w)")
_SIMPLE_DIV = re.compile(r"^(-?\d+)/(\d+)$")
_LHS = re.compile(r"^[a-zA-Z](?:_\{?\w+\}?)?\s*=\s*")
_LEADING_DOT = re.compile(r"(?<![\d}])\.(\d)")
_GROUPED_INT = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def normalize(answer: str) -> str:
    r"""A canonical string for an answer: what two equal answers share.

    ``\dfrac``/``\tfrac`` -> ``\frac``; ``\left``/``\right`` and LaTeX spacing
    removed; ``\text{...}`` unwrapped; degrees, ``%``, ``$`` and trailing units
    removed; ``\frac12`` -> ``\frac{1}{2}``, ``\sqrt2`` -> ``\sqrt{2}``, ``a/b`` ->
    ``\frac{a}{b}``; ``x = 5`` -> ``5``; ``.5`` -> ``0.5``; thousands separators and
    all whitespace removed; a trailing period dropped.
    """
    s = answer.strip()
    if len(s) > MAX_ANSWER_CHARS:
        return s
    s = s.replace("\n", " ")
    s = s.rstrip(".").strip()
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\displaystyle", "")
    s = _SPACES.sub(" ", s)
    s = _LEFT_RIGHT.sub("", s)
    for _ in range(3):  # \text{\textbf{x}}
        s, n = _TEXT_WRAP.subn(r"\1", s)
        if n == 0:
            break
    s = _DEGREES.sub("", s)
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "").replace("$", "")
    s = s.strip()
    m = _UNIT_RE.match(s)
    if m:
        s = m.group(1)
    s = _LHS.sub("", s) if len(s) < 60 and s.count("=") == 1 else s
    s = _FRAC_SHORT.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_SHORT_ARG.sub(r"\\frac{\1}{\2}", s)
    s = _SQRT_SHORT.sub(r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    if _GROUPED_INT.match(s):
        s = s.replace(",", "")
    m = _SIMPLE_DIV.match(s)
    if m:
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    s = _LEADING_DOT.sub(r"0.\1", s)
    s = s.rstrip(".")
    if s.startswith("\\{") and s.endswith("\\}"):
        s = s[2:-2]  # a set written as a list
    return s


_FRAC = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$")
_NUMBER = re.compile(r"^-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE]([-+]?\d+))?$")
_MAX_EXPONENT = 400
"""Numbers with a larger decimal exponent compare as strings only: ``Fraction("1e999999999")``
builds the exact integer, gigabytes and seconds of work on a short answer."""


def _to_number(s: str) -> Fraction | None:
    m = _NUMBER.match(s)
    if m:
        exponent = m.group(1)
        if exponent is not None and (len(exponent) > 6 or abs(int(exponent)) > _MAX_EXPONENT):
            return None
        try:
            return Fraction(s)
        except (ValueError, ZeroDivisionError):
            return None
    m = _FRAC.match(s)
    if m:
        den = int(m.group(3))
        if den == 0:
            return None
        value = Fraction(int(m.group(2)), den)
        return -value if m.group(1) else value
    return None


def _split_top_level(s: str) -> list[str]:
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for c in s:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(c)
    parts.append("".join(current))
    return parts


def _strings_equal(a: str, b: str) -> bool:
    if a == b:
        return True
    x, y = _to_number(a), _to_number(b)
    if x is not None and y is not None:
        if x == y:
            return True
        # Relative, on the exact values: float() of a big fraction would overflow.
        return abs(x - y) <= Fraction(1, 10**9) * max(Fraction(1), abs(x), abs(y))
    return False


def _structured_equal(a: str, b: str) -> bool:
    """Tuples, intervals and comma lists, element by element."""
    if len(a) < 2 or len(b) < 2:
        return False
    opens, closes = "([", ")]"
    a_wrapped = a[0] in opens and a[-1] in closes
    b_wrapped = b[0] in opens and b[-1] in closes
    if a_wrapped != b_wrapped:
        return False
    if a_wrapped:
        if (a[0], a[-1]) != (b[0], b[-1]):
            return False
        a, b = a[1:-1], b[1:-1]
    pa, pb = _split_top_level(a), _split_top_level(b)
    if len(pa) != len(pb) or len(pa) < 2:
        return False
    return all(_strings_equal(x, y) or _structured_equal(x, y) for x, y in zip(pa, pb, strict=True))


def _math_verify_equal(gold: str, pred: str) -> bool | None:
    """math-verify's verdict, or None when it is not installed or failed."""
    if not USE_MATH_VERIFY or len(gold) > MAX_ANSWER_CHARS or len(pred) > MAX_ANSWER_CHARS:
        return None
    try:
        import math_verify  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    # Its signal-based time-out works only in a main thread (our pool workers);
    # elsewhere it must be off, and the pool's time-out is the bound.
    main = threading.current_thread() is threading.main_thread()
    timeout = _MATH_VERIFY_TIMEOUT_S if main else None
    try:
        g = math_verify.parse(f"${gold}$", parsing_timeout=timeout)
        p = math_verify.parse(f"${pred}$", parsing_timeout=timeout)
        if not g or not p:
            return None
        return bool(math_verify.verify(g, p, timeout_seconds=timeout))
    except Exception:  # math-verify raises many kinds on odd LaTeX: no verdict
        return None


def is_equiv(pred: str, gold: str, *, use_math_verify: bool = True) -> tuple[bool, str]:
    """Whether two answers are equal, and which rule said so (or ``"none"``)."""
    if pred.strip() == gold.strip():
        return True, "exact"
    a, b = normalize(pred), normalize(gold)
    if _strings_equal(a, b):
        return True, "normalized"
    if _structured_equal(a, b):
        return True, "structured"
    if use_math_verify and _math_verify_equal(gold, pred):
        return True, "math_verify"
    return False, "none"


def _non_finite(answer: str) -> bool:
    """Whether an answer reads as a float NaN or infinity (``nan``, ``-inf``, ``Infinity``).

    Such a reference is a data error (a missing value read as NaN), not an answer, and
    a response that writes the same text must not be given credit for it. LaTeX's
    ``\\infty`` is an answer (a limit, an interval's end) and is not caught here.
    """
    text = normalize(answer)
    if len(text) > 12 or not text or text[-1] not in "nNfFyY":
        return False
    try:
        return not _pymath.isfinite(float(text))
    except ValueError:
        return False


def _reference(ground_truth: Any) -> list[str]:
    if isinstance(ground_truth, bool):
        raise ValueError(f"ground_truth is not an answer: {ground_truth!r}")
    if isinstance(ground_truth, int | float):
        if isinstance(ground_truth, float) and not _pymath.isfinite(ground_truth):
            raise ValueError(f"ground_truth is not a finite number: {ground_truth!r}")
        return [repr(ground_truth) if isinstance(ground_truth, float) else str(ground_truth)]
    if isinstance(ground_truth, str):
        boxed = last_boxed(ground_truth) if "\\boxed" in ground_truth else None
        answer = boxed if boxed is not None else ground_truth
        if _non_finite(answer):
            raise ValueError(f"ground_truth is not a finite number: {ground_truth!r}")
        return [answer]
    if isinstance(ground_truth, list) and ground_truth:
        return [a for g in ground_truth for a in _reference(g)]
    raise ValueError(f"ground_truth is not an answer: {ground_truth!r}")


def compute_score(
    response: str, ground_truth: Any, *, use_math_verify: bool = True
) -> ScoreOutcome:
    r"""1.0 if the last ``\boxed{}`` of ``response`` equals the reference answer, else 0.0.

    Args:
        response: the model's text.
        ground_truth: the answer (``"\frac{14}{3}"``), a solution containing a
            ``\boxed{}``, a number, or a list of accepted answers.
        use_math_verify: allow the symbolic fallback.
    """
    references = _reference(ground_truth)
    extracted = last_boxed(response)
    details: dict[str, Any] = {"extracted": extracted, "format_ok": extracted is not None}
    if extracted is None:
        return ScoreOutcome(0.0, details)
    for reference in references:
        equal, rule = is_equiv(extracted, reference, use_math_verify=use_math_verify)
        if equal:
            details["matched_by"] = rule
            return ScoreOutcome(1.0, details)
    return ScoreOutcome(0.0, details)
