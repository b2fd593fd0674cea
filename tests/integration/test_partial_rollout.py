"""Partial rollouts (``trainer.pipeline.partial_rollout``): a weight push that lands
while a batch generates is applied between two decode steps; the samples keep their
tokens so far and go on under the new weights, each token tagged with its version.

The push is made to land at a known decode step: a forward hook on the model starts
it on another thread at the k-th forward (the prefill is the first) and waits until
the engine has it (partial on: posted for the next step; off: inside
``update_weights``, waiting for the engine), so no timing decides the outcome.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

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

pytestmark = pytest.mark.timeout(120)

SWITCH_AT = 4  # the push lands during the 4th forward: tokens 0..3 old, 4.. new
RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(10, 2000, size=int(n)).tolist() for n in (5, 7, 4, 6, 5, 8, 3, 6, 5)]
SHORT = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)  # done before the push
LONG = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=3)


def requests() -> list[GenerationRequest]:
    """Nine rows: six finish after two tokens (the batch then drops them, so the
    rebuild under new weights runs on a selected batch), three run on past the push."""
    return [
        GenerationRequest(PROMPTS[:6], SHORT),
        GenerationRequest(PROMPTS[6:8], LONG),
        GenerationRequest(PROMPTS[8:], SAMPLED),
    ]


def new_weights(engine: HFEngine, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: p.detach() + 0.05 * torch.randn(p.shape, generator=g)
        for n, p in engine.model.named_parameters()
    }


class PushAt:
    """A forward hook that starts ``push`` on a thread at the ``at``-th forward and
    returns once ``landed()`` is true (bounded)."""

    def __init__(self, at: int, push: Callable[[], Any], landed: Callable[[], bool]) -> None:
        self.at, self.push, self.landed = at, push, landed
        self.calls = 0
        self.results: list[Any] = []
        self.thread: threading.Thread | None = None

    def __call__(self, module: Any, args: Any, output: Any) -> None:
        self.calls += 1
        if self.calls != self.at:
            return
        self.thread = threading.Thread(target=lambda: self.results.append(self.push()))
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.landed() and time.monotonic() < deadline:
            time.sleep(0.002)
        assert self.landed(), "the weight push did not reach the engine"


def run_with_push(
    core: RolloutCore, engine: HFEngine, push: Callable[[], Any], landed: Callable[[], bool]
) -> tuple[list[list[SampleOutput]], PushAt]:
    hook = PushAt(SWITCH_AT, push, landed)
    handle = engine.model.register_forward_hook(hook)
    try:
        handles = core.submit_requests(requests())
        out = [h.result() for h in handles]
    finally:
        handle.remove()
    assert hook.thread is not None
    hook.thread.join(timeout=60)
    assert not hook.thread.is_alive()
    return out, hook


def teacher_forced(
    model: Any, prompt: list[int], tokens: list[int], temperature: float
) -> tuple[list[int], list[float]]:
    """Greedy tokens and the log-probs of ``tokens``, from one forward over prompt +
    tokens (position i of the response is predicted at prompt length - 1 + i)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    lp = torch.log_softmax(logits / (temperature or 1.0), -1)
    picked = lp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
    return logits.argmax(-1).tolist(), picked.tolist()


@pytest.fixture()
def old_outputs(tiny_model_dir: Path) -> list[list[SampleOutput]]:
    """What the old weights generate for the same requests, undisturbed."""
    return HFEngine(tiny_model_dir).generate(requests())


@pytest.fixture()
def partial_core(tiny_model_dir: Path) -> Iterator[tuple[RolloutCore, HFEngine]]:
    engine = HFEngine(tiny_model_dir, partial_rollout=True)
    core = RolloutCore(engine, replica_id="r0")
    try:
        yield core, engine
    finally:
        core.close()


def check_partial(
    out: list[list[SampleOutput]], old: list[list[SampleOutput]], engine: HFEngine
) -> None:
    """Nothing lost, the right versions per token, the prefix the old weights', the
    rest what the new weights produce from that prefix (teacher-forced)."""
    prompts = {0: PROMPTS[:6], 1: PROMPTS[6:8], 2: PROMPTS[8:]}
    params = {0: SHORT, 1: LONG, 2: SAMPLED}
    for r, samples in enumerate(out):
        assert [(s.prompt_index, s.sample_index) for s in samples] == [
            (i, 0) for i in range(len(prompts[r]))
        ]
        for s, o in zip(samples, old[r], strict=True):
            p = params[r]
            assert len(s.token_ids) == len(s.logprobs) == p.max_tokens  # nothing lost
            assert s.finish_reason == FinishReason.LENGTH
            assert s.weight_version == 0  # the oldest
            if p.max_tokens <= SWITCH_AT:  # finished before the push
                assert s.token_weight_versions == [0] * p.max_tokens
                assert s.token_ids == o.token_ids
                continue
            assert s.token_weight_versions == [0] * SWITCH_AT + [1] * (p.max_tokens - SWITCH_AT)
            # Before the push: exactly the old weights' tokens (and log-probs).
            assert s.token_ids[:SWITCH_AT] == o.token_ids[:SWITCH_AT]
            np.testing.assert_allclose(s.logprobs[:SWITCH_AT], o.logprobs[:SWITCH_AT], atol=1e-5)
            # After it: the new weights' (the engine holds them now).
            greedy, lps = teacher_forced(
                engine.model, prompts[r][s.prompt_index], s.token_ids, p.temperature
            )
            np.testing.assert_allclose(s.logprobs[SWITCH_AT:], lps[SWITCH_AT:], atol=1e-4)
            if p.temperature == 0:
                assert s.token_ids[SWITCH_AT:] == greedy[SWITCH_AT:]
            # ... which are not the old weights' log-probs for the same tokens.
            assert not np.allclose(s.logprobs[SWITCH_AT:], o.logprobs[SWITCH_AT:], atol=1e-3)


def test_push_mid_generation_continues_under_the_new_weights(
    partial_core: tuple[RolloutCore, HFEngine], old_outputs: list[list[SampleOutput]]
) -> None:
    core, engine = partial_core
    w = new_weights(engine)
    out, hook = run_with_push(
        core, engine, lambda: core.update_weights(w, 1), lambda: engine.update_pending
    )
    assert hook.results[0].version == 1 and engine.weight_version == 1
    check_partial(out, old_outputs, engine)


def test_push_mid_generation_over_grpc(
    partial_core: tuple[RolloutCore, HFEngine], old_outputs: list[list[SampleOutput]]
) -> None:
    """The same through a replica on a real gRPC server: the push is the chunk stream
    of UpdateWeights, the samples come back through Generate with their versions."""
    core, engine = partial_core
    server = start_rollout_server(core)
    try:
        with RemoteRolloutClient(server.address) as client:
            w = new_weights(engine)
            hook = PushAt(
                SWITCH_AT,
                lambda: client.update_weights(w, 1, transports=("grpc",)),
                lambda: engine.update_pending,
            )
            handle = engine.model.register_forward_hook(hook)
            try:
                out = [
                    sorted(
                        client.generate(r.prompts, r.params),
                        key=lambda s: (s.prompt_index, s.sample_index),
                    )
                    for r in [GenerationRequest(PROMPTS[6:8], LONG)]
                ]
            finally:
                handle.remove()
            assert hook.thread is not None
            hook.thread.join(timeout=60)
    finally:
        server.stop(0)
    assert engine.weight_version == 1
    for s, prompt, o in zip(out[0], PROMPTS[6:8], old_outputs[1], strict=True):
        assert len(s.token_ids) == LONG.max_tokens
        assert s.token_weight_versions == [0] * SWITCH_AT + [1] * (LONG.max_tokens - SWITCH_AT)
        assert s.token_ids[:SWITCH_AT] == o.token_ids[:SWITCH_AT]
        greedy, lps = teacher_forced(engine.model, prompt, s.token_ids, 0.0)
        assert s.token_ids[SWITCH_AT:] == greedy[SWITCH_AT:]
        np.testing.assert_allclose(s.logprobs[SWITCH_AT:], lps[SWITCH_AT:], atol=1e-4)


def test_partial_rollout_off_finishes_under_the_old_weights(
    tiny_model_dir: Path, old_outputs: list[list[SampleOutput]]
) -> None:
    """Off (the default): the push waits for the batch; every sample is the old
    weights' alone, with no per-token versions, and the push applies after."""
    engine = HFEngine(tiny_model_dir)
    core = RolloutCore(engine, replica_id="r0")
    entered = threading.Event()
    check = engine.check_weights

    def check_and_note(*args: Any, **kwargs: Any) -> None:
        check(*args, **kwargs)
        entered.set()  # update_weights checks, then waits for the engine's lock

    engine.check_weights = check_and_note  # type: ignore[method-assign]
    try:
        w = new_weights(engine)
        out, hook = run_with_push(core, engine, lambda: core.update_weights(w, 1), entered.is_set)
    finally:
        core.close()
    assert hook.results[0].version == 1 and engine.weight_version == 1
    for samples, old in zip(out, old_outputs, strict=True):
        for s, o in zip(samples, old, strict=True):
            assert s.token_ids == o.token_ids and s.weight_version == 0
            assert s.token_weight_versions == []
            np.testing.assert_allclose(s.logprobs, o.logprobs, atol=1e-5)


# --------------------------------------------------------------------------- the driver


@pytest.fixture(scope="module")
def arithmetic_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlfleet.driver.data.preprocess import preprocess

    out = tmp_path_factory.mktemp("arith")
    preprocess("arithmetic", None, out, n=64, n_test=8, digits=1, ops="+-*", seed=0)
    return out


def _pipelined_config(model: Path, data: Path, run_dir: Path, *more: str) -> Any:
    from rlfleet.common.config import load_config

    example = Path(__file__).resolve().parents[2] / "examples" / "ppo_tiny.yaml"
    return load_config(
        example,
        [
            f"actor.model_path={model}",
            f"data.train_files={data / 'train.parquet'}",
            f"data.val_files={data / 'test.parquet'}",
            f"trainer.default_local_dir={run_dir}",
            "data.train_batch_size=4",
            "data.max_response_length=8",
            "actor.ppo_mini_batch_size=2",
            "actor.ppo_micro_batch_size=null",
            "ref.log_prob_micro_batch_size=null",
            "rollout.log_prob_micro_batch_size=null",
            "rollout.n=2",
            "trainer.total_training_steps=3",
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
            "trainer.val_before_train=false",
            "trainer.resume_mode=disable",
            "trainer.logger=[jsonl]",
            "trainer.pipeline.enable=true",
            "trainer.pipeline.max_staleness=1",
            "trainer.pipeline.partial_rollout=true",
            "rollout.max_num_batched_tokens=null",  # a step's batch: one engine batch
            *more,
        ],
    )


def _run_holding_step_2(trainer: Any, engine: HFEngine) -> list[Any]:
    """``trainer.fit()`` with step 2's generation held at its first decode step until
    a weight update is posted to ``engine`` (step 1's push), so that it lands there."""
    producing: dict[str, int] = {"step": 0, "forwards": 0}
    produce = trainer._produce

    def tracked(step: int, min_version: int) -> Any:
        producing.update(step=step, forwards=0)
        return produce(step, min_version)

    def hold(module: Any, args: Any, output: Any) -> None:
        if producing["step"] != 2:
            return
        producing["forwards"] += 1
        if producing["forwards"] == 2:  # the first decode step of step 2's batch
            deadline = time.monotonic() + 120
            while not engine.update_pending and time.monotonic() < deadline:
                time.sleep(0.005)
            assert engine.update_pending, "the push of version 1 never came"

    trainer._produce = tracked
    handle = engine.model.register_forward_hook(hold)
    try:
        return list(trainer.fit())
    finally:
        handle.remove()


def _check_token_staleness(records: list[Any]) -> None:
    """Step 2 trains on samples whose first token is version 0's and the rest version
    1's: one version behind the policy by the sample count (staleness 1), mostly
    fresh by the token count."""
    assert [r.step for r in records] == [1, 2, 3]
    first, second, third = (r.metrics for r in records)
    for m in (first, second, third):
        for key in (
            "rollout/stale_token_frac",
            "rollout/token_staleness_mean",
            "rollout/token_staleness_max",
            "rollout/partial_sample_frac",
        ):
            assert key in m, key
        assert m["rollout/token_staleness_max"] <= m["staleness/max"] <= 1.0
        assert m["rollout/token_staleness_mean"] <= m["staleness/mean"]
    assert first["rollout/stale_token_frac"] == 0.0  # the initial weights, on-policy
    # Step 2: every sample began under version 0 (the oldest: staleness 1 by sample)...
    assert second["staleness/mean"] == 1.0
    assert second["rollout/partial_sample_frac"] > 0.0
    # ... but the tokens after the push are version 1's, the policy's own.
    assert 0.0 < second["rollout/stale_token_frac"] < 1.0
    assert second["rollout/token_staleness_mean"] < 1.0
    assert second["rollout/token_staleness_max"] == 1.0


def test_pipelined_run_with_partial_rollouts_reports_token_staleness(
    tiny_model_dir: Path, arithmetic_dir: Path, tmp_path: Path
) -> None:
    """Every role in this process: the push is handed over as tensors."""
    from rlfleet.driver.loop import PPOTrainer

    cfg = _pipelined_config(tiny_model_dir, arithmetic_dir, tmp_path)
    with PPOTrainer(config=cfg) as trainer:
        trainer.init_workers()
        engine = trainer._w.rollouts[0].client.core.engine
        assert isinstance(engine, HFEngine) and engine.partial_rollout
        records = _run_holding_step_2(trainer, engine)
    _check_token_staleness(records)


def _run_over_grpc(
    cfg: Any, engine: Any, run: Callable[[Any, Any], list[Any]]
) -> tuple[list[Any], RolloutCore, Any]:
    """``run(trainer, engine)`` with a trainer service and a replica on ``engine`` on
    real gRPC servers (the reward in process); returns the records, the replica
    (closed) and its status read before it closed."""
    from rlfleet.common.rpc import create_server
    from rlfleet.driver.clients import Role, remote_workers
    from rlfleet.driver.loop import PPOTrainer
    from rlfleet.reward.client import InProcessRewardClient
    from rlfleet.reward.core import RewardManager
    from rlfleet.trainer.core import TrainerCore
    from rlfleet.trainer.servicer import TrainerServicer
    from rlfleet.trainer.servicer import add_to_server as trainer_add_to_server

    trainer_core = TrainerCore(cfg)
    trainer_server = create_server([(trainer_add_to_server, TrainerServicer(trainer_core))])
    replica = RolloutCore(engine, replica_id="r0")
    replica_server = start_rollout_server(replica)
    try:
        mapping = remote_workers(trainer_server.address, [replica_server.address])
        mapping[Role.RewardModel] = InProcessRewardClient(RewardManager(cfg.reward, num_workers=0))
        with PPOTrainer(config=cfg, role_worker_mapping=mapping) as trainer:
            records = run(trainer, engine)
        status = replica.status()
    finally:
        replica_server.stop(0)
        replica.close()
        trainer_server.stop(0)
    return records, replica, status


def test_pipelined_run_over_grpc_with_bulk_pushes(
    tiny_model_dir: Path, arithmetic_dir: Path, tmp_path: Path
) -> None:
    """A trainer service and a replica on real gRPC servers; the pushes take the bulk
    TCP plane, whose verified tensors the engine adopts as its weights (the swap, and
    the release of the tensors it held before, now happen mid-generation)."""
    cfg = _pipelined_config(
        tiny_model_dir, arithmetic_dir, tmp_path / "run", "rollout.weight_transport=tcp"
    )
    engine = HFEngine(tiny_model_dir, partial_rollout=True)
    records, replica, status = _run_over_grpc(cfg, engine, _run_holding_step_2)
    applied = replica.metrics.registry.get_sample_value(
        "rlfleet_rollout_weight_update_bytes_total", {"transport": "tcp"}
    )
    # Tensors an adopting update replaced went back to the receiver for reuse.
    spare = status.weight_spare_bytes
    _check_token_staleness(records)
    assert all(r.metrics.get("weight_sync/transport/tcp") == 1.0 for r in records)
    assert applied and applied > 0 and engine.weight_version == 3
    assert spare > 0


def _run_holding_step_2_on_vllm(trainer: Any, engine: Any) -> list[Any]:
    """``trainer.fit()`` with step 2's generation held after its first vLLM step until
    step 1's push is posted, so that it lands mid-generation. vLLM's engine core steps
    on its own while this thread waits, so the hold also pauses its scheduler (the
    update's own pause and resume then take over)."""
    producing: dict[str, int] = {"step": 0, "calls": 0}
    produce = trainer._produce
    vllm_step = engine.llm.llm_engine.step

    def tracked(step: int, min_version: int) -> Any:
        producing.update(step=step, calls=0)
        return produce(step, min_version)

    def held_step() -> Any:
        out = vllm_step()  # returns once vLLM has run a step: the first tokens exist
        if producing["step"] == 2:
            producing["calls"] += 1
            if producing["calls"] == 1:  # step 2's first step is done: hold here
                engine._core_call("pause_scheduler", "keep", False)
                deadline = time.monotonic() + 120
                while (
                    not engine.update_pending
                    and engine.info().weight_version < 1
                    and time.monotonic() < deadline
                ):
                    time.sleep(0.005)
                assert engine.update_pending, "the push of version 1 never came"
        return out

    trainer._produce = tracked
    engine.llm.llm_engine.step = held_step
    try:
        return list(trainer.fit())
    finally:
        engine.llm.llm_engine.step = vllm_step


def test_pipelined_run_over_grpc_on_the_vllm_engine(
    tiny_model_dir: Path, arithmetic_dir: Path, tmp_path: Path
) -> None:
    """The same run with the replica on vLLM (``make test-vllm``): step 1's push lands
    between two of vLLM's steps of step 2's generation, and the token staleness says
    so. 64-token responses (the random tiny model seldom ends earlier) keep the
    requests running while the push arrives."""
    pytest.importorskip("vllm", reason="vllm is not installed: run `make test-vllm`")
    from rlfleet.rollout.vllm_engine import VLLMEngine

    cfg = _pipelined_config(
        tiny_model_dir, arithmetic_dir, tmp_path / "run", "data.max_response_length=64"
    )
    engine = VLLMEngine(
        tiny_model_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20,
        partial_rollout=True,
    )  # fmt: skip
    try:
        records, _, _ = _run_over_grpc(cfg, engine, _run_holding_step_2_on_vllm)
    finally:
        engine.close()
    _check_token_staleness(records)
    assert engine.info().weight_version == 3
