"""A checkpoint saved by the trainer on a CUDA device (FSDP2, megatron) holds a
``huggingface/`` folder that loads on CPU, equal to the checkpoint's actor state.
Skipped where there is no GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rlfleet.trainer import checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

_SCRIPT = textwrap.dedent(
    """
    import sys
    from rlfleet.trainer import checkpoint
    from rlfleet.trainer.core import TrainerCore
    from rlfleet.trainer.megatron_testing import scored_batch
    from rlfleet.trainer.testing import make_config

    model_dir, run_dir, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    cfg = make_config(
        model_dir,
        ["trainer.device=cuda", f"trainer.default_local_dir={run_dir}", *overrides],
        algorithm={"adv_estimator": "gae"},
        actor={"lr": 1e-3},
    )
    core = TrainerCore(cfg)
    for step in range(2):
        core.train_step(scored_batch(step))
    checkpoint.save(core, step=2)
    core.shutdown()
    """
)


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["actor.param_offload=true"],
        ["actor.backend=megatron", "critic.backend=megatron"],
    ],
    ids=["fsdp", "fsdp-offload", "megatron"],
)
def test_cuda_checkpoint_holds_hf(
    tiny_model_dir: Path, tmp_path: Path, overrides: list[str]
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tiny_model_dir), str(run_dir), *overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    folder = run_dir / "checkpoints" / "global_step_2"
    actor = checkpoint.read_state(folder / "actor")["model"]
    assert all(t.device.type == "cpu" for t in actor.values())
    model = AutoModelForCausalLM.from_pretrained(folder / "huggingface", local_files_only=True)
    AutoTokenizer.from_pretrained(folder / "huggingface", local_files_only=True)
    loaded = model.state_dict()
    assert {n for n, _ in model.named_parameters()} <= set(actor)
    for name, t in actor.items():
        assert torch.equal(loaded[name], t), name
