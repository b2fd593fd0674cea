"""GenerationHandle.batches: the samples as they finish, grouped by what is ready."""

from __future__ import annotations

import threading

import pytest

from rlfleet.rollout.core import GenerationHandle
from rlfleet.rollout.engine import FinishReason, GenerationRequest, SampleOutput, SamplingParams
from rlfleet.rollout.handle import DONE


def _handle(rows: int) -> GenerationHandle:
    return GenerationHandle(GenerationRequest([[1]] * rows, SamplingParams(max_tokens=2)), 0)


def _sample(i: int) -> SampleOutput:
    return SampleOutput(
        prompt_index=i,
        sample_index=0,
        token_ids=[i],
        logprobs=[],
        finish_reason=FinishReason.LENGTH,
    )


def test_ready_samples_group_up_to_the_cap() -> None:
    h = _handle(5)
    for i in range(5):
        h._put(_sample(i))
    h._put(DONE)
    groups = [[s.prompt_index for s in g] for g in h.batches(2)]
    assert groups == [[0, 1], [2, 3], [4]]
    assert h.cancelled  # iteration over: the request is released


def test_error_comes_after_the_samples_before_it() -> None:
    h = _handle(3)
    h._put(_sample(0))
    h._put(_sample(1))
    h._put(RuntimeError("engine failed"))
    got = []
    with pytest.raises(RuntimeError, match="engine failed"):
        for group in h.batches(8):
            got.append([s.prompt_index for s in group])
    assert got == [[0, 1]]


def test_waits_for_the_first_then_takes_what_is_ready() -> None:
    h = _handle(3)
    it = h.batches(8)
    threading.Timer(0.2, h._put, (_sample(0),)).start()
    assert [s.prompt_index for s in next(it)] == [0]  # waited for; nothing else ready
    h._put(_sample(1))
    h._put(_sample(2))
    assert [s.prompt_index for s in next(it)] == [1, 2]
    h._put(DONE)
    assert list(it) == []


def test_cap_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_samples"):
        next(_handle(1).batches(0))
