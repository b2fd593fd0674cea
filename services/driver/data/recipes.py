"""Per-dataset conversion of raw records into rows of verl's parquet schema.

The schema contract (what :mod:`rlfleet.driver.data.preprocess` writes and
:class:`rlfleet.driver.data.dataset.RLHFDataset` reads) is verl's:

=================  ==========================================  =========================
column             arrow type                                  meaning
=================  ==========================================  =========================
``data_source``    ``string``                                  picks the reward scorer
``prompt``         ``list<struct<role: string, content: string>>``  the chat, last turn user
``ability``        ``string``                                  ``math``, ``nlp``, ...
``reward_model``   ``struct<style: string, ground_truth: string>``  ``style`` rule or model
``extra_info``     ``struct<split: string, index: int64, ...>``  per-dataset extras
=================  ==========================================  =========================

``extra_info.index`` counts the rows of one split from 0. Each converter takes a
record (a dict) and returns one row, or raises :class:`RecordError` naming the
field at fault. Converters never guess: a missing or mistyped field is an error.

Data sources (what the reward service routes on):

* ``openai/gsm8k`` -- GSM8K, ground truth the number after ``####``, commas removed.
* ``DigitalLearningGmbH/MATH-lighteval`` -- the MATH layout (``problem, level, type,
  solution``); ``HuggingFaceH4/MATH-500`` -- MATH-500's layout (``problem, solution,
  answer, subject, level, unique_id``). Both are verl's names for its math scorer.
* ``Rowan/hellaswag`` -- multiple choice, endings listed as A-D in the prompt; ground
  truth the label (the ending's 0-based index) as a string, ``"0"``..``"3"``.
* ``Anthropic/hh-rlhf`` (transcripts) and ``Dahoas/full-hh-rlhf`` (Dahoas layout).
* ``rlfleet/arithmetic`` -- the synthetic set, in GSM8K's answer format.
* ``rlfleet/calculator`` -- synthetic remainders (``4821 % 7``) for multi-turn
  rollouts with the calculator tool, in GSM8K's answer format.
* ``apps`` / ``taco`` -- APPS and TACO (``question``, ``solutions``, ``starter_code``,
  ``input_output``): ground truth the test cases as JSON (``inputs``, ``outputs``,
  ``fn_name`` for call-based problems), verl's names for its code scorers.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

import pyarrow as pa

from rlfleet.driver.data.sources import RecordError

Mode = Literal["rl", "rm", "sft"]
Row = dict[str, Any]

#: verl's GSM8K instruction (also in the tiny tokenizer's corpus, so it tokenizes short).
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and put the final answer within \\boxed{}."
HELLASWAG_INSTRUCTION = "Which ending is the most likely? Answer with its letter only."

# ------------------------------------------------------------------------ schema

PROMPT_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
REWARD_MODEL_TYPE = pa.struct([("style", pa.string()), ("ground_truth", pa.string())])
_STR = pa.string()
_INT = pa.int64()


def verl_schema(
    extra_info: list[tuple[str, pa.DataType]] | None = None,
    extra_columns: list[tuple[str, pa.DataType]] | None = None,
) -> pa.Schema:
    """verl's five columns; ``extra_info`` fields after ``split`` and ``index``."""
    info = pa.struct([("split", _STR), ("index", _INT), *(extra_info or [])])
    return pa.schema(
        [
            ("data_source", _STR),
            ("prompt", PROMPT_TYPE),
            ("ability", _STR),
            ("reward_model", REWARD_MODEL_TYPE),
            ("extra_info", info),
            *(extra_columns or []),
        ]
    )


def _row(
    data_source: str,
    content: str | list[dict[str, str]],
    ability: str,
    style: str,
    ground_truth: str,
    info: dict[str, Any],
) -> Row:
    prompt = [{"role": "user", "content": content}] if isinstance(content, str) else content
    return {
        "data_source": data_source,
        "prompt": prompt,
        "ability": ability,
        "reward_model": {"style": style, "ground_truth": ground_truth},
        "extra_info": info,
    }


def _text(rec: Mapping[str, Any], key: str, *, allow_empty: bool = False) -> str:
    if key not in rec:
        raise RecordError(key, f"missing (the record has {sorted(rec)})")
    value = rec[key]
    if not isinstance(value, str):
        raise RecordError(key, f"expected a string, got {type(value).__name__}: {value!r:.80}")
    if not allow_empty and not value.strip():
        raise RecordError(key, "empty")
    return value


# ------------------------------------------------------------------------ gsm8k

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def gsm8k_final_answer(answer: str) -> str:
    """The number after the last ``####``, thousands separators removed."""
    _, sep, tail = answer.rpartition("####")
    if not sep:
        raise RecordError("answer", "no '#### <answer>' line")
    value = tail.strip().replace(",", "")
    if not _NUMBER.fullmatch(value):
        raise RecordError("answer", f"the text after '####' is not a number: {tail.strip()!r:.80}")
    return value


GSM8K_SCHEMA = verl_schema([("answer", _STR), ("question", _STR)])


def gsm8k(rec: Mapping[str, Any], split: str, index: int) -> Row:
    question = _text(rec, "question")
    answer = _text(rec, "answer")
    truth = gsm8k_final_answer(answer)
    info = {"split": split, "index": index, "answer": answer, "question": question}
    return _row("openai/gsm8k", f"{question} {GSM8K_INSTRUCTION}", "math", "rule", truth, info)


# ------------------------------------------------------------------------ math

_BOXED = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _braced(text: str, start: int) -> int | None:
    """Index just past the brace group opening at ``text[start] == '{'``, or None."""
    depth = 0
    i = start
    while i < len(text):
        c = text[i]
        if c == "\\":  # an escaped character (\{, \}, \\) never opens or closes a group
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def last_boxed(solution: str) -> str | None:
    """The content of the last top-level ``\\boxed{...}`` (or ``\\fbox{...}``).

    Nested braces and escaped braces are handled; ``\\boxed 5`` (no braces) gives
    ``5``. Returns None when there is no well-formed box.
    """
    found: str | None = None
    pos = 0
    while (m := _BOXED.search(solution, pos)) is not None:
        i = m.end()
        while i < len(solution) and solution[i] == " ":
            i += 1
        if i < len(solution) and solution[i] == "{":
            end = _braced(solution, i)
            if end is None:
                pos = m.end()
                continue
            found = solution[i + 1 : end - 1]
            pos = end
        elif i > m.end():  # "\boxed 5$": up to the next $ or whitespace
            j = i
            while j < len(solution) and solution[j] not in "$ \n\t":
                j += 1
            if j > i:
                found = solution[i:j]
            pos = j
        else:
            pos = m.end()
    return found


MATH_SCHEMA = verl_schema(
    [
        ("question", _STR),
        ("solution", _STR),
        ("level", _INT),
        ("subject", _STR),
        ("unique_id", _STR),
    ]
)


def _level(rec: Mapping[str, Any]) -> int | None:
    level = rec.get("level")
    if level is None:
        return None
    if isinstance(level, bool):
        raise RecordError("level", f"expected an int or 'Level N', got {level!r}")
    if isinstance(level, int):
        return level
    if isinstance(level, str):
        m = re.fullmatch(r"\s*(?:Level\s*)?(\d+)\s*", level)
        if m:
            return int(m.group(1))
        if re.fullmatch(r"\s*Level\s*\?\s*", level):  # a few MATH problems are unrated
            return None
    raise RecordError("level", f"expected an int or 'Level N', got {level!r:.40}")


def math(rec: Mapping[str, Any], split: str, index: int) -> Row:
    problem = _text(rec, "problem")
    has_answer = "answer" in rec
    solution = rec.get("solution")
    if solution is not None and not isinstance(solution, str):
        raise RecordError("solution", f"expected a string, got {type(solution).__name__}")
    if has_answer:
        truth = _text(rec, "answer").strip()
    else:
        solution = _text(rec, "solution")
        boxed = last_boxed(solution)
        if boxed is None or not boxed.strip():
            raise RecordError("solution", "no \\boxed{...} answer in the solution")
        truth = boxed.strip()
    subject = rec.get("subject", rec.get("type"))
    if subject is not None and not isinstance(subject, str):
        raise RecordError("subject", f"expected a string, got {type(subject).__name__}")
    unique_id = rec.get("unique_id")
    source = (
        "HuggingFaceH4/MATH-500"
        if has_answer and "unique_id" in rec
        else "DigitalLearningGmbH/MATH-lighteval"
    )
    info = {
        "split": split,
        "index": index,
        "question": problem,
        "solution": solution,
        "level": _level(rec),
        "subject": subject,
        "unique_id": unique_id if isinstance(unique_id, str) else None,
    }
    return _row(source, f"{problem} {MATH_INSTRUCTION}", "math", "rule", truth, info)


# ------------------------------------------------------------------------ hellaswag

HELLASWAG_SCHEMA = verl_schema(
    [
        ("ind", _INT),
        ("activity_label", _STR),
        ("ctx", _STR),
        ("choices", pa.list_(_STR)),
        ("label", _INT),
        ("source_id", _STR),
        ("split_type", _STR),
    ]
)


_LETTERS = "ABCDEFGHIJ"


def _clean_wikihow(text: str) -> str:
    """Remove HellaSwag's WikiHow markup (``[title]``, ``[step]``, ...) and double spaces."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return re.sub(r"  +", " ", text).strip()


def hellaswag(rec: Mapping[str, Any], split: str, index: int) -> Row:
    activity = _text(rec, "activity_label")
    if "ctx_a" in rec:
        ctx_b = _text(rec, "ctx_b", allow_empty=True)
        ctx = _text(rec, "ctx_a") + (" " + ctx_b[:1].upper() + ctx_b[1:] if ctx_b else "")
    else:
        ctx = _text(rec, "ctx")
    endings = rec.get("endings")
    if not isinstance(endings, list) or not 2 <= len(endings) <= len(_LETTERS):
        raise RecordError("endings", f"expected a list of 2 to 10 strings, got {endings!r:.80}")
    if not all(isinstance(e, str) for e in endings):
        raise RecordError("endings", "every ending must be a string")
    label = rec.get("label")
    if isinstance(label, str) and label.strip().isdigit():
        label = int(label)
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(endings):
        raise RecordError(
            "label", f"expected an ending index 0..{len(endings) - 1}, got {label!r:.40}"
        )
    choices = [_clean_wikihow(e) for e in endings]
    query = _clean_wikihow(f"{activity}: {ctx}")
    listing = "\n".join(f"{letter}. {c}" for letter, c in zip(_LETTERS, choices, strict=False))
    ind = rec.get("ind")
    info = {
        "split": split,
        "index": index,
        "ind": ind if isinstance(ind, int) else None,
        "activity_label": activity,
        "ctx": ctx,
        "choices": choices,
        "label": label,
        "source_id": rec.get("source_id") if isinstance(rec.get("source_id"), str) else None,
        "split_type": rec.get("split_type") if isinstance(rec.get("split_type"), str) else None,
    }
    content = f"{query}...\n{listing}\n{HELLASWAG_INSTRUCTION}"
    return _row("Rowan/hellaswag", content, "nlp", "rule", str(label), info)


# ------------------------------------------------------------------------ hh-rlhf

HUMAN = "\n\nHuman:"
ASSISTANT = "\n\nAssistant:"
_TURN = re.compile(r"(\n\nHuman:|\n\nAssistant:)")


def transcript_to_chat(text: str, field: str) -> list[dict[str, str]]:
    """Split an Anthropic transcript into chat turns (user / assistant).

    Consecutive turns of the same role (a handful of hh-rlhf records have them)
    are merged with a blank line, so the chat alternates as chat templates expect.
    A trailing empty Assistant marker (a prompt's end) is dropped.
    """
    if text.startswith(("Human:", "Assistant:")):
        text = "\n\n" + text
    parts = _TURN.split(text)
    if parts[0].strip():
        raise RecordError(field, f"text before the first '\\n\\nHuman:' turn: {parts[0]!r:.60}")
    chat: list[dict[str, str]] = []
    for marker, body in zip(parts[1::2], parts[2::2], strict=True):
        role = "user" if marker == HUMAN else "assistant"
        content = body.strip()
        if chat and chat[-1]["role"] == role:
            chat[-1]["content"] = f"{chat[-1]['content']}\n\n{content}".strip()
        else:
            chat.append({"role": role, "content": content})
    if chat and chat[-1]["role"] == "assistant" and not chat[-1]["content"]:
        chat.pop()
    if not any(m["role"] == "user" for m in chat):
        raise RecordError(field, "no '\\n\\nHuman:' turn")
    return chat


def split_transcripts(chosen: str, rejected: str | None) -> tuple[str, str, str | None]:
    """``(prompt, chosen reply, rejected reply)`` of Anthropic transcripts.

    The prompt is the context the two transcripts share, up to and including the
    last ``\\n\\nAssistant:`` marker in it: the Assistant turn being compared. For
    almost every record that is the last Assistant marker of both transcripts; in
    the few where a reply itself contains another marker, it still cuts where the
    transcripts part. With no ``rejected``, the last marker of ``chosen``.
    """
    if rejected is None:
        shared = chosen
    else:
        n = 0
        limit = min(len(chosen), len(rejected))
        while n < limit and chosen[n] == rejected[n]:
            n += 1
        shared = chosen[:n]
        if n == len(chosen) == len(rejected):
            shared = chosen
    cut = shared.rfind(ASSISTANT)
    if cut < 0:
        field = "chosen" if rejected is None else "rejected"
        raise RecordError(field, "no shared context ending in a '\\n\\nAssistant:' turn")
    end = cut + len(ASSISTANT)
    prompt = chosen[:end]
    return prompt, chosen[end:].strip(), None if rejected is None else rejected[end:].strip()


def hh_schema(mode: Mode) -> pa.Schema:
    info = [("prompt_text", _STR)]
    if mode == "rm":
        return verl_schema(info, [("chosen", _STR), ("rejected", _STR)])
    if mode == "sft":
        return verl_schema(info, [("response", _STR)])
    return verl_schema(info)


def full_hh_rlhf(rec: Mapping[str, Any], split: str, index: int, mode: Mode) -> Row:
    if "prompt" in rec:  # Dahoas layout: prompt, response, chosen, rejected
        source = "Dahoas/full-hh-rlhf"
        prompt_text = _text(rec, "prompt")
        chat = transcript_to_chat(prompt_text, "prompt")
        chosen = _text(rec, "chosen", allow_empty=True).strip() if mode == "rm" else ""
        rejected = _text(rec, "rejected", allow_empty=True).strip() if mode == "rm" else ""
        response = _text(rec, "response", allow_empty=True).strip()
    else:  # Anthropic transcripts: chosen, rejected
        source = "Anthropic/hh-rlhf"
        full_chosen = _text(rec, "chosen")
        full_rejected = _text(rec, "rejected") if "rejected" in rec or mode == "rm" else None
        prompt_text, chosen, rejected_reply = split_transcripts(full_chosen, full_rejected)
        rejected = rejected_reply or ""
        chat = transcript_to_chat(prompt_text, "chosen")
        response = chosen
    info = {"split": split, "index": index, "prompt_text": prompt_text}
    row = _row(source, chat, "alignment", "model", response, info)
    if mode == "rm":
        row["chosen"] = chosen
        row["rejected"] = rejected
    elif mode == "sft":
        row["response"] = response
    return row


# ------------------------------------------------------------------------ arithmetic

ARITHMETIC_SCHEMA = GSM8K_SCHEMA
ARITHMETIC_OPS = "+-*"


def arithmetic_problem(a: int, op: str, b: int) -> tuple[str, str, int]:
    """``(question, step-by-step answer ending in '#### N', N)``."""
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    question = f"What is {a} {op} {b}?"
    return question, f"{a} {op} {b} = {value}\n#### {value}", value


def arithmetic(
    n_train: int, n_test: int, *, seed: int, digits: int = 2, ops: str = "+-"
) -> dict[str, list[Row]]:
    """A synthetic GSM8K-format set a ~1M-parameter model can learn.

    Operands have 1 to ``digits`` digits; ``-`` keeps results non-negative; ``*``
    takes a one-digit second factor so answers stay short. Problems are distinct,
    and no test problem appears in train. The same arguments give the same rows.
    """
    if digits < 1 or digits > 6:
        raise ValueError(f"digits must be 1..6, got {digits}")
    if not ops or any(op not in ARITHMETIC_OPS for op in ops):
        raise ValueError(f"ops must be a non-empty subset of {ARITHMETIC_OPS!r}, got {ops!r}")
    if n_train < 0 or n_test < 0:
        raise ValueError(f"--n and --n-test must be >= 0, got {n_train} and {n_test}")
    hi = 10**digits - 1
    sizes = {"+": (hi + 1) ** 2, "-": (hi + 1) * (hi + 2) // 2, "*": (hi + 1) * 10}
    space = sum(sizes[op] for op in set(ops))
    if n_train + n_test > space // 2:  # keeps the rejection sampling below fast
        raise ValueError(
            f"{n_train + n_test} distinct problems asked for, but {digits}-digit operands "
            f"with ops {ops!r} give only {space} (at most half may be used): "
            "raise --digits or lower --n / --n-test"
        )
    rng = random.Random(seed)
    seen: set[tuple[int, str, int]] = set()
    out: dict[str, list[Row]] = {"train": [], "test": []}
    for split, count in (("train", n_train), ("test", n_test)):
        attempts = 0
        while len(out[split]) < count:
            attempts += 1
            if attempts > 100 * count + 1000:  # bound: the space check makes this unreachable
                raise RuntimeError(f"could not draw {count} distinct problems")
            op = rng.choice(ops)
            a = rng.randint(0, hi)
            b = rng.randint(0, 9 if op == "*" else hi)
            if op == "-" and b > a:
                a, b = b, a
            if (a, op, b) in seen:
                continue
            seen.add((a, op, b))
            question, answer, value = arithmetic_problem(a, op, b)
            info = {
                "split": split,
                "index": len(out[split]),
                "answer": answer,
                "question": question,
            }
            out[split].append(
                _row(
                    "rlfleet/arithmetic",
                    f"{question} {GSM8K_INSTRUCTION}",
                    "math",
                    "rule",
                    str(value),
                    info,
                )
            )
    return out


# ------------------------------------------------------------------------ calculator

CALCULATOR_SCHEMA = verl_schema(
    [("answer", _STR), ("question", _STR), ("expression", _STR), ("tool_call", _STR)]
)
CALCULATOR_SOURCE = "rlfleet/calculator"
CALCULATOR_INSTRUCTION = 'A calculator tool is available. Output the final answer after "####".'
"""Short on purpose: the call's format is the model's to know (a chat template with
``tools=`` tells a large model; the warm start teaches the tiny one)."""


def calculator_call(expression: str) -> str:
    """The Hermes tool call of the calculator on ``expression`` (what the model writes).

    ``arguments`` comes before ``name`` (a JSON object's keys are unordered; every
    Hermes parser reads either order): the expression then follows the question by
    a few tokens, and a small model learns to copy it in far fewer steps."""
    args = {"arguments": {"expression": expression}, "name": "calculator"}
    return f"<tool_call>{json.dumps(args)}</tool_call>"


def calculator_problem(a: int, b: int) -> tuple[str, str, int]:
    """``(question, expression, value)`` of ``a % b``."""
    return f"What is {a} % {b}?", f"{a} % {b}", a % b


def calculator(n_train: int, n_test: int, *, seed: int, digits: int = 3) -> dict[str, list[Row]]:
    """Remainders of ``digits``-digit numbers by a one-digit divisor (3 to 9), for
    multi-turn rollouts with the ``calculator`` tool (``examples/agentic_calculator.yaml``).

    A small model cannot compute ``482 % 7`` in its head (guessing a digit is right
    about one time in six), but it can copy one digit from the tool's answer: the
    prompt says a calculator is available, and the answer (GSM8K's ``#### N``, scored
    by the gsm8k rule under data source ``rlfleet/calculator``) is the tool's result.
    ``extra_info`` holds the call a model should make (``tool_call``) and the
    reference answer, from which :func:`calculator_transcript` builds a warm-start
    conversation. Problems are distinct, no test problem is in train; the same
    arguments give the same rows.
    """
    if not 2 <= digits <= 5:
        raise ValueError(f"digits must be 2..5, got {digits}")
    if n_train < 0 or n_test < 0:
        raise ValueError(f"--n and --n-test must be >= 0, got {n_train} and {n_test}")
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    space = [(a, b) for a in range(lo, hi + 1) for b in range(3, 10)]
    if n_train + n_test > len(space):
        raise ValueError(
            f"{n_train + n_test} distinct problems asked for, but {digits}-digit numbers give "
            f"only {len(space)}: raise --digits or lower --n / --n-test"
        )
    random.Random(seed).shuffle(space)
    picked = {"train": space[:n_train], "test": space[n_train : n_train + n_test]}
    out: dict[str, list[Row]] = {"train": [], "test": []}
    for split, problems in picked.items():
        for a, b in problems:
            question, expression, value = calculator_problem(a, b)
            info = {
                "split": split,
                "index": len(out[split]),
                "answer": f"#### {value}",
                "question": question,
                "expression": expression,
                "tool_call": calculator_call(expression),
            }
            # The question last: the model's call repeats it a few tokens later.
            content = f"{CALCULATOR_INSTRUCTION} {question}"
            out[split].append(_row(CALCULATOR_SOURCE, content, "math", "rule", str(value), info))
    return out


def calculator_transcript(row: Mapping[str, Any]) -> list[dict[str, str]]:
    """The conversation a calculator row asks for, after its prompt: the model's call,
    the tool's answer (computed by the tool itself), the model's final answer."""
    from rlfleet.tools.builtin import evaluate

    info = row["extra_info"]
    result = evaluate(info["expression"])
    return [
        {"role": "assistant", "content": info["tool_call"]},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": f"#### {result}"},
    ]


# ------------------------------------------------------------------------ apps / taco

CODE_STDIN_INSTRUCTION = (
    "Write a Python 3 program that reads the input from standard input and prints the "
    "answer to standard output. Put the whole program in one ```python code block."
)
CODE_CALL_INSTRUCTION = (
    "Write the Python 3 function `{fn_name}` (a method of `class Solution` when the "
    "starter code has one). Put the code in one ```python code block."
)
MAX_CODE_GROUND_TRUTH_CHARS = 1 << 20
"""The reward service's default bound on a text ground truth (``--max-text-chars``):
a problem whose test cases are longer keeps its leading cases that fit."""

APPS_SCHEMA = verl_schema(
    [
        ("question", _STR),
        ("starter_code", _STR),
        ("difficulty", _STR),
        ("problem_id", _STR),
        ("solution", _STR),
        ("num_test_cases", _INT),
        ("test_cases", _INT),
    ]
)


def _json_field(rec: Mapping[str, Any], key: str) -> Any:
    """A field that APPS / TACO store as a JSON string (or already decoded)."""
    value = rec.get(key)
    if isinstance(value, str):
        if not value.strip():
            raise RecordError(key, "empty")
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise RecordError(key, f"not valid JSON: {e}") from None
    return value


def _test_cases(rec: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    """The problem's test cases as the code scorer reads them, and how many it had."""
    if "input_output" not in rec:
        raise RecordError("input_output", f"missing (the record has {sorted(rec)})")
    io = _json_field(rec, "input_output")
    if not isinstance(io, dict):
        raise RecordError("input_output", f"expected a JSON object, got {type(io).__name__}")
    inputs, outputs = io.get("inputs"), io.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise RecordError("input_output", "needs 'inputs' and 'outputs' lists")
    if len(inputs) != len(outputs):
        raise RecordError("input_output", f"{len(inputs)} inputs but {len(outputs)} outputs")
    if not inputs:
        raise RecordError("input_output", "no test cases")
    fn_name = io.get("fn_name")
    if fn_name is not None and (not isinstance(fn_name, str) or not fn_name.isidentifier()):
        raise RecordError("input_output", f"fn_name must be an identifier, got {fn_name!r:.40}")
    if fn_name is None:
        for i, (x, y) in enumerate(zip(inputs, outputs, strict=True)):
            for what, v in (("input", x), ("output", y)):
                lines_ok = isinstance(v, list) and all(isinstance(t, str) for t in v)
                if not isinstance(v, str) and not lines_ok:
                    raise RecordError(
                        "input_output",
                        f"stdin/stdout case {i}: {what} must be a string or a list of lines, "
                        f"got {type(v).__name__}",
                    )
    budget = MAX_CODE_GROUND_TRUTH_CHARS - 200  # the keys and fn_name
    kept_in: list[Any] = []
    kept_out: list[Any] = []
    used = 0
    for x, y in zip(inputs, outputs, strict=True):
        used += len(json.dumps(x)) + len(json.dumps(y)) + 4
        if used > budget:
            break
        kept_in.append(x)
        kept_out.append(y)
    if not kept_in:
        raise RecordError(
            "input_output",
            f"its first test case alone is over {MAX_CODE_GROUND_TRUTH_CHARS} characters",
        )
    cases: dict[str, Any] = {"inputs": kept_in, "outputs": kept_out}
    if fn_name is not None:
        cases["fn_name"] = fn_name
    return cases, len(inputs)


def apps(rec: Mapping[str, Any], split: str, index: int, data_source: str = "apps") -> Row:
    """One APPS or TACO problem: the question (and starter code) as the prompt."""
    question = _text(rec, "question")
    starter = rec.get("starter_code") or ""
    if not isinstance(starter, str):
        raise RecordError("starter_code", f"expected a string, got {type(starter).__name__}")
    cases, total = _test_cases(rec)
    solution: str | None = None
    if rec.get("solutions"):
        solutions = _json_field(rec, "solutions")
        if not isinstance(solutions, list) or not all(isinstance(x, str) for x in solutions):
            raise RecordError("solutions", "expected a JSON list of strings")
        solution = solutions[0] if solutions else None
    fn_name = cases.get("fn_name")
    parts = [question.strip()]
    if starter.strip():
        parts.append(f"Starter code:\n```python\n{starter.rstrip()}\n```")
    parts.append(
        CODE_CALL_INSTRUCTION.format(fn_name=fn_name) if fn_name else CODE_STDIN_INSTRUCTION
    )
    difficulty = rec.get("difficulty")
    problem_id = rec.get("problem_id")
    info = {
        "split": split,
        "index": index,
        "question": question,
        "starter_code": starter,
        "difficulty": difficulty if isinstance(difficulty, str) else None,
        "problem_id": None if problem_id is None else str(problem_id),
        "solution": solution,
        "num_test_cases": total,
        "test_cases": len(cases["inputs"]),
    }
    truth = json.dumps(cases)
    return _row(data_source, "\n\n".join(parts), "code", "rule", truth, info)


# ------------------------------------------------------------------------ registry

Converter = Callable[[Mapping[str, Any], str, int], Row]


def converter(name: str, mode: Mode = "rl") -> tuple[Converter, pa.Schema]:
    """The record converter and output schema of dataset ``name``."""
    if name == "gsm8k":
        return gsm8k, GSM8K_SCHEMA
    if name == "math":
        return math, MATH_SCHEMA
    if name == "hellaswag":
        return hellaswag, HELLASWAG_SCHEMA
    if name in ("apps", "taco"):

        def code(rec: Mapping[str, Any], split: str, index: int) -> Row:
            return apps(rec, split, index, data_source=name)

        return code, APPS_SCHEMA

    if name == "full_hh_rlhf":

        def hh(rec: Mapping[str, Any], split: str, index: int) -> Row:
            return full_hh_rlhf(rec, split, index, mode)

        return hh, hh_schema(mode)
    raise ValueError(f"no converter for dataset {name!r}")
