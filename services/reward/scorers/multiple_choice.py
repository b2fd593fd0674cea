r"""Multiple choice: the chosen option, by letter or by option text.

The reference is a letter (``"B"``), a 0-based index (``1`` or ``"1"`` with
``extra_info["choices"]``) or an option's text. The response's choice is, in
order of preference: the last ``\boxed{X}``; the last "answer is (X)" / "Answer:
X"; a response that is only a letter (``"B"``, ``"(B)"``, ``"B."``); otherwise,
when the options are known (``extra_info["choices"]``, ``"endings"`` or
``"options"``), the option whose text appears last in the response. Letters A-J.
"""

from __future__ import annotations

import re
from typing import Any

from rlfleet.reward.types import ScoreOutcome

__all__ = ["compute_score", "extract_choice"]

_LETTERS = "ABCDEFGHIJ"
_TAIL_CHARS = 2000
_BOXED = re.compile(r"\\boxed\{\s*\(?([A-J])\)?\s*\}")
_ANSWER_IS = re.compile(
    r"(?:answer|choice|option)\s*(?:is|:)?\s*:?\s*(?:option\s*)?\(?\**([A-J])\b\)?", re.IGNORECASE
)
_ONLY_LETTER = re.compile(r"^\s*\(?([A-J])\)?[.:]?\s*$")


def _choices(extra_info: dict[str, Any] | None) -> list[str]:
    if not extra_info:
        return []
    for key in ("choices", "endings", "options"):
        value = extra_info.get(key)
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
    return []


def extract_choice(response: str, choices: list[str]) -> str | None:
    """The letter the response picks, or None."""
    tail = response[-_TAIL_CHARS:]
    for pattern in (_BOXED, _ANSWER_IS):
        found = pattern.findall(tail)
        if found:
            return str(found[-1]).upper()
    m = _ONLY_LETTER.match(tail)
    if m:
        return m.group(1)
    if choices:
        low = tail.lower()
        best, best_pos = None, -1
        for i, text in enumerate(choices[: len(_LETTERS)]):
            t = text.strip().lower()
            pos = low.rfind(t) if t else -1
            if pos > best_pos:
                best, best_pos = _LETTERS[i], pos
        return best
    return None


def _reference_letter(ground_truth: Any, choices: list[str]) -> str:
    if isinstance(ground_truth, bool):
        raise ValueError(f"ground_truth is not an option: {ground_truth!r}")
    if isinstance(ground_truth, int | float) and float(ground_truth).is_integer():
        index = int(ground_truth)
        if 0 <= index < len(_LETTERS):
            return _LETTERS[index]
    if isinstance(ground_truth, str):
        g = ground_truth.strip()
        m = _ONLY_LETTER.match(g)
        if m and len(g) <= 4:
            return m.group(1).upper()
        if g.isdigit() and int(g) < len(_LETTERS):
            return _LETTERS[int(g)]
        lowered = [c.strip().lower() for c in choices]
        if g.lower() in lowered:
            return _LETTERS[lowered.index(g.lower())]
    raise ValueError(
        f"ground_truth is not an option letter, index or option text: {ground_truth!r}"
    )


def compute_score(
    response: str, ground_truth: Any, extra_info: dict[str, Any] | None = None
) -> ScoreOutcome:
    """1.0 when the response picks the reference option, else 0.0."""
    choices = _choices(extra_info)
    reference = _reference_letter(ground_truth, choices)
    picked = extract_choice(response, choices)
    details: dict[str, Any] = {"extracted": picked, "format_ok": picked is not None}
    return ScoreOutcome(1.0 if picked == reference else 0.0, details)
