"""The typed, validated run configuration: one source of truth for every service.

A run is described by one YAML file plus dotted command-line overrides::

    cfg = load_config("examples/ppo_tiny.yaml", ["actor.lr=1e-6", "rollout.n=4"])
    save_resolved(cfg, cfg.trainer.default_local_dir)  # writes <run dir>/config.yaml

Sections and keys follow verl's names where the concept is the same (``data``,
``actor``, ``critic``, ``ref``, ``rollout``, ``reward``, ``algorithm``, ``trainer``),
plus rlfleet's placement: ``resource_pools``, ``mapping`` and ``services``.

Decisions worth knowing:

* **Batch units are verl's.** ``data.train_batch_size`` and ``*.ppo_mini_batch_size``
  count *prompts*; each prompt yields ``rollout.n`` responses, so a mini-batch holds
  ``ppo_mini_batch_size * rollout.n`` samples. ``*.ppo_micro_batch_size`` and every
  ``log_prob_micro_batch_size`` count *samples per device* (verl's ``..._per_gpu``).
  Hence the checks: ``train_batch_size % ppo_mini_batch_size == 0``, and the
  per-device mini-batch ``ppo_mini_batch_size * n / dp_size`` is a whole number that
  ``ppo_micro_batch_size`` divides.
* **Resource pools** map a pool name to one entry per node. On ``trainer.device:
  cuda`` an entry is the number of GPUs of that node; on ``cpu`` it is the number of
  CPU cores given to the pool on that node, and each role runs one process per node
  (so its data-parallel world size is the number of nodes). A bare integer is
  shorthand for a single node (``rollout_pool: 4`` == ``[4]``).
* **Placement**: actor and rollout on one pool is *colocated* (time-shared devices);
  otherwise *disaggregated*.
* **Derived values** (``None`` in the schema: clip ranges, the critic's and ref's
  model, ``critic.enable``, ``rollout.response_length``, the run directory, ...) are
  filled in once the whole config is valid, so the config saved with a run is a
  complete record and every service can read its own section alone.
* Every error is reported at once, as ``path: message (got value)``, in one
  :class:`ConfigError`. Unknown keys are errors with close matches suggested.

Nothing here imports torch.
"""

from __future__ import annotations

from rlfleet.common.config.checks import run_warnings
from rlfleet.common.config.load import apply_overrides, config_from_dict, load_config, save_resolved
from rlfleet.common.config.schema import (
    GROUP_ESTIMATORS,
    ROLES,
    ActorConfig,
    AlgorithmConfig,
    AutoscaleConfig,
    Config,
    ConfigError,
    ConfigIssue,
    CriticConfig,
    CustomRewardFunction,
    DataConfig,
    FilterGroupsConfig,
    FsdpConfig,
    GuardConfig,
    HealthConfig,
    KLControlConfig,
    KLLossControlConfig,
    MappingConfig,
    MegatronConfig,
    MultiTurnConfig,
    OverlongBufferConfig,
    PipelineConfig,
    Placement,
    PolicyLossConfig,
    RayConfig,
    RecoveryConfig,
    RefConfig,
    RewardConfig,
    RewardModelConfig,
    Role,
    RolloutConfig,
    RolloutCorrectionConfig,
    SandboxConfig,
    SchedulerConfig,
    SecurityConfig,
    ServicesConfig,
    TLSSection,
    ToolsConfig,
    ToolSource,
    TrainerConfig,
    ValKwargs,
)

__all__ = [
    "GROUP_ESTIMATORS",
    "ROLES",
    "ActorConfig",
    "AlgorithmConfig",
    "AutoscaleConfig",
    "Config",
    "ConfigError",
    "ConfigIssue",
    "CriticConfig",
    "CustomRewardFunction",
    "DataConfig",
    "FilterGroupsConfig",
    "FsdpConfig",
    "GuardConfig",
    "HealthConfig",
    "KLControlConfig",
    "KLLossControlConfig",
    "MappingConfig",
    "MegatronConfig",
    "MultiTurnConfig",
    "OverlongBufferConfig",
    "PipelineConfig",
    "Placement",
    "PolicyLossConfig",
    "RayConfig",
    "RecoveryConfig",
    "RefConfig",
    "RewardConfig",
    "RewardModelConfig",
    "Role",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "SandboxConfig",
    "SchedulerConfig",
    "SecurityConfig",
    "ServicesConfig",
    "TLSSection",
    "ToolSource",
    "ToolsConfig",
    "TrainerConfig",
    "ValKwargs",
    "apply_overrides",
    "config_from_dict",
    "load_config",
    "run_warnings",
    "save_resolved",
]
