"""The agentic calculator demo on a CPU: GRPO with multi-turn rollouts teaches the tiny
model to call the calculator, and the reward rises.

Everything is built here: the tiny model, the remainder problems
(`rlfleet preprocess calculator`'s recipe), a supervised warm start on conversations
the project writes (mostly direct answers, which are guesses, and some calls to the
tool), then ten GRPO steps of `examples/agentic_calculator.yaml` with the built-in
calculator, every role in this process. Seeded: the same run each time on one
machine. About two minutes on two cores, most of it the warm start (the 1M-parameter
model needs ~200 steps before it copies the expression into its call and the tool's
answer into its reply; without that no tool can help it).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_grpo_teaches_the_tiny_model_to_call_the_calculator(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    import torch

    from rlfleet.launch.agentic_demo import make_data, run_ppo, sft_warm_start

    torch.set_num_threads(2)
    torch.manual_seed(0)
    data = tmp_path / "data"
    make_data(data, seed=0)
    sft = tmp_path / "sft"
    sft_warm_start(tiny_model_dir, data, sft, seed=0)
    summary = run_ppo(sft, data, tmp_path / "run")

    assert summary["global_steps"] == 10
    steps = [
        json.loads(line)
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    train = [s["metrics"] for s in steps if "critic/score/mean" in s.get("metrics", {})]
    assert len(train) == 10
    scores = np.array([m["critic/score/mean"] for m in train])
    turns = np.array([m["multi_turn/turns/mean"] for m in train])
    # It learns to call the tool: the share of conversations with a tool turn grows.
    assert turns[-2:].mean() > turns[:2].mean() + 0.2, turns
    assert turns[-2:].mean() > 1.7, turns
    # ... and the reward rises with it (training reward, second half over first).
    assert scores[5:].mean() > scores[:5].mean() + 0.05, scores
    vals = summary["validation"]
    before = vals[0]["val/test_score/mean"]
    after = vals[-1]["val/test_score/mean"]
    assert after >= before and after > 0.5, (before, after)
    # The replica inserted tool turns (loss-mask 0) into the sequences the trainer got;
    # that they are masked out of the loss and their log-probs left out is checked
    # token by token in tests/integration/test_multiturn_over_grpc.py.
    assert train[-1]["multi_turn/tool_tokens/mean"] > 10
