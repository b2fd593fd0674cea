"""Bucketing of a weight push and the checks of the receiving side."""

from __future__ import annotations

import pytest
import torch

from rlfleet.common.codec import iter_chunks
from rlfleet.common.errors import InvalidArgument
from rlfleet.trainer.weights import WeightStreamReceiver, iter_buckets


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
    ("buckets", "pattern"),
    [
        ([({"a": torch.ones(3)}, _meta(0))], "without the final"),
        ([({"a": torch.ones(3)}, _meta(1, final=True, tensors=1))], "bucket 1 arrived"),
        ([({"a": torch.ones(3)}, _meta(0, final=True, tensors=2))], "sender said 2"),
    ],
    ids=["no-final", "order", "count"],
)
def test_receiver_refuses_incomplete_updates(
    buckets: list[tuple[dict[str, torch.Tensor], dict[str, str]]], pattern: str
) -> None:
    with pytest.raises(InvalidArgument, match=pattern):
        WeightStreamReceiver().receive(_stream(buckets))
