"""The reward service over real gRPC on 127.0.0.1 (port 0), and its CLI as processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format, message_factory
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from rlfleet.common.config import CustomRewardFunction, RewardConfig
from rlfleet.common.errors import DeadlineExceeded, InvalidArgument, Unauthenticated
from rlfleet.common.rpc import create_channel, error_info
from rlfleet.reward.client import RemoteRewardClient
from rlfleet.reward.core import RewardManager
from rlfleet.reward.server import RewardService, start_reward_service
from rlfleet.reward.types import Sample
from rlfleet.v1 import reward_pb2, reward_pb2_grpc

REPO = Path(__file__).resolve().parents[2]

CUSTOM = textwrap.dedent(
    """
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        if solution_str == "hang":
            time.sleep(1000)
        return float(solution_str == ground_truth)
    """
)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RewardService]:
    custom = tmp_path_factory.mktemp("custom") / "reward_fn.py"
    custom.write_text(CUSTOM)
    config = RewardConfig(
        num_workers=2,
        sample_timeout_s=1.0,
        # rlfleet's routing: the table's sources keep their built-in scorers.
        custom_function=CustomRewardFunction(path=str(custom), keep_builtin_scorers=True),
    )
    with start_reward_service(config, port=0, metrics_port=0, max_batch_size=512) as svc:
        yield svc


@pytest.fixture()
def client(service: RewardService) -> Iterator[RemoteRewardClient]:
    with RemoteRewardClient(service.address, timeout_s=30) as c:
        yield c


def _gsm8k(n: int, offset: int = 0) -> list[Sample]:
    return [
        Sample("openai/gsm8k", f"step {i}\n#### {i + offset:,}", str(i), id=f"s{i}")
        for i in range(n)
    ]


def test_score_and_info(client: RemoteRewardClient) -> None:
    results = client.score(
        [
            *_gsm8k(3),
            Sample("math500", r"so $\boxed{\left(3, \dfrac{\pi}{2}\right)}$", r"(3,\frac{\pi}{2})"),
            {"data_source": "hellaswag", "response": "answer: (C)", "ground_truth": 2},
        ]
    )
    assert [r.score for r in results] == [1.0] * 5
    assert [r.id for r in results[:3]] == ["s0", "s1", "s2"]
    assert results[0].details["extracted"] == "0"
    info = client.info()
    assert {"gsm8k", "math", "multiple_choice", "custom"} <= set(info.scorers)
    assert info.data_sources["openai/gsm8k"] == "gsm8k"
    assert info.default_scorer == "custom" and info.max_batch_size == 512


def test_stream_returns_every_result_with_running_index(client: RemoteRewardClient) -> None:
    batches = [_gsm8k(10), _gsm8k(5, offset=1), [Sample("other", "hang", "")], _gsm8k(3)]
    results = list(client.score_stream(batches))
    assert sorted(r.index for r in results) == list(range(19))
    by_index = {r.index: r for r in results}
    assert all(by_index[i].score == 1.0 for i in range(10))
    assert all(by_index[i].score == 0.0 for i in range(10, 15))
    assert by_index[15].timed_out
    # Results come back as they finish: the hung sample's comes last.
    assert results[-1].index == 15


def test_stream_packs_results_that_are_ready_together(service: RewardService) -> None:
    """``pack_results`` on the first request: results that finish together share a
    message (the rest in ``more``); each index once. Without it: one per message,
    as any gRPC client written before it expects."""

    def request(samples: list[Sample], pack: bool) -> reward_pb2.ScoreRequest:
        from rlfleet.reward.serde import sample_to_proto

        return reward_pb2.ScoreRequest(
            samples=[sample_to_proto(x) for x in samples], pack_results=pack
        )

    batches = [_gsm8k(300), _gsm8k(300, offset=1), _gsm8k(100)]
    with create_channel(service.address) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        packed = list(stub.ScoreStream(iter([request(b, True) for b in batches]), timeout=30))
        plain = list(stub.ScoreStream(iter([request(b, False) for b in batches]), timeout=30))
    flat = [r for m in packed for r in (m, *m.more)]
    assert sorted(r.index for r in flat) == list(range(700))
    assert all(not r.more for m in packed for r in m.more)
    assert max(len(m.more) for m in packed) <= 255
    assert len(packed) <= 350  # 700 rule results are ready in bursts, not one by one
    scores = {r.index: r.score for r in flat}
    assert all(scores[i] == 1.0 for i in range(300)) and scores[300] == 0.0
    assert len(plain) == 700 and not any(m.more for m in plain)
    assert sorted(m.index for m in plain) == list(range(700))


@pytest.mark.parametrize(
    ("sample", "field"),
    [
        (reward_pb2.RewardSample(response="x"), "samples[1].data_source"),
        (reward_pb2.RewardSample(data_source="gsm8k", response="x"), "samples[1].ground_truth"),
    ],
)
def test_invalid_argument_names_field_and_index(
    service: RewardService, sample: reward_pb2.RewardSample, field: str
) -> None:
    good = reward_pb2.RewardSample(data_source="gsm8k", response="#### 1")
    good.ground_truth.string_value = "1"
    with create_channel(service.address) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        with pytest.raises(grpc.RpcError) as exc:
            stub.Score(reward_pb2.ScoreRequest(samples=[good, sample]), timeout=10)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info = error_info(exc.value)
    assert info is not None and info.field == field and info.sample_index == 1


def test_wrong_type_unknown_source_and_oversized_batch(client: RemoteRewardClient) -> None:
    with pytest.raises(InvalidArgument) as exc:
        client.score([Sample("gsm8k", "#### 1", ["1", "2"])])
    assert exc.value.field == "samples[0].ground_truth"
    with pytest.raises(InvalidArgument, match="over the limit"):
        client.score(_gsm8k(513))
    with pytest.raises(InvalidArgument) as exc:
        list(client.score_stream([_gsm8k(2), [Sample("", "x", "1")]]))
    assert exc.value.field == "samples[2].data_source" and exc.value.sample_index == 2


def _mixed_rule_batch(n: int) -> list[Sample]:
    """Built-in rule samples: gsm8k and multiple choice scored inline, math in the pool."""
    samples: list[Sample] = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            samples.append(Sample("openai/gsm8k", f"so\n#### {i:,}", str(i), id=f"g{i}"))
        elif kind == 1:
            samples.append(Sample("gsm8k", f"#### {i + 1}", i, id=f"w{i}"))  # wrong number
        elif kind == 2:
            samples.append(
                Sample("math500", rf"\boxed{{\dfrac{{{i}}}{{2}}}}", rf"\frac{{{i}}}{{2}}")
            )
        else:
            samples.append(Sample("hellaswag", "Answer: (B)", 1, extra_info={"n": i}))
    return samples


def _scorer_errors(service: RewardService, scorer: str) -> float:
    line = f'rlfleet_reward_sample_errors_total{{scorer="{scorer}"}} '
    text = service.metrics.render()
    return float(text.split(line, 1)[1].split()[0]) if line in text else 0.0


def test_large_rule_batch_matches_the_in_process_scores(client: RemoteRewardClient) -> None:
    samples = _mixed_rule_batch(300)
    remote = client.score(samples)
    with RewardManager(RewardConfig(), num_workers=0) as local:
        expected = local.score(samples)
    assert remote == expected
    assert [r.index for r in remote] == list(range(300))
    assert remote[0].details == {"extracted": "0", "format_ok": True}
    assert {r.score for r in remote[1::4]} == {0.0} and {r.score for r in remote[::4]} == {1.0}


def test_large_batch_problems_are_reported_like_small_ones(
    service: RewardService, client: RemoteRewardClient
) -> None:
    # An invalid sample deep in a large batch: INVALID_ARGUMENT naming it.
    samples = _gsm8k(200)
    samples[150] = Sample("gsm8k", "#### 1", None)
    with pytest.raises(InvalidArgument) as exc:
        client.score(samples)
    assert exc.value.field == "samples[150].ground_truth" and exc.value.sample_index == 150
    # A scorer that raises on one sample (multiple choice, in the handler thread,
    # on a reference that is no option): that sample scores 0, flagged and counted;
    # the others are unaffected.
    errors_before = _scorer_errors(service, "multiple_choice")
    samples = _gsm8k(200)
    samples[7] = Sample("hellaswag", "A", "not an option")
    results = client.score(samples)
    assert results[7].score == 0.0 and "ValueError" in results[7].error
    assert all(r.score == 1.0 and not r.error for i, r in enumerate(results) if i != 7)
    assert _scorer_errors(service, "multiple_choice") == errors_before + 1
    # Inline, pooled and custom samples in one request.
    results = client.score([*_mixed_rule_batch(100), Sample("other", "abc", "abc")])
    assert [r.scorer for r in results[-3:]] == ["math", "multiple_choice", "custom"]
    assert results[-1].score == 1.0 and [r.index for r in results] == list(range(101))


def test_deadline_is_honoured(client: RemoteRewardClient) -> None:
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        client.score([Sample("other", "hang", "")], timeout_s=0.3)
    assert time.monotonic() - start < 1.0


def test_hanging_scorer_does_not_block_other_clients(
    service: RewardService, client: RemoteRewardClient
) -> None:
    hung: list[Any] = []
    t = threading.Thread(target=lambda: hung.extend(client.score([Sample("x", "hang", "")] * 2)))
    t.start()
    time.sleep(0.1)
    with RemoteRewardClient(service.address) as other:
        start = time.monotonic()
        results = other.score(_gsm8k(100))
        assert time.monotonic() - start < 0.9  # well before the 1 s sample time-out
    assert all(r.score == 1.0 for r in results)
    t.join(15)
    assert [r.timed_out for r in hung] == [True, True]
    assert all(r.score == 0.0 and "timed out" in r.error for r in hung)


def test_concurrent_clients_get_their_own_answers(service: RewardService) -> None:
    def run(k: int) -> bool:
        with RemoteRewardClient(service.address) as c:
            for _round in range(3):
                samples = [
                    Sample("gsm8k", f"#### {k * 1000 + i}", str(k * 1000 + i + (i % 2)))
                    for i in range(64)
                ]
                results = c.score(samples)
                if [r.score for r in results] != [1.0 - (i % 2) for i in range(64)]:
                    return False
        return True

    with ThreadPoolExecutor(8) as ex:
        assert all(ex.map(run, range(8)))


def test_metrics_endpoint(service: RewardService, client: RemoteRewardClient) -> None:
    client.score(_gsm8k(4))
    url = f"http://127.0.0.1:{service.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    assert 'rlfleet_reward_requests_total{code="OK",method="Score"}' in text
    assert "rlfleet_reward_request_duration_seconds_bucket" in text
    assert 'rlfleet_reward_samples_total{data_source="openai/gsm8k",scorer="gsm8k"}' in text
    assert "rlfleet_reward_score_bucket" in text
    assert "rlfleet_reward_sample_timeouts_total" in text


def test_generic_reflection_client_lists_and_calls(service: RewardService) -> None:
    """No rlfleet stubs: descriptors come from the server's reflection service."""
    with grpc.insecure_channel(service.address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        assert "rlfleet.v1.RewardService" in db.get_services()
        pool = DescriptorPool(db)
        svc = pool.FindServiceByName("rlfleet.v1.RewardService")
        method = svc.FindMethodByName("Score")
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        request = json_format.ParseDict(
            {
                "samples": [
                    {"dataSource": "openai/gsm8k", "response": "#### 42", "groundTruth": "42"}
                ]
            },
            request_cls(),
        )
        call = channel.unary_unary(
            f"/{svc.full_name}/{method.name}",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response_cls.FromString,
        )
        response = json_format.MessageToDict(call(request, timeout=10))
    assert response["results"][0]["score"] == 1.0
    assert response["results"][0]["scorer"] == "gsm8k"


def test_bearer_token_required_when_configured() -> None:
    with start_reward_service(RewardConfig(num_workers=1), auth_token="s3cret") as svc:
        with RemoteRewardClient(svc.address) as anonymous, pytest.raises(Unauthenticated):
            anonymous.score(_gsm8k(1))
        with RemoteRewardClient(svc.address, auth_token="s3cret") as c:
            assert c.score(_gsm8k(1))[0].score == 1.0


def _read_serving_line(proc: subprocess.Popen[str], timeout_s: float = 60) -> dict[str, Any]:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("{"):
            event: dict[str, Any] = json.loads(line)
            if event.get("event") == "serving":
                return event
    proc.kill()
    raise AssertionError(f"service did not start: {proc.stderr.read() if proc.stderr else ''}")


def test_cli_serve_then_score_as_processes(tmp_path: Path) -> None:
    rows = [
        {"data_source": "openai/gsm8k", "response": "so 18\n#### 18", "ground_truth": "18"},
        {"data_source": "openai/gsm8k", "solution_str": "#### 17", "ground_truth": "18"},
        {
            "data_source": "math",
            "response": r"\boxed{\dfrac{1}{2}}",
            "reward_model": {"ground_truth": "0.5"},
        },
    ]
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {**os.environ, "RW_TOKEN": "tok"}
    serve = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from rlfleet.reward.server import main; sys.exit(main(sys.argv[1:]))",
            "--port=0",
            "--auth-token-env=RW_TOKEN",
            "--metrics-port=0",
            "-o",
            "reward.num_workers=1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        event = _read_serving_line(serve)
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from rlfleet.reward.cli import main; sys.exit(main(sys.argv[1:]))",
                "score",
                f"--addr={event['address']}",
                f"--input={data}",
                "--auth-token-env=RW_TOKEN",
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        lines = [json.loads(line) for line in out.stdout.splitlines()]
        assert [line["score"] for line in lines] == [1.0, 0.0, 1.0]
        assert [line["index"] for line in lines] == [0, 1, 2]
        assert lines[0]["details"]["extracted"] == "18"
        assert "scored 3 samples" in out.stderr
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            assert serve.wait(30) == 0
        finally:
            if serve.poll() is None:
                serve.kill()


def test_rule_service_runs_with_torch_blocked() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None
        sys.modules["transformers"] = None
        from rlfleet.common.config import RewardConfig
        from rlfleet.reward.server import start_reward_service
        from rlfleet.reward.client import RemoteRewardClient
        from rlfleet.reward.types import Sample
        import rlfleet.reward.cli, rlfleet.reward.core
        with start_reward_service(RewardConfig(num_workers=1)) as svc:
            with RemoteRewardClient(svc.address) as c:
                r = c.score([Sample("gsm8k", "#### 3", "3"), Sample("math", r"\\boxed{3}", "3")])
        assert [x.score for x in r] == [1.0, 1.0], r
        loaded = {m for m, v in sys.modules.items() if v is not None}
        assert "torch" not in loaded and "transformers" not in loaded
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_a_client_with_several_connections_splits_a_batch(service: RewardService) -> None:
    """``connections=3``: one batch goes out as 3 concurrent parts (one per connection,
    which a ``--processes N`` service spreads over processes); results and error
    indices are the whole batch's."""
    samples = _gsm8k(300, offset=0) + _gsm8k(10, offset=1)
    with RemoteRewardClient(service.address, timeout_s=30, connections=3, min_part=50) as c:
        results = c.score(samples)
        assert [r.index for r in results] == list(range(310))
        assert [r.score for r in results] == [1.0] * 300 + [0.0] * 10
        assert [r.id for r in results] == [s.id for s in samples]

        bad = [*samples[:250], Sample("", "#### 1", "1"), *samples[250:]]
        with pytest.raises(InvalidArgument) as exc:
            c.score(bad)
        assert exc.value.sample_index == 250
        assert exc.value.field == "samples[250].data_source"

        # Small batches stay one request.
        assert [r.score for r in c.score(_gsm8k(20))] == [1.0] * 20
    with pytest.raises(ValueError, match="connections"):
        RemoteRewardClient(service.address, connections=-1)
    # connections=0: as many as the service reports (one process here).
    with RemoteRewardClient(service.address, timeout_s=30, connections=0, min_part=50) as c:
        assert c.info().processes == 1
        assert [r.score for r in c.score(samples)] == [1.0] * 300 + [0.0] * 10
        assert c.connections == 1
