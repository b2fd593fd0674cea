"""The `rlfleet train` path: a run whose trainer, rollout and reward are separate processes
saves checkpoints that hold ``huggingface/`` (the trained actor, loadable and generating
with transformers), and `rlfleet export` writes it out as a process of its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from rlfleet.driver.data.preprocess import preprocess
from rlfleet.trainer import checkpoint

pytestmark = pytest.mark.slow


def _raw(model: Path, data: Path, run_dir: Path) -> dict[str, object]:
    return {
        "data": {
            "train_files": str(data / "train.parquet"),
            "val_files": str(data / "test.parquet"),
            "train_batch_size": 4,
            "max_prompt_length": 64,
            "max_response_length": 8,
        },
        "actor": {"model_path": str(model), "lr": 1e-3, "ppo_mini_batch_size": 2},
        "rollout": {"n": 2},
        "algorithm": {"adv_estimator": "grpo"},
        "reward": {"num_workers": 1},
        "trainer": {
            "total_training_steps": 2,
            "save_freq": 2,
            "test_freq": -1,
            "default_local_dir": str(run_dir),
            "resume_mode": "disable",
            "logger": ["jsonl"],
            "val_before_train": False,
        },
        "resource_pools": {"train_pool": [1], "rollout_pool": [1]},
        "mapping": {"actor": "train_pool", "rollout": "rollout_pool"},
    }


def _hf_params(folder: Path) -> tuple[dict[str, torch.Tensor], object, object]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model.state_dict(), model, tokenizer


def test_rlfleet_train_checkpoints_hold_hf_and_export_writes_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    preprocess("arithmetic", None, data, n=16, n_test=4, digits=1, ops="+-*", seed=0)
    run_dir = tmp_path / "run"
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(yaml.safe_dump(_raw(tiny_model_dir, data, run_dir)))
    cmd = [sys.executable, "-m", "rlfleet.launch.train", "--config", str(cfg_file)]
    done = subprocess.run([*cmd, "--no-scheduler"], capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]

    folder = run_dir / "checkpoints" / "global_step_2"
    actor = checkpoint.read_state(folder / "actor")["model"]
    loaded, model, tokenizer = _hf_params(folder / "huggingface")
    for name, t in actor.items():
        assert torch.equal(loaded[name], t), name
    ids = tokenizer("3+4=", return_tensors="pt")  # type: ignore[operator]
    out = model.generate(**ids, max_new_tokens=3, do_sample=False)  # type: ignore[attr-defined]
    assert out.shape[1] == ids["input_ids"].shape[1] + 3

    export = [sys.executable, "-m", "rlfleet.cli", "export", "--run", str(run_dir)]
    got = subprocess.run(
        [*export, "--out", str(tmp_path / "hf")], capture_output=True, text=True, timeout=120
    )
    assert got.returncode == 0, got.stderr[-3000:]
    assert json.loads(got.stdout.strip().splitlines()[-1])["step"] == 2
    exported, _, _ = _hf_params(tmp_path / "hf")
    for name, t in actor.items():
        assert torch.equal(exported[name], t), name

    again = subprocess.run(
        [*export, "--step", "1", "--out", str(tmp_path / "hf1")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 2
    assert again.stderr.strip().startswith("rlfleet export: --step: no checkpoint of step 1")
