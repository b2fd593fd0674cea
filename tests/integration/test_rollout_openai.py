"""The OpenAI-compatible endpoint of a rollout replica, driven by the official ``openai``
client: a replica in this process on 127.0.0.1 (and one real ``rlfleet serve rollout``
process) with authentication on.

What is tested, and how:

* chat and completions, streaming and not, ``n > 1``, log-probs, stop strings, limits,
  auth, sessions and their rewards, against the tiny random model;
* the recorded trajectory equals what was returned (text, token strings and log-probs
  bit for bit) and its log-probs equal a teacher-forced pass of the model (1e-4);
* tool calls: the tiny model is fine-tuned in the test (about 150 Adam steps on one
  two-turn conversation: a Hermes tool call, then the answer after the tool result),
  so its greedy output *is* a tool call; the test checks the endpoint parses it into
  ``message.tool_calls`` and that the two turns are recorded as one chained session
  whose loss mask covers the model's tokens only.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("openai")

import openai
import torch

from rlfleet.common.auth import credential_set, generate_tokens, write_credential_set
from rlfleet.common.http import HttpEndpoint
from rlfleet.common.rpc import Security, create_channel, using_security
from rlfleet.driver.external import trajectory_rows
from rlfleet.rollout import serde
from rlfleet.rollout.chat_format import render_chat, template_supports_tools
from rlfleet.rollout.core import RolloutCore
from rlfleet.rollout.engine import GenerateLimits
from rlfleet.rollout.hf_engine import HFEngine
from rlfleet.rollout.openai_api import OpenAIOptions
from rlfleet.rollout.openai_server import load_tokenizer, openai_url, start_openai_server
from rlfleet.rollout.server import start_rollout_server
from rlfleet.rollout.trajectories import Trajectory, TrajectoryStore
from rlfleet.v1 import rollout_pb2, rollout_pb2_grpc

pytestmark = pytest.mark.timeout(300)

MAX_BODY = 64 * 1024


@dataclass
class Replica:
    core: RolloutCore
    store: TrajectoryStore
    endpoint: HttpEndpoint
    url: str
    grpc_address: str
    tokens: dict[str, str]
    tokenizer: Any
    model: Any  # the engine's model (teacher forcing)

    def client(self, role: str = "agent", **kw: Any) -> Any:
        return openai.OpenAI(
            base_url=self.url, api_key=self.tokens[role], max_retries=0, timeout=120, **kw
        )

    def stub(self, role: str) -> Any:
        channel = create_channel(self.grpc_address, auth_token=self.tokens[role])
        return rollout_pb2_grpc.RolloutServiceStub(channel)

    def trajectory(self, session: str) -> Trajectory:
        resp = self.stub("agent").GetTrajectories(
            rollout_pb2.GetTrajectoriesRequest(session_ids=[session]), timeout=30
        )
        (t,) = resp.trajectories
        return serde.trajectory_from_proto(t)

    def post(self, path: str, body: Any, role: str | None = "agent") -> tuple[int, Any]:
        return _post(self.url + path, body, self.tokens[role] if role else None)


def _post(url: str, body: Any, token: str | None) -> tuple[int, Any]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST")
    req.add_header("Content-Type", "application/json")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def _serve(model_dir: Path, tokens: dict[str, str], **options: Any) -> Replica:
    security = Security(credentials=credential_set(tokens)["rollout"])
    engine = HFEngine(model_dir)
    limits = GenerateLimits(max_n=4, max_prompts=4, max_new_tokens=64, max_request_tokens=8192)
    core = RolloutCore(engine, replica_id="oai-test", limits=limits)
    store = TrajectoryStore(max_tokens=1 << 16)
    tokenizer = load_tokenizer(str(model_dir))
    with using_security(security):
        server = start_rollout_server(core, trajectories=store)
    endpoint = start_openai_server(
        core, tokenizer, store, options=OpenAIOptions(max_body_bytes=MAX_BODY, **options),
        security=security,
    )  # fmt: skip
    replica = Replica(
        core, store, endpoint, openai_url(endpoint, "127.0.0.1"), server.address, tokens,
        tokenizer, engine.model,
    )  # fmt: skip
    replica._server = server  # type: ignore[attr-defined]
    return replica


def _stop(r: Replica) -> None:
    r.endpoint.stop()
    r._server.stop(0)  # type: ignore[attr-defined]
    r.core.close()


@pytest.fixture(scope="module")
def tokens() -> dict[str, str]:
    return generate_tokens()


@pytest.fixture(scope="module")
def replica(tiny_model_dir: Path, tokens: dict[str, str]) -> Iterator[Replica]:
    r = _serve(tiny_model_dir, tokens)
    yield r
    _stop(r)


def teacher_forced(
    model: Any, prompt: list[int], tokens: list[int], temperature: float
) -> np.ndarray:
    """log softmax(logits / T) of each sampled token (T = 1 when greedy), one forward pass."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    t = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(logits / t, dim=-1)
    return lp.gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1).numpy()


MESSAGES = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 12 + 30?"},
]


# ------------------------------------------------------------------ chat


def test_chat_is_recorded_exactly_and_its_log_probs_are_the_models(replica: Replica) -> None:
    client = replica.client()
    raw = client.chat.completions.with_raw_response.create(
        model="policy", messages=MESSAGES, n=2, max_tokens=12, temperature=0.8, seed=11,
        logprobs=True, extra_headers={"X-Session-Id": "chat-1"},
    )  # fmt: skip
    assert raw.headers["x-session-id"] == "chat-1"
    out = raw.parse()
    assert out.object == "chat.completion" and [c.index for c in out.choices] == [0, 1]
    assert out.model == replica.core.info().model  # the served model's id
    t = replica.trajectory("chat-1")
    assert len(t.completions) == 2 and not t.finished
    prompt = render_chat(replica.tokenizer, MESSAGES)
    assert out.usage.prompt_tokens == len(prompt)
    assert out.usage.completion_tokens == sum(c.token_ids.size for c in t.completions)
    for choice, rec in zip(out.choices, t.completions, strict=True):
        assert rec.prompt_ids.tolist() == prompt
        assert rec.weight_version == 0 and np.isclose(rec.temperature, 0.8)
        ids = rec.token_ids.tolist()
        assert choice.message.content == replica.tokenizer.decode(ids, skip_special_tokens=True)
        assert choice.message.role == "assistant" and not choice.message.tool_calls
        assert choice.finish_reason in ("stop", "length")
        returned = [x.logprob for x in choice.logprobs.content]
        assert np.array_equal(np.float32(returned), rec.logprobs)  # bit for bit
        assert [x.token for x in choice.logprobs.content] == replica.tokenizer.batch_decode(
            [[i] for i in ids]
        )
        want = teacher_forced(replica.model, prompt, ids, 0.8)
        np.testing.assert_allclose(rec.logprobs, want, atol=1e-4, rtol=0)
    # The same seed samples the same responses (and records them again, in the session).
    again = client.chat.completions.create(
        model="policy", messages=MESSAGES, n=2, max_tokens=12, temperature=0.8, seed=11,
        extra_headers={"X-Session-Id": "chat-1"},
    )  # fmt: skip
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]
    assert again.choices[0].logprobs is None  # not asked for
    assert len(replica.trajectory("chat-1").completions) == 4
    twice = replica.stub("agent").GetTrajectories(  # each session once, however often asked
        rollout_pb2.GetTrajectoriesRequest(session_ids=["chat-1", "chat-1"]), timeout=30
    )
    assert [t.session_id for t in twice.trajectories] == ["chat-1"]


def test_streamed_chat_sends_each_choice_and_usage_then_done(replica: Replica) -> None:
    client = replica.client()
    stream = client.chat.completions.create(
        model="policy", messages=MESSAGES, n=3, max_tokens=6, temperature=1.0, seed=3,
        stream=True, stream_options={"include_usage": True}, logprobs=True, user="stream-1",
    )  # fmt: skip
    content: dict[int, str] = {}
    finish: dict[int, str] = {}
    logprobs: dict[int, list[float]] = {}
    usage = None
    for chunk in stream:  # the client stops at data: [DONE]
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content is not None:
                content[c.index] = content.get(c.index, "") + c.delta.content
            if c.logprobs is not None and c.logprobs.content:
                logprobs.setdefault(c.index, []).extend(x.logprob for x in c.logprobs.content)
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert sorted(content) == sorted(finish) == [0, 1, 2]
    t = replica.trajectory("stream-1")  # the session id came from `user`
    assert len(t.completions) == 3
    recorded = sorted(
        (
            replica.tokenizer.decode(c.token_ids.tolist(), skip_special_tokens=True),
            c.logprobs.tolist(),
        )
        for c in t.completions
    )
    assert recorded == sorted((content[i], logprobs[i]) for i in range(3))
    assert usage is not None and usage.completion_tokens == sum(
        c.token_ids.size for c in t.completions
    )


def test_stop_strings_end_the_text_and_the_recorded_tokens(replica: Replica) -> None:
    client = replica.client()
    full = client.completions.create(model="p", prompt="12 + 30 =", max_tokens=20, temperature=0)
    text = full.choices[0].text
    assert len(text) > 12
    stop = text[6:9]  # greedy: the same text again, cut where `stop` first appears
    cut = client.completions.create(
        model="p", prompt="12 + 30 =", max_tokens=20, temperature=0, stop=[stop, "zzz-never"],
        extra_headers={"X-Session-Id": "stop-1"}, logprobs=0,
    )  # fmt: skip
    c = cut.choices[0]
    assert c.text == text[: text.index(stop)] and c.finish_reason == "stop"
    (rec,) = replica.trajectory("stop-1").completions
    decoded = replica.tokenizer.decode(rec.token_ids.tolist(), skip_special_tokens=True)
    assert decoded.startswith(c.text) and stop in decoded  # through the stop string, no further
    assert c.logprobs.token_logprobs == rec.logprobs.tolist()
    assert len(c.logprobs.tokens) == rec.token_ids.size


def test_completions_with_several_prompts_and_token_prompts(replica: Replica) -> None:
    client = replica.client()
    out = client.completions.create(
        model="p", prompt=["1 + 1 =", "2 + 2 ="], n=2, max_tokens=4, temperature=1.0, seed=5,
        logprobs=0, extra_headers={"X-Session-Id": "cmpl-1"},
    )  # fmt: skip
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert all(len(c.logprobs.token_logprobs) == len(c.logprobs.tokens) for c in out.choices)
    t = replica.trajectory("cmpl-1")
    enc = [replica.tokenizer.encode(p) for p in ("1 + 1 =", "2 + 2 =")]
    assert [c.prompt_ids.tolist() for c in t.completions] == [enc[0], enc[0], enc[1], enc[1]]
    ids = client.completions.create(model="p", prompt=[5, 6, 7], max_tokens=3, user="cmpl-2")
    assert ids.choices[0].text is not None
    assert replica.trajectory("cmpl-2").completions[0].prompt_ids.tolist() == [5, 6, 7]
    chunks = list(
        client.completions.create(
            model="p", prompt="3 + 3 =", max_tokens=3, stream=True, user="cmpl-3"
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    (rec,) = replica.trajectory("cmpl-3").completions
    assert text == replica.tokenizer.decode(rec.token_ids.tolist(), skip_special_tokens=True)


def test_tools_are_rendered_into_the_prompt(replica: Replica) -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    replica.client().chat.completions.create(
        model="p", messages=MESSAGES, tools=tools, max_tokens=2, user="tools-1"
    )
    (rec,) = replica.trajectory("tools-1").completions
    assert rec.prompt_ids.tolist() == render_chat(replica.tokenizer, MESSAGES, tools)
    assert '<tools>\n{"type": "function", "function": {"name": "add"' in replica.tokenizer.decode(
        rec.prompt_ids.tolist()
    )


def test_models_lists_the_served_model(replica: Replica) -> None:
    (m,) = replica.client().models.list().data
    assert m.id == replica.core.info().model and m.owned_by == "rlfleet"


# ------------------------------------------------------------------ auth and bounds


def test_requests_without_a_valid_key_or_role_are_refused(replica: Replica) -> None:
    bad = openai.OpenAI(base_url=replica.url, api_key="x" * 43, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.chat.completions.create(model="p", messages=MESSAGES, max_tokens=1)
    assert info.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.PermissionDeniedError):
        replica.client("observer").chat.completions.create(
            model="p", messages=MESSAGES, max_tokens=1
        )
    status, body = replica.post("/chat/completions", {"messages": MESSAGES}, role=None)
    assert status == 401 and body["error"]["type"] == "authentication_error"
    # The driver's key works too; the trajectory RPCs follow the roles policy.
    replica.client("driver").chat.completions.create(model="p", messages=MESSAGES, max_tokens=1)
    with pytest.raises(grpc.RpcError) as rpc:
        replica.stub("agent").PopTrajectories(rollout_pb2.PopTrajectoriesRequest(), timeout=10)
    assert rpc.value.code() == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"n": 5}, "n"),  # max_n 4
        ({"max_tokens": 65}, "max_tokens"),  # max_new_tokens 64
        ({"max_completion_tokens": 65}, "max_completion_tokens"),
        ({"top_logprobs": 3, "logprobs": True}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x " * 3000}]}, "messages"),  # > context
    ],
)
def test_requests_over_the_limits_are_400(replica: Replica, kw: dict[str, Any], param: str) -> None:
    args = {"model": "p", "messages": MESSAGES, "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as info:
        replica.client().chat.completions.create(**args)
    assert info.value.body["param"] == param
    assert info.value.status_code == 400


def test_oversized_and_malformed_bodies(replica: Replica) -> None:
    big = [{"role": "user", "content": "x" * MAX_BODY}]
    with pytest.raises(openai.APIStatusError) as info:
        replica.client().chat.completions.create(model="p", messages=big, max_tokens=1)
    assert info.value.status_code == 413
    host, port = replica.url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    auth = {"Authorization": f"Bearer {replica.tokens['agent']}"}
    for body, status in ((b"{nope", 400), (b'{"messages": NaN}', 400), (b"[]", 400)):
        conn.request("POST", "/v1/chat/completions", body=body, headers=auth)
        r = conn.getresponse()
        assert r.status == status and "message" in json.loads(r.read())["error"]
    conn.request("DELETE", "/v1/models", headers=auth)
    r = conn.getresponse()
    assert r.status == 405
    r.read()
    conn.close()
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", "/v1/nothing", headers=auth)
    assert conn.getresponse().status == 404
    conn.close()
    # Framing the body two ways (request smuggling's trick) or in a form int() would
    # take but HTTP does not (+, _) is a 400.
    body = b'{"messages": []}'
    for lengths in ([len(body), 2], ["+16"], ["1_6"]):
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.putrequest("POST", "/v1/chat/completions")
        conn.putheader("Authorization", auth["Authorization"])
        for n in lengths:
            conn.putheader("Content-Length", str(n))
        conn.endheaders(body)
        r = conn.getresponse()
        assert r.status == 400, lengths
        assert "Content-Length" in json.loads(r.read())["error"]["message"]
        conn.close()


def test_a_generation_past_its_time_limit_is_cancelled_with_504(
    tiny_model_dir: Path, tokens: dict[str, str], replica: Replica
) -> None:
    endpoint = start_openai_server(
        replica.core, replica.tokenizer, replica.store,
        options=OpenAIOptions(request_timeout_s=1e-3),
        security=Security(credentials=credential_set(tokens)["rollout"]),
    )  # fmt: skip
    try:
        client = openai.OpenAI(
            base_url=openai_url(endpoint, "127.0.0.1"), api_key=tokens["agent"], max_retries=0
        )
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(
                model="p", messages=MESSAGES, n=4, max_tokens=64, user="slow-1"
            )
        assert info.value.status_code == 504
        assert replica.store.state("slow-1") is None  # nothing returned, nothing recorded
    finally:
        endpoint.stop()


class _GatedEngine:
    """An HFEngine whose batches wait at a gate until released or all cancelled."""

    def __init__(self, inner: HFEngine) -> None:
        self.inner = inner
        self.started = threading.Event()
        self.release = threading.Event()

    def generate(self, requests: Any, on_sample: Any = None, cancelled: Any = None) -> Any:
        self.started.set()
        while not self.release.wait(0.01):
            if cancelled is not None and all(cancelled(r) for r in range(len(requests))):
                break
        return self.inner.generate(requests, on_sample, cancelled)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_has_its_generation_cancelled(
    tiny_model_dir: Path, tokens: dict[str, str], stream: bool
) -> None:
    """A client sends a request and closes its connection before any answer: the
    replica cancels the generation at once (it would otherwise wait at the gate,
    then run to its end or the request time-out)."""
    engine = _GatedEngine(HFEngine(tiny_model_dir))
    core = RolloutCore(engine, replica_id="oai-gone")  # type: ignore[arg-type]
    store = TrajectoryStore(max_tokens=1 << 16)
    endpoint = start_openai_server(
        core, load_tokenizer(str(tiny_model_dir)), store,
        security=Security(credentials=credential_set(tokens)["rollout"]),
    )  # fmt: skip
    try:
        conn = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=30)
        body = {"model": "p", "messages": MESSAGES, "n": 4, "max_tokens": 64, "stream": stream}
        conn.request(
            "POST", "/v1/chat/completions", body=json.dumps(body),
            headers={"Authorization": f"Bearer {tokens['agent']}",
                     "Content-Type": "application/json"},
        )  # fmt: skip
        assert engine.started.wait(30)
        conn.close()
        deadline = time.monotonic() + 10
        while core.status().requests_cancelled < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        status = core.status()
        assert status.requests_cancelled == 1 and status.generated_tokens_total == 0
        assert store.stats()["completions"] == 0  # nothing was returned, nothing recorded
    finally:
        engine.release.set()
        endpoint.stop()
        core.close()


# ------------------------------------------------------------------ sessions


def test_sessions_end_with_a_reward_and_the_driver_takes_them_once(replica: Replica) -> None:
    client = replica.client()
    out = client.chat.completions.create(model="p", messages=MESSAGES, max_tokens=3)
    sid = out.session_id  # generated: no header, metadata or user
    assert sid.startswith("s-")
    client.chat.completions.create(
        model="p", messages=MESSAGES, max_tokens=3, metadata={"session_id": sid}
    )
    for bad in (1e308, -2e6, "1"):  # 1e308 is infinity in float32, where rewards train
        status, body = replica.post(f"/sessions/{sid}/reward", {"reward": bad})
        assert status == 400 and body["error"]["param"] == "reward", body
    status, body = replica.post(f"/sessions/{sid}/reward", {"reward": 0.75, "group": "task-1"})
    assert status == 200 and body["completions"] == 2 and body["reward"] == 0.75
    assert replica.post(f"/sessions/{sid}/reward", {"reward": 1})[0] == 409
    assert replica.post("/sessions/unknown-1/finish", {})[0] == 404
    assert replica.post(f"/sessions/{sid}/reward", {"group": "x"}, role="observer")[0] == 403
    with pytest.raises(openai.ConflictError):
        client.chat.completions.create(
            model="p", messages=MESSAGES, max_tokens=1, extra_headers={"X-Session-Id": sid}
        )
    status, body = replica.post("/sessions/" + replica_session(replica) + "/finish", {})
    assert status == 200 and body["reward"] is None
    popped: list[Trajectory] = []
    stub = replica.stub("driver")
    for _ in range(5):
        resp = stub.PopTrajectories(
            rollout_pb2.PopTrajectoriesRequest(max_sessions=100), timeout=10
        )
        popped += [serde.trajectory_from_proto(t) for t in resp.trajectories]
        if not resp.trajectories:
            break
    mine = [t for t in popped if t.session_id == sid]
    assert len(mine) == 1 and mine[0].reward == 0.75 and mine[0].info == {"group": "task-1"}
    assert all(t.finished for t in popped)
    assert replica.store.state(sid) is None  # taken: gone from the replica


def replica_session(replica: Replica) -> str:
    """A fresh one-completion session."""
    out = replica.client().chat.completions.create(model="p", messages=MESSAGES, max_tokens=2)
    return str(out.session_id)


def test_a_sleeping_engine_answers_503_which_clients_retry(replica: Replica) -> None:
    replica.core.sleep(1)
    try:
        with pytest.raises(openai.InternalServerError) as info:
            replica.client().chat.completions.create(
                model="p", messages=MESSAGES, max_tokens=2, user="asleep-1"
            )
        assert info.value.status_code == 503 and info.value.body["code"] == "engine_asleep"
    finally:
        replica.core.wake_up()
    assert replica.store.state("asleep-1") is None


def test_a_replica_without_the_endpoint_has_no_trajectories(
    replica: Replica, tokens: dict[str, str]
) -> None:
    with using_security(Security(credentials=credential_set(tokens)["rollout"])):
        server = start_rollout_server(replica.core)
    try:
        stub = rollout_pb2_grpc.RolloutServiceStub(
            create_channel(server.address, auth_token=tokens["driver"])
        )
        with pytest.raises(grpc.RpcError) as info:
            stub.PopTrajectories(rollout_pb2.PopTrajectoriesRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        server.stop(0)


# ------------------------------------------------------------------ tools, for real

#: A chat template that renders tools and tool calls (Hermes-style blocks), short so
#: that the fine-tuning below is cheap.
TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\ntools:' }}"
    "{%- for t in tools %}{{- ' ' + t.function.name }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>' + m.content + '</tool_response><|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if m.content %}{{- m.content + '\\n' }}{%- endif %}"
    "{%- for c in m.tool_calls %}{{- '<tool_call>\\n' + "
    "({'name': c.function.name, 'arguments': c.function.arguments} | tojson) + '\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
ADD_TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ANSWER = "The answer is 5."


def _after_call(arguments: Any) -> list[dict[str, Any]]:
    return [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]


@pytest.fixture(scope="module")
def tool_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model fine-tuned until its greedy answer to QUESTION is CALL and, after
    the tool result, ANSWER (one conversation, the model's turns in the loss)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("models") / "tool"
    shutil.copytree(tiny_model_dir, out)
    tok = load_tokenizer(str(out))
    tok.chat_template = TOOL_TEMPLATE
    tok.save_pretrained(out)
    tok = load_tokenizer(str(out))
    assert template_supports_tools(tok)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    p1 = render_chat(tok, QUESTION, [ADD_TOOL])
    t1 = [*tok.encode(CALL, add_special_tokens=False), end]
    p2 = render_chat(tok, _after_call({"a": 2, "b": 3}), [ADD_TOOL])
    assert p2[: len(p1) + len(t1)] == p1 + t1  # the conversation chains
    t2 = [*tok.encode(ANSWER, add_special_tokens=False), end]
    seq = torch.tensor([p2 + t2])
    labels = torch.full_like(seq, -100)
    labels[0, len(p1) : len(p1) + len(t1)] = torch.tensor(t1)
    labels[0, len(p2) :] = torch.tensor(t2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(out).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(400):  # converges in about 150
        loss = model(input_ids=seq, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 5e-3:
            break
    model.eval().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tool_replica(tool_model_dir: Path, tokens: dict[str, str]) -> Iterator[Replica]:
    r = _serve(tool_model_dir, tokens)
    yield r
    _stop(r)


def test_a_tool_call_in_the_output_is_parsed_and_the_session_chains(tool_replica: Replica) -> None:
    client = tool_replica.client()
    first = client.chat.completions.create(
        model="p", messages=QUESTION, tools=[ADD_TOOL], temperature=0, max_tokens=64,
        extra_headers={"X-Session-Id": "tool-1"},
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    # The agent runs the tool and sends the conversation back, as OpenAI clients do.
    history = _after_call(call.function.arguments)
    history[1]["tool_calls"][0]["id"] = call.id
    history[2]["tool_call_id"] = call.id
    second = client.chat.completions.create(
        model="p", messages=history, tools=[ADD_TOOL], temperature=0, max_tokens=64,
        stream=True, extra_headers={"X-Session-Id": "tool-1"},
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in second if c.choices)
    assert text == ANSWER
    status, _ = tool_replica.post("/sessions/tool-1/reward", {"reward": 1.0})
    assert status == 200
    resp = tool_replica.stub("driver").PopTrajectories(
        rollout_pb2.PopTrajectoriesRequest(max_sessions=10), timeout=10
    )
    (t,) = [serde.trajectory_from_proto(x) for x in resp.trajectories if x.session_id == "tool-1"]
    c1, c2 = t.completions
    tok = tool_replica.tokenizer
    assert tok.decode(c1.token_ids.tolist()) == CALL + "<|im_end|>"
    assert tok.decode(c2.token_ids.tolist()) == ANSWER + "<|im_end|>"
    # One trainer row: the tool result between the turns is context, not trained on.
    (row,) = trajectory_rows(t)
    assert row.prompt_ids.tolist() == c1.prompt_ids.tolist()
    masked = row.response_ids[row.loss_mask == 0].tolist()
    assert (
        tok.decode(masked)
        == "\n<|im_start|>user\n<tool_response>5</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert (
        row.response_ids[row.loss_mask == 1].tolist()
        == c1.token_ids.tolist() + c2.token_ids.tolist()
    )
    both = np.concatenate([c1.logprobs, c2.logprobs])
    assert np.array_equal(row.logprobs[row.loss_mask == 1], both)
    # Greedy log-probs are the model's raw log-softmax over the whole chained sequence.
    full = teacher_forced(
        tool_replica.model, row.prompt_ids.tolist(), row.response_ids.tolist(), temperature=0
    )
    np.testing.assert_allclose(full[row.loss_mask == 1], both, atol=1e-4, rtol=0)


# ------------------------------------------------------------------ the real process


def _read_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    out = proc.stdout
    threading.Thread(target=lambda: lines.put(out.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout_s)
    except queue.Empty:
        raise AssertionError(f"the replica printed nothing within {timeout_s}s") from None


def test_rlfleet_serve_rollout_with_an_openai_port(tiny_model_dir: Path, tmp_path: Path) -> None:
    secrets = write_credential_set(tmp_path / "secrets")
    env = {**os.environ, "RLFLEET_CREDENTIALS": str(secrets / "rollout.json")}
    env.pop("RLFLEET_INSECURE", None)
    cmd = [
        sys.executable, "-m", "rlfleet.rollout.server", "--model", str(tiny_model_dir),
        "--port", "0", "--metrics-port", "0", "--openai-port", "0", "--torch-threads", "1",
        "--grace-s", "2", "--trajectory-max-sessions", "10",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        ready = json.loads(_read_line(proc, 120))
        assert ready["event"] == "serving"
        url = ready["openai_url"]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        key = (secrets / "agent.token").read_text()
        client = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)
        out = client.chat.completions.create(
            model="p", messages=MESSAGES, max_tokens=4, user="proc-1"
        )
        assert out.choices[0].message.role == "assistant" and out.session_id == "proc-1"
        stub = rollout_pb2_grpc.RolloutServiceStub(create_channel(ready["address"], auth_token=key))
        got = stub.GetTrajectories(
            rollout_pb2.GetTrajectoriesRequest(session_ids=["proc-1"]), timeout=10
        )
        assert len(got.trajectories[0].completions) == 1
        metrics = urllib.request.Request(
            f"http://{ready['metrics']}/metrics",
            headers={"Authorization": f"Bearer {(secrets / 'observer.token').read_text()}"},
        )
        with urllib.request.urlopen(metrics, timeout=10) as r:
            text = r.read().decode()
        assert 'rlfleet_rollout_trajectory_sessions{state="open"} 1.0' in text
        assert 'rlfleet_rollout_trajectory_events_total{event="completions"} 1.0' in text
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="k" * 43, max_retries=0).models.list()
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for f in (proc.stdout, proc.stderr):
            if f:
                f.close()


def test_idle_connections_without_a_key_do_not_lock_out_an_agent(replica: Replica) -> None:
    """More idle sockets than the endpoint's connection cap, none sending anything:
    an agent with its key is still answered (each new connection beyond the cap
    closes the oldest one that has not authenticated)."""
    cap = replica.endpoint._server.max_connections
    host, port = replica.url.split("//")[1].split("/")[0].split(":")
    idle = [socket.create_connection((host, int(port))) for _ in range(cap + 4)]
    try:
        models = replica.client().models.list()
        assert [m.id for m in models.data]
    finally:
        for s in idle:
            s.close()
