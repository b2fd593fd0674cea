"""Rank 0 leads, the other ranks follow: running one operation on every rank.

Under ``torchrun`` with N ranks, rank 0 serves gRPC and owns the
:class:`~rlfleet.trainer.core.TrainerCore`; ranks 1..N-1 sit in :func:`follow`. For each
model operation rank 0 calls :meth:`Dispatcher.run` with one argument per rank (its
rows of the batch): the operation name and arguments go out with
``scatter_object_list``, every rank runs the same :class:`RankOps` method (the
collectives inside FSDP line up because every rank makes the same calls in the same
order), and the results come back to rank 0 with ``gather_object``. ``"stop"`` ends the
followers' loop.

With one rank no process group is needed: :class:`Dispatcher` calls the method directly.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from rlfleet.trainer.backend import Backend, ModelRole
from rlfleet.trainer.worker import Worker

__all__ = ["STOP", "Dispatcher", "RankOps", "follow"]

logger = logging.getLogger(__name__)

STOP = "stop"


class RankOps:
    """The operations any rank can be told to run: :class:`Worker` methods plus the
    collective parts of checkpointing and weight gathering."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.backend: Backend = worker.backend
        self._ops: dict[str, Callable[..., Any]] = {
            "compute_log_prob": worker.compute_log_prob,
            "compute_ref_log_prob": worker.compute_ref_log_prob,
            "compute_values": worker.compute_values,
            "update_actor": worker.update_actor,
            "update_critic": worker.update_critic,
            "sft_step": worker.sft_step,
            "state_dicts": self.state_dicts,
            "load_checkpoint": self.load_checkpoint,
            "drain_full_params": self.drain_full_params,
            "export_hf": self.export_hf,
            "set_lr_scale": self.set_lr_scale,
            "set_total_steps": self.backend.set_total_steps,
        }

    def run(self, op: str, arg: Any, kwargs: dict[str, Any]) -> Any:
        fn = self._ops.get(op)
        if fn is None:
            raise ValueError(f"unknown rank operation {op!r}; known: {sorted(self._ops)}")
        if arg is None:
            return fn(**kwargs)
        return fn(arg, **kwargs)

    def state_dicts(self, roles: Sequence[str]) -> dict[str, Any]:
        """Full states of ``roles`` (complete on rank 0) and this rank's RNG states."""
        import random

        import numpy as np

        out: dict[str, Any] = {role: self.backend.state_dict(role) for role in roles}
        rng: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": np.random.get_state(),
        }
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        out["rng"] = rng
        return out

    def load_checkpoint(self, path: str, roles: list[str], world_size: int) -> None:
        """Load ``roles`` and this rank's RNG state from a checkpoint folder."""
        import random

        import numpy as np

        from rlfleet.trainer.checkpoint import read_rank_state

        rank = dist.get_rank() if dist.is_initialized() else 0
        states, rng = read_rank_state(path, roles, rank, world_size)
        for role, state in states.items():
            self.backend.load_state_dict(role, state)
        if rng is not None:
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])

    def drain_full_params(self, role: str = "actor", adapter: bool = False) -> None:
        """A follower's part of a weight push: take part in every gather (``adapter``:
        a LoRA actor's adapters only)."""
        params = (
            self.backend.iter_adapter_params() if adapter else self.backend.iter_full_params(role)
        )
        for _ in params:
            pass

    def export_hf(self, role: str, path: str) -> None:
        self.backend.export_hf(role, path)

    def set_lr_scale(self, role: ModelRole, scale: float) -> float:
        """The configured lr of ``role`` times ``scale`` from now on; the lr in effect."""
        self.backend.set_lr_scale(role, scale)
        return self.backend.lr(role)


class Dispatcher:
    """Runs an operation on every rank (see the module docstring); used on rank 0."""

    def __init__(self, ops: RankOps) -> None:
        self.ops = ops
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1

    def send(self, op: str, args: Sequence[Any] | None, kwargs: dict[str, Any]) -> Any:
        """Tell every rank to run ``op``; returns rank 0's own argument."""
        per_rank = list(args) if args is not None else [None] * self.world_size
        if len(per_rank) != self.world_size:
            raise ValueError(f"{op}: {len(per_rank)} arguments for {self.world_size} ranks")
        if self.world_size == 1:
            return per_rank[0]
        out: list[Any] = [None]
        try:
            dist.scatter_object_list(out, [(op, a, kwargs) for a in per_rank], src=0)
        except RuntimeError as e:  # torch.distributed's errors (a pickling one is not)
            _group_broken(op, e)
        return out[0][1]

    def gather(self, result: Any) -> list[Any]:
        """Rank 0's result plus every follower's, in rank order."""
        if self.world_size == 1:
            return [result]
        results: list[Any] = [None] * self.world_size
        try:
            dist.gather_object(result, results, dst=0)
        except RuntimeError as e:  # torch.distributed's errors (a pickling one is not)
            _group_broken("gather", e)
        return results

    def run(self, op: str, args: Sequence[Any] | None = None, **kwargs: Any) -> list[Any]:
        """Run ``op`` on every rank with ``args[r]`` (None: no positional argument)."""
        mine = self.send(op, args, kwargs)
        return self.gather(self.ops.run(op, mine, kwargs))

    def stop(self) -> None:
        """Release the followers (on shutdown: one already gone is no error)."""
        if self.world_size == 1:
            return
        try:
            dist.scatter_object_list([None], [(STOP, None, {})] * self.world_size, src=0)
        except RuntimeError as e:
            logger.warning("followers not released (a rank is already gone): %s", e)


GROUP_BROKEN_EXIT = 75


def _group_broken(what: str, error: BaseException) -> NoReturn:
    """A collective of the group failed: a rank is gone (or its link), and no later
    collective can succeed. Rank 0 leaves at once (exit code ``GROUP_BROKEN_EXIT``), so
    the driver sees the trainer gone rather than a trainer that fails every call, and
    the launcher restarts the whole group (``trainer.recovery``)."""
    logger.critical(
        "rank 0: %s failed in the process group (%s: %s): a rank is gone; exiting so "
        "the launcher restarts every rank",
        what,
        type(error).__name__,
        error,
    )
    logging.shutdown()
    os._exit(GROUP_BROKEN_EXIT)


def follow(ops: RankOps) -> None:
    """A follower rank's loop: run what rank 0 sends until it sends ``"stop"``.

    An exception in an operation is logged and returned to rank 0 as its result (so
    rank 0 is not left waiting in the gather); rank 0 raises it.
    """
    while True:
        box: list[Any] = [None]
        dist.scatter_object_list(box, None, src=0)
        op, arg, kwargs = box[0]
        if op == STOP:
            return
        try:
            result = ops.run(op, arg, kwargs)
        except Exception as exc:  # reported to rank 0, which raises it
            logger.exception("rank %d: %s failed", dist.get_rank(), op)
            result = exc
        dist.gather_object(result, None, dst=0)
