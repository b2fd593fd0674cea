"""``WeightHandOver``: how a weight update travels from the thread that received it to
the thread that generates (partial rollouts, both engines)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from rlfleet.rollout.engine import WeightHandOver


def _wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert cond()


def test_a_free_engine_lets_the_poster_apply_it() -> None:
    lock = threading.RLock()
    handover = WeightHandOver(lock)
    ran: list[str] = []
    handover.post(lambda: ran.append(threading.current_thread().name))
    assert ran == [threading.current_thread().name] and not handover.pending
    assert handover.take() is False  # nothing left to take


def test_a_busy_engine_applies_it_between_two_steps() -> None:
    lock = threading.RLock()
    handover = WeightHandOver(lock)
    ran: list[str] = []
    lock.acquire()  # this thread is the generating one
    try:
        poster = threading.Thread(
            target=handover.post, args=(lambda: ran.append(threading.current_thread().name),)
        )
        poster.start()
        _wait_for(lambda: handover.pending)
        assert ran == []  # waits for the next step
        assert handover.take() is True
        assert ran == [threading.current_thread().name]  # applied on the generating thread
        poster.join(timeout=10)
        assert not poster.is_alive() and not handover.pending
    finally:
        lock.release()


def test_an_update_that_fails_fails_the_poster_and_the_batch() -> None:
    lock = threading.RLock()
    handover = WeightHandOver(lock)
    errors: list[BaseException] = []

    def bad() -> None:
        raise ValueError("shape mismatch")

    def post() -> None:
        try:
            handover.post(bad)
        except ValueError as e:
            errors.append(e)

    lock.acquire()
    try:
        poster = threading.Thread(target=post)
        poster.start()
        _wait_for(lambda: handover.pending)
        with pytest.raises(ValueError, match="shape mismatch"):
            handover.take()
        poster.join(timeout=10)
    finally:
        lock.release()
    assert [str(e) for e in errors] == ["shape mismatch"]
    handover.post(lambda: None)  # the next update goes through


def test_posters_take_turns() -> None:
    lock = threading.RLock()
    handover = WeightHandOver(lock)
    order: list[int] = []
    lock.acquire()
    try:
        first = threading.Thread(target=handover.post, args=(lambda: order.append(1),))
        first.start()
        _wait_for(lambda: handover.pending)
        second = threading.Thread(target=handover.post, args=(lambda: order.append(2),))
        second.start()
        time.sleep(0.05)
        assert handover.take() and order == [1]  # one update per step
    finally:
        lock.release()
    first.join(timeout=10)
    second.join(timeout=10)  # the engine is free now: the second poster applies its own
    assert order == [1, 2]
