"""The tiny offline model: tokenizer round-trips, chat template, loading, determinism, CLI."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.cli import main
from rlfleet.common import tiny_model


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> Any:
    m = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    return m.eval()


def test_import_does_not_pull_in_torch() -> None:
    code = (
        "import sys, rlfleet.common.tiny_model, rlfleet.cli; "
        "heavy = [m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_folder_is_a_llama_hf_directory(tiny_model_dir: Path, tok: Any, model: Any) -> None:
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (tiny_model_dir / name).is_file(), name
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is True
    assert model.config.vocab_size == len(tok) == 2048
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<|pad|>", "<|bos|>", "<|endoftext|>")
    assert model.config.pad_token_id == tok.pad_token_id
    assert model.config.bos_token_id == tok.bos_token_id
    assert model.config.eos_token_id == tok.eos_token_id
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.eos_token_id == [tok.eos_token_id, im_end]
    assert model.generation_config.pad_token_id == tok.pad_token_id
    assert tok.padding_side == "left"


def test_param_count_in_range(model: Any) -> None:
    n = sum(p.numel() for p in model.parameters())
    assert 0.8e6 <= n <= 1.5e6, n
    assert n == tiny_model.count_parameters(model.config)


def test_small_preset_param_count() -> None:
    n = tiny_model.count_parameters(tiny_model.build_config("small"))
    assert 15e6 <= n <= 25e6, n


ROUND_TRIP_CASES = [
    "",
    "Hello world",
    " leading space",
    "  two leading spaces and trailing  ",
    "line one\n\nline three\n",
    "\ttab\r\nwindows newline",
    "Maria\u2019s book costs €12,50 — or 12.50 dollars.",
    "48/2 = <<48/2=24>>24\n#### 24",
    "1234567890 + 0987654321 = ?",
    "-17 * 3.25 = -55.25",
    "日本語のテキスト 🙂 e\u0301 ﬁ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|pad|> literal <|bos|> markers",
    "   \n  \n",
]


@pytest.mark.parametrize("text", ROUND_TRIP_CASES)
def test_round_trip_examples(tok: Any, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_round_trip_property(tok: Any, text: str) -> None:
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sampled_from(["12", " 7", "+", "=", " ", "\n", "####", "\u2019", "€", "ab"])))
def test_round_trip_arithmetic_like(tok: Any, parts: list[str]) -> None:
    text = "".join(parts)
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_encode_adds_no_special_tokens_and_splits_digits(tok: Any) -> None:
    ids = tok.encode("12345")
    assert tok.convert_ids_to_tokens(ids) == ["1", "2", "3", "4", "5"]
    assert tok("hi").input_ids == tok.encode("hi")
    assert tok.bos_token_id not in tok.encode("hi there")
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|pad|>", "<|bos|>"):
        assert len(tok.encode(special)) == 1, special
    assert tok.decode(tok.encode("<|im_start|>a<|im_end|>"), skip_special_tokens=True) == "a"


def test_chat_template(tok: Any) -> None:
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert no_prompt.endswith("What is 2+2?<|im_end|>\n")
    assert prompt.startswith(no_prompt)

    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids == tok.encode(prompt)
    assert ids[-3:] == tok.encode("<|im_start|>assistant\n")


def test_forward_pass(tok: Any, model: Any) -> None:
    batch = tok(["What is 3 + 4?", "Hi"], return_tensors="pt", padding=True)
    assert batch.input_ids[1, 0].item() == tok.pad_token_id  # left padding
    with torch.no_grad():
        out = model(**batch)
    assert out.logits.shape == (2, batch.input_ids.shape[1], len(tok))
    assert torch.isfinite(out.logits).all()


def test_generate_with_left_padding(tok: Any, model: Any) -> None:
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in ("What is 12 + 30? Let's think step by step.", "Hi")
    ]
    batch = tok(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(
            **batch, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id
        )
    width = batch.input_ids.shape[1]
    assert out.shape[0] == 2
    assert width < out.shape[1] <= width + 8
    assert torch.equal(out[:, :width], batch.input_ids)
    tok.batch_decode(out[:, width:], skip_special_tokens=True)  # decodes without error


def test_same_seed_same_bytes_other_seed_other_weights(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    again = tiny_model.build_tiny_model(tmp_path / "again", preset="tiny", seed=0)
    other = tiny_model.build_tiny_model(tmp_path / "other", preset="tiny", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert _sha256(again / name) == _sha256(tiny_model_dir / name), name
    assert _sha256(other / "model.safetensors") != _sha256(tiny_model_dir / "model.safetensors")
    assert _sha256(other / "tokenizer.json") == _sha256(tiny_model_dir / "tokenizer.json")


def test_cli_init_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli-model"
    assert main(["init-model", "--out", str(out), "--preset", "tiny"]) == 0
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (out / name).is_file(), name
    assert "params=1,049,728" in capsys.readouterr().out

    # An existing folder is kept unless --force; a failed build leaves nothing behind.
    assert main(["init-model", "--out", str(out)]) == 2  # refused, as bad input
    assert "--force" in capsys.readouterr().err
    argv = ["init-model", "--out", str(out), "--force", "--seed", "3", "--vocab-size", "512"]
    assert main(argv) == 0
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 512
    tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert len(tok) == 512
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cli-model"]


def test_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown preset"):
        tiny_model.build_tiny_model(tmp_path / "x", preset="huge")
    with pytest.raises(ValueError, match="vocab_size"):
        tiny_model.train_tokenizer(vocab_size=100)
