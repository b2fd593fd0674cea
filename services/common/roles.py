"""Roles: the one vocabulary every package uses.

Three kinds of names, and how they meet:

* **model roles** (:data:`Role`): ``actor``, ``critic``, ``ref``, ``rollout``,
  ``reward_model``: what the config's ``mapping`` places on resource pools;
* **services** (:data:`Service`): ``trainer``, ``rollout``, ``reward``, ``scheduler``:
  the processes that serve them (:data:`SERVICE_OF`) and register with the scheduler;
* **verl's role names** (:class:`VerlRole`): ``Actor``, ``ActorRolloutRef``, ...: the
  keys of verl's ``role_worker_mapping``; the combined ones name colocation.

Credentials add the callers that are not services (``driver``, ``observer``, ``agent``)
and the tools service (``tools``, which serves no model role): :data:`PRINCIPALS`. Placement is *colocated* when the actor and the rollout share a
pool (:func:`is_colocated`), and only then.

Nothing here imports anything heavy.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Literal

__all__ = [
    "PRINCIPALS",
    "ROLES",
    "SERVICES",
    "SERVICE_OF",
    "PlacementMode",
    "Role",
    "Service",
    "VerlRole",
    "is_colocated",
    "placement_of",
]

Role = Literal["actor", "critic", "ref", "rollout", "reward_model"]
ROLES: tuple[Role, ...] = ("actor", "critic", "ref", "rollout", "reward_model")

Service = Literal["rollout", "reward", "trainer", "scheduler"]
SERVICES: tuple[Service, ...] = ("rollout", "reward", "trainer", "scheduler")

#: The service that serves each model role.
SERVICE_OF: dict[Role, Service] = {
    "actor": "trainer",
    "critic": "trainer",
    "ref": "trainer",
    "rollout": "rollout",
    "reward_model": "reward",
}

#: Who holds a credential: every service, plus the driver, read-only observers, and
#: external agents (the rollout replicas' OpenAI-compatible endpoint and their own
#: trajectories, nothing else); the tools service of multi-turn rollouts is one.
PRINCIPALS: tuple[str, ...] = (
    "driver",
    "trainer",
    "rollout",
    "reward",
    "scheduler",
    "observer",
    "tools",
    "agent",
)

PlacementMode = Literal["colocated", "disaggregated"]


class VerlRole(enum.StrEnum):
    """verl's roles (``verl.trainer.ppo.ray_trainer.Role``) and the model roles each
    one names; a member's value is the model role's name where there is one, so a
    ``role_worker_mapping`` may use either."""

    Actor = "actor"
    Rollout = "rollout"
    ActorRollout = "actor_rollout"
    Critic = "critic"
    RefPolicy = "ref"
    RewardModel = "reward_model"
    ActorRolloutRef = "actor_rollout_ref"

    @property
    def roles(self) -> tuple[Role, ...]:
        return _VERL_ROLES[self]

    @property
    def combined(self) -> bool:
        """Names the actor and the rollout together: colocated placement."""
        return "actor" in self.roles and "rollout" in self.roles


_VERL_ROLES: dict[str, tuple[Role, ...]] = {
    "actor": ("actor",),
    "rollout": ("rollout",),
    "actor_rollout": ("actor", "rollout"),
    "critic": ("critic",),
    "ref": ("ref",),
    "reward_model": ("reward_model",),
    "actor_rollout_ref": ("actor", "rollout", "ref"),
}


def is_colocated(role_pool: Mapping[str, str | None]) -> bool:
    """Whether the actor and the rollout share a pool (model role -> pool name)."""
    actor = role_pool.get("actor")
    return actor is not None and actor == role_pool.get("rollout")


def placement_of(role_pool: Mapping[str, str | None]) -> PlacementMode:
    return "colocated" if is_colocated(role_pool) else "disaggregated"
