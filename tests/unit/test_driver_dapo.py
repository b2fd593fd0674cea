"""DAPO in the driver, every role in this process: dynamic sampling (groups whose samples
all score the same are dropped and generation goes on until the batch is full, in sync
and pipelined mode, bounded by max_num_gen_batches), overlong reward shaping, and the
rollout engine's log-probs carried into the trainer's batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlfleet.common.config import Config, load_config
from rlfleet.driver.batch import trainer_batch
from rlfleet.driver.data.preprocess import preprocess
from rlfleet.driver.loop import PPOTrainer
from rlfleet.reward.types import Sample
from rlfleet.trainer import batch as B

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ppo_tiny.yaml"
N = 4  # samples per prompt


@pytest.fixture(scope="module")
def arithmetic_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("arith")
    preprocess("arithmetic", None, out, n=64, n_test=8, digits=1, ops="+-*", seed=0)
    return out


def _config(model: Path, data: Path, run_dir: Path, *overrides: str) -> Config:
    base = [
        f"actor.model_path={model}",
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'test.parquet'}",
        f"trainer.default_local_dir={run_dir}",
        "data.train_batch_size=4",
        "data.max_response_length=8",
        "actor.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size=null",
        "actor.use_kl_loss=false",
        "ref.log_prob_micro_batch_size=null",
        "rollout.log_prob_micro_batch_size=null",
        f"rollout.n={N}",
        "trainer.total_training_steps=2",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.val_before_train=false",
        "trainer.resume_mode=disable",
        "trainer.logger=[jsonl]",
    ]
    return load_config(EXAMPLE, [*base, *overrides])


def _even_constant(samples: list[Sample]) -> list[float]:
    """Prompts with an even answer score 1 on every sample (their groups are dropped);
    the others score their first response token's parity (their groups mostly differ)."""
    return [1.0 if int(s.ground_truth) % 2 == 0 else float(s.response_ids[0] % 2) for s in samples]


DYNAMIC = [
    "algorithm.filter_groups.enable=true",
    "algorithm.filter_groups.max_num_gen_batches=8",
    "data.gen_batch_size=3",  # rounds of 3 prompts for a batch of 4: several rounds
]


def test_dynamic_sampling_fills_the_batch_with_mixed_groups(
    tiny_model_dir: Path, arithmetic_dir: Path, tmp_path: Path
) -> None:
    cfg = _config(tiny_model_dir, arithmetic_dir, tmp_path, *DYNAMIC)
    with PPOTrainer(config=cfg, reward_fn=_even_constant) as trainer:
        trainer.init_workers()
        gb = trainer._produce(1, trainer._policy_version)
        pad = trainer.train_dataset.pad_token_id
    prompts = gb.prompts
    assert len(prompts["raw_prompt_ids"]) == 4 and len(gb.samples) == 4 * N
    assert [(s.prompt_index, s.sample_index) for s in gb.samples] == [
        (i, j) for i in range(4) for j in range(N)
    ]
    for i in range(4):
        group = gb.scores[i * N : (i + 1) * N]
        assert len(set(group)) > 1, group  # no group with equal scores is trained on
        assert int(prompts["reward_model"][i]["ground_truth"]) % 2 == 1
    m = gb.sampling
    rounds = m["train/num_gen_batches"]
    assert rounds >= 2 and m["dynamic_sampling/prompts_drawn"] == 3 * rounds
    kept = m["dynamic_sampling/prompts_drawn"] - m["dynamic_sampling/prompts_dropped"]
    assert kept == 4 + m["dynamic_sampling/prompts_surplus"]
    assert m["dynamic_sampling/samples_generated"] == 3 * rounds * N
    # the joined prompt rows are the prompts the samples answered
    for i, ids in enumerate(prompts["raw_prompt_ids"]):
        row = prompts["input_ids"][i][prompts["attention_mask"][i].bool()]
        assert row.tolist() == ids
    batch = trainer_batch(gb, N, pad)
    B.validate_ppo_batch(batch, "train_step", ["input_ids", "scores", "uid", "rollout_log_probs"])
    valid = batch["response_mask"].bool()
    want = [x for s in gb.samples for x in s.logprobs]
    assert batch["rollout_log_probs"][valid].tolist() == pytest.approx(want)
    assert (batch["rollout_log_probs"][~valid] == 0).all()


@pytest.mark.parametrize("pipelined", [False, True])
def test_dynamic_sampling_trains_in_sync_and_pipelined_mode(
    tiny_model_dir: Path, arithmetic_dir: Path, tmp_path: Path, pipelined: bool
) -> None:
    cfg = _config(
        tiny_model_dir, arithmetic_dir, tmp_path, *DYNAMIC,
        f"trainer.pipeline.enable={str(pipelined).lower()}",
        "algorithm.rollout_correction.rollout_is=token",
    )  # fmt: skip
    with PPOTrainer(config=cfg, reward_fn=_even_constant) as trainer:
        records = trainer.fit()
        assert trainer.pipelined == pipelined
    assert [r.step for r in records] == [1, 2]
    for r in records:
        assert len(r.indices) == 4
        assert r.metrics["train/num_gen_batches"] >= 2
        assert r.metrics["dynamic_sampling/prompts_dropped"] >= 1
        assert 0.0 < r.metrics["rollout_corr/rollout_is_mean"] <= 2.0
        assert r.metrics["critic/score/mean"] > 0.0
    # every round draws fresh prompts from the loader: none is trained on twice
    assert len(set(records[0].indices) | set(records[1].indices)) == 8


def test_dynamic_sampling_fails_when_the_batch_cannot_be_filled(
    tiny_model_dir: Path, arithmetic_dir: Path, tmp_path: Path
) -> None:
    cfg = _config(
        tiny_model_dir, arithmetic_dir, tmp_path,
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=2",
    )  # fmt: skip
    with PPOTrainer(config=cfg, reward_fn=lambda samples: [0.0] * len(samples)) as trainer:
        with pytest.raises(RuntimeError, match=r"2 generation rounds .* drew 8 prompts and kept 0"):
            trainer.fit()
        assert trainer.global_steps == 0


def test_filter_on_acc_and_missing_acc(
    tiny_model_dir: Path, arithmetic_dir: Path, tmp_path: Path
) -> None:
    def scored(samples: list[Sample]) -> list[dict[str, Any]]:
        # the score is the same for every sample; acc decides which groups stay
        return [
            {"score": 0.5, "acc": bool(s.response_ids[0] % 2) and int(s.ground_truth) % 2 == 1}
            for s in samples
        ]

    cfg = _config(
        tiny_model_dir, arithmetic_dir, tmp_path, *DYNAMIC, "algorithm.filter_groups.metric=acc"
    )
    with PPOTrainer(config=cfg, reward_fn=scored) as trainer:
        trainer.init_workers()
        gb = trainer._produce(1, trainer._policy_version)
    assert len(gb.samples) == 4 * N and set(gb.scores) == {0.5}
    assert all(int(rm["ground_truth"]) % 2 == 1 for rm in gb.prompts["reward_model"])
    with PPOTrainer(config=cfg, reward_fn=lambda samples: [1.0] * len(samples)) as trainer:
        trainer.init_workers()
        with pytest.raises(RuntimeError, match="returned no 'acc'"):
            trainer._produce(1, trainer._policy_version)


def test_overlong_penalty_shapes_training_scores(
    tiny_model_dir: Path, arithmetic_dir: Path, tmp_path: Path
) -> None:
    cfg = _config(
        tiny_model_dir, arithmetic_dir, tmp_path,
        "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=4",
        "reward.overlong_buffer.penalty_factor=0.5",
    )  # fmt: skip
    assert cfg.reward.overlong_buffer.max_resp_len == 8
    with PPOTrainer(config=cfg, reward_fn=lambda samples: [1.0] * len(samples)) as trainer:
        trainer.init_workers()
        gb = trainer._produce(1, trainer._policy_version)
    lengths = [len(s.token_ids) for s in gb.samples]
    # no penalty up to 8 - 4 = 4 tokens, then -(len - 4) / 4 * 0.5, down to -0.5 at 8
    want = [1.0 + min(-(n - 4) / 4 * 0.5, 0.0) for n in lengths]
    assert gb.scores == pytest.approx(want)
    assert any(n > 4 for n in lengths)  # the untrained model rambles: something is penalised
    penalties = [w - 1.0 for w in want]
    assert gb.sampling["reward/overlong_reward/mean"] == pytest.approx(sum(penalties) / len(want))
    frac = sum(p < 0 for p in penalties) / len(want)
    assert gb.sampling["reward/overlong/mean"] == pytest.approx(frac)


def test_a_reward_services_acc_reaches_dynamic_sampling_and_validation(
    tiny_model_dir: Path, arithmetic_dir: Path, tmp_path: Path
) -> None:
    """A verl compute_score returning {"score", "acc"} behind the reward service's
    client (ScoreResult: the extras are its details): metric=acc filters on it (the
    details were dropped, so every run stopped with "returned no 'acc'"), and
    validation reports it per data source, as verl logs a scorer's extra keys."""
    from rlfleet.common.config import CustomRewardFunction, RewardConfig
    from rlfleet.reward.client import InProcessRewardClient
    from rlfleet.reward.core import RewardManager

    fn = tmp_path / "score.py"
    fn.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    odd = int(ground_truth) % 2 == 1\n"
        "    return {'score': 0.5, 'acc': odd and len(solution_str) % 2 == 1, 'pred': 'x'}\n"
    )
    manager = RewardManager(RewardConfig(custom_function=CustomRewardFunction(path=str(fn))))
    reward = InProcessRewardClient(manager)
    cfg = _config(
        tiny_model_dir, arithmetic_dir, tmp_path / "run", *DYNAMIC,
        "algorithm.filter_groups.metric=acc",
    )  # fmt: skip
    try:
        with PPOTrainer(config=cfg, reward_fn=reward, val_reward_fn=reward) as trainer:
            trainer.init_workers()
            gb = trainer._produce(1, trainer._policy_version)
            val = trainer.validate()
    finally:
        manager.close()
    assert len(gb.samples) == 4 * N and set(gb.scores) == {0.5}
    assert all(int(rm["ground_truth"]) % 2 == 1 for rm in gb.prompts["reward_model"])
    acc = {k: v for k, v in val.items() if k.startswith("val/acc/")}
    assert acc and all(0.0 <= v <= 1.0 for v in acc.values()), val
    assert not any(k.startswith("val/pred/") for k in val)  # not a number


def test_verls_trainer_arguments_are_taken(
    tiny_model_dir: Path, arithmetic_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RayPPOTrainer's keyword arguments, as verl's main_ppo passes them, construct the
    trainer; what rlfleet cannot honour is refused or said."""
    cfg = _config(tiny_model_dir, arithmetic_dir, tmp_path)
    verl_kwargs: dict[str, Any] = {
        "processor": None, "ray_worker_group_cls": object, "device_name": "cpu",
    }  # fmt: skip
    PPOTrainer(config=cfg, **verl_kwargs).close()
    with caplog.at_level("WARNING"):
        PPOTrainer(config=cfg, collate_fn=lambda rows: rows, train_sampler=[]).close()
    assert "collate_fn / train_sampler are not used" in caplog.text
    with pytest.raises(ValueError, match="processor: multimodal"):
        PPOTrainer(config=cfg, processor=object())
    with pytest.raises(ValueError, match="device_name 'cuda' disagrees"):
        PPOTrainer(config=cfg, device_name="cuda")
