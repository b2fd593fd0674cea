"""RolloutService on a real gRPC server on 127.0.0.1 (port 0) with the tiny model."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

torch = pytest.importorskip("torch")

from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from rlfleet.common.codec.wire import iter_chunks  # noqa: E402
from rlfleet.common.errors import (  # noqa: E402
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
)
from rlfleet.rollout.client import (  # noqa: E402
    InProcessRolloutClient,
    RemoteRolloutClient,
)
from rlfleet.rollout.core import RolloutCore  # noqa: E402
from rlfleet.rollout.engine import (  # noqa: E402
    CancelCheck,
    FinishReason,
    GenerationRequest,
    SampleCallback,
    SampleOutput,
    SamplingParams,
)
from rlfleet.rollout.hf_engine import HFEngine  # noqa: E402
from rlfleet.rollout.server import load_detokenizer, start_rollout_server  # noqa: E402
from rlfleet.trainer.ppo.core_algos import logprobs_from_logits  # noqa: E402
from rlfleet.v1 import rollout_pb2, rollout_pb2_grpc  # noqa: E402
from rlfleet.weightsync.sender import send_update  # noqa: E402

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 12, 13, 14, 15, 16, 17, 18]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class CountingEngine:
    """An HFEngine that records the size of every batch it runs."""

    def __init__(self, inner: HFEngine) -> None:
        self.inner = inner
        self.batches: list[int] = []

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        on_sample: SampleCallback | None = None,
        cancelled: CancelCheck | None = None,
    ) -> list[list[SampleOutput]]:
        self.batches.append(len(requests))
        return self.inner.generate(requests, on_sample, cancelled)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture()
def served(tiny_model_dir: Path) -> Iterator[tuple[RolloutCore, str, CountingEngine]]:
    engine = CountingEngine(HFEngine(tiny_model_dir))
    core = RolloutCore(engine, replica_id="r0")  # type: ignore[arg-type]
    server = start_rollout_server(core, detokenize=load_detokenizer(str(tiny_model_dir)))
    try:
        yield core, server.address, engine
    finally:
        server.stop(0)
        core.close()


def perturbed(engine: HFEngine, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: p.detach() + 0.1 * torch.randn(p.shape, generator=g)
        for n, p in engine.model.named_parameters()
    }


def greedy_with(tiny_model_dir: Path, weights: dict[str, torch.Tensor]) -> list[list[int]]:
    ref = HFEngine(tiny_model_dir)
    ref.update_weights(weights, 1)
    [out] = ref.generate([GenerationRequest(PROMPTS, GREEDY)])
    return [s.token_ids for s in out]


def by_index(samples: Iterator[SampleOutput]) -> list[SampleOutput]:
    return sorted(samples, key=lambda s: (s.prompt_index, s.sample_index))


def test_generate_n_samples_with_consistent_logprobs(served, tiny_model_dir: Path) -> None:
    core, address, engine = served
    with RemoteRolloutClient(address) as client:
        params = SamplingParams(n=3, temperature=0.8, max_tokens=7, seed=5)
        samples = by_index(client.generate(PROMPTS, params, detokenize=True))
    assert [(s.prompt_index, s.sample_index) for s in samples] == [
        (p, k) for p in range(3) for k in range(3)
    ]
    worst = 0.0
    for s in samples:
        assert s.weight_version == 0 and len(s.logprobs) == len(s.token_ids) > 0
        seq = torch.tensor([PROMPTS[s.prompt_index] + s.token_ids])
        with torch.no_grad():
            logits = engine.inner.model(seq).logits[0, len(PROMPTS[s.prompt_index]) - 1 : -1]
        ref = logprobs_from_logits(logits / 0.8, torch.tensor(s.token_ids))
        worst = max(worst, (ref - torch.tensor(s.logprobs)).abs().max().item())
        assert isinstance(s.text, str)
    assert worst < 1e-4
    # In-process client, same seed: the same samples.
    local = by_index(InProcessRolloutClient(core).generate(PROMPTS, params))
    assert [s.token_ids for s in local] == [s.token_ids for s in samples]
    # The last prompt alone, with its seed index from the whole batch: its samples.
    with RemoteRolloutClient(address) as client:
        alone = by_index(client.generate(PROMPTS[2:], params, seed_indices=[2]))
    assert [s.token_ids for s in alone] == [s.token_ids for s in samples if s.prompt_index == 2]


def test_ignore_eos_crosses_grpc(served) -> None:
    """``ignore_eos`` reaches the engine: remotely as in-process, every sample is
    exactly ``max_tokens`` long, where without it some stop at eos."""
    core, address, _ = served
    with_eos = SamplingParams(n=16, temperature=1.0, max_tokens=64, seed=3)
    no_eos = SamplingParams(n=16, temperature=1.0, max_tokens=64, seed=3, ignore_eos=True)
    with RemoteRolloutClient(address) as client:
        stopped = by_index(client.generate(PROMPTS, with_eos))
        remote = by_index(client.generate(PROMPTS, no_eos))
    # The seed makes eos come up in some samples (the test's premise).
    assert any(s.finish_reason == FinishReason.STOP for s in stopped)
    assert all(len(s.token_ids) == 64 for s in remote)
    assert all(s.finish_reason == FinishReason.LENGTH for s in remote)
    local = by_index(InProcessRolloutClient(core).generate(PROMPTS, no_eos))
    assert [s.token_ids for s in remote] == [s.token_ids for s in local]


def test_results_carry_prompt_ids_and_replica(served) -> None:
    _, address, _ = served
    channel = grpc.insecure_channel(address)
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
    req = rollout_pb2.GenerateRequest(
        prompts=[
            rollout_pb2.Prompt(id="a", token_ids=[5, 6]),
            rollout_pb2.Prompt(id="b", token_ids=[7]),
        ],
        sampling=rollout_pb2.SamplingParams(max_tokens=3, stop_token_ids=[]),  # n=0 -> 1, greedy
    )
    results = list(stub.Generate(req, timeout=60))
    assert sorted((r.prompt_id, r.prompt_index, r.sample_index) for r in results) == [
        ("a", 0, 0),
        ("b", 1, 0),
    ]
    assert all(r.replica_id == "r0" and len(r.token_ids) <= 3 for r in results)
    assert all(not r.logprobs for r in results)  # not asked for
    health = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="rlfleet.v1.RolloutService"), timeout=5
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    channel.close()


def test_packed_results_carry_the_same_samples(served) -> None:
    """``pack_results``: samples that finished together come in one message (the
    first at the top, the rest in ``more``), the same samples as one per message;
    without it, one sample per message, ``more`` empty. The client reads both."""
    _, address, _ = served
    channel = grpc.insecure_channel(address)
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)

    def request(pack: bool) -> rollout_pb2.GenerateRequest:
        return rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(id=f"p{i}", token_ids=p) for i, p in enumerate(PROMPTS)],
            sampling=rollout_pb2.SamplingParams(
                n=8, temperature=1.0, max_tokens=6, seed=11, ignore_eos=True, logprobs=True
            ),
            pack_results=pack,
        )

    def flat(messages: list[rollout_pb2.GenerateResult]) -> list[tuple]:
        out = []
        for m in messages:
            for r in [m, *m.more]:
                out.append((r.prompt_id, r.sample_index, list(r.token_ids), len(r.logprobs)))
        return sorted(out)

    single = list(stub.Generate(request(False), timeout=60))
    packed = list(stub.Generate(request(True), timeout=60))
    samples = len(PROMPTS) * 8
    assert len(single) == samples and all(not m.more for m in single)
    assert len(packed) < samples  # every sample finishes in the same decode step
    assert all(not r.more for m in packed for r in m.more)
    assert flat(packed) == flat(single)
    assert all(n == 6 for *_, n in flat(packed))
    with RemoteRolloutClient(address) as client:
        got = client.generate(
            PROMPTS, SamplingParams(n=8, temperature=1.0, max_tokens=6, seed=11, ignore_eos=True)
        )
        remote = sorted((f"p{s.prompt_index}", s.sample_index, s.token_ids) for s in got)
    assert remote == [(pid, k, ids) for pid, k, ids, _ in flat(single)]
    channel.close()


def test_stop_ids_through_the_service(served) -> None:
    _, address, _ = served
    with RemoteRolloutClient(address) as client:
        [free] = client.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8))
        stop = free.token_ids[3]
        [s] = client.generate(
            PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=(stop,))
        )
    assert s.token_ids == free.token_ids[: free.token_ids.index(stop) + 1]
    assert s.finish_reason == FinishReason.STOP


def test_validation_errors_name_the_field(served) -> None:
    _, address, _ = served
    channel = grpc.insecure_channel(address)
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
    cases = [
        (rollout_pb2.GenerateRequest(), "prompts"),
        (
            rollout_pb2.GenerateRequest(
                prompts=[rollout_pb2.Prompt(token_ids=[1]), rollout_pb2.Prompt()]
            ),
            "prompts[1].token_ids",
        ),
        (
            rollout_pb2.GenerateRequest(
                prompts=[rollout_pb2.Prompt(token_ids=[1])],
                sampling=rollout_pb2.SamplingParams(max_tokens=100_000),
            ),
            "sampling.max_tokens",
        ),
        (
            rollout_pb2.GenerateRequest(
                prompts=[rollout_pb2.Prompt(token_ids=[1])],
                sampling=rollout_pb2.SamplingParams(temperature=-1),
            ),
            "sampling.temperature",
        ),
    ]
    for req, field in cases:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith(field + ":"), e.value.details()
    channel.close()
    with (
        RemoteRolloutClient(address) as client,
        pytest.raises(FailedPrecondition, match="at least 9"),
    ):
        list(client.generate(PROMPTS[:1], GREEDY, min_weight_version=9))


@pytest.mark.parametrize("transports", [("grpc",), ("tcp",), ("shm", "tcp")])
def test_weight_update_changes_greedy_output_exactly(
    served, tiny_model_dir: Path, transports
) -> None:
    _, address, engine = served
    new = perturbed(engine.inner, seed=7)
    expected = greedy_with(tiny_model_dir, new)
    with RemoteRolloutClient(address) as client:
        before = [s.token_ids for s in by_index(client.generate(PROMPTS, GREEDY))]
        assert before != expected
        result = client.update_weights(new, version=4, transports=transports)
        assert (result.version, result.transport) == (4, transports[0])
        assert result.bytes == sum(t.numel() * 4 for t in new.values())
        after = by_index(client.generate(PROMPTS, GREEDY))
        assert [s.token_ids for s in after] == expected
        assert {s.weight_version for s in after} == {4}
        status = client.status()
    assert (status.weight_version, status.engine, status.queue_depth) == (4, "hf", 0)
    assert status.generated_tokens_total == 6 * 6 and status.tokens_per_second > 0


def test_corrupt_update_rejected_and_old_weights_serve(served) -> None:
    _, address, engine = served
    channel = grpc.insecure_channel(address)
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
    with RemoteRolloutClient(channel) as client:
        before = [s.token_ids for s in by_index(client.generate(PROMPTS, GREEDY))]
        chunks = list(iter_chunks(perturbed(engine.inner, 3), max_chunk_bytes=100_000))
        bad = chunks[2]
        bad.pieces[0].data = b"\x00" * len(bad.pieces[0].data)
        with pytest.raises(grpc.RpcError) as e:
            stub.UpdateWeights(iter(rollout_pb2.WeightChunk(version=1, chunk=c) for c in chunks))
        assert e.value.code() == grpc.StatusCode.DATA_LOSS
        assert "crc32" in e.value.details()
        w = perturbed(engine.inner, 3)
        w["model.norm.weight"] = w["model.norm.weight"][:10]
        with pytest.raises(InvalidArgument, match=r"model\.norm\.weight"):
            send_update(channel, w, 1, transports=("grpc",))
        with pytest.raises(InvalidArgument, match=r"model\.norm\.weight"):
            send_update(channel, w, 1, transports=("tcp",))
        after = [s.token_ids for s in by_index(client.generate(PROMPTS, GREEDY))]
        assert after == before
        assert client.status().weight_version == 0
    channel.close()


def test_concurrent_callers_share_batches(served) -> None:
    core, address, engine = served
    results: dict[int, list[SampleOutput]] = {}
    errors: list[BaseException] = []
    gate = threading.Barrier(6)

    def call(i: int) -> None:
        try:
            with RemoteRolloutClient(address) as client:
                gate.wait()
                results[i] = list(client.generate([PROMPTS[i % 3]], GREEDY))
        except BaseException as e:  # reported below
            errors.append(e)

    # A long request occupies the engine while the others queue up behind it.
    long = core.submit(PROMPTS, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(long.result()) == 3
    alone = [s.token_ids for s in by_index(InProcessRolloutClient(core).generate(PROMPTS, GREEDY))]
    assert {i: r[0].token_ids for i, r in results.items()} == {i: alone[i % 3] for i in range(6)}
    assert max(engine.batches) > 1  # several callers ran in one engine batch
    assert sum(engine.batches) == 1 + 6 + 1


def test_sleep_and_wake_up(served) -> None:
    _, address, _ = served
    with RemoteRolloutClient(address) as client:
        assert client.sleep(1) == 0  # CPU: the weights already live in host memory
        assert client.status().sleeping
        with pytest.raises(FailedPrecondition, match="asleep"):
            list(client.generate(PROMPTS[:1], GREEDY))
        client.wake_up()
        assert not client.status().sleeping
        assert len(list(client.generate(PROMPTS[:1], GREEDY))) == 1


def test_send_update_rejects_stale_versions(served) -> None:
    _, address, engine = served
    w = perturbed(engine.inner, 1)
    assert send_update(address, w, 3, transports=("tcp",)).version == 3
    with pytest.raises(FailedPrecondition, match="older"):
        send_update(address, w, 2, transports=("grpc",))
    with pytest.raises(DataLoss):
        channel = grpc.insecure_channel(address)
        chunks = list(iter_chunks(w, max_chunk_bytes=100_000))[:-1]
        try:
            rollout_pb2_grpc.RolloutServiceStub(channel).UpdateWeights(
                iter(rollout_pb2.WeightChunk(version=5, chunk=c) for c in chunks)
            )
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.DATA_LOSS
            raise DataLoss(e.details()) from e
        finally:
            channel.close()
