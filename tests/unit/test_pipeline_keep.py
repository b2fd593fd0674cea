"""Which batches a pipelined run keeps when its trainer is restored from a checkpoint
(rlfleet.driver.loop.keep_after_restore), and how their versions are renumbered."""

from __future__ import annotations

from rlfleet.driver.batch import GeneratedBatch
from rlfleet.driver.loop import _renumbered, keep_after_restore
from rlfleet.rollout.engine import SampleOutput


def _batch(step: int, *versions: int, tokens: list[int] | None = None) -> GeneratedBatch:
    samples = [
        SampleOutput(0, i, [1, 2], [0.0, 0.0], "stop", weight_version=v)
        for i, v in enumerate(versions)
    ]
    if tokens is not None:
        samples[0].token_weight_versions = tokens
    return GeneratedBatch(step, {}, {"pos": step}, 0, samples, [0.0] * len(samples), {})


def test_batches_from_the_restored_weights_or_older_are_kept_in_order() -> None:
    # Restored to step 2, version 2; the batch of step 4 failed, 5 and 6 were queued.
    ahead = [_batch(6, 3), _batch(4, 2, 1), _batch(5, 2)]
    kept = keep_after_restore(ahead, restored_step=2, restored_version=2)
    assert [gb.step for gb in kept] == [4, 5]  # 6 came from the discarded version 3


def test_a_newer_token_drops_the_batch_and_everything_after_it() -> None:
    # A partial rollout: its oldest version is 2, but later tokens came from version 3.
    ahead = [_batch(3, 1), _batch(4, 2, tokens=[2, 3]), _batch(5, 1)]
    kept = keep_after_restore(ahead, restored_step=2, restored_version=2)
    assert [gb.step for gb in kept] == [3]


def test_nothing_kept_past_a_gap_or_at_or_before_the_restored_step() -> None:
    assert keep_after_restore([_batch(4, 1), _batch(6, 1)], 2, 5) == keep_after_restore(
        [_batch(4, 1)], 2, 5
    )
    assert keep_after_restore([_batch(2, 1), _batch(3, 1)], 2, 5) == []
    assert keep_after_restore([], 2, 5) == []


def test_renumbering_moves_every_version_it_carries() -> None:
    gb = _batch(4, 2, 1, tokens=[2, 2])
    gb.min_weight_version = 1
    moved = _renumbered(gb, 3)
    assert [s.weight_version for s in moved.samples] == [5, 4]
    assert moved.samples[0].token_weight_versions == [5, 5]
    assert moved.min_weight_version == 4
    assert [s.weight_version for s in gb.samples] == [2, 1]  # the original untouched
    assert _renumbered(gb, 0) is gb
