"""Request limits, sampling ranges and weight value checks of the rollout replica."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest

from rlfleet.common.errors import InvalidArgument
from rlfleet.rollout.engine import (
    GenerateLimits,
    GenerationRequest,
    SamplingParams,
    validate_sampling,
)


def _check(limits: GenerateLimits, prompts: list[list[int]], **params: object) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as e:
        limits.check(GenerationRequest(prompts, SamplingParams(**params)))  # type: ignore[arg-type]
    return e.value


def test_each_limit_names_its_field_value_and_limit() -> None:
    limits = GenerateLimits(max_n=2, max_prompts=2, max_samples=3, max_new_tokens=10)
    err = _check(limits, [[1]], n=3)
    assert (err.field, err.value, err.code) == ("sampling.n", 3, "LIMIT_EXCEEDED")
    assert "limit of 2" in str(err)
    assert _check(limits, [[1]] * 3).field == "prompts"
    assert (_check(limits, [[1]] * 2, n=2).field, _check(limits, [[1]] * 2, n=2).value) == (
        "sampling.n",
        4,
    )
    assert _check(limits, [[1]], max_tokens=11).field == "sampling.max_tokens"
    tokens = GenerateLimits(max_request_tokens=20)
    err = _check(tokens, [[1] * 5, [2] * 5], n=1, max_tokens=6)  # 10 + 2 x 6 = 22
    assert (err.field, err.value) == ("prompts", 22)
    GenerateLimits(max_request_tokens=22).check(
        GenerationRequest([[1] * 5, [2] * 5], SamplingParams(max_tokens=6))
    )


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_n=0"):
        GenerateLimits(max_n=0)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"temperature": 1.4e-45}, "sampling.temperature"),
        ({"temperature": 0.005}, "sampling.temperature"),
        ({"temperature": math.inf}, "sampling.temperature"),
        ({"temperature": math.nan}, "sampling.temperature"),
        ({"top_k": -2}, "sampling.top_k"),
    ],
)
def test_sampling_out_of_range(params: dict[str, float], field: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        validate_sampling(SamplingParams(**params))  # type: ignore[arg-type]
    assert e.value.field == field


def test_sampling_in_range() -> None:
    for params in ({"temperature": 0.0}, {"temperature": 0.01}, {"top_k": 0}, {"top_k": -1}):
        validate_sampling(SamplingParams(**params))  # type: ignore[arg-type]


def test_weight_values() -> None:
    torch = pytest.importorskip("torch")
    from rlfleet.weightsync.receiver import check_weight_values

    good = {"a": torch.ones(3), "b": torch.zeros(2), "step": torch.zeros(1, dtype=torch.long)}
    check_weight_values(good)
    with pytest.raises(InvalidArgument) as e:
        check_weight_values({**good, "a": torch.tensor([1.0, math.nan, math.inf])})
    assert (e.value.field, e.value.code) == ("weights['a']", "NON_FINITE_WEIGHTS")
    with pytest.raises(InvalidArgument) as e:
        check_weight_values({"a": -torch.zeros(3, dtype=torch.bfloat16), "b": torch.zeros(2)})
    assert (e.value.field, e.value.code) == ("weights['a']", "ZERO_WEIGHTS")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -math.nan])
def test_non_finite_found_in_every_float_dtype(dtype: str, bad: float) -> None:
    torch = pytest.importorskip("torch")
    from rlfleet.weightsync import receiver as weights

    t = torch.randn(1000, dtype=getattr(torch, dtype))
    weights.check_weight_values({"w": t})
    t[777] = bad
    with pytest.raises(InvalidArgument, match="non-finite"):
        weights.check_weight_values({"w": t})
    # Largest finite values, of both signs, are finite.
    info = torch.finfo(t.dtype)
    weights.check_weight_values(
        {"w": torch.tensor([info.max, -info.max, info.tiny], dtype=t.dtype)}
    )


def test_value_check_spans_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    from rlfleet.weightsync import checksum
    from rlfleet.weightsync import receiver as weights

    monkeypatch.setattr(checksum, "_VALUE_BLOCK", 7)
    t = torch.zeros(50, dtype=torch.bfloat16)
    with pytest.raises(InvalidArgument, match="all zeros"):
        weights.check_weight_values({"w": t})
    t[43] = 1.0
    weights.check_weight_values({"w": t})
    t[48] = math.inf
    with pytest.raises(InvalidArgument, match="non-finite"):
        weights.check_weight_values({"w": t})


def test_server_arguments_carry_the_limits() -> None:
    pytest.importorskip("grpc")
    from rlfleet.rollout.server import add_serve_arguments, resolve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = resolve_arguments(
        parser.parse_args(["--model", "m", "--max-n", "3", "--max-version-step", "9"])
    )
    assert (args.max_n, args.max_samples, args.max_version_step) == (3, 8192, 9)


def test_server_takes_its_settings_from_the_run_config(tmp_path: Path) -> None:
    """`--config` like every other server: the rollout section (and trainer.device) give
    the defaults, a flag given on the command line wins, and no model is an error."""
    pytest.importorskip("grpc")
    from rlfleet.rollout.server import add_serve_arguments, resolve_arguments

    config = tmp_path / "run.yaml"
    config.write_text(
        "actor: {model_path: /models/actor}\n"
        "trainer: {device: cuda}\n"
        "rollout: {dtype: bfloat16, engine: vllm, gpu_memory_utilization: 0.7,\n"
        "          max_num_batched_tokens: 4096}\n"
    )
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = resolve_arguments(parser.parse_args(["--config", str(config)]))
    assert (args.model, args.engine, args.dtype, args.device) == (
        "/models/actor", "vllm", "bfloat16", "cuda",
    )  # fmt: skip
    assert (args.gpu_memory_utilization, args.max_num_batched_tokens) == (0.7, 4096)
    assert args.lora_rank == 0  # a full-weight actor: no adapter slot
    assert args.kv_cache_memory_bytes == 0  # sized by gpu_memory_utilization
    sized = ["--config", str(config), "-o", "rollout.kv_cache_memory_bytes=67108864"]
    assert resolve_arguments(parser.parse_args(sized)).kv_cache_memory_bytes == 64 << 20
    given = [*sized, "--kv-cache-memory-bytes", "1024"]
    assert resolve_arguments(parser.parse_args(given)).kv_cache_memory_bytes == 1024
    lora = resolve_arguments(
        parser.parse_args(["--config", str(config), "-o", "actor.lora_rank=8"])
    )
    assert lora.lora_rank == 8  # vLLM serves the actor's adapters itself
    flag = ["--config", str(config), "-o", "actor.lora_rank=8", "--lora-rank", "0"]
    assert resolve_arguments(parser.parse_args(flag)).lora_rank == 0  # merge them instead
    args = resolve_arguments(
        parser.parse_args(["--config", str(config), "--model", "/m", "--dtype", "float32",
                           "-o", "rollout.engine=hf", "-o", "rollout.max_num_batched_tokens=null",
                           "--device", "cpu"])
    )  # fmt: skip
    assert (args.model, args.engine, args.dtype, args.device) == ("/m", "hf", "float32", "cpu")
    bare = resolve_arguments(parser.parse_args(["--model", "/m"]))
    assert (bare.engine, bare.dtype, bare.device, bare.gpu_memory_utilization) == (
        "hf", "float32", "cpu", 0.5,
    )  # fmt: skip
    with pytest.raises(ValueError, match="--model"):
        resolve_arguments(parser.parse_args([]))


def test_partial_rollout_comes_from_the_pipeline_section(tmp_path: Path) -> None:
    """A replica started with the run config applies weight pushes between decode
    steps when the run is pipelined with partial rollouts; the flag wins; off bare."""
    pytest.importorskip("grpc")
    from rlfleet.rollout.server import add_serve_arguments, resolve_arguments

    config = tmp_path / "run.yaml"
    config.write_text(
        "actor: {model_path: /models/actor}\n"
        "trainer: {pipeline: {enable: true, partial_rollout: true}}\n"
    )
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert resolve_arguments(parser.parse_args(["--config", str(config)])).partial_rollout
    off = parser.parse_args(["--config", str(config), "--no-partial-rollout"])
    assert not resolve_arguments(off).partial_rollout
    assert not resolve_arguments(parser.parse_args(["--model", "/m"])).partial_rollout
    flag = parser.parse_args(["--model", "/m", "--partial-rollout"])
    assert resolve_arguments(flag).partial_rollout


def test_a_replica_started_with_the_run_config_takes_the_runs_requests(tmp_path: Path) -> None:
    """The limits a replica starts with cover what the run it serves sends it (one
    step's prompts x n on a single replica, the response length, val_kwargs.n): a config
    the checks accepted is not refused by its own replicas. A flag given wins."""
    pytest.importorskip("grpc")
    from rlfleet.common.config import load_config
    from rlfleet.rollout.server import (
        add_serve_arguments,
        limits_from_arguments,
        resolve_arguments,
    )

    config = tmp_path / "run.yaml"
    config.write_text(
        "actor: {model_path: /models/actor, ppo_mini_batch_size: 256}\n"
        "data: {train_batch_size: 1024, max_prompt_length: 1024,\n"
        "       max_response_length: 40000}\n"
        "rollout: {n: 65, val_kwargs: {n: 70}}\n"
    )
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    limits = limits_from_arguments(resolve_arguments(parser.parse_args(["--config", str(config)])))
    assert limits == GenerateLimits().covering(load_config(str(config)))
    assert (limits.max_n, limits.max_prompts, limits.max_samples) == (70, 8192, 1024 * 65)
    assert limits.max_new_tokens == 40000
    assert limits.max_request_tokens == 1024 * 65 * (1024 + 40000)
    # The run's own step request passes; one beyond it is still refused.
    step = GenerationRequest(
        prompts=[[1] * 1024] * 1024, params=SamplingParams(n=65, max_tokens=40000)
    )
    limits.check(step)
    with pytest.raises(InvalidArgument, match="samples per prompt 71"):
        limits.check(GenerationRequest(prompts=[[1]], params=SamplingParams(n=71)))
    # Defaults that already cover a small run stay as they are; a flag given wins.
    small = tmp_path / "small.yaml"
    small.write_text("actor: {model_path: /models/actor}\n")
    args = resolve_arguments(parser.parse_args(["--config", str(small)]))
    assert (args.max_n, args.max_samples, args.max_new_tokens) == (64, 8192, 32768)
    args = resolve_arguments(parser.parse_args(["--config", str(config), "--max-n", "8"]))
    assert args.max_n == 8
    bare = resolve_arguments(parser.parse_args(["--model", "/m"]))
    assert bare.max_request_tokens == GenerateLimits().max_request_tokens
