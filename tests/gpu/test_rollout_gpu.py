"""The HF rollout engine on a CUDA device: log-probs against a teacher-forced forward of
the same weights, sleep / wake for colocated placement, an in-place weight update.
Skipped where there is no GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlfleet.rollout.engine import GenerationRequest, SamplingParams
from rlfleet.rollout.hf_engine import HFEngine
from rlfleet.trainer.ppo.core_algos import logprobs_from_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 12, 13, 14, 15, 16, 17, 18]]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> HFEngine:
    return HFEngine(tiny_model_dir, device="cuda")


def test_logprobs_match_teacher_forced_forward_on_cuda(engine: HFEngine) -> None:
    assert engine.info().device.startswith("cuda")
    params = SamplingParams(n=2, temperature=0.8, max_tokens=12, seed=5)
    [samples] = engine.generate([GenerationRequest(PROMPTS, params)])
    worst = 0.0
    for s in samples:
        prompt = PROMPTS[s.prompt_index]
        seq = torch.tensor([prompt + s.token_ids], device="cuda")
        with torch.no_grad():
            logits = engine.model(seq).logits[0, len(prompt) - 1 : -1].float() / 0.8
        ref = logprobs_from_logits(logits, torch.tensor(s.token_ids, device="cuda")).cpu()
        worst = max(worst, (ref - torch.tensor(s.logprobs)).abs().max().item())
    assert worst < 1e-4, worst


def test_sleep_releases_device_memory_and_wake_restores(tiny_model_dir: Path) -> None:
    eng = HFEngine(tiny_model_dir, device="cuda")
    req = [GenerationRequest(PROMPTS, SamplingParams(temperature=0, max_tokens=6))]
    before = [s.token_ids for s in eng.generate(req)[0]]
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    freed = eng.sleep(level=1)
    torch.cuda.synchronize()
    assert freed > 0
    assert torch.cuda.memory_allocated() <= held - freed
    eng.wake_up()
    assert [s.token_ids for s in eng.generate(req)[0]] == before


def test_weight_update_on_cuda_changes_greedy_output(tiny_model_dir: Path) -> None:
    eng = HFEngine(tiny_model_dir, device="cuda")
    req = [GenerationRequest(PROMPTS, SamplingParams(temperature=0, max_tokens=6))]
    before = [s.token_ids for s in eng.generate(req)[0]]
    g = torch.Generator().manual_seed(0)
    new = {
        k: v.detach().cpu() + 0.05 * torch.randn(v.shape, generator=g)
        for k, v in eng.model.named_parameters()
    }
    eng.update_weights(new, version=3)
    after = [s.token_ids for s in eng.generate(req)[0]]
    assert eng.info().weight_version == 3
    assert after != before
    for k, p in eng.model.named_parameters():
        assert p.device.type == "cuda"
        assert torch.equal(p.detach().cpu(), new[k]), k
