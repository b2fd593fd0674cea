"""The demo's example configs survive a new model: on a second model the project
builds, shaped otherwise than the demo's (``tiny-deep``: narrower, twice as deep, its
own tokenizer), from a weak supervised start on two-digit additions and subtractions,
``examples/arithmetic_ppo.yaml`` and ``examples/arithmetic_grpo.yaml`` with only the
model and data paths changed raise greedy test accuracy (before this recipe they
lowered it: 31% -> 26% with GAE, 31% -> 19% with GRPO; BENCHMARKS.md).

How weak the start is depends on the CPU kind (the order of floating-point sums in
300 SFT steps): 31% on an Intel Xeon VM, 6% on an AMD EPYC VM, both 2 vCPUs; the
recipe raised both (31% -> 37% / 36%, 6% -> 24% / 24%). The test asks for a weak start
that is not nothing, and for a rise.

The model pair (base and warm start) and the data are built once for the module, the
way ``rlfleet demo --preset tiny-deep --ops +- --sft-steps 300`` builds them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.common.tiny_model import build_tiny_model
from rlfleet.launch.demo import make_data, run_example, sft_warm_start

PRESET = "tiny-deep"
OPS = "+-"
SFT_STEPS = 300  # a weak start: 6% to 31% greedy accuracy, by CPU kind


@pytest.fixture(scope="module")
def weak_start(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    import torch

    torch.set_num_threads(1)  # as the demo: the trainer and the rollout keep a core each
    root = tmp_path_factory.mktemp("recipe")
    model = build_tiny_model(root / PRESET, preset=PRESET, seed=0)
    data = root / "data"
    make_data(data, seed=0, ops=OPS)
    sft = root / f"{PRESET}-sft"
    sft_warm_start(model, data, sft, steps=SFT_STEPS, lr=3e-3, batch_size=32, seed=0)
    return sft, data


@pytest.mark.parametrize("example", ["arithmetic_ppo.yaml", "arithmetic_grpo.yaml"])
def test_example_config_does_not_collapse_on_a_second_model(
    weak_start: tuple[Path, Path], tmp_path: Path, example: str
) -> None:
    sft, data = weak_start
    summary = run_example(example, sft, data, tmp_path, extra=["trainer.logger=[jsonl]"])
    vals = [v["val/test_score/mean"] for v in summary["validation"]]
    before, after = vals[0], vals[-1]
    assert 0.02 <= before <= 0.5, f"the warm start is meant to be weak: {before:.0%}"
    assert after > before, (
        f"{example}: greedy accuracy did not rise {before:.0%} -> {after:.0%} ({vals})"
    )
