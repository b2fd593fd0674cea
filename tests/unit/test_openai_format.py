"""The OpenAI endpoint's pure parts: request validation, chat rendering with tools,
Hermes tool-call parsing, stop strings, bodies. (Against a running replica:
tests/integration/test_rollout_openai.py.)"""

from __future__ import annotations

import json
from typing import Any

import pytest

from rlfleet.common.tiny_model import train_tokenizer
from rlfleet.rollout.chat_format import hermes_tools_prompt, parse_tool_calls, render_chat
from rlfleet.rollout.engine import EngineInfo, FinishReason, GenerateLimits, SampleOutput
from rlfleet.rollout.openai_api import ApiError, OpenAIFrontend, parse_body
from rlfleet.rollout.trajectories import TrajectoryStore

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "a + b",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        },
    },
}


@pytest.fixture(scope="module")
def tok() -> Any:
    return train_tokenizer()


class FakeCore:
    """What request validation reads of the core: its limits and the model's length."""

    limits = GenerateLimits(max_n=4, max_prompts=3, max_new_tokens=16)

    def info(self) -> EngineInfo:
        return EngineInfo("hf", "m", "float32", "cpu", 0, max_model_len=1000)


@pytest.fixture()
def front(tok: Any) -> OpenAIFrontend:
    return OpenAIFrontend(FakeCore(), tok, TrajectoryStore(max_tokens=2000))  # type: ignore[arg-type]


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


# ------------------------------------------------------------------ tool calls


def test_tool_calls_are_parsed_from_hermes_blocks() -> None:
    text = (
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "mul", "arguments": "{\\"x\\": 3}"}'  # unterminated: generation ended
    )
    content, calls = parse_tool_calls(text)
    assert content == "Let me add."
    assert [c["function"]["name"] for c in calls] == ["add", "mul"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert calls[1]["function"]["arguments"] == '{"x": 3}'
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize(
    "text",
    [
        "no tools here",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>["add"]</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{bad</tool_call>',
        "<tool_call>" + "[" * 3000,  # nesting past the JSON parser's recursion limit
        '<tool_call>{"name": "a", "arguments": ' + "[" * 3000 + "]" * 3000 + "}</tool_call>",
    ],
)
def test_text_that_is_not_a_clean_tool_call_stays_content(text: str) -> None:
    assert parse_tool_calls(text) == (text, [])


def test_only_a_tool_call_has_no_content() -> None:
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert content is None and calls[0]["function"]["arguments"] == "{}"


# ------------------------------------------------------------------ chat rendering


def test_tools_reach_a_template_without_tool_support_in_hermes_format(tok: Any) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "add", "arguments": {"a": 2, "b": 3}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "tool", "tool_call_id": "c2", "content": "ok"},
    ]
    text = tok.decode(render_chat(tok, messages, [ADD]))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n" + hermes_tools_prompt([ADD]))
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
        "</tool_call><|im_end|>"
    ) in text
    # Runs of tool results are one user turn, as Qwen2.5 renders them.
    assert (
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\nok\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in text
    assert text.endswith("<|im_start|>assistant\n")
    # Without a system message, the tools block is one.
    plain = tok.decode(render_chat(tok, [{"role": "user", "content": "x"}], [ADD]))
    assert plain.startswith("<|im_start|>system\n# Tools\n")


def test_a_template_with_tool_support_renders_tools_itself(tok: Any) -> None:
    import copy

    t = copy.deepcopy(tok)
    t.chat_template = (
        "{%- if tools %}TOOLS:{% for tool in tools %}{{ tool.function.name }};{% endfor %}\n"
        "{%- endif %}"
        "{%- for m in messages %}[{{ m.role }}]{{ m.content }}"
        "{%- if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} "
        "{{ c.function.arguments | tojson }}{% endfor %}{% endif %}{% endfor %}"
    )
    msgs = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
            ],
        },
    ]
    assert t.decode(render_chat(t, msgs, [ADD])) == 'TOOLS:add;[user]q[assistant]CALL add {"a": 1}'


# ------------------------------------------------------------------ validation


def error_of(
    front: OpenAIFrontend, kind: str, body: dict[str, Any], header: str | None = None
) -> ApiError:
    with pytest.raises(ApiError) as info:
        front.prepare(kind, body, header)
    return info.value


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(n=5), "n"),  # max_n 4
        (chat(n=0), "n"),
        (chat(n=True), "n"),  # a JSON boolean is not an integer
        (chat(max_tokens=17), "max_tokens"),  # max_new_tokens 16
        (chat(max_completion_tokens=0), "max_completion_tokens"),
        (chat(temperature=2.5), "temperature"),
        (chat(temperature="hot"), "temperature"),
        (chat(top_p=0), "top_p"),
        (chat(top_logprobs=2, logprobs=True), "top_logprobs"),
        (chat(stop=["a"] * 5), "stop"),
        (chat(presence_penalty=0.5), "presence_penalty"),
        (chat(logit_bias={"5": 10}), "logit_bias"),
        (chat(response_format={"type": "json_object"}), "response_format"),
        (chat(tools=[ADD], tool_choice="required"), "tool_choice"),
        (
            chat(tools=[{"type": "function", "function": {"name": "bad name"}}]),
            "tools[0].function.name",
        ),
        (chat(functions=[{"name": "f"}]), "functions"),
        (chat(messages=[]), "messages"),
        (chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
        (
            chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "messages[0].content[0]",
        ),
        (
            chat(messages=[{"role": "user", "content": "x", "tool_calls": []}]),
            "messages[0].tool_calls",
        ),
        (chat(user="has space"), "user"),
        (chat(metadata={"session_id": "a/b"}), "metadata.session_id"),
        (chat(messages=[{"role": "user", "content": "x " * 1200}]), "messages"),  # > context
    ],
)
def test_chat_requests_out_of_bounds_are_400_naming_the_parameter(
    front: OpenAIFrontend, body: dict[str, Any], param: str
) -> None:
    e = error_of(front, "chat", body)
    assert e.status == 400 and e.param == param, (e.param, e.message)
    assert e.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": ["a", "b", "c", "d"]}, "prompt"),  # max_prompts 3
        ({"prompt": "x", "logprobs": 2}, "logprobs"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "n": 4, "max_tokens": 16, "seed": 2**64}, "seed"),
        ({"prompt": [10**30]}, "prompt"),  # beyond any integer type: 400, not 500
        ({"prompt": [[1], [-1]]}, "prompt"),
    ],
)
def test_completion_requests_out_of_bounds(
    front: OpenAIFrontend, body: dict[str, Any], param: str
) -> None:
    assert error_of(front, "completion", body).param == param


def test_a_request_larger_than_the_trajectory_store_is_refused(front: OpenAIFrontend) -> None:
    e = error_of(front, "completion", {"prompt": [[5] * 300] * 2, "n": 4, "max_tokens": 10})
    assert e.status == 400 and e.code == "limit_exceeded" and "trajectory store" in e.message


def test_prepared_sampling_and_sessions(front: OpenAIFrontend, tok: Any) -> None:
    p = front.prepare(
        "chat",
        chat(
            n=2,
            temperature=0.001,
            top_p=0.5,
            seed=7,
            stop=["<|im_end|>", "xyzzy plugh"],
            max_tokens=3,
        ),
        "sess-1",
    )
    assert p.session_id == "sess-1" and p.kind == "chat"
    assert p.prompts == [render_chat(tok, [{"role": "user", "content": "hi"}])]
    q = p.params
    assert (q.n, q.temperature, q.top_p, q.seed, q.max_tokens) == (2, 0.0, 0.5, 7, 3)
    assert q.logprobs  # always recorded
    # A stop string of one token stops the engine there too.
    assert q.stop_token_ids == (tok.convert_tokens_to_ids("<|im_end|>"),)
    # Session id: header, then metadata.session_id, then user, else generated.
    meta = front.prepare("chat", chat(metadata={"session_id": "m1"}, user="u1"), None)
    assert meta.session_id == "m1"
    assert front.prepare("chat", chat(user="u1"), None).session_id == "u1"
    gen = front.prepare("chat", chat(), None).session_id
    assert gen.startswith("s-") and gen != front.prepare("chat", chat(), None).session_id
    # Without max_tokens: what the limits and the context leave.
    assert front.prepare("completion", {"prompt": [1] * 990}, None).params.max_tokens == 10
    assert front.prepare("completion", {"prompt": [1] * 10}, None).params.max_tokens == 16
    # Token prompts, several prompts.
    multi = front.prepare("completion", {"prompt": [[1, 2], [3]], "logprobs": 0}, None)
    assert multi.prompts == [[1, 2], [3]] and multi.logprobs


def test_a_finished_session_takes_no_more_turns(front: OpenAIFrontend) -> None:
    from rlfleet.rollout.trajectories import Completion

    front.store.record(
        "done",
        Completion.of([1], [2], [-0.5], weight_version=0, finish_reason=FinishReason.STOP,
                      temperature=1.0),
    )  # fmt: skip
    front.finish_session("done", {"reward": 1}, reward_required=True)
    e = error_of(front, "chat", chat(), "done")
    assert e.status == 409 and e.code == "session_finished"
    with pytest.raises(ApiError) as info:
        front.finish_session("done", {"reward": 1}, reward_required=True)
    assert info.value.status == 409
    with pytest.raises(ApiError) as info:
        front.finish_session("unknown", {"reward": 1}, reward_required=True)
    assert info.value.status == 404
    for body, required in (({}, True), ({"reward": float("nan")}, False), ({"reward": "1"}, False)):
        with pytest.raises(ApiError) as info:
            front.finish_session("x", body, reward_required=required)
        assert info.value.param == "reward"


def test_stop_strings_cut_tokens_and_text_where_the_stop_starts(
    front: OpenAIFrontend, tok: Any
) -> None:
    ids = tok.encode("12 + 30 = 42\nthen more text", add_special_tokens=False)
    lps = [-0.1 * (i + 1) for i in range(len(ids))]
    prep = front.prepare(
        "completion", {"prompt": "q", "stop": ["\n", "zzz"], "max_tokens": 16}, None
    )
    choice = front._choice(prep, SampleOutput(0, 0, ids, lps, FinishReason.LENGTH, 3))
    assert choice.text == "12 + 30 = 42" and choice.finish_reason == "stop"
    k = len(choice.token_ids)
    # The shortest prefix whose text holds the stop string: the sampled "\n" is its last token.
    assert choice.token_ids == ids[:k] and choice.logprobs == lps[:k]
    assert "\n" in tok.decode(ids[:k]) and "\n" not in tok.decode(ids[: k - 1])
    assert choice.weight_version == 3
    # No stop string in the output: untouched.
    plain = front._choice(
        front.prepare("completion", {"prompt": "q", "stop": "zzz"}, None),
        SampleOutput(0, 0, ids, lps, FinishReason.LENGTH, 0),
    )
    assert plain.token_ids == ids and plain.finish_reason == "length"


def test_tool_calls_in_the_output_finish_with_tool_calls(front: OpenAIFrontend, tok: Any) -> None:
    out = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    ids = [*tok.encode(out, add_special_tokens=False), tok.convert_tokens_to_ids("<|im_end|>")]
    prep = front.prepare("chat", chat(tools=[ADD]), None)
    c = front._choice(prep, SampleOutput(0, 0, ids, [0.0] * len(ids), FinishReason.STOP, 0))
    assert c.finish_reason == "tool_calls" and c.content is None
    msg = front.response(prep, [c])["choices"][0]["message"]
    assert msg["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    # tool_choice "none": the same text is just content.
    none = front.prepare("chat", chat(tools=[ADD], tool_choice="none"), None)
    c2 = front._choice(none, SampleOutput(0, 0, ids, [0.0] * len(ids), FinishReason.STOP, 0))
    assert c2.finish_reason == "stop" and c2.content == out and not c2.tool_calls


@pytest.mark.parametrize(
    "raw",
    [b"not json", b"[1, 2]", b'{"a": NaN}', b'{"a": Infinity}', b"\xff\xfe", b"[" * 100000,
     json.dumps({"a": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}).encode(),
     # lone surrogates (JSON escapes that are not Unicode): in a value, in a key
     b'{"prompt": "hi \\ud800"}', b'{"stop": ["\\udc00"]}', b'{"\\ud83d": 1}'],
)  # fmt: skip
def test_bodies_that_are_not_a_plain_json_object_are_400(raw: bytes) -> None:
    with pytest.raises(ApiError) as info:
        parse_body(raw)
    assert info.value.status == 400


def test_serve_flags_come_from_rollout_openai_and_a_flag_wins(tmp_path: Any) -> None:
    import argparse

    from rlfleet.rollout.openai_server import openai_from_args
    from rlfleet.rollout.server import add_serve_arguments, resolve_arguments

    config = tmp_path / "run.yaml"
    config.write_text(
        "actor: {model_path: /models/actor}\n"
        "rollout: {openai: {port: 0, max_sessions: 7, session_ttl_s: 9.5, max_body_bytes: 1000}}\n"
    )
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = resolve_arguments(
        parser.parse_args(["--config", str(config), "--trajectory-max-tokens", "123"])
    )
    assert args.openai_port == 0
    options, store = openai_from_args(args)
    assert (store.max_sessions, store.max_tokens, store.ttl_s) == (7, 123, 9.5)
    assert options.max_body_bytes == 1000 and options.max_connections == 128
    bare = resolve_arguments(parser.parse_args(["--model", "/m"]))
    assert bare.openai_port is None  # off unless asked for
    with pytest.raises(ValueError):
        openai_from_args(
            resolve_arguments(parser.parse_args(["--model", "/m", "--openai-max-connections", "0"]))
        )
