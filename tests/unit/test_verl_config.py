"""verl's config layout read through rlfleet.common.config.verl (no torch)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from rlfleet.common.config import ConfigError, config_from_dict, load_config
from rlfleet.common.config import verl as verl_config

REPO = Path(__file__).resolve().parents[2]
VERL_YAML = REPO / "tests" / "fixtures" / "verl" / "ppo_trainer.yaml"

# verl's GSM8K PPO quickstart command line, with local paths.
QUICKSTART = [
    "data.train_files=gsm8k/train.parquet",
    "data.val_files=gsm8k/test.parquet",
    "data.train_batch_size=256",
    "data.max_prompt_length=512",
    "data.max_response_length=256",
    "actor_rollout_ref.model.path=models/qwen",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=64",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    "critic.optim.lr=1e-5",
    "critic.model.path=models/critic",
    "critic.ppo_micro_batch_size_per_gpu=4",
    "algorithm.kl_ctrl.kl_coef=0.001",
    "trainer.logger=console",
    "trainer.val_before_train=False",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "trainer.save_freq=10",
    "trainer.test_freq=10",
    "trainer.total_epochs=15",
]
CPU = ["actor_rollout_ref.rollout.name=hf", "trainer.device=cpu"]


def _error(raw: object, overrides: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw, overrides)  # type: ignore[arg-type]
    return info.value


# --------------------------------------------------------------------------- loads


def test_verls_own_ppo_trainer_yaml_loads_unchanged() -> None:
    cfg = load_config(VERL_YAML)
    # verl's ``~/models/...`` expanded once, for every service that reads it.
    assert cfg.actor.model_path == str(Path("~/models/deepseek-llm-7b-chat").expanduser())
    assert cfg.data.train_batch_size == 1024 and cfg.actor.ppo_mini_batch_size == 256
    assert cfg.rollout.engine == "vllm" and cfg.rollout.tensor_parallel_size == 2
    assert cfg.rollout.gpu_memory_utilization == 0.5
    assert cfg.rollout.max_num_batched_tokens == 8192
    assert cfg.rollout.dtype == "bfloat16"
    assert cfg.trainer.logger == ["console", "wandb"]
    assert cfg.trainer.device == "cuda"
    assert cfg.resource_pools == {"global_pool": [8]}
    assert cfg.placement().mode == "colocated"
    # interpolations: ${trainer.project_name}, ${actor_rollout_ref.model.path}
    assert cfg.trainer.default_local_dir == "checkpoints/verl_examples/gsm8k"
    assert cfg.critic.tokenizer_path == cfg.actor.model_path
    assert cfg.critic.ppo_mini_batch_size == 256
    assert cfg.reward.reward_model.enable is False


def test_compute_dtype_follows_verls_mixed_precision_not_its_model_dtype() -> None:
    """verl's FSDP workers compute in bf16 (fp32 reduction) when mixed_precision is
    null, whatever model_dtype (the stored weights') says; a param_dtype given wins;
    reductions in another dtype are refused, naming the key."""
    cfg = load_config(VERL_YAML)
    assert (cfg.actor.dtype, cfg.critic.dtype, cfg.ref.dtype) == ("bfloat16",) * 3
    mp = "+actor_rollout_ref.actor.fsdp_config.mixed_precision"
    fp32 = load_config(VERL_YAML, [f"{mp}={{param_dtype: fp32, reduce_dtype: fp32}}"])
    assert fp32.actor.dtype == "float32" and fp32.critic.dtype == "bfloat16"
    stored = load_config(VERL_YAML, ["actor_rollout_ref.actor.fsdp_config.model_dtype=bf16"])
    assert stored.actor.dtype == "bfloat16"
    with pytest.raises(ConfigError, match=r"fsdp_config\.mixed_precision"):
        load_config(VERL_YAML, [f"{mp}={{param_dtype: bf16, reduce_dtype: bf16}}"])


def test_every_row_accepts_verls_default() -> None:
    translation = verl_config.translate({"actor_rollout_ref": {}})
    assert translation.issues == []
    assert translation.ignored() == []  # nothing given, nothing listed


def test_quickstart_maps_each_key_onto_rlfleets() -> None:
    cfg = config_from_dict(None, QUICKSTART + CPU)
    assert cfg.data.train_files == ["gsm8k/train.parquet"]
    assert (cfg.data.train_batch_size, cfg.data.max_response_length) == (256, 256)
    assert cfg.actor.model_path == "models/qwen"
    assert cfg.actor.lr == pytest.approx(1e-6)
    assert cfg.actor.ppo_mini_batch_size == 64 and cfg.actor.ppo_micro_batch_size == 4
    assert cfg.rollout.log_prob_micro_batch_size == 8
    assert cfg.rollout.tensor_parallel_size == 1
    assert cfg.ref.log_prob_micro_batch_size == 4
    assert cfg.critic.lr == pytest.approx(1e-5)
    assert cfg.critic.model_path == "models/critic"
    assert cfg.critic.ppo_micro_batch_size == 4
    assert cfg.algorithm.kl_ctrl.kl_coef == pytest.approx(0.001)
    assert cfg.trainer.logger == ["console"]
    assert cfg.trainer.val_before_train is False
    assert (cfg.trainer.save_freq, cfg.trainer.test_freq, cfg.trainer.total_epochs) == (10, 10, 15)
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (1, 1)
    assert cfg.resource_pools == {"global_pool": [1]}
    assert cfg.rollout.engine == "hf" and cfg.trainer.device == "cpu"
    # a vLLM memory knob on the hf engine changes nothing: rlfleet's default stays
    assert cfg.rollout.gpu_memory_utilization == 0.5
    # keys the quickstart leaves out take verl's defaults, not rlfleet's
    assert cfg.trainer.project_name == "verl_examples"
    assert cfg.rollout.dtype == "bfloat16"


def test_a_verl_shaped_file_with_overrides(tmp_path: Path) -> None:
    path = tmp_path / "ppo.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "actor_rollout_ref": {"model": {"path": "m"}, "rollout": {"name": "hf", "n": 4}},
                "algorithm": {"adv_estimator": "grpo"},
                "trainer": {"device": "cpu", "n_gpus_per_node": 2, "logger": ["console", "file"]},
            }
        )
    )
    cfg = load_config(path, ["actor_rollout_ref.rollout.n=2", "+trainer.nnodes=2"])
    assert cfg.rollout.n == 2
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.critic.enable is False
    assert cfg.trainer.logger == ["console", "jsonl"]
    assert cfg.resource_pools == {"global_pool": [2, 2]}


# --------------------------------------------------------------------------- ignored


def test_ignored_keys_are_listed_once_with_the_reason() -> None:
    translation = verl_config.translate(
        None,
        QUICKSTART
        + CPU
        + ["actor_rollout_ref.actor.use_torch_compile=false", "ray_init.num_cpus=4"],
    )
    assert translation.issues == []
    ignored = {e.key: e.reason for e in translation.ignored()}
    assert set(ignored) == {
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        "actor_rollout_ref.actor.use_torch_compile",
        "ray_init",
    }
    assert "hf engine" in ignored["actor_rollout_ref.rollout.gpu_memory_utilization"]
    assert "Ray" in ignored["ray_init"]
    lines = translation.startup_lines()
    assert "3 ignored" in lines[0]
    for key, reason in ignored.items():
        [line] = [x for x in lines if key in x]
        assert reason in line


def test_vllm_knobs_map_with_the_vllm_engine() -> None:
    cfg = config_from_dict(None, [*QUICKSTART, "actor_rollout_ref.rollout.name=vllm"])
    assert cfg.rollout.engine == "vllm"
    assert cfg.rollout.gpu_memory_utilization == pytest.approx(0.4)
    assert cfg.rollout.max_num_batched_tokens == 8192


def test_the_report_says_where_each_key_went(tmp_path: Path) -> None:
    translation = verl_config.translate(None, QUICKSTART + CPU)
    path = translation.write(tmp_path)
    assert path == tmp_path / verl_config.REPORT_FILE
    report = yaml.safe_load(path.read_text())
    mapped = {m["verl"]: m for m in report["mapped"]}
    assert mapped["critic.optim.lr"]["rlfleet"] == "critic.lr"
    assert mapped["trainer.logger"]["value"] == ["console"]
    assert mapped["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"]["rlfleet"] == (
        "actor.ppo_micro_batch_size"
    )
    [ignored] = report["ignored"]
    assert ignored["verl"] == "actor_rollout_ref.rollout.gpu_memory_utilization"
    assert ignored["value"] == 0.4 and ignored["reason"]
    defaults = {m["verl"]: m for m in report["mapped_from_verl_defaults"]}
    assert defaults["actor_rollout_ref.rollout.dtype"]["rlfleet"] == "rollout.dtype"


# --------------------------------------------------------------------------- refused


@pytest.mark.parametrize(
    ("override", "key", "missing"),
    [
        ("actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.name", "engines"),
        ("critic.model.lora_rank=8", "critic.model.lora_rank", "LoRA"),
        ("algorithm.adv_estimator=grpo_passk", "algorithm.adv_estimator", "advantage estimators"),
        ("trainer.logger=[console,mlflow]", "trainer.logger", "loggers"),
        ("trainer.default_hdfs_dir=hdfs://x", "trainer.default_hdfs_dir", "HDFS"),
        (
            "actor_rollout_ref.actor.ppo_micro_batch_size=32",
            "actor_rollout_ref.actor.ppo_micro_batch_size",
            "global micro-batch",
        ),
    ],
)
def test_a_refused_value_is_one_line_naming_key_and_value(
    override: str, key: str, missing: str
) -> None:
    err = _error(None, [*QUICKSTART, *CPU, override])
    [issue] = err.issues
    assert issue.path == key
    line = str(issue)
    assert "\n" not in line
    assert line.startswith(f"{key}: rlfleet does not implement")
    assert missing in line
    value = override.partition("=")[2].strip("[]").split(",")[-1]
    assert value.lower() in line.lower()


def test_refusals_come_with_rlfleets_own_errors_at_once() -> None:
    err = _error(
        None,
        [*QUICKSTART, *CPU, "actor_rollout_ref.rollout.name=sglang", "data.train_batch_size=100"],
    )
    paths = {i.path for i in err.issues}
    assert "actor_rollout_ref.rollout.name" in paths
    # 64 does not divide 100: rlfleet's check, named by the verl key the input used
    assert "actor_rollout_ref.actor.ppo_mini_batch_size" in paths


def test_an_unknown_key_names_the_close_verl_key() -> None:
    err = _error(None, [*QUICKSTART, *CPU, "actor_rollout_ref.actor.optim.lrr=1"])
    [issue] = err.issues
    assert issue.path == "actor_rollout_ref.actor.optim.lrr"
    assert "actor_rollout_ref.actor.optim.lr" in issue.message


def test_two_given_keys_setting_one_rlfleet_key_differently_are_refused() -> None:
    err = _error(
        None,
        [
            *QUICKSTART,
            *CPU,
            "actor_rollout_ref.actor.grad_clip=0.5",
            "actor_rollout_ref.actor.optim.clip_grad=2.0",
        ],
    )
    [issue] = err.issues
    assert "actor.grad_clip" in issue.message


# --------------------------------------------------------------------------- the issue's list


def test_keys_the_issue_found_refused_are_mapped(tmp_path: Path) -> None:
    score = tmp_path / "score.py"
    score.write_text(
        "def my_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
    )
    cfg = config_from_dict(
        None,
        [
            *QUICKSTART,
            *CPU,
            f"custom_reward_function.path={score}",
            "custom_reward_function.name=my_score",
            "custom_reward_function.reward_kwargs={scale: 2.0}",
        ],
    )
    assert cfg.reward.custom_function.path == str(score)
    assert cfg.reward.custom_function.name == "my_score"
    assert cfg.reward.custom_function.reward_kwargs == {"scale": 2.0}
    assert cfg.reward.custom_function.keep_builtin_scorers is False  # verl's routing
    assert cfg.critic.lr == pytest.approx(1e-5)
    assert cfg.trainer.nnodes == 1 and cfg.trainer.n_gpus_per_node == 1


def test_packing_and_dynamic_batches_map() -> None:
    """use_remove_padding and the token budgets (once refused) land on rlfleet's keys,
    the budgets following verl's interpolations."""
    cfg = config_from_dict(
        None,
        [
            *QUICKSTART,
            *CPU,
            "actor_rollout_ref.model.use_remove_padding=true",
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
            "critic.ppo_max_token_len_per_gpu=8192",
        ],
    )
    assert cfg.actor.use_remove_padding is True
    assert cfg.critic.use_remove_padding is False  # critic.model's verl default
    assert cfg.actor.use_dynamic_bsz and cfg.actor.ppo_max_token_len_per_gpu == 4096
    assert cfg.ref.log_prob_use_dynamic_bsz and cfg.ref.log_prob_max_token_len_per_gpu == 4096
    assert cfg.rollout.log_prob_use_dynamic_bsz
    assert cfg.rollout.log_prob_max_token_len_per_gpu == 4096
    assert cfg.critic.use_dynamic_bsz
    assert cfg.critic.ppo_max_token_len_per_gpu == 8192
    assert cfg.critic.forward_max_token_len_per_gpu == 8192
    # verl's defaults: padded, fixed micro-batches
    plain = config_from_dict(None, QUICKSTART + CPU)
    assert plain.actor.use_remove_padding is False and plain.actor.use_dynamic_bsz is False


# --------------------------------------------------------------------------- algorithms

_A = "actor_rollout_ref.actor"
GRPO = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4"]


@pytest.mark.parametrize("mode", ["vanilla", "gspo", "cispo"])
def test_policy_loss_modes_map(mode: str) -> None:
    cfg = config_from_dict(None, [*QUICKSTART, *CPU, f"{_A}.policy_loss.loss_mode={mode}"])
    assert cfg.actor.policy_loss.loss_mode == mode


def test_dapo_recipe_keys_map() -> None:
    """verl's DAPO recipe: clip-higher, token-mean, filter_groups, gen_batch_size, the dapo
    reward manager and its overlong buffer (both of verl's spellings)."""
    dapo = [
        *QUICKSTART, *CPU, *GRPO,
        f"{_A}.clip_ratio_low=0.2", f"{_A}.clip_ratio_high=0.28",
        f"{_A}.loss_agg_mode=token-mean",
        "+algorithm.filter_groups.enable=true", "+algorithm.filter_groups.metric=acc",
        "+algorithm.filter_groups.max_num_gen_batches=5", "+data.gen_batch_size=384",
        "reward_model.reward_manager=dapo",
    ]  # fmt: skip
    buffers = [
        [
            "+reward_model.overlong_buffer.enable=true",
            "+reward_model.overlong_buffer.len=64",
            "+reward_model.overlong_buffer.penalty_factor=1.0",
            "+reward_model.overlong_buffer.log=false",
        ],
        [
            "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=true",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.len=64",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.log=false",
            "+reward_model.reward_kwargs.max_resp_len=256",
        ],
    ]
    for buffer in buffers:
        cfg = config_from_dict(None, [*dapo, *buffer])
        assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (0.2, 0.28)
        fg = cfg.algorithm.filter_groups
        assert fg.enable and fg.metric == "acc" and fg.max_num_gen_batches == 5
        assert cfg.data.gen_batch_size == 384
        assert cfg.reward.reward_manager == "naive"  # dapo scores as naive does
        ob = cfg.reward.overlong_buffer
        assert ob.enable and ob.len == 64 and ob.penalty_factor == 1.0
        assert ob.max_resp_len == 256  # max_response_length, or given alike


@pytest.mark.parametrize(
    ("override", "key", "missing"),
    [
        (f"{_A}.policy_loss.loss_mode=clip_cov", f"{_A}.policy_loss.loss_mode", "clip_cov"),
        (
            "+algorithm.filter_groups.enable=true +algorithm.filter_groups.max_num_gen_batches=0",
            "algorithm.filter_groups.max_num_gen_batches",
            "unbounded",
        ),
        (
            "+algorithm.filter_groups.filter_type=band_pass",
            "algorithm.filter_groups.filter_type",
            "band_pass",
        ),
        (
            "+algorithm.rollout_correction.rollout_is_threshold='0.5_5.0'",
            "algorithm.rollout_correction.rollout_is_threshold",
            "IcePop",
        ),
        (
            "+algorithm.rollout_correction.bypass_mode=true",
            "algorithm.rollout_correction.bypass_mode",
            "bypass",
        ),
        (
            "+algorithm.rollout_correction.rollout_rs=token_k1",
            "algorithm.rollout_correction.rollout_rs",
            "rejection sampling",
        ),
        ("reward_model.reward_manager=prime", "reward_model.reward_manager", "batch, prime"),
    ],
)
def test_algorithm_values_rlfleet_lacks_are_refused(override: str, key: str, missing: str) -> None:
    err = _error(None, [*QUICKSTART, *CPU, *GRPO, *override.split()])
    [issue] = err.issues
    assert issue.path == key and missing in issue.message


def test_the_dapo_recipes_disabled_dynamic_sampling_loads() -> None:
    """verl's dapo_trainer.yaml ships filter_groups off with metric null, 0 rounds and
    gen_batch_size = train_batch_size: values that do nothing while it is off are
    ignored (they were refused); once it is on they are checked."""
    off = [
        "+algorithm.filter_groups.enable=false",
        "+algorithm.filter_groups.metric=null",
        "+algorithm.filter_groups.max_num_gen_batches=0",
        "+data.gen_batch_size=${data.train_batch_size}",
    ]
    cfg = config_from_dict(None, [*QUICKSTART, *CPU, *GRPO, *off])
    fg = cfg.algorithm.filter_groups
    assert not fg.enable and cfg.data.gen_batch_size is None
    err = _error(None, [*QUICKSTART, *CPU, *GRPO, *off[1:], "+algorithm.filter_groups.enable=true"])
    assert sorted(i.path for i in err.issues) == [
        "algorithm.filter_groups.max_num_gen_batches",
        "algorithm.filter_groups.metric",
    ]
    # A gen_batch_size of its own still needs dynamic sampling.
    err = _error(None, [*QUICKSTART, *CPU, *GRPO, *off[:3], "+data.gen_batch_size=4096"])
    assert [i.path for i in err.issues] == ["data.gen_batch_size"]


def test_rollout_correction_current_and_older_spellings() -> None:
    base = [*QUICKSTART, *CPU]
    cfg = config_from_dict(None, base)
    assert cfg.algorithm.rollout_correction.rollout_is is None  # verl's default: off
    current = config_from_dict(
        None,
        [
            *base,
            "+algorithm.rollout_correction.rollout_is=sequence",
            "+algorithm.rollout_correction.rollout_is_threshold=3.0",
        ],
    )
    rc = current.algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_is_threshold) == ("sequence", 3.0)
    # verl 0.5: actor.tis_imp_ratio_cap > 0 turns token-level weights on; -1 is off
    cap = config_from_dict(None, [*base, f"+{_A}.tis_imp_ratio_cap=2.5"])
    rc = cap.algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_is_threshold) == ("token", 2.5)
    off = config_from_dict(None, [*base, f"+{_A}.tis_imp_ratio_cap=-1"])
    assert off.algorithm.rollout_correction.rollout_is is None
    # verl 0.6: rollout_is true and a threshold apply weights at rollout_is_level
    legacy = config_from_dict(
        None,
        [
            *base,
            "+algorithm.rollout_is=true",
            "+algorithm.rollout_is_threshold=1.5",
            "+algorithm.rollout_is_level=sequence",
            "+algorithm.rollout_is_mode=truncate",
        ],
    )
    rc = legacy.algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_is_threshold) == ("sequence", 1.5)
    metrics_only = config_from_dict(
        None, [*base, "+algorithm.rollout_is=false", "+algorithm.rollout_is_threshold=1.5"]
    )
    assert metrics_only.algorithm.rollout_correction.rollout_is is None
    err = _error(
        None,
        [
            *base,
            "+algorithm.rollout_is=true",
            "+algorithm.rollout_is_threshold=2.0",
            "+algorithm.rollout_is_mode=mask",
        ],
    )
    [issue] = err.issues
    assert issue.path == "algorithm.rollout_is_mode" and "mask mode" in issue.message


def test_a_budget_below_the_longest_sequence_is_refused() -> None:
    err = _error(
        None,
        [
            *QUICKSTART,
            *CPU,
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=700",
        ],
    )
    paths = {i.path for i in err.issues}
    # prompt 512 + response 256 = 768 tokens; ref and rollout inherit the budget
    assert "actor_rollout_ref.actor.ppo_max_token_len_per_gpu" in paths
    assert "768" in str(err)


@pytest.mark.parametrize(
    ("value", "expected"), [("console", ["console"]), ("[console,wandb]", ["console", "wandb"])]
)
def test_logger_is_a_string_or_a_list(value: str, expected: list[str]) -> None:
    cfg = config_from_dict(None, [*QUICKSTART, *CPU, f"trainer.logger={value}"])
    assert cfg.trainer.logger == expected


def test_rlfleet_keys_mix_in_with_their_own_meaning() -> None:
    cfg = config_from_dict(
        {"actor_rollout_ref": {"rollout": {"name": "hf"}}, "resource_pools": {"p": [1], "q": [1]}},
        [
            *QUICKSTART,
            "trainer.device=cpu",
            "mapping.actor=p",
            "mapping.rollout=q",
            "mapping.critic=p",
            "services.max_restarts=5",
        ],
    )
    assert cfg.resource_pools == {"p": [1], "q": [1]}
    # an override of one role keeps rlfleet's default for the others
    assert (cfg.mapping.actor, cfg.mapping.rollout, cfg.mapping.critic) == ("p", "q", "p")
    assert cfg.mapping.ref == "train_pool"
    assert cfg.placement().mode == "disaggregated"
    assert cfg.services.max_restarts == 5


def test_an_rlfleet_config_is_not_translated() -> None:
    assert not verl_config.is_verl_shaped({"actor": {"lr": 1e-3}}, ["rollout.n=2"])
    assert verl_config.is_verl_shaped(None, ["+actor_rollout_ref.model.path=m"])
    assert config_from_dict(None, ["actor.lr=1e-3"]).trainer.project_name == "rlfleet"


# --------------------------------------------------------------------------- docs


def test_docs_verl_md_is_generated_from_the_table() -> None:
    spec = importlib.util.spec_from_file_location(
        "gen_verl_doc", REPO / "tools" / "gen_verl_doc.py"
    )
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    text = (REPO / "docs" / "verl.md").read_text(encoding="utf-8")
    assert text == gen.render(), "docs/verl.md is stale: run python tools/gen_verl_doc.py"
    for row in verl_config.ROWS:
        assert f"| `{row.key}` |" in text


def test_lora_keys_map_onto_the_actor() -> None:
    cfg = config_from_dict(
        None,
        [
            *QUICKSTART,
            *CPU,
            "actor_rollout_ref.model.lora_rank=8",
            "actor_rollout_ref.model.lora_alpha=32",
            "actor_rollout_ref.model.target_modules=[q_proj,v_proj]",
        ],
    )
    assert cfg.actor.lora_rank == 8
    assert cfg.actor.lora_alpha == 32
    assert cfg.actor.target_modules == ["q_proj", "v_proj"]


def test_lora_with_vllm_is_accepted_and_with_megatron_refused_in_one_line() -> None:
    lora_vllm = [
        *QUICKSTART,
        *CPU,
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.rollout.name=vllm",
        "trainer.device=cuda",
    ]
    cfg = config_from_dict(None, lora_vllm)
    assert (cfg.actor.lora_rank, cfg.rollout.engine) == (8, "vllm")
    err = _error(None, [*lora_vllm, "actor_rollout_ref.actor.strategy=megatron"])
    lines = [str(i) for i in err.issues if i.path == "actor_rollout_ref.model.lora_rank"]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "megatron" in lines[0] and "8" in lines[0]


def test_fully_async_partial_rollout_maps_onto_the_pipeline() -> None:
    cfg = config_from_dict(
        None,
        [
            *QUICKSTART,
            *CPU,
            "async_training.partial_rollout=true",
            "trainer.pipeline.enable=true",
            "resource_pools={train_pool: [1], rollout_pool: [1]}",
            "mapping={actor: train_pool, ref: train_pool, critic: train_pool, "
            "rollout: rollout_pool}",
        ],
    )
    assert cfg.trainer.pipeline.partial_rollout and cfg.trainer.pipeline.enable
    # Without rlfleet's pipelined mode it is refused, naming the key.
    err = _error(None, [*QUICKSTART, *CPU, "async_training.partial_rollout=true"])
    assert "trainer.pipeline.partial_rollout" in str(err)


def test_keys_of_verls_newer_generated_config_load() -> None:
    """Keys a newer verl's generated ``ppo_trainer.yaml`` adds, at its defaults, and
    its OmegaConf relative interpolations (``${.x}`` a sibling, ``${..x}`` a sibling
    of the parent): each accepted and read, or ignored with a reason; values that
    would change behaviour refused naming the key."""
    A, R = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    newer = [
        f"+{A}.use_fused_kernels=false",
        f"+{A}.use_remove_padding=false",
        "+actor_rollout_ref.ref.model=null",
        f"+{R}.cudagraph_capture_sizes=null",
        f"+{R}.over_sample_rate=0",
        f"+{R}.skip_rollout=false",
        f"+{R}.skip_dump_dir=/tmp/rollout_dump",
        "+actor_rollout_ref.nccl_timeout=600",
        "+ray_kwargs.ray_init.num_cpus=null",
        "+ray_kwargs.timeline_json_file=null",
        f"{R}.multi_turn.format=chatml",  # an older verl's default: the hermes parser
    ]
    raw = yaml.safe_load(VERL_YAML.read_text())
    raw["critic"]["ppo_max_token_len_per_gpu"] = 12345
    raw["critic"]["forward_max_token_len_per_gpu"] = "${.ppo_max_token_len_per_gpu}"
    raw["critic"]["ppo_micro_batch_size_per_gpu"] = "${oc.select:.ppo_micro_batch_size,null}"
    raw["critic"]["optim"]["weight_decay"] = "${..cliprange_value}"
    cfg = config_from_dict(raw, [*newer, *CPU])
    assert cfg.critic.forward_max_token_len_per_gpu == 12345
    assert cfg.critic.weight_decay == raw["critic"]["cliprange_value"]
    assert cfg.rollout.multi_turn.format == "hermes"
    for bad, key in (
        (f"{R}.skip_rollout=true", f"{R}.skip_rollout"),
        (f"{R}.over_sample_rate=0.1", f"{R}.over_sample_rate"),
        (f"{A}.use_remove_padding=true", f"{A}.use_remove_padding"),
        ("actor_rollout_ref.ref.model={path: other}", "actor_rollout_ref.ref.model"),
    ):
        error = _error(raw, [*newer, *CPU, bad])
        assert any(i.path == key for i in error.issues), (bad, str(error))
    climbing = dict(raw, critic={**raw["critic"], "grad_clip": "${.....x}"})
    assert "names no key" in str(_error(climbing, CPU))


def test_keys_of_an_older_verl_release_load() -> None:
    """Keys of verl's ``ppo_trainer.yaml`` around v0.3, at their defaults: accepted;
    ``multi_turn.max_turns`` (today's ``max_assistant_turns``) is read, and values
    asking for what rlfleet lacks are refused naming the key."""
    AR, R = "actor_rollout_ref", "actor_rollout_ref.rollout"
    older = [
        f"+{AR}.model.return_last_hidden_state=false",
        f"+{AR}.model.use_fused_loss=false",
        f"+{R}.chat_scheduler=null",
        f"+{R}.use_fire_sampling=false",
        f"+{R}.multi_turn.max_turns=2",
    ]
    raw = yaml.safe_load(VERL_YAML.read_text())
    cfg = config_from_dict(raw, [*older, *CPU])
    assert cfg.rollout.multi_turn.max_turns == 2
    for bad, key in (
        (f"{AR}.model.return_last_hidden_state=true", f"{AR}.model.return_last_hidden_state"),
        (f"{R}.use_fire_sampling=true", f"{R}.use_fire_sampling"),
    ):
        error = _error(raw, [*older, *CPU, bad])
        assert any(i.path == key for i in error.issues), (bad, str(error))


@pytest.mark.parametrize(
    "overrides",
    [
        ["+custom_reward_function.reward_kwargs.bonus=0.5"],
        ["custom_reward_function.reward_kwargs.bonus=0.5"],
        ["custom_reward_function.reward_kwargs={bonus:0.5}"],  # Hydra's dict, no spaces
        ["custom_reward_function.reward_kwargs={bonus: 0.5}"],
    ],
)
def test_reward_kwargs_as_hydra_takes_them(overrides: list[str]) -> None:
    cfg = config_from_dict(None, [*QUICKSTART, *CPU, *overrides])
    assert cfg.reward.custom_function.reward_kwargs == {"bonus": 0.5}


def test_a_value_that_does_not_parse_is_one_line() -> None:
    err = _error(None, [*QUICKSTART, *CPU, "data.train_batch_size=[1,2"])
    [issue] = err.issues
    assert issue.path == "data.train_batch_size" and "\n" not in str(issue)
    assert "not a YAML value" in str(issue)


def test_errors_name_the_verl_keys_the_input_used() -> None:
    for override, key, rlfleet in (
        ("actor_rollout_ref.rollout.n=0", "actor_rollout_ref.rollout.n", "rollout.n"),
        ("actor_rollout_ref.rollout.temperature=hot", "actor_rollout_ref.rollout.temperature",
         "rollout.temperature"),
        ("actor_rollout_ref.actor.optim.lr=-1", "actor_rollout_ref.actor.optim.lr", "actor.lr"),
    ):  # fmt: skip
        [issue] = _error(None, [*QUICKSTART, *CPU, override]).issues
        assert issue.path == key and f"(as rlfleet's {rlfleet})" in issue.message
    [issue] = _error(None, [*QUICKSTART, *CPU, "+trainer.foo=1"]).issues
    assert issue.path == "trainer.foo" and str(issue).endswith("(got '1')")


def test_a_lower_clip_at_or_past_one_is_refused() -> None:
    """1 - clip_ratio_low is the ratio's lower bound: at 1 or more it never clips."""
    [issue] = _error(None, [*QUICKSTART, *CPU, "actor_rollout_ref.actor.clip_ratio_low=1.5"]).issues
    assert issue.path == "actor_rollout_ref.actor.clip_ratio_low" and "less than 1" in str(issue)


def test_a_mandatory_value_left_unset_says_so() -> None:
    """verl's generated config marks values the user must give with OmegaConf's ???
    (rollout.name): left as is, it was refused as an unknown rollout engine '???'."""
    err = _error(None, [*QUICKSTART, *CPU, "actor_rollout_ref.rollout.name=???"])
    [issue] = [i for i in err.issues if i.path == "actor_rollout_ref.rollout.name"]
    assert issue.message == "is required and not set (??? in the config): give it"


def test_data_tokenizer_is_not_refused_through_the_critics_default(tmp_path: Path) -> None:
    """verl's critic.model.tokenizer_path defaults to the actor's model path; with
    data.tokenizer set elsewhere that default was refused as a critic tokenizer of its
    own. A critic tokenizer given explicitly is still checked."""
    cfg = config_from_dict(None, [*QUICKSTART, *CPU, f"data.tokenizer={tmp_path}"])
    assert cfg.actor.tokenizer_path == str(tmp_path)
    err = _error(None, [*QUICKSTART, *CPU, f"critic.model.tokenizer_path={tmp_path}"])
    assert [i.path for i in err.issues] == ["critic.model.tokenizer_path"]
