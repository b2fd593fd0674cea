"""HF engine: log-probs equal a teacher-forced forward pass, sampling semantics, weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from rlfleet.common.errors import FailedPrecondition, InvalidArgument  # noqa: E402
from rlfleet.rollout.engine import (  # noqa: E402
    Engine,
    FinishReason,
    GenerationRequest,
    SampleOutput,
    SamplingParams,
)
from rlfleet.rollout.hf_engine import HFEngine  # noqa: E402
from rlfleet.trainer.ppo.core_algos import logprobs_from_logits  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 12, 13, 14, 15, 16, 17, 18]]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> HFEngine:
    return HFEngine(tiny_model_dir)


def teacher_forced(engine: HFEngine, prompt: list[int], s: SampleOutput, temperature: float):
    seq = torch.tensor([prompt + s.token_ids])
    with torch.no_grad():
        logits = engine.model(seq).logits[0, len(prompt) - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
    return logprobs_from_logits(logits, torch.tensor(s.token_ids))


def test_is_an_engine(engine: HFEngine) -> None:
    assert isinstance(engine, Engine)
    info = engine.info()
    assert (info.engine, info.dtype, info.device) == ("hf", "float32", "cpu")
    assert info.eos_token_ids == (2, 4)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_logprobs_match_teacher_forced_forward(engine: HFEngine, temperature: float) -> None:
    params = SamplingParams(n=2, temperature=temperature, max_tokens=10, seed=3, top_k=50)
    [samples] = engine.generate([GenerationRequest(PROMPTS, params)])
    assert [(s.prompt_index, s.sample_index) for s in samples] == [
        (p, k) for p in range(3) for k in range(2)
    ]
    worst = 0.0
    for s in samples:
        assert len(s.logprobs) == len(s.token_ids) == 10
        ref = teacher_forced(engine, PROMPTS[s.prompt_index], s, temperature)
        worst = max(worst, (ref - torch.tensor(s.logprobs)).abs().max().item())
    assert worst < 1e-4, worst


def test_greedy_matches_hf_generate(engine: HFEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    [samples] = engine.generate([GenerationRequest(PROMPTS, params)])
    for s, prompt in zip(samples, PROMPTS, strict=True):
        ref = engine.model.generate(
            torch.tensor([prompt]),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert s.token_ids == ref
        assert s.finish_reason == FinishReason.LENGTH


def test_seeded_sampling_is_reproducible_and_independent_of_batchmates(engine: HFEngine) -> None:
    params = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=11)
    [a] = engine.generate([GenerationRequest(PROMPTS[:2], params)])
    other = GenerationRequest([[7, 7, 7]], SamplingParams(n=2, temperature=1.0, max_tokens=9))
    [b, _] = engine.generate([GenerationRequest(PROMPTS[:2], params), other])
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    # Different samples of one prompt differ (with overwhelming probability).
    assert len({tuple(s.token_ids) for s in a[:3]}) > 1
    [c] = engine.generate(
        [
            GenerationRequest(
                PROMPTS[:2], SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=12)
            )
        ]
    )
    assert [s.token_ids for s in a] != [s.token_ids for s in c]


def test_seed_indices_make_a_prompts_samples_independent_of_its_request(
    engine: HFEngine,
) -> None:
    """One batch of three prompts, then the same prompts split over two requests (in
    another order) with their batch indices as seed indices: the same samples."""
    params = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=13)
    [whole] = engine.generate([GenerationRequest(PROMPTS, params)])
    first, second = engine.generate(
        [
            GenerationRequest([PROMPTS[2], PROMPTS[0]], params, seed_indices=[2, 0]),
            GenerationRequest([PROMPTS[1]], params, seed_indices=[1]),
        ]
    )
    split = {(2, s.sample_index): s.token_ids for s in first if s.prompt_index == 0}
    split |= {(0, s.sample_index): s.token_ids for s in first if s.prompt_index == 1}
    split |= {(1, s.sample_index): s.token_ids for s in second}
    assert split == {(s.prompt_index, s.sample_index): s.token_ids for s in whole}
    # Without them, the prompt alone in its request draws the noise of index 0.
    [alone] = engine.generate([GenerationRequest([PROMPTS[1]], params)])
    assert [s.token_ids for s in alone] != [s.token_ids for s in whole if s.prompt_index == 1]


def test_top_k_1_is_greedy(engine: HFEngine) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    topk1 = SamplingParams(temperature=0.9, top_k=1, max_tokens=6, seed=0)
    tiny_p = SamplingParams(temperature=0.9, top_p=1e-6, max_tokens=6, seed=0)
    [g, k, p] = engine.generate(
        [
            GenerationRequest(PROMPTS, greedy),
            GenerationRequest(PROMPTS, topk1),
            GenerationRequest(PROMPTS, tiny_p),
        ]
    )
    assert [s.token_ids for s in g] == [s.token_ids for s in k] == [s.token_ids for s in p]


def test_stop_ids_end_a_sample_and_are_returned(engine: HFEngine) -> None:
    [free] = engine.generate(
        [GenerationRequest(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8))]
    )
    stop_at = free[0].token_ids[2]
    first = free[0].token_ids.index(stop_at)
    [stopped] = engine.generate(
        [
            GenerationRequest(
                PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=(stop_at,))
            )
        ]
    )
    s = stopped[0]
    assert s.token_ids == free[0].token_ids[: first + 1]
    assert s.finish_reason == FinishReason.STOP
    assert len(s.logprobs) == len(s.token_ids)


def test_mixed_max_tokens_and_no_logprobs(engine: HFEngine) -> None:
    seen: list[tuple[int, int]] = []
    out = engine.generate(
        [
            GenerationRequest(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=2)),
            GenerationRequest(
                PROMPTS[1:2], SamplingParams(temperature=0, max_tokens=5, logprobs=False)
            ),
        ],
        on_sample=lambda r, s: seen.append((r, len(s.token_ids))),
    )
    assert [len(s.token_ids) for s in out[0]] == [2]
    assert out[1][0].logprobs == [] and len(out[1][0].token_ids) == 5
    assert seen == [(0, 2), (1, 5)]  # streamed in the order they finished


def test_validation_names_the_field(engine: HFEngine) -> None:
    with pytest.raises(InvalidArgument, match=r"prompts\[1\].token_ids"):
        engine.validate([GenerationRequest([[1], []], SamplingParams())])
    with pytest.raises(InvalidArgument, match=r"sampling\.max_tokens") as e:
        engine.validate([GenerationRequest([[1, 2]], SamplingParams(max_tokens=5000))])
    assert "2048" in str(e.value)
    with pytest.raises(InvalidArgument, match="vocabulary"):
        engine.validate([GenerationRequest([[1, 99999]], SamplingParams())])
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)


def test_sleep_level2_drops_weights_until_an_update(tiny_model_dir: Path) -> None:
    eng = HFEngine(tiny_model_dir)
    req = [GenerationRequest(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4))]
    before = eng.generate(req)[0][0].token_ids
    weights = {k: v.clone() for k, v in eng.model.state_dict().items()}
    nbytes = sum(p.numel() * 4 for p in eng.model.parameters())
    freed = eng.sleep(level=2)
    assert freed == nbytes
    assert eng.model.model.embed_tokens.weight.numel() == 0
    with pytest.raises(FailedPrecondition):
        eng.generate(req)
    eng.wake_up()
    with pytest.raises(FailedPrecondition, match="update"):
        eng.generate(req)
    eng.update_weights(weights, version=1)
    assert eng.model.lm_head.weight is eng.model.model.embed_tokens.weight  # still tied
    assert eng.generate(req)[0][0].token_ids == before
    assert eng.info().weight_version == 1


def test_sleep_at_level_1_then_2_goes_deeper(tiny_model_dir: Path) -> None:
    """Asked for level 2 while asleep at level 1, the engine drops its weights (it
    returned OK and did nothing); the same level again, or a lower one, is a no-op."""
    eng = HFEngine(tiny_model_dir)
    nbytes = sum(p.numel() * 4 for p in eng.model.parameters())
    assert eng.sleep(level=1) == 0  # cpu: the weights already live in host memory
    assert eng.sleep(level=1) == 0
    assert eng.sleep(level=2) == nbytes
    assert eng.model.model.embed_tokens.weight.numel() == 0
    assert eng.sleep(level=1) == 0 and eng.sleep(level=2) == 0
    eng.wake_up()
    req = [GenerationRequest(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4))]
    with pytest.raises(FailedPrecondition, match="update"):
        eng.generate(req)


def test_update_weights_checks_names_shapes_dtypes(tiny_model_dir: Path) -> None:
    eng = HFEngine(tiny_model_dir)
    sd = {k: v.clone() for k, v in eng.model.state_dict().items()}
    bad_shape = dict(sd, **{"model.norm.weight": torch.zeros(3)})
    with pytest.raises(InvalidArgument, match=r"'model.norm.weight' has shape \[3\]"):
        eng.update_weights(bad_shape, 1)
    with pytest.raises(InvalidArgument, match="dtype bfloat16"):
        eng.update_weights(dict(sd, **{"model.norm.weight": sd["model.norm.weight"].bfloat16()}), 1)
    with pytest.raises(InvalidArgument, match="'nope' is not a parameter"):
        eng.update_weights(dict(sd, nope=torch.zeros(1)), 1)
    partial = dict(sd)
    del partial["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(InvalidArgument, match="missing 1 of"):
        eng.update_weights(partial, 1)
    assert eng.info().weight_version == 0
    # The tied alias alone covers the embedding.
    alias_only = dict(sd)
    del alias_only["model.embed_tokens.weight"]
    eng.update_weights(alias_only, 2)
    assert eng.info().weight_version == 2


@pytest.mark.parametrize(
    ("prompts", "params", "field", "message"),
    [
        ([], {}, "requests[0].prompts", "no prompts"),
        ([[1, 2], []], {}, "prompts[1].token_ids", "prompt has no tokens"),
        ([[1, -3, 99, 7]], {}, "prompts[0].token_ids", r"token ids \[-3, 99\] outside"),
        ([[1] * 10], {"max_tokens": 60}, "sampling.max_tokens", "= 70 exceeds .* 64 tokens"),
        ([[1]], {"stop_token_ids": [5, 64]}, "sampling.stop_token_ids", r"stop ids \[64\]"),
    ],
)
def test_validate_requests_names_the_field(
    prompts: list[list[int]], params: dict[str, Any], field: str, message: str
) -> None:
    from rlfleet.rollout.engine import validate_requests

    request = GenerationRequest(prompts=prompts, params=SamplingParams(**params))
    with pytest.raises(InvalidArgument, match=message) as err:
        validate_requests([request], vocab_size=64, max_len=64)
    assert err.value.field == field
    validate_requests(
        [GenerationRequest(prompts=[[0, 63]], params=SamplingParams(max_tokens=62))], 64, 64
    )


def test_samples_do_not_depend_on_token_budget_batches(tiny_model_dir: Path) -> None:
    """Rows grouped by prompt length into token-budget batches draw the same tokens
    as in one batch (seeded), and their log-probs still match a teacher-forced pass."""
    prompts = [[5] * n for n in (3, 17, 9, 30, 4, 22)]
    params = SamplingParams(n=3, temperature=0.9, max_tokens=7, seed=21, ignore_eos=True)
    whole = HFEngine(tiny_model_dir)
    split = HFEngine(tiny_model_dir, max_num_batched_tokens=3 * (17 + 7))
    [a] = whole.generate([GenerationRequest(prompts, params)])
    order: list[int] = []
    [b] = split.generate(
        [GenerationRequest(prompts, params)], on_sample=lambda r, s: order.append(s.prompt_index)
    )
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    # Shortest prompts first: the batches went by length.
    assert order[:3] == [0, 0, 0] and order[-3:] == [3, 3, 3]
    worst = 0.0
    for s in b:
        ref = teacher_forced(split, prompts[s.prompt_index], s, 0.9)
        worst = max(worst, (ref - torch.tensor(s.logprobs)).abs().max().item())
    assert worst < 1e-4, worst
    with pytest.raises(InvalidArgument, match="max_num_batched_tokens"):
        HFEngine(tiny_model_dir, max_num_batched_tokens=0)


def test_token_budget_groups_cover_every_row_within_the_budget() -> None:
    from rlfleet.rollout.hf_engine import _Rows

    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 40, (25,), generator=gen).tolist()
    requests = [
        GenerationRequest([[1] * n for n in lens[:15]], SamplingParams(n=2, max_tokens=8)),
        GenerationRequest([[1] * n for n in lens[15:]], SamplingParams(n=3, max_tokens=20)),
    ]
    rows = _Rows.build(requests, eos=(2,))
    assert [len(rows.groups(None))] == [1]
    budget = 300
    groups = rows.groups(budget)
    assert sorted(np.concatenate(groups).tolist()) == list(range(15 * 2 + 10 * 3))
    for g in groups:
        cost = len(g) * (rows.length[g].max() + rows.max_new[g].max())
        assert cost <= budget or len(g) == 1
        assert (np.diff(rows.length[g]) >= 0).all()  # grouped by prompt length
    # A row larger than the budget runs alone rather than not at all.
    assert [len(g) for g in rows.groups(5)] == [1] * 60


def test_rows_that_finish_early_leave_the_batch(engine: HFEngine) -> None:
    """Eight short rows end after two tokens, so the batch drops them (and their
    cache) and goes on with the two long ones: those match a run on their own."""
    short = GenerationRequest([[5, 6, 7]] * 8, SamplingParams(temperature=0, max_tokens=2))
    long = GenerationRequest(
        PROMPTS[:2], SamplingParams(n=1, temperature=0.8, max_tokens=9, seed=4, ignore_eos=True)
    )
    [s, mixed] = engine.generate([short, long])
    [alone] = engine.generate([long])
    assert [len(x.token_ids) for x in s] == [2] * 8
    assert [x.token_ids for x in mixed] == [x.token_ids for x in alone]
    for x in mixed:
        ref = teacher_forced(engine, PROMPTS[x.prompt_index], x, 0.8)
        assert (ref - torch.tensor(x.logprobs)).abs().max().item() < 1e-4


def test_sampler_draws_from_the_softmax() -> None:
    """The inversion sampler with counter-based numbers: token frequencies over many
    rows match softmax(logits / T), top-k and top-p keep only their tokens, and the
    log-probs are those of the untruncated distribution."""
    from rlfleet.rollout.hf_engine import _Batch, _Rows, _sample

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, float("-inf"), 0.25])
    n = 20000
    for temperature, top_k, top_p in [
        (1.0, -1, 1.0),
        (0.7, -1, 1.0),
        (1.0, 3, 1.0),
        (1.0, -1, 0.6),
    ]:
        params = SamplingParams(
            n=n, temperature=temperature, top_k=top_k, top_p=top_p, seed=5, max_tokens=1
        )
        rows = _Rows.build([GenerationRequest([[1]], params)], eos=())
        batch = _Batch.of(rows, np.arange(n), vocab=8, pad=0, dev=torch.device("cpu"))
        tok, lp = _sample(logits.repeat(n, 1), batch, step=0)
        probs = torch.softmax(logits / temperature, -1)
        assert torch.allclose(lp, probs.log()[tok], atol=1e-5)
        keep = torch.ones(8, dtype=torch.bool)
        if top_k > 0:
            keep = probs >= probs.topk(top_k).values[-1]
        if top_p < 1:
            ordered = probs.sort(descending=True)
            before = ordered.values.cumsum(0) - ordered.values
            keep = torch.zeros(8, dtype=torch.bool)
            keep[ordered.indices[before < top_p]] = True
        want = torch.where(keep, probs, 0) / probs[keep].sum()
        freq = torch.bincount(tok, minlength=8).float() / n
        assert (freq - want).abs().max().item() < 0.015, (temperature, top_k, top_p, freq, want)
        assert freq[~keep].sum().item() == 0


def test_grouped_decode_attention_equals_sdpa(tiny_model_dir: Path) -> None:
    """The engine's own model attends in decode steps without repeating the KV cache
    per query head; on a left-padded batch its logits equal plain sdpa's."""
    from transformers import AutoModelForCausalLM

    eng = HFEngine(tiny_model_dir)
    assert eng.model.config._attn_implementation == "rlfleet_grouped_decode_sdpa"
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), local_files_only=True)
    assert plain.config._attn_implementation == "sdpa"
    ids = torch.tensor([[0, 0, 0, 5, 6, 7], [3, 4, 5, 6, 7, 8]])
    mask = (ids != 0).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    step = torch.tensor([[9], [10]])
    logits = []
    for model in (eng.model, plain):
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
            nxt = model(
                input_ids=step,
                attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], -1),
                position_ids=pos[:, -1:] + 1,
                past_key_values=out.past_key_values,
                use_cache=True,
            )
        logits.append(nxt.logits[:, -1])
    assert torch.allclose(logits[0], logits[1], atol=1e-5)
