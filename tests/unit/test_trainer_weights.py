"""Bucketing of a weight push and the checks of the receiving side."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlfleet.common.codec.wire import iter_chunks
from rlfleet.common.errors import DataLoss, InvalidArgument, RlfleetError
from rlfleet.weightsync.sender import iter_buckets
from rlfleet.weightsync.wire import WeightStreamReceiver


def _named() -> list[tuple[str, torch.Tensor]]:
    return [(f"w{i}", torch.full((n,), float(i))) for i, n in enumerate([10, 30, 5, 100, 1])]


def test_buckets_bounded_and_ordered() -> None:
    buckets = list(iter_buckets(_named(), bucket_bytes=160))
    sizes = [sum(t.numel() * 4 for _, t in b) for b, _ in buckets]
    assert [name for b, _ in buckets for name, _ in b] == [f"w{i}" for i in range(5)]
    assert [final for _, final in buckets] == [False, False, False, True]
    assert sizes == [160, 20, 400, 4]  # a tensor over the limit is a bucket of its own


def _stream(buckets: list[tuple[dict[str, torch.Tensor], dict[str, str]]], version: int = 5):  # type: ignore[no-untyped-def]
    for batch, meta in buckets:
        for chunk in iter_chunks(batch, meta):
            yield version, chunk


def _meta(i: int, final: bool = False, tensors: int = 0) -> dict[str, str]:
    m = {"rlfleet.weights.version": "5", "rlfleet.weights.bucket": str(i)}
    if final:
        m.update({"rlfleet.weights.final": "1", "rlfleet.weights.tensors": str(tensors)})
    return m


def test_receiver_assembles_buckets() -> None:
    a, b = {"a": torch.ones(3)}, {"b": torch.zeros(2, 2)}
    version, tensors = WeightStreamReceiver().receive(
        _stream([(a, _meta(0)), (b, _meta(1, final=True, tensors=2))])
    )
    assert version == 5 and set(tensors) == {"a", "b"}
    # A plain single-stream sender (no bucket meta) is one complete update.
    assert set(WeightStreamReceiver().receive(_stream([(a, {})]))[1]) == {"a"}


@pytest.mark.parametrize(
    ("buckets", "error", "pattern"),
    [
        ([({"a": torch.ones(3)}, _meta(0))], DataLoss, "without the final"),
        ([({"a": torch.ones(3)}, _meta(1, final=True, tensors=1))], InvalidArgument, "bucket 1"),
        ([({"a": torch.ones(3)}, _meta(0, final=True, tensors=2))], InvalidArgument, "said 2"),
        (
            [({"a": torch.ones(3)}, _meta(0)), ({"a": torch.ones(3)}, _meta(1, True, 2))],
            InvalidArgument,
            "sent twice",
        ),
        (
            [({"a": torch.ones(3)}, _meta(0, True, 1)), ({"b": torch.ones(3)}, _meta(1))],
            InvalidArgument,
            "after the final",
        ),
    ],
    ids=["no-final", "order", "count", "duplicate", "after-final"],
)
def test_receiver_refuses_incomplete_updates(
    buckets: list[tuple[dict[str, torch.Tensor], dict[str, str]]],
    error: type[RlfleetError],
    pattern: str,
) -> None:
    with pytest.raises(error, match=pattern):
        WeightStreamReceiver().receive(_stream(buckets))


def test_receiver_stops_at_a_corrupt_or_truncated_bucket() -> None:
    first = [(5, c) for c in iter_chunks({"a": torch.ones(3000)}, _meta(0), max_chunk_bytes=4096)]
    second = list(_stream([({"b": torch.ones(3)}, _meta(1, final=True, tensors=2))]))
    assert len(first) > 2
    with pytest.raises(DataLoss, match="inside a bucket") as err:
        WeightStreamReceiver().receive(first[:-1])
    assert err.value.code == "INCOMPLETE_UPDATE"
    version, chunk = first[1]
    chunk.pieces[0].data = bytes([chunk.pieces[0].data[0] ^ 0xFF]) + chunk.pieces[0].data[1:]
    with pytest.raises(DataLoss, match="bucket 0") as err:
        WeightStreamReceiver().receive([first[0], (version, chunk), *first[2:], *second])
    assert err.value.code == "CORRUPT_CHUNK"


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda p: setattr(p, "dtype", 99), "a"),
        (lambda p: p.shape.__setitem__(0, 2), "a"),
        (lambda p: (p.shape.pop(), p.shape.extend([-1, 4])), "a"),
    ],
    ids=["unknown-dtype", "shape-disagrees-with-bytes", "negative-dimension"],
)
def test_a_malformed_chunk_is_invalid_argument_not_data_loss(mutate: Any, field: str) -> None:
    """A chunk whose checksums hold but whose header cannot be right (dtype, shape) is
    the sender's mistake, INVALID_ARGUMENT naming the tensor; DATA_LOSS stays for bytes
    that differ from what was checksummed (above)."""
    [(version, chunk)] = list(_stream([({"a": torch.ones(3)}, _meta(0, final=True, tensors=1))]))
    mutate(chunk.pieces[0])
    with pytest.raises(InvalidArgument) as err:
        WeightStreamReceiver().receive([(version, chunk)])
    assert err.value.code == "MALFORMED_CHUNK" and err.value.field == field, err.value


def test_receiver_checks_the_version_first() -> None:
    seen: list[int] = []
    bucket = [({"a": torch.ones(3)}, _meta(0, final=True, tensors=1))]
    assert WeightStreamReceiver(on_version=seen.append).receive(_stream(bucket))[0] == 5
    assert seen == [5]
    with pytest.raises(InvalidArgument, match="says version 5, its chunks 9"):
        WeightStreamReceiver().receive(_stream(bucket, version=9))


def test_push_targets_are_only_known_replicas() -> None:
    from rlfleet.trainer.servicer import refused_push_targets

    registered = {"10.0.0.5:50053"}
    assert refused_push_targets(["10.0.0.5:50053"], registered, registry=True) == {}
    refused = refused_push_targets(["10.0.0.5:50053", "127.0.0.1:9"], registered, registry=True)
    assert list(refused) == [1] and "registered with the scheduler" in refused[1]
    # Without a scheduler: the configured replicas and loopback only.
    assert refused_push_targets(["127.0.0.1:9", "[::1]:9"], (), registry=False) == {}
    assert refused_push_targets(["10.0.0.5:50053"], registered, registry=False) == {}
    refused = refused_push_targets(["203.0.113.9:80"], registered, registry=False)
    assert "services.rollout" in refused[0]


@pytest.mark.parametrize(
    ("targets", "field", "value"),
    [
        ([("r", "127.0.0.1:99999")], "targets[0].address", "127.0.0.1:99999"),  # wrapped before
        ([("r", "127.0.0.1:1\x00x")], "targets[0].address", "127.0.0.1:1\x00x"),  # cut before
        ([("r", "127.0.0.1")], "targets[0].address", "127.0.0.1"),
        ([("r", "")], "targets[0].address", ""),
        ([("r", "127.0.0.1:0")], "targets[0].address", "127.0.0.1:0"),
        ([("a", "127.0.0.1:5"), ("a", "127.0.0.1:6")], "targets[1].replica_id", "a"),
        ([], "targets", None),
    ],
)
def test_push_targets_are_well_formed(
    targets: list[tuple[str, str]], field: str, value: object
) -> None:
    """A malformed address is refused by name (not dialled as something else, not a
    permission error); two targets with one replica id would merge their outcomes."""
    from rlfleet.trainer.push import check_push_targets

    with pytest.raises(InvalidArgument) as info:
        check_push_targets(targets)
    assert info.value.field == field
    if value is not None:
        assert info.value.value == value
    check_push_targets([("a", "127.0.0.1:5"), ("b", "[::1]:6"), ("c", "replica-3.svc:50053")])


def test_a_weight_update_with_a_non_tensor_column_is_refused_by_name() -> None:
    """Weight chunks carry tensors; a string or JSON column (which the codec itself
    allows) was INTERNAL AttributeError ('list' has no numel)."""
    bucket = {"a": torch.ones(3), "junk": ["x", "y"]}
    with pytest.raises(InvalidArgument) as info:
        WeightStreamReceiver().receive(_stream([(bucket, _meta(0, final=True, tensors=2))]))  # type: ignore[list-item]
    assert (info.value.field, info.value.value) == ("chunk.columns", "junk")


def test_json_nested_past_the_stack_is_a_codec_error() -> None:
    """A JSON column row nested 100,000 deep (json.loads raises RecursionError, which
    reached the services as INTERNAL) is refused like any malformed row."""
    from rlfleet.common.codec.batch import CodecError, decode_rows

    with pytest.raises(CodecError, match="column 'uid' row 1: JSON nested too deeply"):
        decode_rows("uid", "json", ["1", "[" * 100_000 + "]" * 100_000])
    assert decode_rows("uid", "json", ["[[1]]"]) == [[[1]]]


def test_an_update_that_fills_the_byte_budget_exactly_is_received() -> None:
    """The budget (``max_bytes``) spent to the byte by the last bucket: the update is
    received (the assembler made for a next bucket once raised ValueError for a
    budget of 0); one byte less and it is refused."""
    a, b = {"a": torch.ones(3)}, {"b": torch.zeros(2, 2)}
    buckets = [(a, _meta(0)), (b, _meta(1, final=True, tensors=2))]
    held = _held_by(buckets)
    assert set(WeightStreamReceiver(max_bytes=held).receive(_stream(buckets))[1]) == {"a", "b"}
    with pytest.raises(RlfleetError, match="at most"):
        WeightStreamReceiver(max_bytes=held - 1).receive(_stream(buckets))


def _held_by(buckets: list[tuple[dict[str, torch.Tensor], dict[str, str]]]) -> int:
    """What the buckets' assemblers hold in all: the least budget that takes them."""
    from rlfleet.common.codec.wire import ChunkAssembler

    total = 0
    for batch, meta in buckets:
        asm = ChunkAssembler(max_bytes=10**9)
        for chunk in iter_chunks(batch, meta):
            asm.add(chunk)
        total += asm.held
    return total
