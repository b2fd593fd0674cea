"""Rule scorers: GSM8K, MATH, multiple choice, against hand cases and the real data sets."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest

from rlfleet.reward.scorers import (
    CustomScorer,
    gsm8k,
    math,
    multiple_choice,
    outcome_from_custom,
    run_scorer,
)

REPO = Path(__file__).resolve().parents[2]
DATA = Path(os.environ.get("RLFLEET_DATA_DIR", REPO.parent / "shared" / "data"))


def _rows(relative: str) -> list[dict[str, Any]]:
    path = DATA / relative
    if not path.is_file():
        pytest.skip(f"{path} not found (set RLFLEET_DATA_DIR to the shared data folder)")
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# ------------------------------------------------------------------------ GSM8K


# verl's rule (strict, flexible) and the lenient option (strict, flexible), per row.
GSM8K_TABLE: list[tuple[str, str, Any, tuple[float, float, float, float]]] = [
    ("exact", "so she makes 18 dollars.\n#### 18", "18", (1, 1, 1, 1)),
    ("decimal zeros", "#### 18.00", "18", (0, 0, 1, 1)),
    ("dollar sign", "#### $18", "18", (0, 1, 1, 1)),  # strict: no match; flexible: 18
    ("trailing period", "The answer:\n#### 18.", "18", (0, 0, 1, 1)),
    ("thousands separator", "#### 1,000", "1000", (1, 0, 1, 1)),  # flexible keeps commas
    ("negative", "#### -7", "-7", (1, 1, 1, 1)),
    ("last marker wins", "#### 18\n#### 20", "20", (1, 1, 1, 1)),
    ("earlier marker ignored", "#### 20\n#### 18", "20", (0, 0, 0, 0)),
    ("beyond the last 300", "#### 18\n" + "x" * 400, "18", (0, 0, 1, 1)),
    ("no answer", "I do not know", "18", (0, 0, 0, 0)),
    ("no marker", "the answer is 18", "18", (0, 1, 0, 1)),
    ("no space after ####", "####18", "18", (0, 1, 1, 1)),
    ("wrong number", "#### 19", "18", (0, 0, 0, 0)),
    ("comma after the number", "it is 5, I think", "5", (0, 0, 0, 1)),
    ("trailing zero", "#### 3.50", "3.5", (0, 0, 1, 1)),
    ("int reference", "#### 18", 18, (0, 0, 1, 1)),  # verl: "18" == 18 is false
    ("float reference", "#### 0.5", 0.5, (0, 0, 1, 1)),
    ("empty response", "", "18", (0, 0, 0, 0)),
]


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [row[1:] for row in GSM8K_TABLE],
    ids=[row[0] for row in GSM8K_TABLE],
)
def test_gsm8k_edge_cases(
    response: str, truth: Any, expected: tuple[float, float, float, float]
) -> None:
    got = tuple(
        gsm8k.compute_score(response, truth, method=method, lenient=lenient).score
        for lenient in (False, True)
        for method in ("strict", "flexible")
    )
    assert got == expected


def test_gsm8k_reads_exactly_the_last_300_characters() -> None:
    inside = "#### 18" + "x" * 293  # 300 characters: the marker is the tail's start
    assert len(inside) == gsm8k.TAIL_CHARS
    assert gsm8k.compute_score(inside, "18").score == 1.0
    assert gsm8k.compute_score("a" + inside, "18").score == 1.0
    assert gsm8k.compute_score(inside + "x", "18").score == 0.0  # "### 18" is left
    assert gsm8k.compute_score(inside + "x", "18", lenient=True).score == 1.0


def test_gsm8k_format_score() -> None:
    def strict(response: str) -> float:
        return gsm8k.compute_score(response, "18", format_score=0.1).score

    assert strict("#### 18") == 1.0
    assert strict("#### 17") == 0.1
    assert strict("#### 18.00") == 0.1  # an answer, not equal as text
    assert strict("#### 18.") == 0.1
    assert strict("#### $18") == 0.0  # no answer found
    assert strict("no marker 18") == 0.0
    assert gsm8k.compute_score("#### 18", "18", score=2.0).score == 2.0
    flexible = gsm8k.compute_score("Done.", "18", method="flexible", format_score=0.1)
    assert flexible.score == 0.1 and flexible.details["extracted"] == "."  # verl's quirk
    assert gsm8k.compute_score("Done", "18", method="flexible", format_score=0.1).score == 0.0
    lenient = gsm8k.compute_score("#### 17", "18", format_score=0.1, lenient=True)
    assert lenient.score == 0.1


def test_gsm8k_details() -> None:
    out = gsm8k.compute_score("so the total is 1,800.\n#### 1,800", "1800")
    assert out.details == {"extracted": "1800", "format_ok": True}
    out = gsm8k.compute_score("so the total is 1,800.", "1800", method="flexible")
    assert out.details == {"extracted": "1,800.", "format_ok": False} and out.score == 0.0
    out = gsm8k.compute_score("so the total is 1,800.", "1800", method="flexible", lenient=True)
    assert out.score == 1.0 and out.details["format_ok"] is False


@pytest.mark.parametrize("truth", ["eighteen", "", "-", "18 ", "She sells 9 eggs.\n#### 18"])
def test_gsm8k_reference_that_no_answer_can_equal(truth: str) -> None:
    """verl scores them as any other reference an answer does not equal; the lenient
    option, which reads references as numbers, refuses those that are none."""
    assert gsm8k.compute_score("#### 18", truth, format_score=0.1).score == 0.1
    if truth in ("eighteen", "", "-"):  # (lenient reads "18 " and a whole answer)
        with pytest.raises(ValueError, match="not a number"):
            gsm8k.compute_score("#### 18", truth, lenient=True)


def test_gsm8k_lenient_reference_forms() -> None:
    whole = "She sells 9 eggs.\n#### 18"
    assert gsm8k.compute_score("reasoning\n#### 18", whole, lenient=True).score == 1.0
    assert gsm8k.compute_score("#### 1234", "1,234", lenient=True).score == 1.0
    with pytest.raises(ValueError, match="not a number"):
        gsm8k.compute_score("#### 1", "eighteen", lenient=True)


def test_every_gsm8k_test_answer_scores_one_and_a_wrong_number_zero() -> None:
    rows = _rows("gsm8k/test.jsonl")
    assert len(rows) == 1319
    rng = random.Random(0)
    for row in rows:
        # The file's own solution is written as a model would: reasoning, then "#### N".
        solution = row["answer"]
        # verl's preprocessing: the number after "####", commas removed.
        truth = solution.rsplit("####", 1)[1].strip().replace(",", "")
        assert gsm8k.compute_score(solution, truth).score == 1.0, solution[-80:]
        wrong = str(int(truth.replace(",", "")) + rng.randint(1, 9))
        wrong_solution = solution.rsplit("####", 1)[0] + "#### " + wrong
        assert gsm8k.compute_score(wrong_solution, truth).score == 0.0
        assert gsm8k.compute_score(wrong_solution, truth, format_score=0.1).score == 0.1


# ------------------------------------------------------------------------- MATH


@pytest.mark.parametrize(
    ("text", "boxed"),
    [
        (r"so $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
        (r"\boxed{1} then \boxed{{2}+{3}}", "{2}+{3}"),
        (r"\fbox{7}", "7"),
        (r"\boxed 5$", "5"),
        (r"\boxed{unbalanced {", "unbalanced {"),
        ("no box here", None),
    ],
)
def test_last_boxed(text: str, boxed: str | None) -> None:
    assert math.last_boxed(text) == boxed


@pytest.mark.parametrize(
    ("pred", "gold"),
    [
        (r"\frac{1}{2}", "0.5"),
        (r"\frac12", r"\frac{1}{2}"),
        (r"\dfrac{3}{4}", "3/4"),
        (r"\left( 3, \frac{\pi}{2} \right)", r"\left( 3, \frac{\pi}{2} \right)"),
        (r"(3,\frac{\pi}{2})", r"\left( 3, \frac{\pi}{2} \right)"),
        (r"30^\circ", "30"),
        (r"50\%", "50"),
        (r"10 \text{ cm}", "10"),
        (r"\left[1, 2\right)", "[1,2)"),
        ("1,000", "1000"),
        (".5", "0.5"),
        (r"\$18", "18"),
        ("x = 5", "5"),
        (r"\text{(C)}", "(C)"),
        (r"2\sqrt{2}", r"\sqrt{8}"),  # math-verify
        (r"\frac{\pi}{2}", r"\pi/2"),  # math-verify
    ],
)
def test_math_equivalences(pred: str, gold: str) -> None:
    assert math.compute_score(f"The answer is $\\boxed{{{pred}}}$.", gold).score == 1.0


@pytest.mark.parametrize(
    ("pred", "gold"),
    [("(1,2)", "[1,2]"), ("3", "4"), (r"\frac{1}{3}", "0.33"), ("x+1", "x-1"), ("", "0")],
)
def test_math_non_equivalences(pred: str, gold: str) -> None:
    assert math.compute_score(f"\\boxed{{{pred}}}", gold).score == 0.0


def _perturbed(answer: str) -> str:
    """The reference answer written the way models vary it."""
    out = answer.replace(r"\frac", r"\dfrac").replace(",", ", ")
    if r"\left" not in out:
        out = out.replace("(", r"\left(").replace(")", r"\right)")
    return out


def test_math500_reference_solutions_score_one() -> None:
    rows = _rows("math500/test.jsonl")
    assert len(rows) == 500
    exact = sum(math.compute_score(r["solution"], r["answer"]).score for r in rows)
    perturbed = sum(
        math.compute_score(f"So $\\boxed{{{_perturbed(r['answer'])}}}$.", r["answer"]).score
        for r in rows
    )
    print(f"MATH-500 reference solutions: {exact / 500:.3f}, perturbed: {perturbed / 500:.3f}")
    assert exact / 500 >= 0.99
    assert perturbed / 500 >= 0.99
    # Someone else's answer scores 0 (different answers only).
    wrong = [
        math.compute_score(f"\\boxed{{{rows[i - 1]['answer']}}}", r["answer"]).score
        for i, r in enumerate(rows)
        if math.normalize(rows[i - 1]["answer"]) != math.normalize(r["answer"])
    ]
    assert sum(wrong) <= 0.01 * len(wrong)


ADVERSARIAL = [
    "",
    "x" * 1_000_000,
    "#### " + "9" * 500_000,
    "1," * 300_000,
    "\\boxed{" * 50_000,
    "\\boxed{" * 2_000 + "1" + "}" * 2_000,
    "}}}}{{{{" * 10_000 + "\\boxed{",
    "数学 答案是 \\boxed{四} 🙂 #### ٣",
    "\x00\ud7ff\ue000" * 1000,
    "(" * 100_000 + "answer is (B)",
]


@pytest.mark.parametrize(
    "scorer",
    [
        "gsm8k",
        "gsm8k_flexible",
        "gsm8k_lenient",
        "gsm8k_flexible_lenient",
        "math",
        "multiple_choice",
    ],
)
def test_adversarial_responses_score_promptly(scorer: str) -> None:
    truth: Any = "B" if scorer == "multiple_choice" else "4"
    for response in ADVERSARIAL:
        start = time.perf_counter()
        out = run_scorer(scorer, scorer, response, truth, {})
        elapsed = time.perf_counter() - start
        assert 0.0 <= out.score <= 1.0
        assert elapsed < 2.0, (scorer, response[:30], elapsed)


# -------------------------------------------------------------- multiple choice


@pytest.mark.parametrize(
    ("response", "truth", "extra", "score"),
    [
        ("The answer is (B).", "B", {}, 1.0),
        ("Answer: C", "B", {}, 0.0),
        ("B", 1, {}, 1.0),
        (r"so \boxed{D}", "D", {}, 1.0),
        ("He walks the dog.", "1", {"endings": ["He sleeps.", "He walks the dog."]}, 1.0),
        ("He sleeps.", "He walks the dog.", {"choices": ["He sleeps.", "He walks the dog."]}, 0.0),
        ("nothing", "A", {}, 0.0),
    ],
)
def test_multiple_choice(response: str, truth: Any, extra: dict[str, Any], score: float) -> None:
    assert multiple_choice.compute_score(response, truth, extra).score == score


# ------------------------------------------------------------------- custom


def test_custom_function_is_called_with_verls_keywords(tmp_path: Path) -> None:
    """As verl calls it: by keyword (any parameter order), reward_kwargs added."""
    path = tmp_path / "reordered.py"
    path.write_text(
        "def score_it(ground_truth, solution_str, extra_info, data_source, *, weight):\n"
        "    return weight * (solution_str == ground_truth) + len(extra_info)\n"
    )
    custom = CustomScorer(str(path), "score_it", {"weight": 3.0})
    assert run_scorer("custom", "openai/gsm8k", "18", "18", {"a": 1}, custom).score == 4.0
    assert CustomScorer.from_json(custom.to_json()) == custom
    with pytest.raises(ValueError, match="no custom function"):
        run_scorer("custom", "openai/gsm8k", "18", "18", {})


def test_custom_return_conventions() -> None:
    assert outcome_from_custom(1).score == 1.0
    out = outcome_from_custom({"score": 0.5, "acc": True, "pred": "x"})
    assert out.score == 0.5 and out.details == {"acc": True, "pred": "x"}
    with pytest.raises(ValueError, match="without 'score'"):
        outcome_from_custom({"acc": 1})
    with pytest.raises(TypeError):
        outcome_from_custom("1.0")
    with pytest.raises(ValueError, match="non-finite"):
        outcome_from_custom(float("nan"))


_NON_FINITE_TRUTHS = [
    float("nan"),
    float("inf"),
    float("-inf"),
    "nan",
    "NaN",
    "-nan",
    "inf",
    "-inf",
    "Infinity",
    r"\boxed{nan}",
    [float("nan")],
    ["nan", float("inf")],
]
_NON_FINITE_RESPONSES = [
    r"\boxed{nan}",
    r"\boxed{NaN}",
    r"\boxed{inf}",
    r"\boxed{-inf}",
    r"\boxed{Infinity}",
    "#### nan",
    "#### inf",
    "the answer is nan",
    "nan",
    "inf",
]


@pytest.mark.parametrize("truth", _NON_FINITE_TRUTHS, ids=repr)
@pytest.mark.parametrize(
    "scorer",
    [
        "math",
        "gsm8k",
        "gsm8k_flexible",
        "gsm8k_lenient",
        "gsm8k_flexible_lenient",
        "multiple_choice",
    ],
)
def test_a_non_finite_ground_truth_never_scores(scorer: str, truth: Any) -> None:
    """NaN (a missing value read from a data frame) or infinity is no answer: an error or 0."""
    for response in _NON_FINITE_RESPONSES:
        try:
            outcome = run_scorer(scorer, scorer, response, truth, {})
        except (ValueError, TypeError):
            continue
        assert outcome.score == 0.0, (scorer, truth, response, outcome)


def test_math_infinity_in_latex_is_still_an_answer() -> None:
    assert math.compute_score(r"so $\boxed{\infty}$", r"\infty").score == 1.0
    assert math.compute_score(r"$\boxed{[0, \infty)}$", r"[0,\infty)").score == 1.0
    assert math.compute_score(r"$\boxed{nan}$", r"\infty").score == 0.0


def test_math_huge_exponents_compare_without_overflow_or_bignums() -> None:
    # Exact values: no float overflow on 1e400 (it raised OverflowError), and a
    # 10**999999999 is never built (seconds and gigabytes) for a short answer.
    assert math.compute_score(r"\boxed{1e400}", "1e401").score == 0.0
    assert math.compute_score(r"\boxed{1e400}", "10e399").score == 1.0
    assert (
        math.compute_score(r"\boxed{1e999999999}", "1e999999998", use_math_verify=False).score
        == 0.0
    )
    assert math.compute_score(r"\boxed{1e999999999}", "1e999999999").score == 1.0
