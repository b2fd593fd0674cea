"""The reward-model scorer on a CUDA device gives the CPU's scores. Skipped where there
is no GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlfleet.reward.model import RewardModelScorer
from rlfleet.reward.types import ChatMessage, Sample

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_reward_model_on_cuda_matches_cpu(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path / "tiny-rm"
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    model.config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    samples = [
        Sample("hh-rlhf", "Sure, here is how." * (i + 1), prompt=f"Question {i}?")
        for i in range(12)
    ] + [Sample("hh-rlhf", "No.", prompt_messages=[ChatMessage("user", "A joke, please.")])]
    cpu = RewardModelScorer(str(out), max_tokens_per_batch=512)
    gpu = RewardModelScorer(str(out), max_tokens_per_batch=512, device="cuda")
    assert next(gpu.model.parameters()).device.type == "cuda"
    a = [o.score for o in cpu.score(samples)]
    b = [o.score for o in gpu.score(samples)]
    assert b == pytest.approx(a, abs=1e-4)
    assert len(set(b)) == len(samples)
