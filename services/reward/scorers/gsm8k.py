"""GSM8K: the final number of a response against the reference number.

Two extraction modes:

* ``strict``: the number after the last ``#### `` marker (GSM8K's own answer
  format); a response without the marker gets no credit and ``format_ok=False``.
* ``flexible``: the last number anywhere in the response.

Numbers may carry thousands separators (``1,234``), a leading ``$``, a sign, a
decimal part and a trailing period (``#### 18.``); they compare as exact decimals
(``18.00 == 18``). A wrong number with the right format scores ``format_score``.

Only the last :data:`TAIL_CHARS` characters of a response are searched: the
answer is at the end, and this bounds the work on a hostile 1 MB response.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

from rlfleet.reward.types import ScoreOutcome

__all__ = ["TAIL_CHARS", "compute_score", "extract_answer", "parse_number"]

TAIL_CHARS = 1000

# Linear-time patterns: no nested quantifiers over overlapping classes.
_NUMBER = r"-?\$?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
_STRICT = re.compile(r"####\s*(" + _NUMBER + r")")
_ANY_NUMBER = re.compile(_NUMBER)
_DIGITS_AND_COMMAS = re.compile(r"^\d[\d,]*(?:\.\d+)?$")


def parse_number(text: str) -> Decimal | None:
    """A number as written in GSM8K answers, or None: ``"-1,234.50."`` -> ``-1234.50``."""
    s = text.strip().rstrip(".").replace("$", "").replace(" ", "")
    negative = s.startswith("-")
    body = s[1:] if negative else s
    if "," in body:
        # Separators are dropped wherever they are ("1,234" and "12,34" -> digits),
        # as verl does; only digits may surround them.
        if _DIGITS_AND_COMMAS.match(body) is None:
            return None
        body = body.replace(",", "")
    try:
        value = Decimal(body)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    return -value if negative else value


def extract_answer(
    response: str, method: Literal["strict", "flexible"] = "strict"
) -> tuple[str | None, bool]:
    """The answer text found and whether the strict ``#### N`` format was present."""
    tail = response[-TAIL_CHARS:]
    strict = _STRICT.findall(tail)
    format_ok = bool(strict)
    if method == "strict":
        return (strict[-1] if strict else None), format_ok
    numbers = _ANY_NUMBER.findall(tail)
    # A bare "," or "." can't match; "-" alone can't either (a digit is required).
    return (numbers[-1] if numbers else None), format_ok


def _reference(ground_truth: Any) -> Decimal | None:
    if isinstance(ground_truth, bool):
        return None
    if isinstance(ground_truth, int | float):
        value = (
            Decimal(repr(ground_truth))
            if isinstance(ground_truth, float)
            else Decimal(ground_truth)
        )
        # A NaN (a missing value in a data frame) or an infinity is no reference:
        # nothing a response can write should match it.
        return value if value.is_finite() else None
    if isinstance(ground_truth, str):
        text = ground_truth
        if "####" in text:  # a whole GSM8K answer: its final number
            found, _ = extract_answer(text, "strict")
            if found is None:
                return None
            text = found
        return parse_number(text)
    return None


def compute_score(
    response: str,
    ground_truth: Any,
    *,
    method: Literal["strict", "flexible"] = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> ScoreOutcome:
    """Score one GSM8K response.

    Args:
        response: the model's text.
        ground_truth: the reference number (``"18"``, ``18``, ``"1,234"``) or a whole
            GSM8K answer ending in ``#### N``.
        method: ``strict`` (``#### N``) or ``flexible`` (last number).
        format_score: score of a well-formed but wrong answer.
        score: score of a correct answer.
    """
    reference = _reference(ground_truth)
    if reference is None:
        raise ValueError(f"ground_truth is not a number: {ground_truth!r}")
    found, format_ok = extract_answer(response, method)
    details: dict[str, Any] = {"extracted": found, "format_ok": format_ok}
    if found is None:
        return ScoreOutcome(0.0, details)
    value = parse_number(found)
    if value is not None and value == reference:
        return ScoreOutcome(score, details)
    return ScoreOutcome(format_score, details)
