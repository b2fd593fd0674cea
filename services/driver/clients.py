"""Roles, resource pools and the clients that serve them: what ``PPOTrainer`` talks to.

verl's seed wires a trainer like this::

    role_worker_mapping = {Role.ActorRolloutRef: ..., Role.Critic: ..., Role.RewardModel: ...}
    resource_pool_manager = ResourcePoolManager(resource_pool_spec=spec, mapping=mapping)
    trainer = PPOTrainer(config=config, tokenizer=tokenizer,
                         role_worker_mapping=role_worker_mapping,
                         resource_pool_manager=resource_pool_manager,
                         reward_fn=reward_fn, val_reward_fn=val_reward_fn)
    trainer.init_workers()
    trainer.fit()

In rlfleet every role is a service, so a *worker spec* in ``role_worker_mapping`` says
how to reach the service of that role. A spec is one of:

* an address ``"host:port"`` -- a running service; the remote client is built;
* for the rollout roles, a list of addresses (one per replica);
* a client object (``TrainerClient``, ``RolloutClient``, reward client), used as is;
* a factory: any callable ``factory(config) -> client`` (for rollout it may return a
  list of :class:`RolloutReplica`); :func:`in_process_workers` returns factories
  that build every role in this process (tests, the demo, ``rlfleet train
  --in-process``).

Actor, critic and reference policy are served by one trainer service, so
``Role.Actor``, ``Role.Critic``, ``Role.RefPolicy``, ``Role.ActorRollout`` and
``Role.ActorRolloutRef`` all name the trainer (the combined roles also name the
rollout: colocated placement); specs given for several of them must be the same.
:class:`ResourcePoolManager` records the pools and which pool each role uses; the
driver reads from it only whether placement is colocated (actor and rollout on one
pool: the rollout engine sleeps while the trainer works).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlfleet.common.roles import PlacementMode, VerlRole, placement_of
from rlfleet.common.roles import VerlRole as Role  # verl's name for its role enum

if TYPE_CHECKING:
    from rlfleet.common.config import Config
    from rlfleet.reward.client import RewardClient
    from rlfleet.rollout.client import RolloutClient
    from rlfleet.trainer.client import TrainerClient

__all__ = [
    "ResourcePoolManager",
    "Role",
    "RolloutReplica",
    "Workers",
    "in_process_workers",
    "remote_workers",
    "resolve_workers",
]

logger = logging.getLogger(__name__)


_COMBINED = frozenset(str(r) for r in VerlRole if r.combined)
_TRAINER_ROLES = (Role.ActorRolloutRef, Role.ActorRollout, Role.Actor, Role.Critic, Role.RefPolicy)
_ROLLOUT_ROLES = (Role.Rollout, Role.ActorRollout, Role.ActorRolloutRef)


@dataclass
class ResourcePoolManager:
    """Pools (name -> devices per node) and the pool of each role (verl's class).

    ``mapping`` keys may be :class:`Role` members or the config's role names
    (``actor``, ``critic``, ``ref``, ``rollout``, ``reward_model``).
    """

    resource_pool_spec: dict[str, list[int]]
    mapping: dict[Any, str] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: Config) -> ResourcePoolManager:
        placement = config.placement()
        return cls(
            {k: list(v) for k, v in config.resource_pools.items()}, dict(placement.role_pool)
        )

    def pool_of(self, role: Role | str) -> str | None:
        name = str(role)
        for key, pool in self.mapping.items():
            if str(key) == name:
                return pool
        if name in (Role.ActorRollout, Role.ActorRolloutRef):
            return self.pool_of(Role.Actor)
        return None

    @property
    def placement(self) -> PlacementMode:
        """Colocated when the actor and the rollout share a pool (or a combined role is used)."""
        combined = any(str(k) in _COMBINED for k in self.mapping)
        pools = {r: self.pool_of(r) for r in ("actor", "rollout")}
        return "colocated" if combined else placement_of(pools)

    def total_devices(self, pool: str) -> int:
        return sum(self.resource_pool_spec.get(pool, []))


@dataclass
class RolloutReplica:
    """One rollout replica: its client, and its address when it is a service (the
    trainer pushes weights to addresses)."""

    replica_id: str
    client: RolloutClient
    address: str | None = None

    def close(self) -> None:
        self.client.close()


@dataclass
class Workers:
    """The resolved clients of a run."""

    trainer: TrainerClient
    rollouts: list[RolloutReplica]
    reward: RewardClient | None
    owned: list[Any] = field(default_factory=list)

    def close(self) -> None:
        for obj in reversed(self.owned):
            close = getattr(obj, "close", None) or getattr(obj, "shutdown", None)
            if close is None:
                continue
            try:
                close()
            except Exception:
                logger.exception("closing %s failed", type(obj).__name__)
        self.owned.clear()


WorkerSpec = Any


def _lookup(mapping: Mapping[Any, WorkerSpec], roles: Sequence[Role]) -> WorkerSpec | None:
    found: list[tuple[Role, WorkerSpec]] = []
    for role in roles:
        for key, spec in mapping.items():
            if str(key) == str(role):
                found.append((role, spec))
    specs = [s for _, s in found]
    if not specs:
        return None
    first = specs[0]
    for role, spec in found[1:]:
        if spec is not first and spec != first:
            raise ValueError(
                f"role_worker_mapping: {role} and {found[0][0]} are served by one trainer "
                f"service but name different workers ({spec!r} vs {first!r})"
            )
    return first


def _is_factory(spec: Any, client_method: str) -> bool:
    return callable(spec) and not hasattr(spec, client_method)


def _trainer(spec: WorkerSpec, config: Config, owned: list[Any]) -> TrainerClient:
    if isinstance(spec, str):
        from rlfleet.trainer.client import RemoteTrainerClient

        client: Any = RemoteTrainerClient(spec)
        owned.append(client)
        return client
    if _is_factory(spec, "train_step"):
        client = spec(config)
        owned.append(client)
        return client
    return spec


def _rollouts(spec: WorkerSpec, config: Config, owned: list[Any]) -> list[RolloutReplica]:
    from rlfleet.rollout.client import RemoteRolloutClient

    if _is_factory(spec, "generate"):
        made = spec(config)
        items = made if isinstance(made, list | tuple) else [made]
        owned.extend(items)
        spec = items
    items = spec if isinstance(spec, list | tuple) else [spec]
    out: list[RolloutReplica] = []
    for i, item in enumerate(items):
        if isinstance(item, RolloutReplica):
            out.append(item)
        elif isinstance(item, str):
            client = RemoteRolloutClient(item)
            owned.append(client)
            out.append(RolloutReplica(f"rollout-{i}", client, item))
        else:
            out.append(RolloutReplica(f"rollout-{i}", item, getattr(item, "address", None)))
    if not out:
        raise ValueError("role_worker_mapping: no rollout replica")
    return out


def _reward(spec: WorkerSpec, config: Config, owned: list[Any]) -> RewardClient:
    if isinstance(spec, str):
        from rlfleet.reward.client import RemoteRewardClient

        # One connection per process of the service (as its GetInfo reports), so that
        # a step's batch is scored by all of a `--processes N` service.
        client: Any = RemoteRewardClient(spec, connections=0)
        owned.append(client)
        return client
    if _is_factory(spec, "score"):
        client = spec(config)
        owned.append(client)
        return client
    return spec


def resolve_workers(role_worker_mapping: Mapping[Any, WorkerSpec], config: Config) -> Workers:
    """Build (or take) the client of every role in ``role_worker_mapping``."""
    owned: list[Any] = []
    try:
        trainer_spec = _lookup(role_worker_mapping, _TRAINER_ROLES)
        if trainer_spec is None:
            raise ValueError(
                "role_worker_mapping names no trainer (Role.Actor / ActorRollout / ActorRolloutRef)"
            )
        rollout_spec = _lookup(role_worker_mapping, (Role.Rollout,))
        if rollout_spec is None:
            rollout_spec = _lookup(role_worker_mapping, _ROLLOUT_ROLES)
        if rollout_spec is None:
            raise ValueError("role_worker_mapping names no rollout (Role.Rollout)")
        reward_spec = _lookup(role_worker_mapping, (Role.RewardModel,))
        trainer = _trainer(trainer_spec, config, owned)
        rollouts = _rollouts(rollout_spec, config, owned)
        reward = _reward(reward_spec, config, owned) if reward_spec is not None else None
    except BaseException:
        for obj in owned:
            close = getattr(obj, "close", None)
            if close is not None:
                close()
        raise
    return Workers(trainer, rollouts, reward, owned)


# ------------------------------------------------------------------ ready-made mappings


def _in_process_trainer(config: Config) -> TrainerClient:
    from rlfleet.trainer.client import InProcessTrainerClient
    from rlfleet.trainer.core import TrainerCore

    return InProcessTrainerClient(TrainerCore(config))


def _in_process_rollouts(config: Config) -> list[RolloutReplica]:
    from rlfleet.rollout.core import RolloutCore
    from rlfleet.rollout.engine import GenerateLimits
    from rlfleet.rollout.hf_engine import HFEngine

    path = config.rollout.model_path or config.actor.model_path
    device = "cuda" if config.trainer.device == "cuda" else "cpu"
    out = []
    for i in range(config.rollout_replicas()):
        engine = HFEngine(
            path,
            dtype=config.rollout.dtype,
            device=device,
            trust_remote_code=config.actor.trust_remote_code,
            max_num_batched_tokens=config.rollout.max_num_batched_tokens,
            partial_rollout=config.trainer.pipeline.enable
            and config.trainer.pipeline.partial_rollout,
        )
        core = RolloutCore(
            engine,
            replica_id=f"rollout-{i}",
            multi_turn=_in_process_multi_turn(config, path),
            limits=GenerateLimits().covering(config),
        )
        out.append(RolloutReplica(core.replica_id, _ClosingRollout(core)))
    return out


def _in_process_multi_turn(config: Config, model_path: str | None) -> Any:
    """Multi-turn rollouts in this process: the run's tools service too (a tool source
    of kind ``service`` without ``services.tools`` gets a tool core of its own here)."""
    if not config.rollout.multi_turn.enable:
        return None
    from transformers import AutoTokenizer

    from rlfleet.rollout.multiturn import multi_turn_from_config
    from rlfleet.tools.builtin import tool_core_from_config
    from rlfleet.tools.client import InProcessToolClient

    service = None
    wants = any(t.kind == "service" for t in config.rollout.multi_turn.tools)
    if wants and config.services.tools is None:
        service = InProcessToolClient(tool_core_from_config(config.tools), own=True)
    tok = AutoTokenizer.from_pretrained(
        config.actor.tokenizer_path or model_path, local_files_only=True
    )
    return multi_turn_from_config(config, tok, service=service)


class _ClosingRollout:
    """An in-process rollout client that also closes its core."""

    def __init__(self, core: Any) -> None:
        from rlfleet.rollout.client import InProcessRolloutClient

        self.core = core
        self._client = InProcessRolloutClient(core)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def close(self) -> None:
        self.core.close()


def _in_process_reward(config: Config) -> RewardClient:
    from rlfleet.reward.client import InProcessRewardClient
    from rlfleet.reward.core import RewardManager

    # Inline scoring: rule scorers are microseconds per sample, and worker
    # processes would compete for the same cores as the models.
    return InProcessRewardClient(RewardManager(config.reward, num_workers=0))


def in_process_workers(config: Config | None = None) -> dict[Role, Callable[[Config], Any]]:
    """Factories that build every role in this process (no sockets)."""
    return {
        Role.ActorRolloutRef: _in_process_trainer,
        Role.Critic: _in_process_trainer,
        Role.Rollout: _in_process_rollouts,
        Role.RewardModel: _in_process_reward,
    }


def remote_workers(
    trainer: str, rollout: Sequence[str], reward: str | None = None
) -> dict[Role, Any]:
    """Specs for services already running at these addresses."""
    out: dict[Role, Any] = {Role.ActorRolloutRef: trainer, Role.Rollout: list(rollout)}
    if reward is not None:
        out[Role.RewardModel] = reward
    return out
