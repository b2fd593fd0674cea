"""Chat formats shared by the rollout edges: rendering messages (with tools) through a
tokenizer's chat template, and Hermes/Qwen tool calls in a model's output.

A template that renders tools itself (its source mentions ``tools`` and ``tool_call``,
as Qwen2.5's does) gets ``tools`` and the messages as they are; one that does not gets
them in Qwen2.5's Hermes format (:func:`hermes_messages`). :func:`parse_tool_calls`
reads ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks back.

Nothing here imports torch; the tokenizer is any Hugging Face tokenizer.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "hermes_messages",
    "hermes_tools_prompt",
    "parse_tool_calls",
    "render_chat",
    "template_supports_tools",
]

_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)


def hermes_tools_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tools block Qwen2.5's chat template puts in the system message (Hermes format)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _template_source(tokenizer: Any) -> str:
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        return "\n".join(str(v) for v in t.values())
    return str(t or "")


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` and ``tool_calls`` itself."""
    src = _template_source(tokenizer)
    return "tools" in src and "tool_call" in src


def _tool_call_text(call: Mapping[str, Any]) -> str:
    fn = call.get("function", call)
    return (
        "<tool_call>\n"
        + json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments")}, ensure_ascii=False)
        + "\n</tool_call>"
    )


def hermes_messages(
    messages: Sequence[dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """Messages for a template without tool support, in Qwen2.5's rendering: the tools
    block in the system message, assistant tool calls as ``<tool_call>`` text, runs of
    tool results as one user turn of ``<tool_response>`` blocks."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m["role"]
        if role == "assistant" and m.get("tool_calls"):
            parts = [m["content"]] if m["content"] else []
            parts += [_tool_call_text(c) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(parts)})
        elif role == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            prev = out[-1] if out else None
            if prev is not None and prev.get("_tool_responses"):
                prev["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_responses": True})
        else:
            out.append({"role": role, "content": m["content"]})
    for m in out:
        m.pop("_tool_responses", None)
    if tools:
        block = hermes_tools_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def render_chat(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """Token ids of ``messages`` (each with a string ``content``; assistant ``tool_calls``
    with arguments as objects, as :mod:`rlfleet.rollout.openai_api` passes them)
    rendered by the tokenizer's chat template with the generation prompt.

    A template that renders tools gets ``tools`` and the messages as they are (tool
    call arguments as objects, as vLLM passes them); one that does not gets them in
    the Hermes format (:func:`hermes_messages`). The text is encoded without adding
    special tokens (the template writes those it wants).
    """
    if template_supports_tools(tokenizer):
        msgs = [dict(m) for m in messages]
        text = tokenizer.apply_chat_template(
            msgs, tools=list(tools) if tools else None, add_generation_prompt=True, tokenize=False
        )
    else:
        text = tokenizer.apply_chat_template(
            hermes_messages(messages, tools), add_generation_prompt=True, tokenize=False
        )
    return list(tokenizer.encode(text, add_special_tokens=False))


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Hermes/Qwen tool calls in a model's output: ``(content, tool_calls)``.

    Each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block (the last
    one may lack its closing tag: generation stopped there) becomes an OpenAI tool
    call, arguments as a JSON string; content is the text before the first block
    (None when empty). If any block is not such JSON, nothing is parsed: the whole
    text is content and there are no tool calls (vLLM's Hermes parser does the same).
    """
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls: list[dict[str, Any]] = []
    for body in _TOOL_CALL.findall(text, start):
        try:  # the model's own text: any JSON, however deep (RecursionError) or odd
            obj = json.loads(body.strip())
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return text, []
            args = obj.get("arguments", obj.get("parameters", {}))
            arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        except (ValueError, RecursionError):
            return text, []
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": obj["name"], "arguments": arguments},
            }
        )
    if not calls:
        return text, []
    content = text[:start].strip()
    return content or None, calls
