"""The reward service bounded against what callers send: metric labels, request sizes,
a dead service seen by its client. Real gRPC servers on 127.0.0.1 (port 0)."""

from __future__ import annotations

import random
import socket
import string
import textwrap
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from rlfleet.common.config import CustomRewardFunction, RewardConfig
from rlfleet.common.errors import InvalidArgument, Unavailable
from rlfleet.common.rpc import create_channel, to_rlfleet_error
from rlfleet.reward.client import RemoteRewardClient
from rlfleet.reward.core import RewardManager
from rlfleet.reward.metrics import prometheus_available
from rlfleet.reward.server import RewardService, start_reward_service
from rlfleet.reward.types import DEFAULT_MAX_TEXT_CHARS, ChatMessage, Sample, SampleLimits
from rlfleet.v1 import reward_pb2, reward_pb2_grpc

CUSTOM = textwrap.dedent(
    """
    import time

    DATA_SOURCES = ["my/source"]

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        if solution_str.startswith("slow "):
            time.sleep(float(solution_str.split()[1]))
        return float(solution_str == ground_truth)
    """
)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RewardService]:
    custom = tmp_path_factory.mktemp("custom") / "reward_fn.py"
    custom.write_text(CUSTOM)
    config = RewardConfig(
        num_workers=2,
        sample_timeout_s=30.0,
        # rlfleet's routing: the table's sources keep their built-in scorers.
        custom_function=CustomRewardFunction(path=str(custom), keep_builtin_scorers=True),
    )
    with start_reward_service(config, port=0, metrics_port=0, max_batch_size=512) as svc:
        yield svc


@pytest.fixture()
def client(service: RewardService) -> Iterator[RemoteRewardClient]:
    with RemoteRewardClient(service.address, timeout_s=60) as c:
        yield c


def _scrape(service: RewardService) -> str:
    url = f"http://127.0.0.1:{service.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text: str = r.read().decode()
    return text


# ------------------------------------------------------------------ metric labels


@pytest.mark.skipif(not prometheus_available(), reason="prometheus-client not installed")
def test_client_chosen_data_sources_do_not_grow_the_metric_series(
    service: RewardService, client: RemoteRewardClient
) -> None:
    rng = random.Random(0)
    sources = [
        "".join(rng.choices(string.ascii_letters + "/_-", k=rng.randint(1, 40))) + f"-{i}"
        for i in range(300)
    ]
    before = _samples_series(_scrape(service))
    samples = [Sample(s, "a", "a") for s in sources]
    samples += [Sample("my/source", "a", "b"), Sample("openai/gsm8k", "#### 3", "3")]
    results = client.score(samples)
    assert [r.scorer for r in results] == ["custom"] * 301 + ["gsm8k"]
    after = _samples_series(_scrape(service))
    # The known sources and "other": not one series per source sent.
    assert set(after) <= {
        ("other", "custom"),
        ("my/source", "custom"),
        ("openai/gsm8k", "gsm8k"),
        ("openai/gsm8k", "custom"),
    }
    assert after[("other", "custom")] - before.get(("other", "custom"), 0.0) == 300.0
    assert after[("my/source", "custom")] - before.get(("my/source", "custom"), 0.0) == 1.0


def _samples_series(text: str) -> dict[tuple[str, str], float]:
    """``rlfleet_reward_samples_total`` as {(data_source, scorer): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "rlfleet_reward_samples_total":
                out[sample.labels["data_source"], sample.labels["scorer"]] = sample.value
    return out


# ------------------------------------------------------------ non-finite references


def test_a_nan_ground_truth_never_scores_over_grpc(
    service: RewardService, client: RemoteRewardClient
) -> None:
    # RemoteRewardClient sends a float NaN as the string "nan": the scorers refuse it.
    results = client.score(
        [
            Sample("math500", r"so $\boxed{nan}$", float("nan")),
            Sample("math500", r"so $\boxed{inf}$", "inf"),
            Sample("openai/gsm8k", "#### 18", float("nan")),
            Sample("math500", r"$\boxed{\infty}$", r"\infty"),
        ]
    )
    assert [r.score for r in results] == [0.0, 0.0, 0.0, 1.0]
    # math refuses them by name; gsm8k, as verl, compares text: nothing equals NaN.
    assert all("finite" in r.error or "not a number" in r.error for r in results[:2])
    # A raw number NaN (another client) is refused with the field and index named.
    request = reward_pb2.ScoreRequest()
    ok = request.samples.add(data_source="math500", response=r"$\boxed{1}$")
    ok.ground_truth.number_value = 1.0
    bad = request.samples.add(data_source="math500", response=r"$\boxed{nan}$")
    bad.ground_truth.number_value = float("nan")
    with create_channel(service.address) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        with pytest.raises(grpc.RpcError) as exc:
            stub.Score(request, timeout=30)
    error = to_rlfleet_error(exc.value)
    assert isinstance(error, InvalidArgument)
    assert error.field == "samples[1].ground_truth"
    assert error.sample_index == 1
    assert "finite" in error.message


# ------------------------------------------------------------------ request bounds


@pytest.fixture(scope="module")
def small() -> Iterator[RewardService]:
    """A service with small bounds."""
    limits = SampleLimits(max_text_chars=1000, max_name_chars=40)
    with start_reward_service(
        port=0, manager=RewardManager(max_batch_size=10, num_workers=0), limits=limits
    ) as svc:
        yield svc


def _ok(i: int = 0) -> Sample:
    return Sample("openai/gsm8k", f"#### {i}", str(i))


@pytest.mark.parametrize(
    ("sample", "field", "size"),
    [
        (Sample("openai/gsm8k", "#### 1" + "x" * 1000, "1"), "response", 1006),
        (Sample("openai/gsm8k", "#### 1", "1", prompt="p" * 1001), "prompt", 1001),
        (Sample("openai/gsm8k", "#### 1", "1" * 1001), "ground_truth", 1001),
        (Sample("math", r"\boxed{1}", ["1" * 600, "2" * 600]), "ground_truth", None),
        (Sample("openai/gsm8k", "#### 1", "1", extra_info={"k": "v" * 1000}), "extra_info", None),
        (
            Sample(
                "openai/gsm8k",
                "#### 1",
                "1",
                prompt_messages=[
                    ChatMessage("user", "u" * 600),
                    ChatMessage("assistant", "a" * 400),
                ],
            ),
            "prompt_messages",
            1013,
        ),
        (Sample("openai/gsm8k" + "/" * 40, "#### 1", "1"), "data_source", 52),
        (Sample("openai/gsm8k", "#### 1", "1", id="i" * 41), "id", 41),
    ],
)
def test_each_field_over_its_bound_is_refused_by_name(
    small: RewardService, sample: Sample, field: str, size: int | None
) -> None:
    with RemoteRewardClient(small.address, timeout_s=60) as c:
        with pytest.raises(InvalidArgument) as exc:
            c.score([_ok(), _ok(1), sample])
        error = exc.value
        assert error.field == f"samples[2].{field}"
        assert error.sample_index == 2
        assert error.code == "TOO_LARGE"
        assert "over the limit of" in error.message
        if size is not None:
            assert error.value == str(size)
            assert f"has {size} " in error.message
        else:
            assert int(str(error.value)) > 1000
        # In a stream, the index counts samples across its requests.
        with pytest.raises(InvalidArgument) as exc:
            list(c.score_stream([[_ok(), _ok(1)], [_ok(2), sample]]))
        assert exc.value.field == f"samples[3].{field}"
        assert exc.value.sample_index == 3
        # Within the bounds, the same service scores.
        assert [r.score for r in c.score([_ok(i) for i in range(10)])] == [1.0] * 10


def test_samples_per_request_are_bounded(small: RewardService) -> None:
    with RemoteRewardClient(small.address, timeout_s=60) as c:
        with pytest.raises(InvalidArgument) as exc:
            c.score([_ok(i) for i in range(11)])
        assert exc.value.field == "samples"
        assert exc.value.value == "11"
        assert "over the limit of 10" in exc.value.message
        with pytest.raises(InvalidArgument) as exc:
            list(c.score_stream([[_ok()] * 10, [_ok()] * 11]))
        assert exc.value.field == "samples"
        assert exc.value.value == "11"


def test_default_bounds_take_a_long_response(client: RemoteRewardClient) -> None:
    """Default: 1 Mi characters per text field, so long responses fit, one more does not."""
    limit = DEFAULT_MAX_TEXT_CHARS
    long = "x" * (limit - 8) + "\n#### 18"
    assert len(long) == limit
    assert client.score([Sample("openai/gsm8k", long, "18")])[0].score == 1.0
    with pytest.raises(InvalidArgument) as exc:
        client.score([Sample("openai/gsm8k", long + " ", "18")])
    assert exc.value.field == "samples[0].response"
    assert exc.value.value == str(limit + 1)


# ------------------------------------------------------------ a dead service, seen by its client


def _assert_names_the_service(error: Unavailable, address: str) -> None:
    assert "reward service" in error.message
    assert address in error.message
    assert error.recoverable


def test_a_port_nobody_listens_on_fails_fast_as_unavailable() -> None:
    # Bound, never listening: connections are refused, and no one else gets the port.
    with socket.socket() as reserved:
        reserved.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{reserved.getsockname()[1]}"
        # The call's own deadline (120 s) is not what ends it: the connect one is.
        with RemoteRewardClient(address, timeout_s=120, connect_timeout_s=0.5) as c:
            with pytest.raises(Unavailable) as exc:
                c.score([_ok()])
            _assert_names_the_service(exc.value, address)
            with pytest.raises(Unavailable) as exc:
                c.info()
            _assert_names_the_service(exc.value, address)
            with pytest.raises(Unavailable) as exc:
                list(c.score_stream([[_ok()]]))
            _assert_names_the_service(exc.value, address)


def test_a_stopped_service_fails_fast_as_unavailable() -> None:
    svc = start_reward_service(port=0, manager=RewardManager(num_workers=0))
    address = svc.address
    try:
        with RemoteRewardClient(address, timeout_s=120, connect_timeout_s=0.5) as c:
            assert c.score([_ok(3)])[0].score == 1.0
            svc.stop(grace_s=0.0)
            for _ in range(2):  # the call that finds it gone, and the next one
                with pytest.raises(Unavailable) as exc:
                    c.score([_ok(3)])
                _assert_names_the_service(exc.value, address)
    finally:
        svc.stop(grace_s=0.0)


def test_a_slow_service_that_is_up_gets_its_whole_call_deadline(client: RemoteRewardClient) -> None:
    # Scoring takes 4 connect time-outs: a connected service is not cut short by it.
    with RemoteRewardClient(client.address, timeout_s=60, connect_timeout_s=0.5) as c:
        (result,) = c.score([Sample("my/source", "slow 2", "slow 2")])
        assert result.score == 1.0 and not result.error
        (result,) = c.score_stream([[Sample("my/source", "slow 2", "x")]])
        assert result.score == 0.0 and not result.error


def test_connect_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="connect_timeout_s must be > 0"):
        RemoteRewardClient("127.0.0.1:1", connect_timeout_s=0)
