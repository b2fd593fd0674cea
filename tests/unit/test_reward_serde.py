"""Protobuf <-> reward types round trips, and file rows -> samples."""

from __future__ import annotations

import pytest

from rlfleet.common.errors import InvalidArgument
from rlfleet.reward.client import sample_from_row
from rlfleet.reward.serde import (
    result_from_proto,
    result_to_proto,
    sample_from_proto,
    sample_to_proto,
)
from rlfleet.reward.types import ChatMessage, Sample, ScoreResult
from rlfleet.v1 import reward_pb2


@pytest.mark.parametrize("truth", ["18", 18, 2.5, ["1", 2], {"a": [1, None, True]}, None, True])
def test_sample_round_trip(truth: object) -> None:
    sample = Sample(
        "math",
        "resp",
        truth,
        prompt="p",
        prompt_messages=[ChatMessage("user", "hi")],
        extra_info={"split": "test", "index": 3, "nested": {"x": [1.5]}},
        id="a",
    )
    wire = reward_pb2.RewardSample.FromString(sample_to_proto(sample).SerializeToString())
    assert sample_from_proto(wire, 0) == sample


def test_result_round_trip() -> None:
    result = ScoreResult(
        index=7,
        score=0.5,
        scorer="gsm8k",
        details={"extracted": "18", "format_ok": True, "n": 3, "none": None, "list": [1, "a"]},
        error="boom",
        timed_out=True,
        id="x",
    )
    wire = reward_pb2.ScoreResult.FromString(result_to_proto(result).SerializeToString())
    assert result_from_proto(wire) == result


def test_rows_from_jsonl_and_verl_parquet() -> None:
    s = sample_from_row({"data_source": "gsm8k", "solution_str": "#### 1", "ground_truth": "1"})
    assert (s.response, s.ground_truth) == ("#### 1", "1")
    verl = {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "2+2?"}],
        "reward_model": {"style": "rule", "ground_truth": "4"},
        "extra_info": {"split": "test", "index": 0},
        "responses": ["#### 4"],
    }
    s = sample_from_row(verl)
    assert s.ground_truth == "4" and s.response == "#### 4"
    assert s.prompt_messages == [ChatMessage("user", "2+2?")]
    with pytest.raises(InvalidArgument) as exc:
        sample_from_row({"data_source": "gsm8k"}, 4)
    assert exc.value.field == "samples[4].response"


def test_sample_limits_check_sizes_at_the_bound_exactly() -> None:
    from rlfleet.reward.types import SampleLimits

    limits = SampleLimits(max_text_chars=10, max_name_chars=5)
    at = sample_to_proto(Sample("gsm8k", "r" * 10, "g" * 10, prompt="p" * 10, id="i" * 5))
    assert sample_from_proto(at, 0, limits).response == "r" * 10
    over = sample_to_proto(Sample("gsm8k", "r" * 11, "1"))
    with pytest.raises(InvalidArgument) as exc:
        sample_from_proto(over, 7, limits)
    assert (exc.value.field, exc.value.value, exc.value.sample_index) == (
        "samples[7].response",
        11,
        7,
    )
    # Without limits (the default), a converter only converts.
    assert sample_from_proto(over, 0).response == "r" * 11


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_sample_limits_are_validated(bad: object) -> None:
    from rlfleet.reward.types import SampleLimits

    with pytest.raises(ValueError, match="max_text_chars must be an integer >= 1"):
        SampleLimits(max_text_chars=bad)  # type: ignore[arg-type]


def test_nesting_depth_names_the_field_and_counts_each_container_once() -> None:
    """A ground truth 33 lists deep is refused as samples[i].ground_truth (it said only
    samples[i]); extra_info 17 dicts deep loads (each dict counted twice refused it)."""
    from rlfleet.common.errors import InvalidArgument
    from rlfleet.reward.serde import sample_from_proto
    from rlfleet.v1 import reward_pb2

    msg = reward_pb2.RewardSample(data_source="x", response="r")
    target = msg.ground_truth
    for _ in range(33):
        target = target.list_value.values.add()
    target.number_value = 1
    with pytest.raises(InvalidArgument) as info:
        sample_from_proto(msg, 3)
    assert info.value.field == "samples[3].ground_truth" and info.value.sample_index == 3

    ok = reward_pb2.RewardSample(data_source="x", response="r")
    struct = ok.extra_info
    for _ in range(17):
        struct = struct.fields["k"].struct_value
    struct.fields["v"].number_value = 1
    assert sample_from_proto(ok, 0).extra_info["k"]["k"]
    deep = reward_pb2.RewardSample(data_source="x", response="r")
    struct = deep.extra_info
    for _ in range(40):
        struct = struct.fields["k"].struct_value
    with pytest.raises(InvalidArgument) as info:
        sample_from_proto(deep, 0)
    assert info.value.field == "samples[0].extra_info"
