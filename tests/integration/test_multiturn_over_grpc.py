"""Multi-turn rollouts end to end on a real model, real tools and real servers.

The model (``tool_model_dir``) was taught one conversation: call the calculator,
then answer. Checked here: the sequence the trainer gets, its masks and the
rollout's log-probs equal a teacher-forced pass of the trainer over the same
tokens; every round of turns is one engine batch; a tool that times out or
crashes, or a tools service that goes away, answers the model with an error turn
and the rollout goes on; the mask crosses the gRPC boundary; a tools service
refuses callers without the right role."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from rlfleet.common.auth import credential_set, generate_tokens
from rlfleet.common.rpc import Security, create_channel, using_security
from rlfleet.driver.batch import GeneratedBatch, multi_turn_metrics, trainer_batch
from rlfleet.driver.data.recipes import calculator
from rlfleet.rollout.core import RolloutCore
from rlfleet.rollout.engine import FinishReason, SampleOutput, SamplingParams
from rlfleet.rollout.hf_engine import HFEngine
from rlfleet.rollout.multiturn import MultiTurn, MultiTurnSettings, ToolBox
from rlfleet.tools.builtin import Calculator
from rlfleet.tools.client import InProcessToolClient, RemoteToolClient
from rlfleet.tools.core import Tool, ToolCore, ToolLimits, ToolSpec
from rlfleet.tools.server import start_tool_server
from rlfleet.v1 import tools_pb2, tools_pb2_grpc

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 160


@pytest.fixture(scope="module")
def tok(tool_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tool_model_dir), local_files_only=True)


@pytest.fixture(scope="module")
def prompts(tok: Any) -> list[list[int]]:
    rows = calculator(6, 0, seed=7)["train"]
    texts = [
        tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
        for r in rows
    ]
    return [list(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]


class Recording:
    """The engine, with each ``generate`` call's rows recorded (a pass-through)."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine = engine
        self.batches: list[int] = []

    def generate(self, requests: Sequence[Any], *args: Any, **kwargs: Any) -> Any:
        self.batches.append(sum(len(r.prompts) * r.params.n for r in requests))
        return self.engine.generate(requests, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def _core(
    model_dir: Path, tok: Any, tools: Sequence[Tool], **settings: Any
) -> tuple[RolloutCore, Recording]:
    engine = Recording(HFEngine(str(model_dir)))
    core_tools = ToolCore(list(tools), ToolLimits(default_timeout_s=10.0))
    box = ToolBox([(InProcessToolClient(core_tools, own=True), None)])
    mt = MultiTurn(tok, box, MultiTurnSettings(**{"max_turns": 3, **settings}))
    return RolloutCore(engine, multi_turn=mt), engine  # type: ignore[arg-type]


def _inserted(s: SampleOutput) -> list[list[int]]:
    """The runs of tokens with loss mask 0 (the tool turns)."""
    runs: list[list[int]] = []
    prev = 1
    for t, m in zip(s.token_ids, s.loss_mask, strict=True):
        if not m:
            if prev:
                runs.append([])
            runs[-1].append(t)
        prev = m
    return runs


def _prompt_batch(prompts: list[list[int]], pad: int) -> dict[str, Any]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return {"input_ids": ids, "attention_mask": mask, "raw_prompt_ids": prompts}


# ------------------------------------------------------------------ the acceptance test


def test_masked_multi_turn_sequence_and_log_probs_match_a_teacher_forced_pass(
    tool_model_dir: Path, tok: Any, prompts: list[list[int]], tmp_path: Path
) -> None:
    from rlfleet.common.config import config_from_dict
    from rlfleet.trainer.core import TrainerCore

    n = 4
    core, engine = _core(tool_model_dir, tok, [Calculator()])
    try:
        params = SamplingParams(n=n, temperature=1.0, max_tokens=MAX_TOKENS, seed=11)
        handle = core.submit(prompts, params)
        samples = handle.result()
    finally:
        core.close()
    assert len(samples) == len(prompts) * n
    multi = [s for s in samples if 0 in s.loss_mask]
    assert len(multi) >= len(samples) // 2, "the model should call the tool in most samples"
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for s in samples:
        assert len(s.loss_mask) == len(s.token_ids) == len(s.logprobs)
        assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.loss_mask, strict=True) if not m)
        assert all(lp < 0.0 or lp == 0.0 for lp in s.logprobs)
    for s in multi:
        [turn, *_] = _inserted(s)
        text = tok.decode(turn, skip_special_tokens=False)
        # The calculator's answer to what the model asked, in the template's format.
        assert "<tool_response>" in text and text.endswith("<|im_start|>assistant\n")
        assert s.token_ids[s.loss_mask.index(0) - 1] == im_end
    # Every round was one engine batch holding every conversation still going.
    assert engine.batches[0] == len(prompts) * n
    assert engine.batches == sorted(engine.batches, reverse=True)
    assert len(engine.batches) <= 3

    gb = GeneratedBatch(
        step=1,
        prompts=_prompt_batch(prompts, int(tok.pad_token_id)),
        loader_state={},
        epoch=0,
        samples=samples,
        scores=[0.0] * len(samples),
        timing={},
    )
    batch = trainer_batch(gb, n, int(tok.pad_token_id))
    r = batch["responses"].shape[1]
    lengths = torch.tensor([len(s.token_ids) for s in samples])
    real = torch.arange(r)[None, :] < lengths[:, None]
    assert torch.equal(batch["attention_mask"][:, -r:].bool(), real)  # tool turns attended
    for i, s in enumerate(samples):
        assert batch["response_mask"][i, : len(s.token_ids)].tolist() == [
            int(m) for m in s.loss_mask
        ]
        assert batch["responses"][i, : len(s.token_ids)].tolist() == s.token_ids
    assert int(batch["response_mask"].sum()) < int(real.sum())

    cfg = config_from_dict(
        {
            "actor": {"model_path": str(tool_model_dir), "ppo_mini_batch_size": 4},
            "data": {"train_batch_size": 4},
            "rollout": {"n": n, "temperature": 1.0},
            "algorithm": {"adv_estimator": "grpo"},
            "trainer": {"default_local_dir": str(tmp_path / "run")},
        }
    )
    trainer = TrainerCore(cfg)
    try:
        out, _ = trainer.compute_log_prob(batch)
    finally:
        trainer.shutdown()
    rollout_lp = torch.zeros_like(out["old_log_probs"])
    for i, s in enumerate(samples):
        rollout_lp[i, : len(s.logprobs)] = torch.tensor(s.logprobs)
    model_tokens = batch["response_mask"].bool()
    diff = (out["old_log_probs"] - rollout_lp)[model_tokens].abs()
    assert float(diff.max()) < 1e-4, f"max |rollout - teacher-forced| = {float(diff.max())}"

    metrics = multi_turn_metrics(samples)
    assert metrics["multi_turn/turns/max"] >= 2 and metrics["multi_turn/tool_tokens/mean"] > 0


def test_a_greedy_conversation_ends_after_the_answer(
    tool_model_dir: Path, tok: Any, prompts: list[list[int]]
) -> None:
    core, _ = _core(tool_model_dir, tok, [Calculator()])
    try:
        [s] = core.submit(
            prompts[:1], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        ).result()
    finally:
        core.close()
    text = tok.decode(s.token_ids, skip_special_tokens=True)
    assert "<tool_response>\n42\n</tool_response>" in text
    assert text.rstrip().endswith("#### 42") and s.finish_reason == FinishReason.STOP
    assert len(_inserted(s)) == 1


def test_turn_and_token_limits_end_a_conversation(
    tool_model_dir: Path, tok: Any, prompts: list[list[int]]
) -> None:
    core, _ = _core(tool_model_dir, tok, [Calculator()], max_turns=1)
    try:
        [s] = core.submit(
            prompts[:1], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        ).result()
        assert 0 not in s.loss_mask and "<tool_call>" in tok.decode(s.token_ids)
        assert s.finish_reason == FinishReason.LENGTH  # wanted a tool, no turn left
    finally:
        core.close()
    core, _ = _core(tool_model_dir, tok, [Calculator()])
    try:
        [s] = core.submit(prompts[:1], SamplingParams(temperature=0.0, max_tokens=70)).result()
        assert len(s.token_ids) <= 70 and s.finish_reason == FinishReason.LENGTH
    finally:
        core.close()


# ------------------------------------------------------------------ failing tools


class SlowCalculator:
    """Named like the calculator, so the model calls it; never answers in time."""

    spec = ToolSpec("calculator", "slow", {"type": "object"})

    def call(self, arguments: Mapping[str, Any], timeout_s: float) -> str:
        time.sleep(timeout_s + 2.0)
        return "too late"


class CrashingCalculator:
    spec = ToolSpec("calculator", "crashes", {"type": "object"})

    def call(self, arguments: Mapping[str, Any], timeout_s: float) -> str:
        raise MemoryError("the tool blew up")


@pytest.mark.parametrize(
    ("tool", "expected"),
    [(SlowCalculator(), "timed out"), (CrashingCalculator(), "MemoryError: the tool blew up")],
)
def test_a_failing_tool_becomes_an_error_turn_and_the_rollout_goes_on(
    tool_model_dir: Path, tok: Any, prompts: list[list[int]], tool: Tool, expected: str
) -> None:
    core, _ = _core(tool_model_dir, tok, [tool], tool_timeout_s=0.5)
    try:
        params = SamplingParams(n=2, temperature=0.0, max_tokens=MAX_TOKENS)
        samples = core.submit(prompts[:2], params).result()
    finally:
        core.close()
    assert len(samples) == 4
    for s in samples:
        [turn] = _inserted(s)[:1]
        text = tok.decode(turn, skip_special_tokens=True)
        assert "Error:" in text and expected in text
        assert s.loss_mask[-1] == 1  # the model answered after the error


# ------------------------------------------------------------------ over gRPC


@pytest.fixture
def creds() -> Iterator[dict[str, Any]]:
    tokens = generate_tokens()
    yield credential_set(tokens)


def test_tools_service_and_rollout_over_grpc_with_auth(
    tool_model_dir: Path, tok: Any, prompts: list[list[int]], creds: dict[str, Any]
) -> None:
    from rlfleet.rollout.client import RemoteRolloutClient
    from rlfleet.rollout.server import start_rollout_server

    tools_core = ToolCore([Calculator()])
    with using_security(Security(credentials=creds["tools"])):
        tools_server = start_tool_server(tools_core)
    try:
        # The replica calls the tools service as the rollout role.
        with using_security(Security(credentials=creds["rollout"])):
            remote_tools = RemoteToolClient(tools_server.address)
            mt = MultiTurn(tok, ToolBox([(remote_tools, None)]), MultiTurnSettings(max_turns=3))
            core = RolloutCore(HFEngine(str(tool_model_dir)), multi_turn=mt)
            rollout_server = start_rollout_server(core)
        try:
            with using_security(Security(credentials=creds["driver"])):
                client = RemoteRolloutClient(rollout_server.address)
                params = SamplingParams(n=2, temperature=0.0, max_tokens=MAX_TOKENS)
                samples = list(client.generate(prompts[:2], params))
                client.close()
            assert len(samples) == 4
            for s in samples:
                assert len(s.loss_mask) == len(s.token_ids) and 0 in s.loss_mask
                assert "<tool_response>\n42\n</tool_response>" in tok.decode(s.token_ids)
            assert tools_core.calls_total == 4

            # The tools service goes away mid-run: the model reads an error, no crash.
            tools_server.stop(0.0)
            with using_security(Security(credentials=creds["driver"])):
                client = RemoteRolloutClient(rollout_server.address)
                [s] = list(
                    client.generate(
                        prompts[:1], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
                    )
                )
                client.close()
            assert "Error: the tool failed" in tok.decode(s.token_ids, skip_special_tokens=True)
        finally:
            rollout_server.stop(0.0)
            core.close()
    finally:
        tools_server.stop(0.0)
        tools_core.close()


def test_tools_service_policy(creds: dict[str, Any]) -> None:
    """CallTool: rollout and driver only; ListTools: every role; nothing without a token."""
    core = ToolCore([Calculator()])
    with using_security(Security(credentials=creds["tools"])):
        server = start_tool_server(core)
    call = tools_pb2.CallToolRequest(name="calculator", arguments_json='{"expression": "2*3"}')
    try:
        for role, may_call in [("rollout", True), ("driver", True), ("observer", False),
                               ("trainer", False), ("reward", False), ("tools", False)]:  # fmt: skip
            with using_security(Security(credentials=creds[role])):
                ch = create_channel(server.address)
            stub = tools_pb2_grpc.ToolServiceStub(ch)
            assert stub.ListTools(tools_pb2.ListToolsRequest(), timeout=10).tools
            if may_call:
                assert stub.CallTool(call, timeout=10).content == "6"
            else:
                with pytest.raises(grpc.RpcError) as e:
                    stub.CallTool(call, timeout=10)
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            ch.close()
        with using_security(None):
            ch = grpc.insecure_channel(server.address)
            with pytest.raises(grpc.RpcError) as e:
                tools_pb2_grpc.ToolServiceStub(ch).CallTool(call, timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            ch.close()
    finally:
        server.stop(0.0)
        core.close()


def test_tools_service_maps_errors_to_status_codes(creds: dict[str, Any]) -> None:
    core = ToolCore([Calculator()])
    with using_security(Security(credentials=creds["tools"])):
        server = start_tool_server(core)
    try:
        with using_security(Security(credentials=creds["driver"])):
            client = RemoteToolClient(server.address)
            from rlfleet.common.errors import InvalidArgument, NotFound

            with pytest.raises(NotFound, match="no tool 'nope'"):
                client.call("nope", "{}", timeout_s=5)
            with pytest.raises(InvalidArgument, match="JSON"):
                client.call("calculator", "[1]", timeout_s=5)
            r = client.call("calculator", json.dumps({"expression": "2 ** 99999"}), timeout_s=5)
            assert "exceed" in r.error
            assert [s.name for s in client.list_tools()] == ["calculator"]
            client.close()
    finally:
        server.stop(0.0)
        core.close()
