"""External rollouts (``trainer.rollout_source: external``): train on what agents ran.

An agent drives the rollout replicas through their OpenAI-compatible endpoints
(:mod:`rlfleet.rollout.openai_api`); each replica records every completion of a
session exactly (prompt ids, sampled ids, log-probs, weight version). When the agent
posts a session's reward (or finishes it for the reward function to score), the
session is ready; the driver takes ready sessions from the replicas
(``PopTrajectories``) instead of generating, ``trainer.external.batch_size`` per step,
and builds the trainer's batch from the recorded tokens:

* a session whose completions *chain* (each prompt starts with the previous prompt
  and its completion: a multi-turn conversation re-rendered by the same template)
  is one row: the first prompt, then everything after it as the response, with the
  loss mask (``response_mask``) on the model's sampled tokens only, so user turns and
  tool results in between are context, not trained on;
* a session whose completions do not chain (``n > 1``, or a re-rendering that changed
  earlier tokens) gives one row per completion;
* every row of a session gets the session's reward (on its last model token), and
  ``uid`` = the session's ``group`` (sessions of one task, for GRPO / RLOO), else its id;
* ``old_log_probs`` are the recorded log-probs (``trainer.external.use_rollout_log_probs``)
  when every completion was sampled at the trainer's temperature; else the trainer
  recomputes them.

A session with a completion more than ``trainer.external.max_staleness`` weight
versions behind the policy is dropped (``external/stale_dropped``); one finished
without a reward is scored by the run's reward function from its last completion's
prompt and text (``data_source`` / ``ground_truth`` from the agent's finish call);
without a reward function it is dropped (``external/unscored_dropped``).

Sessions are taken at most once: the replica forgets a session as it hands it over,
so a driver that dies between taking and training loses those sessions.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from rlfleet.common.errors import DeadlineExceeded, RlfleetError
from rlfleet.driver.batch import Batch, GeneratedBatch
from rlfleet.driver.reward import reward_error_metrics
from rlfleet.rollout.engine import FinishReason, SampleOutput
from rlfleet.rollout.trajectories import Trajectory, TrajectoryStore

if TYPE_CHECKING:
    from rlfleet.common.config import Config
    from rlfleet.driver.reward import RewardAdapter

__all__ = [
    "ExternalRollouts",
    "InProcessTrajectorySource",
    "RemoteTrajectorySource",
    "Row",
    "TrajectorySource",
    "rows_batch",
    "trajectory_rows",
]

logger = logging.getLogger(__name__)


class TrajectorySource(Protocol):
    """Where finished sessions come from: one rollout replica."""

    name: str

    def pop(self, max_sessions: int) -> list[Trajectory]:
        """Up to ``max_sessions`` finished sessions, taken (the replica forgets them)."""
        ...

    def close(self) -> None: ...


class InProcessTrajectorySource:
    """A replica's store in this process (tests; an embedded replica)."""

    def __init__(self, store: TrajectoryStore, name: str = "in-process") -> None:
        self.store = store
        self.name = name

    def pop(self, max_sessions: int) -> list[Trajectory]:
        return self.store.pop_finished(max_sessions)

    def close(self) -> None:
        pass


class RemoteTrajectorySource:
    """A replica's ``PopTrajectories`` over gRPC (the process's credentials and TLS)."""

    def __init__(self, address: str, *, timeout_s: float = 30.0) -> None:
        from rlfleet.common.rpc import create_channel
        from rlfleet.v1 import rollout_pb2_grpc

        self.name = address
        self._channel = create_channel(address)
        self._stub = rollout_pb2_grpc.RolloutServiceStub(self._channel)
        self._timeout_s = timeout_s

    def pop(self, max_sessions: int) -> list[Trajectory]:
        import grpc

        from rlfleet.common.rpc import to_rlfleet_error
        from rlfleet.rollout import serde
        from rlfleet.v1 import rollout_pb2

        try:
            resp = self._stub.PopTrajectories(
                rollout_pb2.PopTrajectoriesRequest(max_sessions=max_sessions),
                timeout=self._timeout_s,
            )
        except grpc.RpcError as e:
            raise to_rlfleet_error(e) from e
        return [serde.trajectory_from_proto(t) for t in resp.trajectories]

    def close(self) -> None:
        self._channel.close()


# --------------------------------------------------------------------------- rows


@dataclass(frozen=True)
class Row:
    """One trainer row of a session (see the module docstring).

    Attributes:
        prompt_ids: int32 ``[P]``.
        response_ids: int32 ``[R]``: the model's tokens and, between turns, the context
            the agent added.
        loss_mask: int8 ``[R]``: 1 on tokens the model sampled.
        logprobs: float32 ``[R]``: their recorded log-probs (0 where the mask is 0).
        weight_version: the oldest weights any of its tokens was sampled with.
        temperatures: the sampling temperatures of its completions.
        session: the session's index in the step's list.
    """

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    weight_version: int
    temperatures: tuple[float, ...]
    session: int


def _chains(t: Trajectory) -> bool:
    cs = t.completions
    for a, b in itertools.pairwise(cs):
        n = a.prompt_ids.size + a.token_ids.size
        if b.prompt_ids.size < n:
            return False
        if not (
            np.array_equal(b.prompt_ids[: a.prompt_ids.size], a.prompt_ids)
            and np.array_equal(b.prompt_ids[a.prompt_ids.size : n], a.token_ids)
        ):
            return False
    return True


def trajectory_rows(t: Trajectory, session: int = 0) -> list[Row]:
    """The rows of one session (one when its completions chain, else one per completion)."""
    cs = t.completions
    if not cs:
        return []
    if not _chains(t):
        return [
            Row(
                c.prompt_ids,
                c.token_ids,
                np.ones(c.token_ids.size, dtype=np.int8),
                c.logprobs,
                c.weight_version,
                (c.temperature,),
                session,
            )
            for c in cs
        ]
    p0 = cs[0].prompt_ids.size
    last = cs[-1]
    response = np.concatenate([last.prompt_ids[p0:], last.token_ids])
    mask = np.zeros(response.size, dtype=np.int8)
    logprobs = np.zeros(response.size, dtype=np.float32)
    for c in cs:
        lo = c.prompt_ids.size - p0
        hi = lo + c.token_ids.size
        mask[lo:hi] = 1
        logprobs[lo:hi] = c.logprobs
    return [
        Row(
            cs[0].prompt_ids,
            response,
            mask,
            logprobs,
            min(c.weight_version for c in cs),
            tuple(c.temperature for c in cs),
            session,
        )
    ]


def rows_batch(
    rows: Sequence[Row],
    scores: Sequence[float],
    uids: Sequence[str],
    pad_token_id: int,
    *,
    old_log_probs: bool,
) -> Batch:
    """The trainer's batch (verl's layout, as ``trainer_batch`` builds it): prompts
    left-padded, responses right-padded; ``response_mask`` is each row's loss mask;
    ``scores`` ``[B]``; ``uid``; ``old_log_probs`` ``[B, R]`` when asked."""
    b = len(rows)
    p = max(1, max(r.prompt_ids.size for r in rows))
    r_len = max(1, max(r.response_ids.size for r in rows))
    ids = np.full((b, p + r_len), pad_token_id, dtype=np.int64)
    attn = np.zeros((b, p + r_len), dtype=np.int64)
    mask = np.zeros((b, r_len), dtype=np.int64)
    lps = np.zeros((b, r_len), dtype=np.float32)
    for i, row in enumerate(rows):  # one copy per row, not per token
        np_, nr = row.prompt_ids.size, row.response_ids.size
        ids[i, p - np_ : p] = row.prompt_ids
        ids[i, p : p + nr] = row.response_ids
        attn[i, p - np_ : p + nr] = 1
        mask[i, :nr] = row.loss_mask
        lps[i, :nr] = row.logprobs
    out: Batch = {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": torch.from_numpy(attn),
        "responses": torch.from_numpy(ids[:, p:].copy()),
        "response_mask": torch.from_numpy(mask),
        "scores": torch.tensor(list(scores), dtype=torch.float32),
        "uid": list(uids),
    }
    if old_log_probs:
        out["old_log_probs"] = torch.from_numpy(lps)
    return out


def _effective_temperature(t: float) -> float:
    """The temperature a log-prob was taken at (greedy: the raw log-softmax, T = 1)."""
    return float(t) if t > 0 else 1.0


# --------------------------------------------------------------------------- the source


class ExternalRollouts:
    """Takes finished sessions from the replicas and turns them into a step's batch.

    Args:
        sources: one per rollout replica.
        config: the run config (``trainer.external``, ``rollout.temperature``,
            ``data.reward_fn_key``).
        pad_token_id: the policy tokenizer's pad id.
        reward: scores sessions finished without a reward; None: they are dropped.
    """

    def __init__(
        self,
        sources: Sequence[TrajectorySource],
        config: Config,
        pad_token_id: int,
        reward: RewardAdapter | None = None,
    ) -> None:
        if not sources:
            raise ValueError(
                "trainer.rollout_source external: no source of sessions (no rollout replica "
                "with an address; in process, pass trajectory_sources=[...])"
            )
        self.sources = list(sources)
        self.config = config
        self.cfg = config.trainer.external
        self.pad_token_id = pad_token_id
        self.reward = reward
        self._carry: list[Trajectory] = []  # taken in a step that then timed out
        self._next = 0  # the source polled first, round-robin

    def close(self) -> None:
        for s in self.sources:
            s.close()

    def _take(self, policy_version: int, stats: dict[str, float]) -> list[Trajectory]:
        want = self.cfg.batch_size
        got, self._carry = self._carry, []
        deadline = time.monotonic() + self.cfg.timeout_s
        while len(got) < want:
            progressed = False
            n = len(self.sources)
            for k in range(n):
                if len(got) >= want:
                    break
                src = self.sources[(self._next + k) % n]
                try:
                    taken = src.pop(want - len(got))
                except RlfleetError as e:
                    if not e.recoverable:
                        raise
                    logger.warning("external rollouts: %s: %s; trying the others", src.name, e)
                    continue
                progressed = progressed or bool(taken)
                for t in taken:
                    if self._stale(t, policy_version):
                        stats["external/stale_dropped"] += 1
                    elif t.completions:
                        got.append(t)
            self._next = (self._next + 1) % n
            if len(got) >= want:
                break
            if time.monotonic() > deadline:
                self._carry = got
                raise DeadlineExceeded(
                    f"trainer.rollout_source external: {len(got)} of {want} finished sessions "
                    f"after {self.cfg.timeout_s:g}s (trainer.external.timeout_s); kept for the "
                    "next try",
                    field="trainer.external.batch_size",
                    value=want,
                )
            if not progressed:
                time.sleep(self.cfg.poll_interval_s)
        self._carry = got[want:]
        return got[:want]

    def _stale(self, t: Trajectory, policy_version: int) -> bool:
        k = self.cfg.max_staleness
        return k is not None and any(policy_version - c.weight_version > k for c in t.completions)

    def _rewards(self, sessions: list[Trajectory], stats: dict[str, float]) -> list[float | None]:
        rewards: list[float | None] = [t.reward for t in sessions]
        todo = [i for i, r in enumerate(rewards) if r is None]
        if not todo:
            return rewards
        if self.reward is None:
            stats["external/unscored_dropped"] += len(todo)
            logger.warning(
                "external rollouts: %d session(s) finished without a reward and the run has no "
                "reward function: dropped",
                len(todo),
            )
            return rewards
        key = self.config.data.reward_fn_key
        last = [sessions[i].completions[-1] for i in todo]
        batch: Batch = {
            "raw_prompt_ids": [c.prompt_ids.tolist() for c in last],
            key: [sessions[i].info.get("data_source", "external") for i in todo],
            "reward_model": [{"ground_truth": sessions[i].info.get("ground_truth")} for i in todo],
            "extra_info": [{"session_id": sessions[i].session_id} for i in todo],
        }
        samples = [
            SampleOutput(j, 0, c.token_ids.tolist(), [], FinishReason.STOP, c.weight_version)
            for j, c in enumerate(last)
        ]
        scores, details = self.reward.score(batch, samples)
        reward_error_metrics(details, self.config.reward.max_error_fraction)
        for i, s in zip(todo, scores, strict=True):
            rewards[i] = float(s)
        stats["external/scored_by_reward_fn"] += len(todo)
        return rewards

    def next_batch(self, step: int, policy_version: int) -> GeneratedBatch:
        """The next ``trainer.external.batch_size`` finished sessions as a step's batch
        (its ``trainer_batch`` set); waits for them up to ``trainer.external.timeout_s``.

        Raises:
            DeadlineExceeded: not enough sessions in time (those taken are kept).
        """
        stats: dict[str, float] = {
            "external/stale_dropped": 0.0,
            "external/oversized_dropped": 0.0,
            "external/unscored_dropped": 0.0,
            "external/scored_by_reward_fn": 0.0,
        }
        t0 = time.perf_counter()
        sessions = self._take(policy_version, stats)
        t_wait = time.perf_counter() - t0
        rewards = self._rewards(sessions, stats)
        t_reward = time.perf_counter() - t0 - t_wait
        rows: list[Row] = []
        scores: list[float] = []
        uids: list[str] = []
        max_rows = self.cfg.max_rows_per_session
        d = self.config.data
        max_tokens = self.cfg.max_tokens_per_row or d.max_prompt_length + d.max_response_length
        for i, (t, reward) in enumerate(zip(sessions, rewards, strict=True)):
            if reward is None:
                continue
            session_rows = trajectory_rows(t, i)
            longest = max(
                (r.prompt_ids.size + r.response_ids.size for r in session_rows), default=0
            )
            if len(session_rows) > max_rows or longest > max_tokens:
                # An agent's session must not blow up the padded batch (rows x longest row).
                logger.warning(
                    "external rollouts: session %r dropped: %d rows (max_rows_per_session %d), "
                    "longest %d tokens (max_tokens_per_row %d)",
                    t.session_id, len(session_rows), max_rows, longest, max_tokens,
                )  # fmt: skip
                stats["external/oversized_dropped"] += 1
                continue
            for row in session_rows:
                rows.append(row)
                scores.append(reward)
                uids.append(t.info.get("group") or f"session:{t.session_id}")
        if not rows:
            raise RuntimeError(
                f"none of the {len(sessions)} sessions taken could be trained on (no reward)"
            )
        want_t = _effective_temperature(self.config.rollout.temperature)
        temps_ok = all(
            abs(_effective_temperature(x) - want_t) <= 1e-6 * max(1.0, want_t)
            for r in rows
            for x in r.temperatures
        )
        finite = all(bool(np.isfinite(r.logprobs).all()) for r in rows)
        use_lp = self.cfg.use_rollout_log_probs and temps_ok and finite
        if self.cfg.use_rollout_log_probs and not use_lp:
            logger.info(
                "external rollouts: recomputing old log-probs (%s)",
                "a completion was sampled at another temperature than rollout.temperature"
                if not temps_ok
                else "a recorded log-prob is not finite",
            )
        batch = rows_batch(rows, scores, uids, self.pad_token_id, old_log_probs=use_lp)
        samples = [
            SampleOutput(
                r.session,
                0,
                r.response_ids[r.loss_mask.astype(bool)].tolist(),
                [],
                FinishReason.STOP,
                r.weight_version,
            )
            for r in rows
        ]
        stats.update(
            {
                "external/sessions": float(len(sessions)),
                "external/rows": float(len(rows)),
                "external/multi_turn_sessions": float(
                    sum(1 for t in sessions if len(t.completions) > 1)
                ),
                "external/rollout_log_probs": 1.0 if use_lp else 0.0,
            }
        )
        return GeneratedBatch(
            step=step,
            prompts={"index": []},
            loader_state={},
            epoch=0,
            samples=samples,
            scores=scores,
            timing={"gen": t_wait, "reward": t_reward},
            min_weight_version=policy_version,
            trainer_batch=batch,
            extra_metrics=stats,
        )


def sources_for(replicas: Sequence[Any]) -> list[TrajectorySource]:
    """A remote source per rollout replica with an address (the driver's replicas)."""
    out: list[TrajectorySource] = []
    for r in replicas:
        if r.address:
            out.append(RemoteTrajectorySource(r.address))
    return out
