"""Rollout protobuf <-> dataclass conversions (and weight sync's, rlfleet.weightsync.wire)
round-trip every field."""

from __future__ import annotations

import pytest

from rlfleet.common.codec.batch import TensorSpec
from rlfleet.common.errors import InvalidArgument
from rlfleet.rollout import serde
from rlfleet.rollout.engine import SamplingParams
from rlfleet.v1 import common_pb2, rollout_pb2
from rlfleet.weightsync import wire as weight_wire
from rlfleet.weightsync.wire import AbortResult, TransferOffer, TransferPlan, UpdateResult


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_sampling_params_round_trip(ignore_eos: bool) -> None:
    p = SamplingParams(
        n=3,
        temperature=0.5,
        top_p=0.75,
        top_k=7,
        max_tokens=11,
        stop_token_ids=(4, 9),
        seed=13,
        logprobs=False,
        ignore_eos=ignore_eos,
    )
    msg = rollout_pb2.SamplingParams.FromString(serde.sampling_to_proto(p).SerializeToString())
    assert msg.ignore_eos is ignore_eos
    assert serde.sampling_from_proto(msg) == p


def test_offer_and_plan_round_trip() -> None:
    bf16 = common_pb2.DType.Value("BFLOAT16")
    offer = TransferOffer(
        version=4,
        tensors=[TensorSpec("a", bf16, (2, 3), 12, 0), TensorSpec("b", bf16, (5,), 10, 12)],
        total_bytes=22,
        transports=["shm", "tcp"],
        sender_host="h",
    )
    wire = rollout_pb2.WeightTransferOffer.FromString(
        weight_wire.offer_to_proto(offer).SerializeToString()
    )
    assert weight_wire.offer_from_proto(wire) == offer
    assert offer.whole and not wire.more_buckets  # the default: one whole update
    plan = TransferPlan("id", "tcp", "127.0.0.1:5", "tok")
    assert weight_wire.plan_from_proto(weight_wire.plan_to_proto(plan)) == plan


@pytest.mark.parametrize(("bucket", "final"), [(0, False), (2, False), (3, True)])
def test_bucket_offer_plan_and_staged_result_round_trip(bucket: int, final: bool) -> None:
    bf16 = common_pb2.DType.Value("BFLOAT16")
    offer = TransferOffer(
        version=9,
        tensors=[TensorSpec("a", bf16, (2, 3), 12, 0)],
        total_bytes=12,
        transports=["tcp"],
        sender_host="h",
        bucket=bucket,
        final=final,
        update_id="" if bucket == 0 else "u1",
    )
    wire = rollout_pb2.WeightTransferOffer.FromString(
        weight_wire.offer_to_proto(offer).SerializeToString()
    )
    assert (wire.bucket, wire.more_buckets) == (bucket, not final)
    assert weight_wire.offer_from_proto(wire) == offer
    assert not offer.whole
    plan = TransferPlan("id", "shm", "seg", "", update_id="u1")
    assert weight_wire.plan_from_proto(weight_wire.plan_to_proto(plan)) == plan
    staged = UpdateResult(version=3, bytes=12, tensors=1, seconds=0.5, transport="tcp", staged=True)
    back = rollout_pb2.UpdateWeightsResponse.FromString(
        weight_wire.update_to_proto(staged).SerializeToString()
    )
    assert weight_wire.update_from_proto(back, "tcp") == staged


def test_offer_with_unknown_transport_is_refused() -> None:
    msg = rollout_pb2.WeightTransferOffer(version=1, transports=[99])
    with pytest.raises(InvalidArgument, match="unknown transports"):
        weight_wire.offer_from_proto(msg)


def test_commit_carries_one_crc32c_per_tensor() -> None:
    msg = rollout_pb2.WeightTransferCommit(transfer_id="t", crc32c=[0, 0xFFFFFFFF, 7])
    again = rollout_pb2.WeightTransferCommit.FromString(msg.SerializeToString())
    assert list(again.crc32c) == [0, 0xFFFFFFFF, 7]


def test_abort_result_and_status_staging_round_trip() -> None:
    from rlfleet.rollout.core import RolloutStatusInfo

    for r in (AbortResult(aborted=False), AbortResult(True, staged_buckets=2, freed_bytes=77)):
        wire = rollout_pb2.AbortWeightTransferResponse.FromString(
            weight_wire.abort_to_proto(r).SerializeToString()
        )
        assert weight_wire.abort_from_proto(wire) == r
    status = RolloutStatusInfo(
        "r0", "m", "hf", "bfloat16", "cpu", 3, 0, 1.5, False, 10, 1 << 33, 5 << 30
    )
    wire_status = rollout_pb2.RolloutStatus.FromString(
        serde.status_to_proto(status).SerializeToString()
    )
    assert serde.status_from_proto(wire_status) == status


def test_multi_turn_sample_round_trips_with_its_loss_mask() -> None:
    from rlfleet.rollout.engine import FinishReason, SampleOutput

    s = SampleOutput(
        prompt_index=2,
        sample_index=1,
        token_ids=[5, 6, 7, 8, 9],
        logprobs=[-0.5, 0.0, 0.0, -1.25, -0.75],
        finish_reason=FinishReason.STOP,
        weight_version=3,
        loss_mask=[1, 0, 0, 1, 1],
    )
    back = serde.result_from_proto(serde.result_to_proto(s))
    assert back.loss_mask == [1, 0, 0, 1, 1] and back.token_ids == s.token_ids
    assert back.logprobs == s.logprobs
    single = serde.result_from_proto(
        serde.result_to_proto(SampleOutput(0, 0, [1, 2], [-1.0, -2.0], FinishReason.LENGTH))
    )
    assert single.loss_mask == []  # single-turn: empty, every token the model's


def test_partial_rollout_sample_round_trips_with_its_token_versions() -> None:
    from rlfleet.rollout.engine import FinishReason, SampleOutput

    s = SampleOutput(
        prompt_index=0,
        sample_index=3,
        token_ids=[5, 6, 7, 8],
        logprobs=[-0.5, -0.25, -1.0, -2.0],
        finish_reason=FinishReason.LENGTH,
        weight_version=4,
        token_weight_versions=[4, 4, 5, 5],
    )
    back = serde.result_from_proto(serde.result_to_proto(s))
    assert back == s
    whole = serde.result_from_proto(
        serde.result_to_proto(SampleOutput(0, 0, [1, 2], [-1.0, -2.0], FinishReason.LENGTH, 2))
    )
    assert whole.token_weight_versions == []  # every token weight_version's
