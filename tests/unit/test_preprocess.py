"""`rlfleet preprocess`: the real GSM8K / MATH-500 / hh-rlhf files, fixtures, and errors."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from rlfleet.cli import main
from rlfleet.driver.data import preprocess as pp
from rlfleet.driver.data.recipes import (
    ASSISTANT,
    GSM8K_SCHEMA,
    HELLASWAG_SCHEMA,
    MATH_SCHEMA,
    gsm8k_final_answer,
    last_boxed,
    transcript_to_chat,
)
from rlfleet.driver.data.sources import RecordError

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
VERL_COLUMNS = ["data_source", "prompt", "ability", "reward_model", "extra_info"]


def data_dir() -> Path:
    """The shared real datasets: $RLFLEET_DATA_DIR, else <repo>/../shared/data."""
    return Path(os.environ.get("RLFLEET_DATA_DIR", REPO.parent / "shared" / "data"))


def need(rel: str) -> Path:
    path = data_dir() / rel
    if not path.exists():
        pytest.skip(f"real dataset {path} absent (set RLFLEET_DATA_DIR to the shared data folder)")
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def rows(path: Path) -> list[dict[str, Any]]:
    return pq.read_table(path).to_pylist()


def cli(argv: list[str]) -> int:
    """`rlfleet preprocess ...` through the real command-line entry point."""
    return main(["preprocess", *argv])


# --------------------------------------------------------------------------- gsm8k


def test_gsm8k_all_rows_convert_with_comma_free_ground_truth(tmp_path: Path) -> None:
    src = need("gsm8k")
    report = pp.preprocess("gsm8k", src, tmp_path)
    assert report.rows == {"train": 7473, "test": 1319}
    assert report.skipped == []
    for split in ("train", "test"):
        raw = read_jsonl(src / f"{split}.jsonl")
        table = pq.read_table(tmp_path / f"{split}.parquet")
        assert table.schema.equals(GSM8K_SCHEMA)
        out = table.to_pylist()
        assert len(out) == len(raw)
        for i, (rec, row) in enumerate(zip(raw, out, strict=True)):
            after = rec["answer"].split("####")[-1].strip()
            assert row["reward_model"] == {"style": "rule", "ground_truth": after.replace(",", "")}
            assert "," not in row["reward_model"]["ground_truth"]
            assert row["data_source"] == "openai/gsm8k"
            assert row["ability"] == "math"
            assert row["extra_info"] == {
                "split": split,
                "index": i,
                "answer": rec["answer"],
                "question": rec["question"],
            }
            [turn] = row["prompt"]
            assert turn["role"] == "user"
            assert turn["content"].startswith(rec["question"]) and "####" in turn["content"]
    # the 93 answers with thousands separators lost them
    assert any("," in r["answer"].split("####")[-1] for r in raw)


def test_cli_gsm8k_writes_verl_columns_readable_by_plain_pyarrow(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = need("gsm8k/test.jsonl")
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "test.jsonl").write_bytes(src.read_bytes())
    assert cli(["gsm8k", "--input", str(folder), "--out", str(tmp_path / "out")]) == 0
    assert "1319 rows" in capsys.readouterr().out
    table = pq.read_table(tmp_path / "out" / "test.parquet")
    assert table.column_names == VERL_COLUMNS
    assert table.num_rows == 1319
    train = pq.read_table(tmp_path / "out" / "train.parquet")
    assert train.num_rows == 0 and train.schema.equals(table.schema)


def test_gsm8k_final_answer() -> None:
    assert gsm8k_final_answer("a\n#### 1,234") == "1234"
    assert gsm8k_final_answer("#### 3\nb\n#### -7.5 ") == "-7.5"
    with pytest.raises(RecordError, match="no '#### <answer>' line"):
        gsm8k_final_answer("the answer is 3")
    with pytest.raises(RecordError, match="not a number"):
        gsm8k_final_answer("#### three")


# --------------------------------------------------------------------------- math


def _norm(text: str | None) -> str | None:
    return None if text is None else re.sub(r"\s+", " ", text).strip()


def test_math500_all_rows_convert_and_boxed_matches_answer(tmp_path: Path) -> None:
    src = need("math500")
    report = pp.preprocess("math", src, tmp_path)
    assert report.rows == {"train": 0, "test": 500}
    raw = read_jsonl(src / "test.jsonl")
    out = rows(tmp_path / "test.parquet")
    matches = sum(_norm(last_boxed(r["solution"])) == _norm(r["answer"]) for r in raw)
    rate = matches / len(raw)
    print(f"MATH-500: last \\boxed{{}} == answer for {matches}/{len(raw)} rows ({rate:.1%})")
    assert rate >= 0.99
    for rec, row in zip(raw, out, strict=True):
        assert row["data_source"] == "HuggingFaceH4/MATH-500"
        assert row["reward_model"] == {"style": "rule", "ground_truth": rec["answer"].strip()}
        assert row["extra_info"]["level"] == rec["level"]
        assert row["extra_info"]["subject"] == rec["subject"]
        assert row["extra_info"]["unique_id"] == rec["unique_id"]
        assert "\\boxed{}" in row["prompt"][0]["content"]
    train = pq.read_table(tmp_path / "train.parquet")
    assert train.num_rows == 0 and train.schema.equals(MATH_SCHEMA)


def test_math500_test_fraction_is_a_seeded_split(tmp_path: Path) -> None:
    src = need("math500")
    a = pp.preprocess("math", src, tmp_path / "a", test_fraction=0.2, seed=3)
    b = pp.preprocess("math", src, tmp_path / "b", test_fraction=0.2, seed=3)
    assert a.rows == b.rows == {"train": 400, "test": 100}
    ids = {
        s: [r["extra_info"]["unique_id"] for r in rows(tmp_path / "a" / f"{s}.parquet")]
        for s in ("train", "test")
    }
    assert ids["test"] == [r["extra_info"]["unique_id"] for r in rows(tmp_path / "b/test.parquet")]
    assert len(set(ids["train"]) | set(ids["test"])) == 500
    assert [r["extra_info"]["index"] for r in rows(tmp_path / "a/test.parquet")] == list(range(100))


def test_math_layout_takes_last_boxed_from_solution(tmp_path: Path) -> None:
    src = tmp_path / "MATH" / "train" / "algebra"
    src.mkdir(parents=True)
    (src / "1.json").write_text(
        json.dumps(
            {
                "problem": "What is $1+1$?",
                "level": "Level 1",
                "type": "Algebra",
                "solution": "First $\\boxed{3}$ is wrong; $1+1=\\boxed{\\frac{4}{2}}$.",
            }
        )
    )
    (src / "2.json").write_text(
        json.dumps(
            {"problem": "p", "level": "Level ?", "type": "Algebra", "solution": "$\\boxed 5$"}
        )
    )
    report = pp.preprocess("math", tmp_path / "MATH", tmp_path / "out")
    assert report.rows == {"train": 2, "test": 0}
    out = rows(tmp_path / "out" / "train.parquet")
    assert [r["reward_model"]["ground_truth"] for r in out] == ["\\frac{4}{2}", "5"]
    assert out[0]["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    assert [r["extra_info"]["level"] for r in out] == [1, None]
    assert out[0]["extra_info"]["subject"] == "Algebra"


@pytest.mark.parametrize(
    ("solution", "expected"),
    [
        ("so $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
        ("$\\boxed{1}$ then $\\boxed{{a}^{b}}$", "{a}^{b}"),
        ("\\fbox{7}", "7"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("$\\boxed 12$", "12"),
        ("\\boxed{\\boxed{9}}", "\\boxed{9}"),
        ("no box here", None),
        ("\\boxed{unclosed", None),
        ("\\boxeddot{x}", None),
    ],
)
def test_last_boxed(solution: str, expected: str | None) -> None:
    assert last_boxed(solution) == expected


# --------------------------------------------------------------------------- hh-rlhf


@pytest.mark.parametrize("mode", ["rl", "rm", "sft"])
def test_hh_rlhf_harmless_base_converts_with_prompts_at_last_assistant_turn(
    tmp_path: Path, mode: str
) -> None:
    src = need("hh-rlhf/harmless-base/test.jsonl.gz")
    report = pp.preprocess("full_hh_rlhf", src, tmp_path, mode=mode)
    assert report.rows == {"train": 0, "test": 2312} and not report.skipped
    raw = read_jsonl(src)
    out = rows(tmp_path / "test.parquet")
    same_turns = 0
    for rec, row in zip(raw, out, strict=True):
        prompt = row["extra_info"]["prompt_text"]
        chosen, rejected = rec["chosen"], rec["rejected"]
        assert prompt.endswith(ASSISTANT)
        assert chosen.startswith(prompt) and rejected.startswith(prompt)
        reply = chosen[len(prompt) :].strip()
        if chosen.count(ASSISTANT) == rejected.count(ASSISTANT):
            same_turns += 1  # the usual case: the cut is each transcript's last turn
            assert prompt == chosen[: chosen.rfind(ASSISTANT) + len(ASSISTANT)]
        assert row["prompt"] == transcript_to_chat(prompt, "chosen")
        assert row["prompt"][0]["role"] == "user"
        assert row["data_source"] == "Anthropic/hh-rlhf"
        assert row["reward_model"] == {"style": "model", "ground_truth": reply}
        if mode == "rm":
            assert (row["chosen"], row["rejected"]) == (reply, rejected[len(prompt) :].strip())
        elif mode == "sft":
            assert row["response"] == reply
        else:
            assert "chosen" not in row and "response" not in row
    assert same_turns >= 2300
    # the last chat turn is the last Human turn before the compared reply
    assert sum(r["prompt"][-1]["role"] == "user" for r in out) >= 2300


def test_dahoas_layout(tmp_path: Path) -> None:
    src = tmp_path / "train.jsonl"
    rec = {
        "prompt": "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: Tell me a joke.\n\nAssistant:",
        "response": " Why did the chicken cross the road?",
        "chosen": " Why did the chicken cross the road?",
        "rejected": " No.",
    }
    src.write_text(json.dumps(rec) + "\n")
    pp.preprocess("full_hh_rlhf", src, tmp_path / "rm", mode="rm")
    [row] = rows(tmp_path / "rm" / "train.parquet")
    assert row["data_source"] == "Dahoas/full-hh-rlhf"
    assert row["prompt"] == [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Tell me a joke."},
    ]
    assert (row["chosen"], row["rejected"]) == ("Why did the chicken cross the road?", "No.")
    pp.preprocess("full_hh_rlhf", src, tmp_path / "sft", mode="sft")
    [row] = rows(tmp_path / "sft" / "train.parquet")
    assert row["response"] == "Why did the chicken cross the road?"


def test_transcript_to_chat_merges_repeated_roles() -> None:
    chat = transcript_to_chat("\n\nHuman: a\n\nAssistant: b\n\nAssistant: c\n\nHuman: d", "x")
    assert chat == [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b\n\nc"},
        {"role": "user", "content": "d"},
    ]
    with pytest.raises(RecordError, match="text before the first"):
        transcript_to_chat("hello\n\nHuman: a", "chosen")


# --------------------------------------------------------------------------- hellaswag


def test_hellaswag_fixture_in_upstream_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = pp.preprocess("hellaswag", FIXTURES / "hellaswag", tmp_path)
    # upstream's test split is unlabeled: validation is the test set, test is ignored
    assert report.rows == {"train": 3, "test": 5}
    assert "hellaswag_test.jsonl" in capsys.readouterr().err
    test = pq.read_table(tmp_path / "test.parquet")
    assert test.schema.equals(HELLASWAG_SCHEMA)
    raw = read_jsonl(FIXTURES / "hellaswag" / "hellaswag_val.jsonl")
    for rec, row in zip(raw, test.to_pylist(), strict=True):
        assert row["data_source"] == "Rowan/hellaswag"
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(int(rec["label"]))}
        choices = row["extra_info"]["choices"]
        assert len(choices) == 4 and all("[" not in c for c in choices)
        content = row["prompt"][0]["content"]
        assert content.startswith(rec["activity_label"] + ": ")
        assert all(f"{letter}. {c}" in content for letter, c in zip("ABCD", choices, strict=True))
        assert content.endswith("Answer with its letter only.")
        assert row["extra_info"]["ind"] == rec["ind"]
    tea = test.to_pylist()[2]
    assert "[" not in tea["prompt"][0]["content"]
    assert tea["extra_info"]["choices"][2].startswith("Pour the hot water")


def test_hellaswag_unlabeled_record_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(pp.PreprocessError, match=r"hellaswag_test\.jsonl:1: field 'label'"):
        pp.preprocess("hellaswag", FIXTURES / "hellaswag" / "hellaswag_test.jsonl", tmp_path)


# --------------------------------------------------------------------------- arithmetic


def test_arithmetic_is_seeded_distinct_and_gsm8k_format(tmp_path: Path) -> None:
    a = pp.preprocess("arithmetic", None, tmp_path / "a", n=300, n_test=50, seed=7, ops="+-*")
    pp.preprocess("arithmetic", None, tmp_path / "b", n=300, n_test=50, seed=7, ops="+-*")
    assert a.rows == {"train": 300, "test": 50}
    train, test = rows(tmp_path / "a/train.parquet"), rows(tmp_path / "a/test.parquet")
    assert train == rows(tmp_path / "b/train.parquet")
    questions = [r["extra_info"]["question"] for r in train + test]
    assert len(set(questions)) == 350
    for row in train + test:
        m = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", row["extra_info"]["question"])
        assert m is not None
        x, op, y = int(m.group(1)), m.group(2), int(m.group(3))
        value = {"+": x + y, "-": x - y, "*": x * y}[op]
        assert value >= 0
        assert row["reward_model"]["ground_truth"] == str(value)
        assert gsm8k_final_answer(row["extra_info"]["answer"]) == str(value)
        assert row["data_source"] == "rlfleet/arithmetic"
        assert len(row["prompt"][0]["content"]) < 120  # short enough for a tiny model
    assert pq.read_table(tmp_path / "a/train.parquet").schema.equals(GSM8K_SCHEMA)
    with pytest.raises(ValueError, match="distinct problems"):
        pp.preprocess("arithmetic", None, tmp_path / "c", n=100, n_test=0, digits=1, ops="+")


# --------------------------------------------------------------------------- errors

BAD_GSM8K = [
    '{"question": "q1", "answer": "x\\n#### 1"}',
    '{"question": "q2", "answer": "x\\n#### 2"}',
    '{"question": "q3"}',
    "",
    '{"question": "q5", "answer": ',
    '{"question": "q6", "answer": "no marker"}',
    '{"question": 7, "answer": "x\\n#### 7"}',
    '["not", "an", "object"]',
    '{"question": "q9", "answer": "x\\n#### 1,000"}',
]


def _bad_file(tmp_path: Path) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(BAD_GSM8K) + "\n")
    return path


def test_malformed_record_stops_the_run_naming_file_line_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _bad_file(tmp_path)
    with pytest.raises(pp.PreprocessError) as info:
        pp.preprocess("gsm8k", src, tmp_path / "out")
    assert f"{src}:3: field 'answer': missing" in str(info.value)
    assert not (tmp_path / "out" / "train.parquet").exists()
    assert cli(["gsm8k", "--input", str(src), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{src}:3: field 'answer'" in err and "--skip-invalid" in err


def test_skip_invalid_reports_every_skipped_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _bad_file(tmp_path)
    out = tmp_path / "out"
    assert cli(["gsm8k", "--input", str(src), "--out", str(out), "--skip-invalid"]) == 0
    err = capsys.readouterr().err
    expected = {3: "'answer'", 5: "'<json>'", 6: "'answer'", 7: "'question'", 8: "'<record>'"}
    for line, field in expected.items():
        assert f"skipped {src}:{line}: field {field}" in err
    assert "skipped 5 invalid records" in err
    kept = rows(out / "train.parquet")
    assert [r["extra_info"]["question"] for r in kept] == ["q1", "q2", "q9"]
    assert [r["extra_info"]["index"] for r in kept] == [0, 1, 2]
    assert kept[2]["reward_model"]["ground_truth"] == "1000"


def test_option_and_input_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="applies to full_hh_rlhf only"):
        pp.preprocess("gsm8k", tmp_path, tmp_path / "o", mode="rm")
    with pytest.raises(ValueError, match="no data files"):
        pp.preprocess("gsm8k", tmp_path, tmp_path / "o")
    with pytest.raises(ValueError, match="needs --input"):
        pp.preprocess("gsm8k", None, tmp_path / "o")
    with pytest.raises(ValueError, match="takes no --input"):
        pp.preprocess("arithmetic", tmp_path, tmp_path / "o")


def test_json_array_and_parquet_inputs(tmp_path: Path) -> None:
    import pyarrow as pa

    recs = [{"question": f"q{i}", "answer": f"s\n#### {i}"} for i in range(4)]
    (tmp_path / "test.json").write_text(json.dumps(recs))
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "train.parquet")
    report = pp.preprocess("gsm8k", tmp_path, tmp_path / "out")
    assert report.rows == {"train": 4, "test": 4}
    bad = tmp_path / "bad"
    bad.mkdir()
    pq.write_table(
        pa.Table.from_pylist([*recs, {"question": "q", "answer": None}]), bad / "train.parquet"
    )
    with pytest.raises(pp.PreprocessError, match=r"train\.parquet:5: field 'answer'"):
        pp.preprocess("gsm8k", bad, tmp_path / "out2")


def test_preprocess_module_imports_without_torch() -> None:
    code = (
        "import sys, rlfleet.driver.data.preprocess, rlfleet.driver.data.sampler;"
        "assert 'torch' not in sys.modules and 'datasets' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
