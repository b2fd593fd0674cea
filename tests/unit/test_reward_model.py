"""The reward-model scorer on a tiny sequence-classification model built locally."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.common.config import RewardConfig, RewardModelConfig
from rlfleet.reward.model import pack_by_token_budget
from rlfleet.reward.types import ChatMessage, Sample


def test_pack_by_token_budget() -> None:
    lengths = [5, 100, 7, 6, 300, 8]
    batches = pack_by_token_budget(lengths, max_tokens=32)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for b in batches:
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 32
    assert pack_by_token_budget(lengths, 10_000, max_batch=2)[0] == [0, 3]


@pytest.fixture(scope="module")
def reward_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("rm") / "tiny-rm"
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    model.config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_reward_model_scores_are_batch_invariant(reward_model_dir: Path) -> None:
    from rlfleet.reward.model import RewardModelScorer

    samples = [
        Sample("hh-rlhf", "Sure, here is how.", prompt="How do I bake bread?"),
        Sample(
            "hh-rlhf",
            "No." * 20,
            prompt_messages=[ChatMessage("user", "Tell me a joke about cats, please.")],
        ),
        Sample("hh-rlhf", "", prompt="Hi"),
    ]
    big = RewardModelScorer(str(reward_model_dir), max_tokens_per_batch=4096)
    small = RewardModelScorer(str(reward_model_dir), max_tokens_per_batch=1)
    a = [o.score for o in big.score(samples)]
    b = [o.score for o in small.score(samples)]
    assert a == pytest.approx(b, abs=1e-4)
    assert len(set(a)) == 3  # distinct texts, distinct scores
    assert "<|im_start|>assistant" in big.text_for(samples[0])  # its own chat template


def test_manager_routes_alignment_data_to_the_reward_model(reward_model_dir: Path) -> None:
    from rlfleet.reward.core import RewardManager

    both = [Sample("Anthropic/hh-rlhf", "Sure.", prompt="Hi"), Sample("gsm8k", "#### 1", "1")]
    enabled = RewardModelConfig(enable=True, path=str(reward_model_dir))
    with RewardManager(RewardConfig(reward_model=enabled), num_workers=0) as m:
        # verl: an enabled reward model's score is every sample's reward.
        assert [r.scorer for r in m.score(both)] == ["reward_model", "reward_model"]
    routed = enabled.model_copy(update={"route_by_data_source": True})
    with RewardManager(RewardConfig(reward_model=routed), num_workers=0) as m:
        results = m.score(both)
        assert [r.scorer for r in results] == ["reward_model", "gsm8k"]
        assert results[0].error == "" and results[0].details["tokens"] > 0
        assert m.info().reward_model == str(reward_model_dir)


def test_reward_model_device_setting() -> None:
    from pydantic import ValidationError

    from rlfleet.reward.model import resolve_device

    assert RewardModelConfig().device == "auto"
    assert resolve_device("cpu") == "cpu" and resolve_device("cuda:1") == "cuda:1"
    torch = pytest.importorskip("torch")
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValidationError, match="device"):
        RewardModelConfig(device="tpu")
