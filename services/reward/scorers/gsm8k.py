"""GSM8K: the final number of a response against the reference number.

By default the score is verl's (``verl/utils/reward_score/gsm8k.py``), exactly:

* only the last :data:`TAIL_CHARS` (300) characters of the response count;
* ``strict``: the text after the last ``#### `` (one space) made of ``-``, digits,
  ``.`` and ``,``, commas then dropped; no such marker scores 0;
* ``flexible``: the last run of ``-``, digits, ``.`` and ``,`` anywhere that is not a
  lone ``.``, as written (commas kept, as verl keeps them);
* the answer is compared as a string with the reference as given: equal scores
  ``score``, different scores ``format_score``. So ``#### 18.00``, ``#### 18.`` and
  ``#### $18`` do not match ``18``, and nothing matches a reference that is not a
  string (``18``, ``18.0``).

``lenient=True`` (``reward.gsm8k_lenient``, an rlfleet option) is the older rule:
numbers may carry a ``$``, separators, a trailing period and any spacing after
``####``, compare as exact decimals (``18.00 == 18``), the reference may be a whole
GSM8K answer, and the last :data:`LENIENT_TAIL_CHARS` characters are searched.

Both modes are linear-time over a clipped tail, so bounded on a hostile 1 MB response.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

from rlfleet.reward.types import ScoreOutcome

__all__ = [
    "LENIENT_TAIL_CHARS",
    "TAIL_CHARS",
    "compute_score",
    "extract_answer",
    "extract_verl_answer",
    "parse_number",
]

TAIL_CHARS = 300
"""verl's clip: only this many characters at the end of a response are read."""
LENIENT_TAIL_CHARS = 1000

# verl's patterns, made of one character class: linear time.
_VERL_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_VERL_NUMBER = re.compile(r"-?[0-9.,]+")

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


def extract_verl_answer(
    response: str, method: Literal["strict", "flexible"] = "strict"
) -> tuple[str | None, bool]:
    """verl's answer text (None: none) and whether its strict ``#### N`` was present."""
    tail = response[-TAIL_CHARS:]
    strict = _VERL_STRICT.findall(tail)
    format_ok = bool(strict)
    if method == "strict":
        return (strict[-1].replace(",", "") if strict else None), format_ok
    numbers = _VERL_NUMBER.findall(tail)
    if not numbers:
        return None, format_ok
    found = next((n for n in reversed(numbers) if n != "."), None)
    # All lone dots: verl's loop ends on the first one, which then matches nothing.
    return (numbers[0] if found is None else found), format_ok


def extract_answer(
    response: str, method: Literal["strict", "flexible"] = "strict"
) -> tuple[str | None, bool]:
    """The lenient answer text found and whether a ``#### N`` was present."""
    tail = response[-LENIENT_TAIL_CHARS:]
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
    lenient: bool = False,
) -> ScoreOutcome:
    """Score one GSM8K response (verl's rule unless ``lenient``).

    Args:
        response: the model's text.
        ground_truth: the reference: a numeric string as verl's data has it (``"18"``);
            as in verl, anything else (``18``, ``18.0``, ``"eighteen"``) equals no
            answer. Lenient: also an int or float, ``"1,234"``, or a whole GSM8K answer
            ending in ``#### N``.
        method: ``strict`` (``#### N``) or ``flexible`` (last number).
        format_score: score of an answer found but different from the reference.
        score: score of a correct answer.
        lenient: rlfleet's decimal comparison (module docstring) instead of verl's.

    Raises:
        ValueError: lenient only: the reference is not a number (no answer could
            ever match it).
    """
    if not lenient:
        # verl compares the answer text with the reference as given: a reference that
        # is not a string (18, 18.0) or no number ("eighteen") equals no answer.
        found, format_ok = extract_verl_answer(response, method)
        details: dict[str, Any] = {"extracted": found, "format_ok": format_ok}
        if found is None:
            return ScoreOutcome(0.0, details)
        return ScoreOutcome(score if found == ground_truth else format_score, details)
    number = _reference(ground_truth)
    if number is None:
        raise ValueError(f"ground_truth is not a number: {ground_truth!r}")
    found, format_ok = extract_answer(response, method)
    details = {"extracted": found, "format_ok": format_ok}
    if found is None:
        return ScoreOutcome(0.0, details)
    value = parse_number(found)
    if value is not None and value == number:
        return ScoreOutcome(score, details)
    return ScoreOutcome(format_score, details)
