"""What the e2e runs on a local cluster share: the arithmetic data, a small GRPO
config, and the data order a run must follow (imported by the tests of this folder)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rlfleet.driver.data.preprocess import preprocess
from rlfleet.driver.loop import PPOTrainer


def arithmetic(out: Path, n: int = 64, digits: int = 1) -> Path:
    """The synthetic arithmetic set (train and test parquet) in ``out``."""
    preprocess("arithmetic", None, out, n=n, n_test=8, digits=digits, ops="+-*", seed=0)
    return out


def grpo_config(
    model: Path, data: Path, run_dir: Path, **sections: Mapping[str, Any]
) -> dict[str, Any]:
    """A GRPO run of a few steps (4 prompts x 2 samples, 8 tokens), train and rollout
    pools on a core each; ``sections`` are merged into its sections (one level deep)."""
    raw: dict[str, Any] = {
        "data": {
            "train_files": str(data / "train.parquet"),
            "val_files": str(data / "test.parquet"),
            "train_batch_size": 4,
            "max_prompt_length": 64,
            "max_response_length": 8,
        },
        "actor": {"model_path": str(model), "ppo_mini_batch_size": 4},
        "rollout": {"n": 2},
        "algorithm": {"adv_estimator": "grpo"},
        "reward": {"num_workers": 1},
        "trainer": {
            "total_training_steps": 3,
            "test_freq": -1,
            "save_freq": -1,
            "default_local_dir": str(run_dir),
            "resume_mode": "disable",
            "logger": ["jsonl"],
            "val_before_train": False,
        },
        "resource_pools": {"train_pool": [1], "rollout_pool": [1]},
        "mapping": {"actor": "train_pool", "rollout": "rollout_pool"},
    }
    for name, values in sections.items():
        if isinstance(raw.get(name), dict):
            raw[name] = {**raw[name], **values}
        else:
            raw[name] = dict(values)
    return raw


def loader_order(trainer: PPOTrainer, steps: int) -> list[list[int]]:
    """The prompts of steps 1..steps, straight from a fresh loader with the run's seed."""
    from rlfleet.driver.data.sampler import PromptLoader

    d = trainer.config.data
    loader = PromptLoader(trainer.train_dataset, d.train_batch_size, shuffle=d.shuffle, seed=d.seed)
    out: list[list[int]] = []
    while len(out) < steps:
        for batch in loader:
            out.append([int(i) for i in batch["index"]])
            if len(out) == steps:
                break
    return out


Weights = dict[str, torch.Tensor]


def checkpoint_weights(folder: Path) -> Weights:
    """The actor's weights in a checkpoint folder (its Hugging Face export)."""
    from safetensors.torch import load_file

    files = sorted((folder / "huggingface").glob("*.safetensors"))
    assert files, f"no actor weights under {folder}: {sorted(folder.rglob('*'))}"
    out: Weights = {}
    for f in files:
        out.update(load_file(str(f)))
    return out
