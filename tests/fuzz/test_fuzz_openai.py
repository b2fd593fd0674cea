"""Hostile HTTP requests against a rollout replica's OpenAI-compatible endpoint: a real
server on 127.0.0.1 with authentication on, a few hundred seeded requests (random bytes,
wrong types and extreme values in every field, broken headers and lengths, odd paths,
methods and session ids, missing, bogus and wrong-role keys), then a normal request.

No request may get a 5xx (a handler that raised: a bug) or go unanswered (every request
here is well-formed HTTP); authentication answers as the policy says; the store stays
within its bounds; afterwards the endpoint still generates. Request ``i`` is drawn from
``random.Random(f"{SEED}:openai:{i}")``, so any one can be replayed alone.
"""

from __future__ import annotations

import http.client
import json
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from fuzzlib import Credentials

from rlfleet.common.auth import OPENAI_ENDPOINT_ROLES
from rlfleet.common.roles import PRINCIPALS
from rlfleet.rollout.core import RolloutCore
from rlfleet.rollout.engine import GenerateLimits
from rlfleet.rollout.hf_engine import HFEngine
from rlfleet.rollout.openai_api import OpenAIOptions
from rlfleet.rollout.openai_server import load_tokenizer, start_openai_server
from rlfleet.rollout.trajectories import TrajectoryStore

pytestmark = pytest.mark.timeout(300)

SEED = 20240611
COUNT = 300
BUDGET_S = 60.0
MAX_BODY = 256 * 1024


@dataclass
class Endpoint:
    host: str
    port: int
    tokens: dict[str, str]
    store: TrajectoryStore


@pytest.fixture(scope="module")
def endpoint(tiny_model_dir: Path) -> Iterator[Endpoint]:
    creds = Credentials.fresh()
    limits = GenerateLimits(
        max_n=4, max_prompts=4, max_samples=16, max_new_tokens=16, max_request_tokens=4096
    )
    core = RolloutCore(HFEngine(tiny_model_dir), replica_id="fuzz-openai", limits=limits)
    store = TrajectoryStore(max_sessions=50, max_tokens=20_000)
    ep = start_openai_server(
        core, load_tokenizer(str(tiny_model_dir)), store,
        options=OpenAIOptions(max_body_bytes=MAX_BODY, request_timeout_s=60, idle_timeout_s=10),
        security=creds.security("rollout"),
    )  # fmt: skip
    try:
        yield Endpoint("127.0.0.1", ep.port, creds.tokens, store)
    finally:
        ep.stop()
        core.close()


WEIRD: list[Any] = [
    None, True, False, 0, -1, 1, 2, 17, 2**31, 2**70, -(2**70), 0.5, 1e308, -1e-308, "", "x",
    "\u0000", "é" * 50, "x" * 5000, [], {}, [1], [[[[[]]]]], {"a": {"b": {"c": []}}},
    [None] * 50, {"type": "text"}, "<|im_end|>", "\ud800".encode("utf-8", "surrogatepass").decode("utf-8", "replace"),
]  # fmt: skip
CHAT_FIELDS = [
    "model", "messages", "n", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "top_k", "seed", "stop", "logprobs", "top_logprobs", "tools", "tool_choice", "stream",
    "stream_options", "user", "metadata", "presence_penalty", "logit_bias", "response_format",
    "functions", "best_of", "echo", "suffix", "prompt", "reward", "group",
]  # fmt: skip


def _valid_chat(rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "p",
        "messages": [{"role": "user", "content": f"{rng.randrange(10)} + {rng.randrange(10)} ="}],
        "max_tokens": rng.randrange(1, 5),
        "n": rng.randrange(1, 3),
    }
    if rng.random() < 0.3:
        body["stream"] = True
    if rng.random() < 0.3:
        body["logprobs"] = True
    if rng.random() < 0.2:
        body["tools"] = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    return body


def _mutated(rng: random.Random) -> dict[str, Any]:
    body = _valid_chat(rng)
    for _ in range(rng.randrange(1, 4)):
        body[rng.choice(CHAT_FIELDS)] = rng.choice(WEIRD)
    if rng.random() < 0.3:  # weird messages
        body["messages"] = [
            {rng.choice(["role", "content", "tool_calls", "name", "x"]): rng.choice(WEIRD)
             for _ in range(rng.randrange(0, 4))}
            for _ in range(rng.randrange(0, 4))
        ]  # fmt: skip
    return body


@dataclass
class Req:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    auth: str  # "none" | "bogus" | a role


def make_request(rng: random.Random, tokens: dict[str, str]) -> Req:
    kind = rng.random()
    path = rng.choice(["/v1/chat/completions"] * 4 + ["/v1/completions"] * 2 + ["/v1/models"])
    method = "POST"
    body: bytes
    if kind < 0.25:
        body = json.dumps(_valid_chat(rng)).encode()
    elif kind < 0.6:
        body = json.dumps(_mutated(rng)).encode()
    elif kind < 0.7:
        body = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 200)))
    elif kind < 0.8:
        sid = rng.choice(["ok-1", "%2F..%2F", "x" * 300, "%C3%A9", "a%20b", "", "..", "%00"])
        path = f"/v1/sessions/{sid}/{rng.choice(['reward', 'finish', 'other'])}"
        body = json.dumps({"reward": rng.choice(WEIRD), "group": rng.choice(WEIRD)}).encode()
    elif kind < 0.9:
        path = rng.choice(["/", "/v1", "/v1/models/x", "/v2/chat/completions", "/v1/" + "a" * 3000,
                           "/v1/chat/completions?x=" + "y" * 100])  # fmt: skip
        method = rng.choice(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
        body = b"{}"
    else:
        body = json.dumps(_valid_chat(rng)).encode() + b" " * rng.choice((0, MAX_BODY))
    headers = {"Content-Type": rng.choice(["application/json", "text/plain", "x/y"])}
    if rng.random() < 0.15:
        headers["X-Session-Id"] = rng.choice(["s-1", "", "a b", "x" * 200, "é", "a/b", "ok.2:3"])
    auth = rng.choice(["agent"] * 6 + ["driver", "none", "bogus", "observer", "trainer"])
    if auth == "bogus":
        headers["Authorization"] = rng.choice(
            ["Bearer " + "x" * 43, "Basic abc", "Bearer", "bearer x"]
        )
    elif auth != "none":
        headers["Authorization"] = f"Bearer {tokens[auth]}"
    return Req(method, path, headers, body, auth)


def send(ep: Endpoint, r: Req) -> int:
    conn = http.client.HTTPConnection(ep.host, ep.port, timeout=90)
    try:
        conn.putrequest(r.method, r.path, skip_accept_encoding=True)
        for k, v in r.headers.items():
            conn.putheader(k, v)
        conn.putheader("Content-Length", str(len(r.body)))
        conn.endheaders(r.body)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def test_storm_gets_no_server_error_and_the_endpoint_still_generates(endpoint: Endpoint) -> None:
    codes: Counter[int] = Counter()
    wrong: list[str] = []
    t0 = time.monotonic()
    for i in range(COUNT):
        if time.monotonic() - t0 > BUDGET_S:
            break
        r = make_request(random.Random(f"{SEED}:openai:{i}"), endpoint.tokens)
        try:
            status = send(endpoint, r)
        except (OSError, http.client.HTTPException) as e:
            wrong.append(f"#{i} {r.method} {r.path[:60]}: no answer ({e!r})")
            continue
        codes[status] += 1
        if status >= 500:
            wrong.append(f"#{i} {r.method} {r.path[:60]}: {status}")
        if r.auth in ("none", "bogus") and status not in (401, 413):
            wrong.append(f"#{i} without a valid key: {status}")
        elif (
            r.auth in PRINCIPALS
            and r.auth not in OPENAI_ENDPOINT_ROLES
            and status not in (403, 413)
        ):
            wrong.append(f"#{i} as {r.auth}: {status}")
    assert not wrong, "\n".join(wrong) + f"\ncodes {dict(codes)}"
    assert codes[200] > 0 and codes[400] > 0, dict(codes)  # reached the handlers
    s = endpoint.store.stats()
    assert s["open"] + s["finished_waiting"] <= 50 and s["tokens"] <= 20_000, s
    ok = Req("POST", "/v1/chat/completions", {"Authorization": f"Bearer {endpoint.tokens['agent']}"},
             json.dumps(_valid_chat(random.Random(1)) | {"stream": False}).encode(), "agent")  # fmt: skip
    assert send(endpoint, ok) == 200


def test_every_route_refuses_strangers_and_other_roles(endpoint: Endpoint) -> None:
    routes = [
        ("GET", "/v1/models", b""),
        ("POST", "/v1/chat/completions", json.dumps(_valid_chat(random.Random(2))).encode()),
        ("POST", "/v1/completions", b'{"prompt": "1 +", "max_tokens": 1}'),
        ("POST", "/v1/sessions/nope/reward", b'{"reward": 1}'),
        ("POST", "/v1/sessions/nope/finish", b"{}"),
    ]
    wrong = []
    for method, path, body in routes:
        for auth in ("none", "bogus", *PRINCIPALS):
            headers = {}
            if auth == "bogus":
                headers["Authorization"] = "Bearer " + "y" * 43
            elif auth != "none":
                headers["Authorization"] = f"Bearer {endpoint.tokens[auth]}"
            status = send(endpoint, Req(method, path, headers, body, auth))
            want = {401} if auth in ("none", "bogus") else {403}
            if auth in OPENAI_ENDPOINT_ROLES:
                want = {200, 404}  # 404: the session does not exist
            if status not in want:
                wrong.append(f"{method} {path} as {auth}: {status} (want {sorted(want)})")
    assert not wrong, "\n".join(wrong)
