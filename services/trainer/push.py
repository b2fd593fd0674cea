"""The trainer's weight push to rollout replicas: which replicas may receive the
model, and the push itself over the best transport each can take.

Both the servicer (``PushWeights``) and the in-process client call
:func:`push_to_targets`; the protobuf form of its :class:`PushOutcome` is in
:mod:`rlfleet.trainer.serde`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlfleet.common.errors import InvalidArgument
from rlfleet.common.rpc import is_loopback
from rlfleet.trainer.models import torch_dtype
from rlfleet.weightsync import wire
from rlfleet.weightsync.sender import DEFAULT_BUCKET_BYTES, push_weights

__all__ = ["PushOutcome", "check_push_targets", "push_to_targets", "refused_push_targets"]


@dataclass(frozen=True)
class PushOutcome:
    """What a push did, per replica (keyed by replica id, in the targets' order)."""

    version: int
    bytes: int
    ok: dict[str, bool] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    transports: dict[str, str] = field(default_factory=dict)  # replica -> grpc | tcp | shm
    seconds: dict[str, float] = field(default_factory=dict)  # replica -> its push's seconds


def check_push_targets(targets: Sequence[tuple[str, str]]) -> None:
    """Each target ``(replica id, address)``: an address ``host:port`` (port 1-65535,
    nothing a resolver would cut or wrap) and a replica id no other target has (the
    outcome is keyed by it).

    Raises:
        InvalidArgument: naming ``targets[i].address`` or ``targets[i].replica_id``.
    """
    if not targets:
        raise InvalidArgument("no rollout targets to push to", field="targets")
    seen: dict[str, int] = {}
    for i, (rid, address) in enumerate(targets):
        host, sep, port = address.rpartition(":")
        if (
            not sep
            or not host.strip("[]")
            or not port.isdigit()
            or not 0 < int(port) < 65536
            or not address.isprintable()
            or any(c.isspace() for c in address)
        ):
            raise InvalidArgument(
                f"target {i} needs an address host:port (port 1-65535)",
                field=f"targets[{i}].address",
                value=address,
            )
        if rid in seen:
            raise InvalidArgument(
                f"targets {seen[rid]} and {i} have the same replica id",
                field=f"targets[{i}].replica_id",
                value=rid,
            )
        seen[rid] = i


def refused_push_targets(
    addresses: Sequence[str], allowed: Collection[str], *, registry: bool
) -> dict[int, str]:
    """The targets the model must not be sent to: index -> why.

    With a registry (``registry=True``), ``allowed`` are the addresses of the alive
    rollout replicas registered with the scheduler (each registered with a rollout
    credential, on its own host); otherwise ``allowed`` are the configured replica
    addresses, and loopback addresses are accepted too.
    """
    known = set(allowed)
    where = "registered with the scheduler" if registry else "configured (services.rollout)"
    refused = {}
    for i, address in enumerate(addresses):
        if address in known or (not registry and is_loopback(address.rpartition(":")[0])):
            continue
        refused[i] = (
            f"{address} is not a rollout replica {where}: weights go only to known replicas"
        )
    return refused


def push_to_targets(
    core: Any,
    targets: Sequence[tuple[str, str]],
    *,
    version: int = 0,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    transports: Sequence[str] = (),
    timeout_s: float = 600.0,
) -> PushOutcome:
    """Push the actor's weights (in the rollout's dtype) to ``targets`` (replica id,
    address) with :func:`rlfleet.weightsync.sender.push_weights`, each replica over
    the first of ``transports`` (names, preference order) it can take; empty is the
    trainer's ``rollout.weight_transport`` (default ``auto``, the best available:
    shared memory on the replica's host, else TCP, else the gRPC stream,
    :data:`rlfleet.weightsync.wire.AUTO`). ``timeout_s`` bounds each replica's calls
    and socket waits (the caller's deadline, for a push over gRPC: a replica that
    stalls cannot hold the trainer past it)."""
    check_push_targets(targets)
    names = (
        wire.transport_names(wire.transport_codes(transports))
        if transports
        else list(wire.transports_for(core.config.rollout.weight_transport))
    )
    version = version or core.weight_version
    dtype = torch_dtype(core.config.rollout.dtype)
    summary = push_weights(
        core.iter_weights(dtype), list(targets), version, bucket_bytes=bucket_bytes,
        transports=names, timeout_s=timeout_s,
    )  # fmt: skip
    return PushOutcome(
        version=version,
        bytes=summary.bytes,
        ok={r.replica_id: r.ok for r in summary.results},
        errors={r.replica_id: r.error for r in summary.results if r.error},
        transports={r.replica_id: r.transport for r in summary.results if r.ok},
        seconds={r.replica_id: r.seconds for r in summary.results if r.ok},
    )
