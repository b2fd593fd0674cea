"""`rlfleet rollout generate` against a real replica on 127.0.0.1."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")

from rlfleet.rollout import cli
from rlfleet.rollout.core import RolloutCore
from rlfleet.rollout.hf_engine import HFEngine
from rlfleet.rollout.server import add_serve_arguments, start_rollout_server

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def address(tiny_model_dir: Path) -> Iterator[str]:
    core = RolloutCore(HFEngine(tiny_model_dir))
    server = start_rollout_server(core)
    yield server.address
    server.stop(0)
    core.close()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_generate_prints_json_lines(
    address: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"id": "q1", "prompt": "What is 2 + 3?"},
                {"messages": [{"role": "user", "content": "Add 4 and 5."}]},
                {"token_ids": [5, 6, 7]},
            ]
        )
        + "\n"
    )
    args = parse(
        [
            "generate",
            "--addr",
            address,
            "--prompts",
            str(prompts),
            "--n",
            "2",
            "--max-tokens",
            "5",
            "--temperature",
            "1.0",
            "--seed",
            "1",
        ]
    )
    assert cli.run(args) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 6
    assert {(r["id"], r["sample_index"]) for r in rows} == {
        (i, k) for i in ("q1", "1", "2") for k in (0, 1)
    }
    for r in rows:
        assert len(r["token_ids"]) == len(r["logprobs"]) <= 5
        assert isinstance(r["text"], str) and r["weight_version"] == 0
        assert r["finish_reason"] in ("stop", "length")


def test_generate_reports_bad_input(address: str, tmp_path: Path, capsys) -> None:
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"nothing": 1}\n')
    assert cli.run(parse(["generate", "--addr", address, "--prompts", str(prompts)])) == 2
    assert "expected an object with prompt" in capsys.readouterr().err
    prompts.write_text('{"token_ids": []}\n')  # refused by the replica: still bad input
    assert cli.run(parse(["generate", "--addr", address, "--prompts", str(prompts)])) == 2
    assert "prompts[0].token_ids" in capsys.readouterr().err


def test_serve_arguments_parse() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(
        ["--model", "m", "--engine", "hf", "--port", "0", "--scheduler", "h:1"]
    )
    assert (args.model, args.engine, args.port, args.scheduler) == ("m", "hf", 0, "h:1")
    assert args.torch_threads is None  # torch's default unless asked


def test_serve_torch_threads_set_before_the_engine_loads(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from rlfleet.rollout import server

    calls: list[object] = []

    def no_engine(*a: object, **kw: object) -> None:
        calls.append("build_engine")
        raise RuntimeError("stop here")

    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n))
    monkeypatch.setattr(server, "build_engine", no_engine)
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    with pytest.raises(RuntimeError, match="stop here"):
        server.serve_main(parser.parse_args(["--model", "m", "--torch-threads", "3", "--insecure"]))
    assert calls == [3, "build_engine"]
    calls.clear()
    with pytest.raises(SystemExit) as refused:  # the flag's type, before anything loads
        parser.parse_args(["--model", "m", "--torch-threads", "0", "--insecure"])
    assert refused.value.code == 2
    assert "argument --torch-threads: must be >= 1 (got 0)" in capsys.readouterr().err
    assert calls == []


def test_serve_lora_rank_reaches_the_vllm_engine_and_is_checked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--lora-rank R` starts the vLLM engine with an adapter slot of rank R; a negative
    rank is refused before the model loads."""
    from rlfleet.rollout import server

    seen: dict[str, object] = {}

    def no_engine(engine: str, model: str, **kw: object) -> None:
        seen.update(kw, engine=engine)
        raise RuntimeError("stop here")

    monkeypatch.setattr(server, "build_engine", no_engine)
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    base = ["--model", "m", "--engine", "vllm", "--insecure"]
    with pytest.raises(RuntimeError, match="stop here"):
        server.serve_main(parser.parse_args([*base, "--lora-rank", "8"]))
    assert seen["engine"] == "vllm" and seen["lora_rank"] == 8
    seen.clear()
    with pytest.raises(SystemExit) as refused:
        parser.parse_args([*base, "--lora-rank", "-1"])
    assert refused.value.code == 2
    assert "argument --lora-rank: must be >= 0 (got -1)" in capsys.readouterr().err
    assert seen == {}
    # The KV cache's size and partial rollouts reach the vLLM engine too.
    flags = [*base, "--kv-cache-memory-bytes", "1048576", "--partial-rollout"]
    with pytest.raises(RuntimeError, match="stop here"):
        server.serve_main(parser.parse_args(flags))
    assert seen["kv_cache_memory_bytes"] == 1 << 20 and seen["partial_rollout"] is True
    seen.clear()
    with pytest.raises(SystemExit) as refused:
        parser.parse_args([*base, "--kv-cache-memory-bytes", "-1"])
    assert refused.value.code == 2
    assert "argument --kv-cache-memory-bytes: must be >= 0 (got -1)" in capsys.readouterr().err
    assert seen == {}
