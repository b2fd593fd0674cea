"""verl's GSM8K PPO quickstart, unchanged but for local paths and sizes, trains.

The test writes a config in verl's layout and a small jsonl in GSM8K's format,
converts it with ``rlfleet preprocess gsm8k``, then runs ``python -m
rlfleet.launch.train --config <verl yaml>`` with verl's quickstart command line
(tiny local model, batch sizes scaled down, ``rollout.name=hf trainer.device=cpu``,
``total_training_steps=2``): every service a real process over gRPC on 127.0.0.1.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

QUESTIONS = [
    ("Tom has 3 apples and buys 2 more. How many apples?", "3 + 2 = 5\n#### 5"),
    ("A box holds 4 pens. How many pens in 2 boxes?", "4 * 2 = 8\n#### 8"),
    ("Sam had 7 coins and spent 3. How many are left?", "7 - 3 = 4\n#### 4"),
    ("There are 6 cats and 1 more arrives. How many cats?", "6 + 1 = 7\n#### 7"),
    ("Ann reads 500 pages a day for 2 days. Pages read?", "500 * 2 = 1,000\n#### 1,000"),
    ("A farm has 9 cows and sells 4. How many are left?", "9 - 4 = 5\n#### 5"),
    ("Jo buys 3 packs of 3 eggs. How many eggs?", "3 * 3 = 9\n#### 9"),
    ("A class of 12 splits in 2 teams. Team size?", "12 / 2 = 6\n#### 6"),
]

# verl's ppo_trainer.yaml layout, a few sections given; the rest take verl's defaults.
VERL_FILE = {
    "data": {"prompt_key": "prompt", "truncation": "error", "dataloader_num_workers": 8},
    "actor_rollout_ref": {
        "hybrid_engine": True,
        "model": {"use_remove_padding": True, "enable_gradient_checkpointing": False},
        "actor": {"strategy": "fsdp", "use_kl_loss": False, "ppo_epochs": 1},
        "rollout": {"name": "vllm", "n": 1, "temperature": 1.0},
    },
    "critic": {"strategy": "fsdp", "model": {"enable_gradient_checkpointing": False}},
    "algorithm": {"adv_estimator": "gae", "kl_ctrl": {"type": "fixed"}},
    "trainer": {"project_name": "verl_examples", "experiment_name": "gsm8k", "device": "cuda"},
}


def _quickstart(data: Path, model: Path, run_dir: Path) -> list[str]:
    """verl's documented quickstart line: local paths, sizes scaled down, CPU."""
    return [
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'test.parquet'}",
        "data.train_batch_size=4",
        "data.max_prompt_length=512",
        "data.max_response_length=8",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        "critic.optim.lr=1e-5",
        f"critic.model.path={model}",
        "critic.ppo_micro_batch_size_per_gpu=2",
        "algorithm.kl_ctrl.kl_coef=0.001",
        "trainer.logger=console",
        "trainer.val_before_train=False",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.save_freq=10",
        "trainer.test_freq=10",
        "trainer.total_epochs=15",
        "actor_rollout_ref.rollout.name=hf",
        "trainer.device=cpu",
        "trainer.total_training_steps=2",
        f"trainer.default_local_dir={run_dir}",
        "trainer.resume_mode=disable",
    ]


def _gsm8k(tmp_path: Path) -> Path:
    raw = tmp_path / "gsm8k"
    raw.mkdir()
    for split, rows in (("train", QUESTIONS), ("test", QUESTIONS[:2])):
        lines = [json.dumps({"question": q, "answer": a}) for q, a in rows]
        (raw / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "data"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlfleet.cli",
            "preprocess",
            "gsm8k",
            "--input",
            str(raw),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return out


FULL_FILE = Path(__file__).resolve().parents[1] / "fixtures" / "verl" / "ppo_trainer.yaml"


@pytest.mark.parametrize("layout", ["sections", "whole_file"])
def test_verl_quickstart_trains_two_steps(
    tiny_model_dir: Path, tmp_path: Path, layout: str
) -> None:
    """``sections``: a file with a few of verl's sections (the rest at verl's defaults);
    ``whole_file``: every key of verl's ppo_trainer.yaml, as the fixture holds it."""
    data = _gsm8k(tmp_path)
    config = tmp_path / "ppo_trainer.yaml"
    if layout == "sections":
        config.write_text(yaml.safe_dump(VERL_FILE), encoding="utf-8")
    else:
        config.write_text(FULL_FILE.read_text(encoding="utf-8"), encoding="utf-8")
    run_dir = tmp_path / "run"
    stderr_path = tmp_path / "stderr.txt"
    with stderr_path.open("w") as stderr:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "rlfleet.launch.train",
                "--config",
                str(config),
                *_quickstart(data, tiny_model_dir, run_dir),
            ],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            cwd=tmp_path,
            timeout=540,
            check=False,
        )
    err = stderr_path.read_text()
    assert done.returncode == 0, err[-4000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["global_steps"] == 2
    assert Path(summary["run_dir"]) == run_dir

    # the ignored keys given, listed once at start-up with the reason
    knob = "ignored actor_rollout_ref.rollout.gpu_memory_utilization=0.4: "
    assert err.count(knob) == 1
    assert err.count("ignored data.dataloader_num_workers=8: ") == 1

    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["rollout"]["engine"] == "hf"
    assert resolved["rollout"]["dtype"] == "bfloat16"  # verl's default, not rlfleet's
    assert resolved["actor"]["ppo_micro_batch_size"] == 2
    assert resolved["critic"]["lr"] == pytest.approx(1e-5)
    assert resolved["resource_pools"] == {"global_pool": [1]}
    report = yaml.safe_load((run_dir / "verl_translation.yaml").read_text())
    mapped = {m["verl"]: m["rlfleet"] for m in report["mapped"]}
    assert mapped["critic.ppo_micro_batch_size_per_gpu"] == "critic.ppo_micro_batch_size"
    assert mapped["trainer.logger"] == "trainer.logger"
    ignored = {i["verl"] for i in report["ignored"]}
    assert "actor_rollout_ref.rollout.gpu_memory_utilization" in ignored
