"""``actor.trust_remote_code`` reaches every loader of the actor's model: the trainer's
FSDP backend, the rollout engine and the replica's tokenizers (``rlfleet serve
rollout`` takes it from the config or ``--trust-remote-code``). The model here is the
tiny Llama saved under a model type transformers does not know, whose classes live in
the folder's own Python files, as a remote-code model on the hub does."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch

from rlfleet.rollout.hf_engine import HFEngine
from rlfleet.rollout.server import (
    add_serve_arguments,
    build_engine,
    engine_kwargs,
    resolve_arguments,
)
from rlfleet.trainer.core import TrainerCore
from rlfleet.trainer.testing import make_batch, make_config

CONFIGURATION = """
from transformers import LlamaConfig


class RemoteConfig(LlamaConfig):
    model_type = "rlfleet_remote_llama"
"""

MODELING = """
from transformers import LlamaForCausalLM

from .configuration_remote import RemoteConfig


class RemoteForCausalLM(LlamaForCausalLM):
    config_class = RemoteConfig
"""


@pytest.fixture(scope="module")
def remote_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("remote") / "model"
    shutil.copytree(tiny_model_dir, out)
    (out / "configuration_remote.py").write_text(CONFIGURATION)
    (out / "modeling_remote.py").write_text(MODELING)
    config = json.loads((out / "config.json").read_text())
    config["model_type"] = "rlfleet_remote_llama"
    config["architectures"] = ["RemoteForCausalLM"]
    config["auto_map"] = {
        "AutoConfig": "configuration_remote.RemoteConfig",
        "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM",
    }
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_the_model_needs_its_own_code(remote_model: Path) -> None:
    with pytest.raises(ValueError, match="trust_remote_code"):
        HFEngine(remote_model)


def test_the_trainer_loads_it_with_the_actor_key(remote_model: Path) -> None:
    cfg = make_config(
        str(remote_model),
        algorithm={"adv_estimator": "grpo"},
        actor={"trust_remote_code": True, "ppo_mini_batch_size": 2},
    )
    core = TrainerCore(cfg)
    assert type(core.backend.models["actor"]).__name__ == "RemoteForCausalLM"
    batch = {**make_batch(seed=0), "scores": torch.tensor([1.0, 0.0, 0.0, 1.0])}
    assert "actor/pg_loss" in core.train_step(batch)


def test_a_replica_loads_it_from_the_config(remote_model: Path, tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(f"actor:\n  model_path: {remote_model}\n  trust_remote_code: true\n")
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = resolve_arguments(parser.parse_args(["--config", str(config)]))
    assert args.trust_remote_code is True
    engine = build_engine(args.engine, args.model, **engine_kwargs(args))
    assert type(engine.model).__name__ == "RemoteForCausalLM"
    # A flag given wins over the config.
    args = resolve_arguments(parser.parse_args(["--config", str(config), "--no-trust-remote-code"]))
    assert engine_kwargs(args).get("trust_remote_code") is None
