"""Sessions and their trajectories: exactly what a replica generated for an external agent.

Every completion the OpenAI-compatible endpoint (:mod:`rlfleet.rollout.openai_api`)
returns is recorded under its request's session id: the prompt token ids the model
saw, the token ids it sampled, their log-probs (the engine's definition, see
:mod:`rlfleet.rollout.engine`), the weight version and the temperature they were
sampled with. The agent ends a session by posting its reward (or by finishing it
without one, for the reward service to score); the driver then takes it with
``PopTrajectories`` and trains on the recorded tokens (``trainer.rollout_source:
external``, :mod:`rlfleet.driver.external`). This is AReaL's proxy idea: any agent
framework drives the rollouts, and training still sees the exact tokens.

Bounds, so an agent cannot grow a replica's memory without limit:

* ``max_sessions`` sessions, ``max_tokens`` tokens over all records (prompt +
  generated tokens of each completion; ids are stored as int32, log-probs as float32);
* ``ttl_s``: a session with no activity (a completion, or its finish) for longer is
  dropped, finished or not.

A record that would pass a bound evicts open sessions first, the one idle longest
first, then finished sessions the driver has not taken yet, the oldest first (they
are the data a run is waiting for). A session whose own records pass ``max_tokens``
is dropped whole. Counters of each kind are in :meth:`TrajectoryStore.stats`.

No sockets, no protobuf, no torch.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from rlfleet.common.errors import FailedPrecondition, InvalidArgument, NotFound
from rlfleet.rollout.engine import FinishReason

__all__ = [
    "DEFAULT_MAX_SESSIONS",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_TTL_S",
    "Completion",
    "Trajectory",
    "TrajectoryStore",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_SESSIONS = 10_000
DEFAULT_MAX_TOKENS = 1 << 22  # ~4M tokens: 32 MiB of ids and log-probs
DEFAULT_TTL_S = 3600.0


@dataclass(frozen=True, slots=True)
class Completion:
    """One sampled response, as the model produced it.

    Attributes:
        prompt_ids: the prompt's token ids, int32 (what the model was conditioned on).
        token_ids: the sampled tokens, int32 (a final stop/eos token included, cut
            after a stop string when the request had one).
        logprobs: one per sampled token, float32 (``log softmax(logits / T)[token]``,
            the raw log-softmax when greedy).
        weight_version: the weights it was sampled with.
        finish_reason: why it ended.
        temperature: the sampling temperature (0: greedy).
        created: Unix time it was recorded.
    """

    prompt_ids: np.ndarray
    token_ids: np.ndarray
    logprobs: np.ndarray
    weight_version: int
    finish_reason: FinishReason
    temperature: float
    created: float = 0.0

    @classmethod
    def of(
        cls,
        prompt_ids: Sequence[int] | np.ndarray,
        token_ids: Sequence[int] | np.ndarray,
        logprobs: Sequence[float] | np.ndarray,
        *,
        weight_version: int,
        finish_reason: FinishReason,
        temperature: float,
        created: float | None = None,
    ) -> Completion:
        """Copies the ids and log-probs into compact arrays; checks they pair up."""
        tokens = np.asarray(token_ids, dtype=np.int32).copy()
        lps = np.asarray(logprobs, dtype=np.float32).copy()
        if tokens.shape != lps.shape or tokens.ndim != 1:
            raise InvalidArgument(
                f"{tokens.size} token ids but {lps.size} log-probs: they must pair up",
                field="logprobs",
            )
        return cls(
            prompt_ids=np.asarray(prompt_ids, dtype=np.int32).copy(),
            token_ids=tokens,
            logprobs=lps,
            weight_version=int(weight_version),
            finish_reason=FinishReason(finish_reason),
            temperature=float(temperature),
            created=time.time() if created is None else float(created),
        )

    @property
    def tokens(self) -> int:
        """What it costs the store: prompt + generated tokens."""
        return int(self.prompt_ids.size + self.token_ids.size)


@dataclass(slots=True)
class Trajectory:
    """A session: its completions in the order they were generated, and how it ended.

    Attributes:
        session_id: the id the agent sent (or the one the endpoint generated).
        completions: in generation order.
        finished: the agent finished it (no more completions are recorded).
        reward: the agent's reward; None: to be scored (or not finished yet).
        info: what the agent said when finishing: ``group`` (sessions of one
            prompt, for the group estimators), ``data_source``, ``ground_truth``.
    """

    session_id: str
    completions: list[Completion] = field(default_factory=list)
    finished: bool = False
    reward: float | None = None
    info: dict[str, str] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.completions)

    @property
    def generated_tokens(self) -> int:
        return sum(int(c.token_ids.size) for c in self.completions)


@dataclass(slots=True)
class _Entry:
    trajectory: Trajectory
    touched: float  # monotonic time of the last activity
    tokens: int = 0


class TrajectoryStore:
    """Bounded, thread-safe store of sessions (see the module docstring).

    Args:
        max_sessions: sessions held at most, open and finished together.
        max_tokens: tokens (prompt + generated, over every record) held at most.
        ttl_s: a session idle longer than this is dropped.
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(
        self,
        *,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        bad = [
            f"{k}={v}"
            for k, v in (
                ("max_sessions", max_sessions),
                ("max_tokens", max_tokens),
                ("ttl_s", ttl_s),
            )
            if not v > 0
        ]
        if bad:
            raise ValueError(f"trajectory store bounds must be > 0: {', '.join(bad)}")
        self.max_sessions = max_sessions
        self.max_tokens = max_tokens
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        # Ordered by last activity (open) and by finish time (finished): eviction and
        # expiry take from the front.
        self._open: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self._finished: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self._tokens = 0
        self._counts = collections.Counter[str]()

    # ------------------------------------------------------------------ writes

    def record(self, session_id: str, completion: Completion) -> None:
        """Append ``completion`` to the session (created on first use).

        Raises:
            FailedPrecondition: the session was finished already (code ``SESSION_FINISHED``).
        """
        now = self._clock()
        with self._lock:
            self._expire(now)
            if session_id in self._finished:
                raise FailedPrecondition(
                    f"session {session_id!r} is finished: start a new session for more turns",
                    field="session_id",
                    value=session_id,
                    code="SESSION_FINISHED",
                )
            entry = self._open.pop(session_id, None)
            if entry is None:
                entry = _Entry(Trajectory(session_id), now)
            entry.trajectory.completions.append(completion)
            entry.tokens += completion.tokens
            entry.touched = now
            self._tokens += completion.tokens
            self._open[session_id] = entry
            self._counts["completions"] += 1
            if entry.tokens > self.max_tokens:
                self._drop(self._open, session_id, "oversized")
                logger.warning(
                    "trajectory store: session %r holds %d tokens, over the store's %d: dropped",
                    session_id,
                    entry.tokens,
                    self.max_tokens,
                )
                return
            self._evict(keep=session_id)

    def finish(
        self, session_id: str, reward: float | None = None, info: Mapping[str, str] | None = None
    ) -> Trajectory:
        """Mark the session finished, with the agent's reward (None: to be scored).

        Returns a snapshot of it. Raises:
            NotFound: no such session (never used, popped, expired or evicted).
            FailedPrecondition: it was finished already (code ``SESSION_FINISHED``).
        """
        now = self._clock()
        with self._lock:
            self._expire(now)
            if session_id in self._finished:
                raise FailedPrecondition(
                    f"session {session_id!r} was finished already",
                    field="session_id",
                    value=session_id,
                    code="SESSION_FINISHED",
                )
            entry = self._open.pop(session_id, None)
            if entry is None:
                raise NotFound(
                    f"no session {session_id!r} on this replica (never used, already taken, "
                    "expired or evicted)",
                    field="session_id",
                    value=session_id,
                )
            t = entry.trajectory
            t.finished = True
            t.reward = None if reward is None else float(reward)
            t.info = dict(info or {})
            entry.touched = now
            self._finished[session_id] = entry
            self._counts["finished"] += 1
            return _snapshot(t)

    # ------------------------------------------------------------------ reads

    def get(self, session_ids: Iterable[str]) -> list[Trajectory]:
        """Snapshots of the named sessions that exist (open or finished), in the order asked."""
        with self._lock:
            self._expire(self._clock())
            out = []
            for sid in session_ids:
                entry = self._open.get(sid) or self._finished.get(sid)
                if entry is not None:
                    out.append(_snapshot(entry.trajectory))
            return out

    def state(self, session_id: str) -> str | None:
        """``"open"``, ``"finished"`` (waiting for the driver), or None (not held)."""
        with self._lock:
            self._expire(self._clock())
            if session_id in self._open:
                return "open"
            return "finished" if session_id in self._finished else None

    def pop_finished(self, max_sessions: int, max_tokens: int | None = None) -> list[Trajectory]:
        """Take up to ``max_sessions`` finished sessions, the oldest finished first, and
        at most ``max_tokens`` tokens of them (at least one session when any is
        finished); they leave the store."""
        if max_sessions < 1:
            raise InvalidArgument(
                f"max_sessions must be >= 1, got {max_sessions}",
                field="max_sessions",
                value=max_sessions,
            )
        with self._lock:
            self._expire(self._clock())
            out: list[Trajectory] = []
            budget = max_tokens if max_tokens is not None else self.max_tokens
            while self._finished and len(out) < max_sessions:
                sid, entry = next(iter(self._finished.items()))
                if out and entry.tokens > budget:
                    break
                del self._finished[sid]
                self._tokens -= entry.tokens
                budget -= entry.tokens
                out.append(entry.trajectory)
            self._counts["popped"] += len(out)
            return out

    def put_back(self, trajectories: Sequence[Trajectory]) -> None:
        """Sessions :meth:`pop_finished` handed out that the caller could not deliver
        (an answer too large): they wait again, first in line, in the order given."""
        with self._lock:
            now = self._clock()
            for t in reversed(trajectories):
                if t.session_id in self._finished or t.session_id in self._open:
                    continue  # the id was used again meanwhile: the newer session stays
                self._finished[t.session_id] = _Entry(t, now, t.tokens)
                self._finished.move_to_end(t.session_id, last=False)
                self._tokens += t.tokens
                self._counts["popped"] -= 1

    def stats(self) -> dict[str, int]:
        """Sessions open and finished, tokens held, and the counters (``completions``,
        ``finished``, ``popped``, ``evicted_open``, ``evicted_finished``, ``expired``,
        ``oversized``)."""
        with self._lock:
            self._expire(self._clock())
            out = {
                "open": len(self._open),
                "finished_waiting": len(self._finished),
                "tokens": self._tokens,
            }
            for k in (
                "completions",
                "finished",
                "popped",
                "evicted_open",
                "evicted_finished",
                "expired",
                "oversized",
            ):
                out[k] = self._counts[k]
            return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._open) + len(self._finished)

    # ------------------------------------------------------------------ bounds

    def _drop(self, table: collections.OrderedDict[str, _Entry], sid: str, why: str) -> None:
        entry = table.pop(sid)
        self._tokens -= entry.tokens
        self._counts[why] += 1

    def _expire(self, now: float) -> None:
        for table in (self._open, self._finished):
            while table:
                sid, entry = next(iter(table.items()))
                if now - entry.touched <= self.ttl_s:
                    break
                self._drop(table, sid, "expired")

    def _evict(self, keep: str) -> None:
        """Bring sessions and tokens within bounds, never evicting ``keep``."""

        def over() -> bool:
            sessions = len(self._open) + len(self._finished)
            return sessions > self.max_sessions or self._tokens > self.max_tokens

        while over():
            victim = next((s for s in self._open if s != keep), None)
            if victim is not None:
                self._drop(self._open, victim, "evicted_open")
                continue
            if not self._finished:
                break  # only `keep` is left, and it fits (checked by the caller)
            victim = next(iter(self._finished))
            logger.warning(
                "trajectory store full: evicting finished session %r before the driver took it",
                victim,
            )
            self._drop(self._finished, victim, "evicted_finished")


def _snapshot(t: Trajectory) -> Trajectory:
    """A copy the caller may keep (completions are immutable; the list is not)."""
    return Trajectory(t.session_id, list(t.completions), t.finished, t.reward, dict(t.info))
