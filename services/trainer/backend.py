"""The plug point between the PPO logic and a parallel training engine.

A :class:`Backend` owns the models of one rank (actor, critic, reference), their
optimizers and lr schedulers, and the collectives of its process group. The PPO logic
(:mod:`rlfleet.trainer.worker`, :mod:`rlfleet.trainer.core`) only ever calls these
methods, so FSDP2 (:mod:`rlfleet.trainer.fsdp`) and Megatron-core
(:mod:`rlfleet.trainer.megatron`) are interchangeable.

Forward and backward take a list of micro-batches at once, not one micro-batch, because
a pipeline-parallel engine schedules them itself (1F1B); a data-parallel engine just
loops. ``loss_fn(outputs, micro_batch) -> (loss, metrics)`` is called once per
micro-batch with the model outputs of that micro-batch: ``{"log_prob", "entropy"}`` for
the actor and the reference (``entropy`` only when asked), ``{"values"}`` for the critic,
each ``(mb, R)`` fp32.

Every method is collective: all ranks of the backend's group call it, in the same order,
with their own micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import torch

__all__ = ["Backend", "LossFn", "Metrics", "ModelRole", "Outputs"]

ModelRole = Literal["actor", "critic", "ref"]
Outputs = dict[str, torch.Tensor]
#: What a loss function reports for its micro-batch: numbers, or 0-dim tensors on the
#: device (read back once per update, not once per micro-batch).
Metrics = dict[str, float | torch.Tensor]
LossFn = Callable[[Outputs, dict[str, Any]], tuple[torch.Tensor, Metrics]]


@runtime_checkable
class Backend(Protocol):
    """What a training engine provides to the PPO logic (see the module docstring)."""

    name: str
    rank: int
    world_size: int  # the data-parallel size: how many ways a mini-batch is split
    device: torch.device

    def has(self, role: ModelRole) -> bool:
        """Whether this backend holds the model of ``role``."""
        ...

    def data_layout(self) -> list[tuple[int, bool]]:
        """For each global rank, in rank order: its data-parallel rank, and whether
        its results count (one rank per data-parallel replica reports; the others of
        that replica are its tensor / pipeline parallel peers)."""
        ...

    def forward(
        self,
        role: ModelRole,
        micro_batches: Sequence[dict[str, Any]],
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> list[Outputs]:
        """No-grad forward of each micro-batch (eval mode); outputs on CPU."""
        ...

    def forward_backward(
        self,
        role: ModelRole,
        micro_batches: Sequence[dict[str, Any]],
        loss_fn: LossFn,
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> list[Metrics]:
        """Forward, ``loss_fn`` and backward of each micro-batch (gradients accumulate);
        returns the metrics ``loss_fn`` gave for each."""
        ...

    def optimizer_step(self, role: ModelRole) -> tuple[float, bool]:
        """Clip the global gradient norm, step and zero the gradients.

        Returns ``(grad_norm, stepped)``: a non-finite norm skips the step.
        """
        ...

    def scheduler_step(self, role: ModelRole) -> None:
        """Advance the lr schedule of ``role`` by one training step."""
        ...

    def lr(self, role: ModelRole) -> float:
        """The current learning rate of ``role``."""
        ...

    def set_lr_scale(self, role: ModelRole, scale: float) -> None:
        """From now on the schedule of ``role`` multiplies its configured lr times
        ``scale`` (see :func:`rlfleet.trainer.fsdp.set_base_lr`)."""
        ...

    def set_total_steps(self, total: int) -> None:
        """The run's total training steps for every lr schedule (warm-up ratio and
        decay; see :func:`rlfleet.trainer.fsdp.set_schedule_total`)."""
        ...

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel group (identity on one rank)."""
        ...

    def iter_full_params(
        self, role: ModelRole = "actor", dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter, gathered whole, in Hugging Face names, one at a time (at most
        one gathered parameter alive per call of ``next``). Only rank 0's tensors are
        meaningful; other ranks take part in the gathers."""
        ...

    def iter_adapter_params(
        self, dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """A LoRA actor's weight push: its adapters only, named and scaled as
        :mod:`rlfleet.weightsync.lora` says, one tensor at a time (collective like
        :meth:`iter_full_params`, which with LoRA yields the merged model). A backend
        or an actor without LoRA raises ``ValueError``."""
        ...

    def state_dict(self, role: ModelRole) -> dict[str, Any]:
        """Full (unsharded, CPU) model, optimizer and scheduler state of ``role``,
        complete on rank 0."""
        ...

    def load_state_dict(self, role: ModelRole, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (every rank passes the full state)."""
        ...

    def export_hf(self, role: ModelRole, path: str) -> None:
        """Write ``role``'s model as a Hugging Face folder (rank 0 writes)."""
        ...
