"""The trajectory store: sessions recorded, finished, taken once; its bounds; the proto form."""

from __future__ import annotations

import numpy as np
import pytest

from rlfleet.common.errors import FailedPrecondition, InvalidArgument, NotFound
from rlfleet.rollout import serde
from rlfleet.rollout.engine import FinishReason
from rlfleet.rollout.trajectories import Completion, Trajectory, TrajectoryStore


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def completion(prompt: int, generated: int, version: int = 0, seed: int = 0) -> Completion:
    rng = np.random.default_rng(seed)
    return Completion.of(
        rng.integers(0, 100, prompt),
        rng.integers(0, 100, generated),
        -rng.random(generated),
        weight_version=version,
        finish_reason=FinishReason.STOP,
        temperature=1.0,
    )


def test_sessions_record_finish_and_are_taken_once_in_finish_order() -> None:
    store = TrajectoryStore()
    a0, a1, b0 = completion(3, 2, seed=1), completion(7, 4, seed=2), completion(2, 2, seed=3)
    store.record("a", a0)
    store.record("b", b0)
    store.record("a", a1)
    (got,) = store.get(["a", "nope"])
    assert [c.token_ids.tolist() for c in got.completions] == [
        a0.token_ids.tolist(),
        a1.token_ids.tolist(),
    ]
    assert not got.finished and got.reward is None
    assert store.pop_finished(10) == []  # nothing finished yet

    store.finish("b", 0.5, {"group": "g"})
    store.finish("a", None)
    assert store.state("a") == "finished" and store.state("zzz") is None
    with pytest.raises(FailedPrecondition) as info:
        store.record("a", completion(1, 1))
    assert info.value.code == "SESSION_FINISHED"
    with pytest.raises(FailedPrecondition):
        store.finish("a", 1.0)
    with pytest.raises(NotFound):
        store.finish("never", 1.0)

    first = store.pop_finished(1)
    assert [t.session_id for t in first] == ["b"]
    assert first[0].reward == 0.5 and first[0].info == {"group": "g"}
    rest = store.pop_finished(5)
    assert [t.session_id for t in rest] == ["a"] and rest[0].reward is None
    assert store.pop_finished(5) == [] and len(store) == 0
    s = store.stats()
    assert s["tokens"] == 0 and s["popped"] == 2 and s["completions"] == 3
    with pytest.raises(InvalidArgument):
        store.pop_finished(0)


def test_a_session_can_start_again_under_its_id_once_taken() -> None:
    store = TrajectoryStore()
    store.record("s", completion(2, 2))
    store.finish("s", 1.0)
    store.pop_finished(1)
    store.record("s", completion(2, 2))
    assert store.state("s") == "open"


def test_session_bound_evicts_open_sessions_idle_longest_first_then_finished() -> None:
    clock = Clock()
    store = TrajectoryStore(max_sessions=3, clock=clock)
    for sid in ("f", "o1", "o2"):
        store.record(sid, completion(1, 1))
        clock.t += 1
    store.finish("f", 1.0)
    store.record("o1", completion(1, 1))  # o1 is now more recent than o2
    clock.t += 1
    store.record("new", completion(1, 1))
    assert store.state("o2") is None  # the open session idle longest
    assert {s: store.state(s) for s in ("f", "o1", "new")} == {
        "f": "finished",
        "o1": "open",
        "new": "open",
    }
    store.finish("o1", 0.0)
    store.finish("new", 0.0)
    store.record("newer", completion(1, 1))  # no open session left to evict: the oldest finished
    assert store.state("f") is None and store.state("newer") == "open"
    s = store.stats()
    assert s["evicted_open"] == 1 and s["evicted_finished"] == 1
    assert len(store) == 3


def test_token_bound_evicts_and_an_oversized_session_is_dropped() -> None:
    store = TrajectoryStore(max_tokens=20)
    store.record("a", completion(5, 5))  # 10 tokens
    store.record("b", completion(5, 5))  # 20
    store.record("c", completion(3, 3))  # 26 > 20: a goes
    assert store.state("a") is None and store.stats()["tokens"] == 16
    store.record("c", completion(8, 8))  # c alone is 22 > 20: dropped whole
    assert store.state("c") is None and store.state("b") == "open"
    s = store.stats()
    assert s["oversized"] == 1 and s["tokens"] == 10


def test_idle_sessions_expire_finished_or_not() -> None:
    clock = Clock()
    store = TrajectoryStore(ttl_s=10.0, clock=clock)
    store.record("old", completion(1, 1))
    store.record("done", completion(1, 1))
    store.finish("done", 1.0)
    clock.t += 5
    store.record("young", completion(1, 1))
    clock.t += 6  # old and done idle 11 s, young 6 s
    assert store.get(["old", "done", "young"])[0].session_id == "young"
    assert store.pop_finished(5) == []
    assert store.stats()["expired"] == 2


def test_pop_respects_a_token_budget_but_always_gives_one() -> None:
    store = TrajectoryStore()
    for sid in ("a", "b", "c"):
        store.record(sid, completion(10, 10))
        store.finish(sid, 1.0)
    assert [t.session_id for t in store.pop_finished(3, max_tokens=45)] == ["a", "b"]
    assert [t.session_id for t in store.pop_finished(3, max_tokens=1)] == ["c"]


def test_sessions_put_back_wait_first_in_line() -> None:
    """What a PopTrajectories answer could not carry goes back, ahead of the rest."""
    store = TrajectoryStore()
    for sid in ("a", "b", "c"):
        store.record(sid, completion(10, 10))
        store.finish(sid, 1.0)
    a, b = store.pop_finished(2)
    tokens = store.stats()["tokens"]
    store.put_back([a, b])
    assert store.stats()["tokens"] == tokens + a.tokens + b.tokens
    assert store.stats()["popped"] == 0
    assert [t.session_id for t in store.pop_finished(3)] == ["a", "b", "c"]


def test_completion_ids_and_logprobs_must_pair_up() -> None:
    with pytest.raises(InvalidArgument):
        Completion.of(
            [1, 2], [3, 4], [-0.1], weight_version=0, finish_reason=FinishReason.STOP,
            temperature=1.0,
        )  # fmt: skip


def test_trajectory_proto_round_trip() -> None:
    t = Trajectory(
        "sess-1",
        [completion(4, 3, version=2, seed=5), completion(9, 1, version=3, seed=6)],
        finished=True,
        reward=0.25,
        info={"group": "g", "ground_truth": "42"},
    )
    back = serde.trajectory_from_proto(serde.trajectory_to_proto(t))
    assert back.session_id == t.session_id and back.finished and back.reward == 0.25
    assert back.info == t.info
    for a, b in zip(t.completions, back.completions, strict=True):
        assert np.array_equal(a.prompt_ids, b.prompt_ids)
        assert np.array_equal(a.token_ids, b.token_ids)
        assert np.array_equal(a.logprobs, b.logprobs)  # float32 both ways: exact
        assert (a.weight_version, a.finish_reason, a.temperature) == (
            b.weight_version,
            b.finish_reason,
            b.temperature,
        )
    unscored = serde.trajectory_from_proto(serde.trajectory_to_proto(Trajectory("x")))
    assert unscored.reward is None and not unscored.finished


def test_pop_trajectories_answers_stay_under_the_message_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An answer carries sessions up to a byte bound (the 64 MiB message limit is
    counted in bytes, not tokens); the rest waits for the next call, none is lost, and
    a session no answer can carry is dropped alone."""
    from rlfleet.rollout import servicer as servicer_mod
    from rlfleet.v1 import rollout_pb2

    store = TrajectoryStore()
    for sid in ("a", "b", "c"):
        store.record(sid, completion(100, 100))
        store.finish(sid, 1.0)
    store.record("huge", completion(100, 5000))
    store.finish("huge", 0.0)
    one = serde.trajectory_to_proto(store.get(["a"])[0]).ByteSize()
    monkeypatch.setattr(servicer_mod, "MAX_TRAJECTORY_BYTES", 2 * one + 10)
    servicer = servicer_mod.RolloutServicer(None, trajectories=store)  # type: ignore[arg-type]
    servicer.core = type("Core", (), {"replica_id": "r0"})()  # what the answer names

    def pop() -> list[str]:
        request = rollout_pb2.PopTrajectoriesRequest(max_sessions=10)
        answer = servicer.PopTrajectories(request, None)  # type: ignore[arg-type]
        return [t.session_id for t in answer.trajectories]

    assert pop() == ["a", "b"]
    assert pop() == ["c"]  # "huge" went back behind it and cannot fit after it
    assert pop() == []  # alone, "huge" is more than any answer carries: dropped
    assert store.stats()["finished_waiting"] == 0
