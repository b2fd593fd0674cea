"""PPOTrainer with every role in this process: sync and pipelined steps, metrics,
validation, checkpoints and an exact resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlfleet.common.config import Config, load_config
from rlfleet.driver.clients import ResourcePoolManager, Role, in_process_workers
from rlfleet.driver.data.preprocess import preprocess
from rlfleet.driver.loop import PPOTrainer, StepRecord
from rlfleet.driver.tracking import Tracking

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ppo_tiny.yaml"


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
        "actor.ppo_mini_batch_size=2",
        "actor.ppo_micro_batch_size=null",
        "ref.log_prob_micro_batch_size=null",
        "rollout.log_prob_micro_batch_size=null",
        "rollout.n=2",
        "trainer.total_training_steps=3",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.val_before_train=false",
        "trainer.resume_mode=disable",
        "trainer.logger=[jsonl]",
    ]
    return load_config(EXAMPLE, [*base, *overrides])


def test_sync_steps_metrics_and_validation(
    tiny_model_dir: Path, arithmetic_dir: Path, tmp_path: Path
) -> None:
    cfg = _config(
        tiny_model_dir, arithmetic_dir, tmp_path, "trainer.total_training_steps=2",
        "trainer.test_freq=2", "trainer.val_before_train=true",
    )  # fmt: skip
    with PPOTrainer(config=cfg) as trainer:
        trainer.init_workers()
        records = trainer.fit()
    assert [r.step for r in records] == [1, 2]
    m = records[-1].metrics
    for phase in ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "weight_sync"):
        assert m[f"timing_s/{phase}"] >= 0.0, phase
    assert m["staleness/mean"] == 0.0  # synchronous: on-policy
    assert m["rollout/weight_version"] == 1.0  # generated after step 1's push
    assert "val/test_score/rlfleet/arithmetic" in m
    assert [s for s, _ in trainer.val_history] == [0, 2]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["kind"] for x in lines] == ["validation", "train", "train"]
    assert len(lines[1]["indices"]) == 4
    assert (tmp_path / "config.yaml").is_file()


def test_pipelined_staleness_is_bounded(
    tiny_model_dir: Path, arithmetic_dir: Path, tmp_path: Path
) -> None:
    cfg = _config(
        tiny_model_dir, arithmetic_dir, tmp_path, "trainer.pipeline.enable=true",
        "trainer.pipeline.max_staleness=1",
    )  # fmt: skip
    with PPOTrainer(config=cfg) as trainer:
        records = trainer.fit()
    stale = [r.metrics["staleness/max"] for r in records]
    # Step 1 is generated with the initial weights; later batches lag one version.
    assert stale[0] == 0.0 and all(s == 1.0 for s in stale[1:]), stale
    assert trainer.pipelined


def test_colocated_sleeps_rollout(
    tiny_model_dir: Path, arithmetic_dir: Path, tmp_path: Path
) -> None:
    cfg = _config(
        tiny_model_dir, arithmetic_dir, tmp_path,
        "trainer.total_training_steps=1", "resource_pools={global_pool: [2]}",
        "mapping={actor: global_pool, ref: global_pool, rollout: global_pool}",
    )  # fmt: skip
    pools = ResourcePoolManager.from_config(cfg)
    assert pools.placement == "colocated"
    with PPOTrainer(config=cfg, resource_pool_manager=pools) as trainer:
        assert trainer.colocated and not trainer.pipelined
        trainer.init_workers()
        core = trainer._w.rollouts[0].client.core  # type: ignore[attr-defined]
        (record,) = trainer.fit()
        assert not core.status().sleeping  # woken up again after the update
    assert record.metrics["staleness/max"] == 0.0


class _Interrupt(Exception):
    pass


@pytest.mark.parametrize("pipelined", [False, True])
def test_killed_run_resumes_with_same_data_order(
    tiny_model_dir: Path, arithmetic_dir: Path, tmp_path: Path, pipelined: bool
) -> None:
    common = [
        "trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.resume_mode=auto",
        f"trainer.pipeline.enable={str(pipelined).lower()}",
    ]  # fmt: skip
    ref_cfg = _config(tiny_model_dir, arithmetic_dir, tmp_path / "ref", *common)
    with PPOTrainer(config=ref_cfg) as trainer:
        reference = [r.indices for r in trainer.fit()]

    run = tmp_path / "run"
    cfg = _config(tiny_model_dir, arithmetic_dir, run, *common)

    def stop_after_3(record: StepRecord) -> None:
        if record.step == 3:
            raise _Interrupt

    with PPOTrainer(config=cfg, on_step=stop_after_3) as trainer:
        with pytest.raises(_Interrupt):
            trainer.fit()
        first = [r.indices for r in trainer.history]
    assert first == reference[:3]

    with PPOTrainer(config=cfg) as trainer:
        resumed = trainer.fit()
    # The checkpoint is at step 2: step 3 is redone with the same prompts, then 4.
    assert [r.step for r in resumed] == [3, 4]
    assert [r.indices for r in resumed] == reference[2:]
    # metrics.jsonl holds each step once: step 3's first record was dropped on resume.
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["kind"] == "train"] == [1, 2, 3, 4]


def test_role_worker_mapping_and_reward_fn(
    tiny_model_dir: Path, arithmetic_dir: Path, tmp_path: Path
) -> None:
    cfg = _config(tiny_model_dir, arithmetic_dir, tmp_path, "trainer.total_training_steps=1")
    calls: list[int] = []

    prompts: set[str] = set()

    def reward_fn(samples: list[Any]) -> list[float]:
        calls.append(len(samples))
        prompts.update(s.prompt for s in samples)
        return [float(len(s.response) % 2) for s in samples]

    mapping = in_process_workers(cfg)
    mapping.pop(Role.RewardModel)
    trainer = PPOTrainer(config=cfg, role_worker_mapping=mapping, reward_fn=reward_fn)
    try:
        trainer.init_workers()
        (record,) = trainer.fit()
    finally:
        trainer.close()
    assert sum(calls) == 4 * 2
    assert 0.0 <= record.metrics["critic/score/mean"] <= 1.0
    # The reward sees each sample's prompt text (a reward model scores in context).
    assert len(prompts) == 4 and all(p.strip() for p in prompts)


def test_tracking_console_without_tty(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    t = Tracking(["console", "jsonl", "tensorboard", "wandb"], tmp_path, total_steps=2)
    t.log({"critic/score/mean": 0.5, "timing_s/step": 1.25, "x": float("nan")}, 1, indices=[1])
    t.close()
    err = capsys.readouterr().err
    assert "step 1/2" in err and "reward 0.500" in err
    rec = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert rec["metrics"] == {"critic/score/mean": 0.5, "timing_s/step": 1.25}
    assert rec["indices"] == [1]
    assert sys.stderr is not None


def test_two_replicas_share_the_prompts(
    tiny_model_dir: Path, arithmetic_dir: Path, tmp_path: Path
) -> None:
    cfg = _config(
        tiny_model_dir, arithmetic_dir, tmp_path, "trainer.total_training_steps=1",
        "rollout.replicas=2",
    )  # fmt: skip
    with PPOTrainer(config=cfg) as trainer:
        trainer.init_workers()
        cores = [r.client.core for r in trainer._w.rollouts]  # type: ignore[attr-defined]
        (record,) = trainer.fit()
        served = [c.status().generated_tokens_total for c in cores]
        versions = [c.status().weight_version for c in cores]
    assert all(n > 0 for n in served), served  # both replicas generated
    assert versions == [1, 1]  # both got the new weights
    assert record.metrics["perf/total_gen_tokens"] == sum(served)


def test_prometheus_endpoint() -> None:
    import urllib.request

    from rlfleet.driver.tracking import SchedulerMetrics, start_metrics_server

    metrics = SchedulerMetrics()
    port = start_metrics_server(metrics, 0)
    metrics.record_step(
        {"timing_s/gen": 1.0, "timing_s/update_actor": 0.5, "timing_s/step": 2.0,
         "perf/tokens_per_second": 100.0, "critic/score/mean": 0.5, "staleness/mean": 1.0},
        3, 64,
    )  # fmt: skip
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'rlfleet_scheduler_phase_seconds_count{phase="update_actor"} 1.0' in text
    assert "rlfleet_scheduler_staleness 1.0" in text
    assert "rlfleet_scheduler_global_step 3.0" in text
    assert "rlfleet_scheduler_tokens_per_second 100.0" in text


def test_a_reward_function_that_raises_stops_the_run_by_default(
    tiny_model_dir: Path, arithmetic_dir: Path, tmp_path: Path
) -> None:
    """A custom reward function that raises scores 0 per sample inside the reward
    service; the driver stops the run on it (as verl would) naming the error, unless
    reward.max_error_fraction allows it, and then reports the fraction per step."""
    from rlfleet.driver.reward import RewardFailed

    fn = tmp_path / "bad_reward.py"
    fn.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    raise ValueError('boom: no score here')\n"
    )
    custom = [f"reward.custom_function.path={fn}", "trainer.total_training_steps=1"]
    cfg = _config(tiny_model_dir, arithmetic_dir, tmp_path / "a", *custom)
    with PPOTrainer(config=cfg) as trainer:
        trainer.init_workers()
        with pytest.raises(RewardFailed, match=r"8 of 8 samples failed to score.*boom"):
            trainer.fit()
    cfg = _config(
        tiny_model_dir, arithmetic_dir, tmp_path / "b", *custom, "reward.max_error_fraction=1"
    )
    with PPOTrainer(config=cfg) as trainer:
        trainer.init_workers()
        (record,) = trainer.fit()
    assert record.metrics["reward/error_fraction"] == 1.0
    assert record.metrics["reward/timeout_fraction"] == 0.0
    assert record.metrics["critic/score/mean"] == 0.0


def test_grpo_with_one_response_per_prompt_trains_on_raw_scores(
    tiny_model_dir: Path,
    arithmetic_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """verl runs GRPO with ``rollout.n=1``: a group of one has baseline 0 and std 1, so
    each response's advantage is its score. The run says so when it starts."""
    cfg = _config(
        tiny_model_dir, arithmetic_dir, tmp_path, "rollout.n=1", "algorithm.adv_estimator=grpo",
        "critic.enable=false", "trainer.total_training_steps=2",
    )  # fmt: skip

    def spread(samples: list[Any]) -> list[float]:  # scores -1, 0.5 and 2 by prompt
        return [(-1.0, 0.5, 2.0)[int(s.ground_truth) % 3] for s in samples]

    with caplog.at_level("WARNING"), PPOTrainer(config=cfg, reward_fn=spread) as trainer:
        records = trainer.fit()
    assert [r.step for r in records] == [1, 2]
    assert any(r.metrics["critic/score/max"] > r.metrics["critic/score/min"] for r in records)
    assert any("rollout.n=1 with adv_estimator grpo" in r.getMessage() for r in caplog.records)
    for r in records:
        m = r.metrics
        assert len(r.indices) == 4  # four prompts, one response each
        assert m["critic/advantages/max"] == pytest.approx(m["critic/score/max"], abs=1e-4)
        assert m["critic/advantages/min"] == pytest.approx(m["critic/score/min"], abs=1e-4)
