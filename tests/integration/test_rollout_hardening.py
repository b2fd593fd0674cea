"""A rollout replica bounded against bad or hostile input, through a real gRPC server
on 127.0.0.1 (port 0) with the tiny model: Generate limits and sampling ranges, a
caller that gives up stops its generation, weight updates with non-finite or all-zero
values or a leaping version change nothing, malformed weight streams and offers are
refused, and a stranger on the bulk TCP listener does not hold up the real sender."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import socket
import ssl
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

torch = pytest.importorskip("torch")

from rlfleet.common.codec.wire import iter_chunks  # noqa: E402
from rlfleet.common.errors import InvalidArgument, RlfleetError  # noqa: E402
from rlfleet.common.rpc import Security, TLSConfig, to_rlfleet_error, using_security  # noqa: E402
from rlfleet.common.secrets_cli import make_tls  # noqa: E402
from rlfleet.rollout.client import RemoteRolloutClient  # noqa: E402
from rlfleet.rollout.core import RolloutCore  # noqa: E402
from rlfleet.rollout.engine import (  # noqa: E402
    CancelCheck,
    GenerateLimits,
    GenerationRequest,
    SampleCallback,
    SampleOutput,
    SamplingParams,
)
from rlfleet.rollout.hf_engine import HFEngine  # noqa: E402
from rlfleet.rollout.server import start_rollout_server  # noqa: E402
from rlfleet.v1 import rollout_pb2, rollout_pb2_grpc  # noqa: E402
from rlfleet.weightsync import wire  # noqa: E402
from rlfleet.weightsync.checksum import tensor_crcs  # noqa: E402
from rlfleet.weightsync.sender import make_offer, send_update  # noqa: E402
from rlfleet.weightsync.tcp import send_tcp  # noqa: E402
from rlfleet.weightsync.wire import bucket_meta  # noqa: E402

pytestmark = pytest.mark.timeout(180)

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 12, 13, 14, 15, 16, 17, 18]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class WatchedEngine:
    """An HFEngine that records each batch: its request count, whether it was told
    about cancellation, and how many samples it returned; ``started`` is set when a
    batch begins."""

    def __init__(self, inner: HFEngine) -> None:
        self.inner = inner
        self.started = threading.Event()
        self.batches: list[tuple[int, int]] = []  # (requests, samples returned)

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        on_sample: SampleCallback | None = None,
        cancelled: CancelCheck | None = None,
    ) -> list[list[SampleOutput]]:
        self.started.set()
        out = self.inner.generate(requests, on_sample, cancelled)
        self.batches.append((len(requests), sum(len(s) for s in out)))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@contextlib.contextmanager
def _serve(core: RolloutCore) -> Iterator[str]:
    server = start_rollout_server(core)
    try:
        yield server.address
    finally:
        server.stop(0)
        core.close()


@pytest.fixture()
def served(tiny_model_dir: Path) -> Iterator[tuple[RolloutCore, str, WatchedEngine]]:
    engine = WatchedEngine(HFEngine(tiny_model_dir))
    core = RolloutCore(engine, replica_id="r0", bulk_token_timeout_s=120.0)  # type: ignore[arg-type]
    with _serve(core) as address:
        yield core, address, engine


def _stub(address: str) -> tuple[grpc.Channel, rollout_pb2_grpc.RolloutServiceStub]:
    channel = grpc.insecure_channel(address)
    return channel, rollout_pb2_grpc.RolloutServiceStub(channel)


def _request(prompts: Sequence[Sequence[int]], **sampling: Any) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=list(p)) for p in prompts],
        sampling=rollout_pb2.SamplingParams(**sampling),
    )


def _refusal(stub: rollout_pb2_grpc.RolloutServiceStub, req: Any) -> RlfleetError:
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(req, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    return to_rlfleet_error(e.value)


def _greedy(address: str) -> list[list[int]]:
    with RemoteRolloutClient(address) as client:
        samples = sorted(client.generate(PROMPTS, GREEDY), key=lambda s: s.prompt_index)
    return [s.token_ids for s in samples]


def _perturbed(engine: HFEngine, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: p.detach() + 0.1 * torch.randn(p.shape, generator=g)
        for n, p in engine.model.named_parameters()
    }


# ----------------------------------------------------------------------------- limits


def test_generate_limits_name_the_field_and_value(tiny_model_dir: Path) -> None:
    limits = GenerateLimits(
        max_n=4,
        max_prompts=3,
        max_samples=6,
        max_new_tokens=32,
        max_request_tokens=200,
        max_stop_token_ids=2,
    )
    core = RolloutCore(HFEngine(tiny_model_dir), limits=limits)
    with _serve(core) as address:
        channel, stub = _stub(address)
        cases = [
            (_request([[1]], n=5), "sampling.n", 5),
            (_request([[1]] * 4), "prompts", 4),
            (_request([[1]] * 3, n=3), "sampling.n", 9),  # 9 samples > 6
            (_request([[1]], max_tokens=33), "sampling.max_tokens", 33),
            (_request([[1]], stop_token_ids=[1, 2, 3]), "sampling.stop_token_ids", 3),
            (_request([[1] * 60] * 2, n=2, max_tokens=32), "prompts", 2 * (120 + 64)),
        ]
        for req, field, value in cases:
            err = _refusal(stub, req)
            assert (err.field, err.value, err.code) == (field, str(value), "LIMIT_EXCEEDED")
        # At the limits, it serves.
        ok = list(stub.Generate(_request([[1, 2]] * 3, n=2, max_tokens=8), timeout=60))
        assert len(ok) == 6
        channel.close()


def test_default_limits_and_the_models_length(served) -> None:
    _, address, _ = served
    channel, stub = _stub(address)
    err = _refusal(stub, _request([[1]], n=65))
    assert (err.field, err.value) == ("sampling.n", "65")
    err = _refusal(stub, _request([[1]] * 8193))
    assert (err.field, err.value) == ("prompts", "8193")
    err = _refusal(stub, _request([[1]], max_tokens=2**32 - 1))
    assert err.field == "sampling.max_tokens"
    # Within the caps but past the model's 2048 positions: the engine's own check.
    err = _refusal(stub, _request([[1] * 2040], max_tokens=9))
    assert (err.field, err.value) == ("sampling.max_tokens", "9")
    channel.close()


def test_in_process_submit_is_bounded_too(tiny_model_dir: Path) -> None:
    core = RolloutCore(HFEngine(tiny_model_dir), limits=GenerateLimits(max_n=2))
    try:
        with pytest.raises(InvalidArgument) as e:
            core.submit([[1, 2]], SamplingParams(n=3))
        assert e.value.field == "sampling.n"
    finally:
        core.close()


# ---------------------------------------------------------------------------- sampling


def test_sampling_ranges_and_vocabulary(served) -> None:
    _, address, _ = served
    channel, stub = _stub(address)
    cases = [
        (_request([[1]], temperature=1.4e-45), "sampling.temperature"),
        (_request([[1]], temperature=1e-3), "sampling.temperature"),
        (_request([[1]], temperature=math.inf), "sampling.temperature"),
        (_request([[1]], temperature=math.nan), "sampling.temperature"),
        (_request([[1]], top_p=1.5), "sampling.top_p"),
        (_request([[1]], top_p=math.nan), "sampling.top_p"),
        (_request([[1]], top_p=-0.5), "sampling.top_p"),
        (_request([[5, 2048]]), "prompts[0].token_ids"),
        (_request([[5], [-1]]), "prompts[1].token_ids"),
        (_request([[5]], stop_token_ids=[4096]), "sampling.stop_token_ids"),
    ]
    for req, field in cases:
        assert _refusal(stub, req).field == field
    # The smallest temperature served gives finite log-probs.
    [s] = stub.Generate(
        _request([[5, 6]], temperature=0.01, max_tokens=4, logprobs=True, seed=1), timeout=60
    )
    assert len(s.logprobs) == 4 and all(math.isfinite(x) for x in s.logprobs)
    channel.close()


def test_in_process_top_k_below_minus_one_is_refused(served) -> None:
    core, _, _ = served
    with pytest.raises(InvalidArgument) as e:
        core.submit([[1, 2]], SamplingParams(top_k=-2))
    assert e.value.field == "sampling.top_k"


# ------------------------------------------------------------------------ cancellation

BIG = {"n": 64, "temperature": 1.0, "max_tokens": 2000, "ignore_eos": True, "seed": 1}


def _small_after(address: str) -> list[SampleOutput]:
    with RemoteRolloutClient(address) as client:
        return list(client.generate(PROMPTS[:1], GREEDY))


def test_cancelled_generate_stops_and_frees_the_engine(served) -> None:
    """A caller cancels a request that would run for many decode steps: the engine
    stops it between two steps, and a small request then runs (alone, right after)."""
    core, address, engine = served
    channel, stub = _stub(address)
    big = stub.Generate(_request(PROMPTS, **BIG), timeout=170)
    assert engine.started.wait(60)
    big.cancel()
    small = _small_after(address)
    assert len(small) == 1 and len(small[0].token_ids) == 6
    # The big batch ended with no sample: had it run on, all 192 would have come
    # (ignore_eos, one length: they all end at the last step).
    assert engine.batches == [(1, 0), (1, 1)]
    status = core.status()
    assert status.requests_cancelled == 1
    assert status.generated_tokens_total == 6 and status.queue_depth == 0
    with pytest.raises(grpc.RpcError) as e:
        list(big)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    channel.close()


def test_generate_past_its_deadline_stops(served) -> None:
    """A big request whose client deadline passes (while it runs or waits) is given
    up: the small request behind it is served, and the big one yields nothing."""
    core, address, engine = served
    channel, stub = _stub(address)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(_request(PROMPTS, **BIG), timeout=1.0))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    small = _small_after(address)
    assert len(small) == 1
    status = core.status()
    assert status.requests_cancelled == 1
    assert status.generated_tokens_total == 6  # the small request's only
    assert all(samples == 0 for _, samples in engine.batches[:-1])
    channel.close()


def test_cancelling_one_request_keeps_its_batch_mates(tiny_model_dir: Path) -> None:
    """In one engine batch, a cancelled request stops; the other runs to its end."""
    engine = HFEngine(tiny_model_dir)
    keep = GenerationRequest(
        [[5, 6]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    )
    drop = GenerationRequest(
        [[7, 8]], SamplingParams(temperature=0, max_tokens=20, n=4, ignore_eos=True)
    )
    steps: list[int] = []

    def cancelled(r: int) -> bool:
        steps.append(r)
        return r == 1 and len(steps) > 4

    out = engine.generate([keep, drop], cancelled=cancelled)
    [alone] = engine.generate([keep])
    assert [s.token_ids for s in out[0]] == [s.token_ids for s in alone]
    assert out[1] == []


# ----------------------------------------------------------------------------- weights


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
@pytest.mark.parametrize("poison", ["nan", "inf", "zeros"])
def test_poisoned_weights_are_refused_and_the_old_ones_serve(
    served, transport: str, poison: str
) -> None:
    core, address, engine = served
    before = _greedy(address)
    w = _perturbed(engine.inner, 5)
    name = "model.layers.1.mlp.up_proj.weight"
    if poison == "nan":
        w[name][3, 7] = math.nan
    elif poison == "inf":
        w[name][0, 0] = -math.inf
    else:
        w = {n: torch.zeros_like(t) for n, t in w.items()}
    with pytest.raises(InvalidArgument) as e:
        send_update(address, w, 1, transports=(transport,))
    if poison == "zeros":
        assert e.value.code == "ZERO_WEIGHTS" and e.value.field.startswith("weights[")
    else:
        assert e.value.code == "NON_FINITE_WEIGHTS"
        assert e.value.field == f"weights[{name!r}]"
    assert _greedy(address) == before
    assert core.status().weight_version == 0
    # A sound update still applies afterwards.
    assert (
        send_update(address, _perturbed(engine.inner, 6), 1, transports=(transport,)).version == 1
    )


def test_poisoned_in_process_update_is_refused(served) -> None:
    core, address, engine = served
    before = _greedy(address)
    w = _perturbed(engine.inner, 5)
    w["model.norm.weight"][0] = math.inf
    with pytest.raises(InvalidArgument, match=r"model\.norm\.weight"):
        core.update_weights(w, 2)
    assert _greedy(address) == before


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_a_leaping_version_is_refused_and_later_pushes_apply(served, transport: str) -> None:
    core, address, engine = served
    before = _greedy(address)
    w = _perturbed(engine.inner, 8)
    for version in (2**63, 2**64 - 1, 2**20 + 1):
        with pytest.raises(InvalidArgument) as e:
            send_update(address, w, version, transports=(transport,))
        assert (e.value.field, e.value.code) == ("version", "VERSION_JUMP")
    assert _greedy(address) == before and core.status().weight_version == 0
    assert send_update(address, w, 2**20, transports=(transport,)).version == 2**20
    assert send_update(address, w, 2**20 + 7, transports=(transport,)).version == 2**20 + 7


def test_version_step_is_configurable(tiny_model_dir: Path) -> None:
    engine = HFEngine(tiny_model_dir)
    core = RolloutCore(engine, max_version_step=10)
    w = _perturbed(engine, 2)
    with _serve(core) as address:
        with pytest.raises(InvalidArgument, match="more than 10 above"):
            send_update(address, w, 11, transports=("grpc",))
        assert send_update(address, w, 10, transports=("grpc",)).version == 10


def _update_error(address: str, chunks: list[rollout_pb2.WeightChunk]) -> grpc.RpcError:
    channel, stub = _stub(address)
    with pytest.raises(grpc.RpcError) as e:
        stub.UpdateWeights(iter(chunks), timeout=60)
    channel.close()
    return e.value


def test_weight_streams_at_once_are_bounded(served) -> None:
    """Each ``UpdateWeights`` stream buffers up to a model's bytes before it is checked,
    and each held a handler thread, with no limit (32 streams: 32 models). Past
    MAX_OPEN_STREAMS a stream is refused with RESOURCE_EXHAUSTED before it is read;
    once the held ones end, a real push applies."""
    from rlfleet.weightsync.receiver import MAX_OPEN_STREAMS

    _, address, engine = served
    w = _perturbed(engine.inner, 15)
    chunks = [rollout_pb2.WeightChunk(version=1, chunk=c) for c in iter_chunks(w)]
    release = threading.Event()

    def stalled() -> Iterator[rollout_pb2.WeightChunk]:
        yield chunks[0]
        release.wait(60)  # then the stream ends short: refused

    channel, stub = _stub(address)
    held = [stub.UpdateWeights.future(stalled(), timeout=90) for _ in range(MAX_OPEN_STREAMS)]
    deadline = time.monotonic() + 30
    while True:  # until the held streams are inside the receiver
        try:
            stub.UpdateWeights(iter(chunks[:1]), timeout=30)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                assert to_rlfleet_error(e).code == "TOO_MANY_TRANSFERS"
                break
        assert time.monotonic() < deadline, "a stream past the limit was read"
        time.sleep(0.1)
    assert stub.GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=5).weight_version == 0
    release.set()
    for f in held:
        with pytest.raises(grpc.RpcError):
            f.result(timeout=60)
    assert send_update(address, w, 1, transports=("grpc",)).version == 1
    channel.close()


def test_chunk_stream_after_the_last_chunk_or_with_a_tensor_twice(served) -> None:
    core, address, engine = served
    before = _greedy(address)
    w = _perturbed(engine.inner, 9)
    chunks = [rollout_pb2.WeightChunk(version=1, chunk=c) for c in iter_chunks(w)]
    # A chunk after the one marked last.
    extra = rollout_pb2.WeightChunk(version=1, chunk=next(iter(iter_chunks(w))))
    err = _update_error(address, [*chunks, extra])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "after the final" in err.details()
    # Two buckets naming one tensor.
    names = list(w)
    first = {n: w[n] for n in names[:5]}
    second = {n: w[n] for n in names[4:]}  # repeats names[4]
    buckets = [
        *iter_chunks(first, bucket_meta(1, 0, final=False)),
        *iter_chunks(second, bucket_meta(1, 1, final=True, tensors=len(names))),
    ]
    err = _update_error(address, [rollout_pb2.WeightChunk(version=1, chunk=c) for c in buckets])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert names[4] in err.details() and "twice" in err.details()
    assert _greedy(address) == before and core.status().weight_version == 0


def test_bulk_offer_naming_a_tensor_twice_is_refused(served) -> None:
    _, address, engine = served
    w = _perturbed(engine.inner, 10)
    offer = wire.offer_to_proto(make_offer(w, 1, ("tcp",)))
    offer.tensors.append(offer.tensors[0])
    channel, stub = _stub(address)
    with pytest.raises(grpc.RpcError) as e:
        stub.OpenWeightTransfer(offer, timeout=30)
    err = to_rlfleet_error(e.value)
    last = len(offer.tensors) - 1
    assert (err.field, err.value, err.code) == (
        f"tensors[{last}].name",
        offer.tensors[0].name,
        "DUPLICATE_TENSOR",
    )
    channel.close()


# ------------------------------------------------------------------ bulk TCP listener


def _open_tcp(address: str, w: dict[str, torch.Tensor], version: int) -> Any:
    offer = make_offer(w, version, ("tcp",))
    channel, stub = _stub(address)
    plan = wire.plan_from_proto(stub.OpenWeightTransfer(wire.offer_to_proto(offer), timeout=30))
    assert plan.transport == "tcp"
    return channel, stub, offer, plan


def _connect(endpoint: str) -> socket.socket:
    host, _, port = endpoint.rpartition(":")
    assert host.startswith("127.")
    return socket.create_connection((host, int(port)), timeout=30)


def test_a_commit_waits_no_longer_than_its_callers_deadline(served) -> None:
    """Commits of TCP transfers whose bytes never come: each ends at its caller's
    deadline (not the 120 s transfer time-out here), holding no handler thread, and
    the replica answers at once afterwards."""
    _, address, engine = served
    w = _perturbed(engine.inner, 11)
    opened = [_open_tcp(address, w, 1) for _ in range(4)]
    t0 = time.monotonic()
    for _channel, stub, offer, plan in opened:
        crcs = [0] * len(offer.tensors)
        commit = rollout_pb2.WeightTransferCommit(transfer_id=plan.transfer_id, crc32c=crcs)
        with pytest.raises(grpc.RpcError) as e:
            stub.CommitWeightTransfer(commit, timeout=1.0)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 30
    # The handlers gave up too (within a poll of 0.25 s) and dropped their transfers:
    # the listeners are closed (before, each handler waited out the transfer's
    # time-out with its listener open).
    deadline = time.monotonic() + 20
    for _channel, _stub, _offer, plan in opened:
        while True:
            try:
                _connect(plan.endpoint).close()
            except ConnectionRefusedError:
                break
            assert time.monotonic() < deadline, f"{plan.endpoint} still listens"
            time.sleep(0.2)
    _channel, stub, _offer, _plan = opened[0]
    assert stub.GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=5).weight_version == 0
    assert _greedy(address)  # generation is not held up
    for channel, *_ in opened:
        channel.close()


def test_commits_without_a_deadline_neither_wedge_the_replica_nor_escape_the_limit(
    served,
) -> None:
    """Commits with no deadline on transfers whose bytes never come (the trainer's
    credential): they still count toward MAX_OPEN_TRANSFERS (more offers are refused,
    not planned and committed in turn until every handler thread waits), and a
    commit whose caller goes away stops waiting; the replica answers throughout."""
    from rlfleet.weightsync.receiver import MAX_OPEN_TRANSFERS

    _, address, engine = served
    w = _perturbed(engine.inner, 13)
    opened = [_open_tcp(address, w, 1) for _ in range(MAX_OPEN_TRANSFERS)]
    futures = []
    for _channel, stub, offer, plan in opened:
        commit = rollout_pb2.WeightTransferCommit(
            transfer_id=plan.transfer_id, crc32c=[0] * len(offer.tensors)
        )
        futures.append(stub.CommitWeightTransfer.future(commit))  # no deadline
    time.sleep(0.5)  # the commits wait for bytes now
    _channel, stub, offer, _plan = opened[0]
    with pytest.raises(grpc.RpcError) as e:
        stub.OpenWeightTransfer(wire.offer_to_proto(offer), timeout=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stub.GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=5).weight_version == 0
    for f in futures:  # the callers go away
        f.cancel()
    deadline = time.monotonic() + 20
    while True:  # their handlers stopped waiting: places again
        try:
            again = _open_tcp(address, w, 1)
            break
        except grpc.RpcError as refused:
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() < deadline, "cancelled commits kept their places"
            time.sleep(0.25)
    again[1].AbortWeightTransfer(
        rollout_pb2.AbortWeightTransferRequest(update_id=again[3].transfer_id), timeout=30
    )
    for channel, *_ in [*opened, again]:
        channel.close()


def test_concurrent_offers_stay_within_the_limit(served) -> None:
    """The count and the new transfer are one step: offers at once do not overshoot."""
    from concurrent.futures import ThreadPoolExecutor

    from rlfleet.weightsync.receiver import MAX_OPEN_TRANSFERS

    _, address, engine = served
    w = _perturbed(engine.inner, 14)

    def offer() -> Any:
        try:
            return _open_tcp(address, w, 1)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            return None

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda _: offer(), range(12)))
    opened = [r for r in results if r is not None]
    assert len(opened) == MAX_OPEN_TRANSFERS
    for channel, stub, _offer, plan in opened:
        stub.AbortWeightTransfer(
            rollout_pb2.AbortWeightTransferRequest(update_id=plan.transfer_id), timeout=30
        )
        channel.close()


def test_open_bulk_transfers_are_bounded(served) -> None:
    """Offers never sent: each held a staging buffer, a listener and a thread until it
    expired, with no limit (20 took 10x the model's bytes). Past MAX_OPEN_TRANSFERS the
    replica refuses with RESOURCE_EXHAUSTED; an abort frees a place at once."""
    from rlfleet.weightsync.receiver import MAX_OPEN_TRANSFERS

    _, address, engine = served
    w = _perturbed(engine.inner, 12)
    opened = [_open_tcp(address, w, 1) for _ in range(MAX_OPEN_TRANSFERS)]
    _channel, stub, offer, _plan = opened[0]
    with pytest.raises(grpc.RpcError) as e:
        stub.OpenWeightTransfer(wire.offer_to_proto(offer), timeout=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert to_rlfleet_error(e.value).code == "TOO_MANY_TRANSFERS"
    abort = rollout_pb2.AbortWeightTransferRequest(update_id=opened[0][3].transfer_id)
    assert stub.AbortWeightTransfer(abort, timeout=30).aborted
    opened.append(_open_tcp(address, w, 1))  # a place again
    for _channel, each, _offer, plan in opened[1:]:
        each.AbortWeightTransfer(
            rollout_pb2.AbortWeightTransferRequest(update_id=plan.transfer_id), timeout=30
        )
    for channel, *_ in opened:
        channel.close()


def test_a_stranger_on_the_listener_does_not_hold_up_the_push(served, tiny_model_dir) -> None:
    """A connection that sends 31 bytes (one short of a token) and stays open, and one
    with a wrong token, do not delay the real sender; the stranger is closed once the
    sender is in. (The token deadline here is 120 s: only the new listener can
    serve the push while the stranger waits.)"""
    core, address, engine = served
    w = _perturbed(engine.inner, 11)
    channel, stub, offer, plan = _open_tcp(address, w, 3)
    stranger = _connect(plan.endpoint)
    stranger.sendall(b"x" * 31)
    wrong = _connect(plan.endpoint)
    wrong.sendall(b"y" * len(plan.token))
    assert wrong.recv(1) == b""  # dropped at once: a full, wrong token
    try:
        crcs = send_tcp(plan, w, offer.tensors, timeout_s=60)
        assert stranger.fileno() >= 0  # still connected while the push went through
        result = stub.CommitWeightTransfer(
            rollout_pb2.WeightTransferCommit(transfer_id=plan.transfer_id, crc32c=crcs),
            timeout=60,
        )
        assert result.version == 3
        assert crcs == tensor_crcs(w, offer.tensors)
        # Once the sender was in, the listener closed the stranger.
        assert stranger.recv(1) == b""
    finally:
        stranger.close()
        wrong.close()
        channel.close()
    assert core.status().weight_version == 3
    expected = HFEngine(tiny_model_dir)
    expected.update_weights(w, 3)
    [out] = expected.generate([GenerationRequest(PROMPTS, GREEDY)])
    assert _greedy(address) == [s.token_ids for s in out]


def test_more_strangers_than_the_listener_keeps_do_not_shut_the_sender_out(
    served, tiny_model_dir
) -> None:
    """More silent connections than the listener keeps waiting, all made before the
    sender: each newcomer drops the oldest, so the real sender still gets in."""
    from rlfleet.weightsync.tcp import MAX_PENDING_CONNECTIONS

    core, address, engine = served
    w = _perturbed(engine.inner, 13)
    channel, stub, offer, plan = _open_tcp(address, w, 4)
    strangers = [_connect(plan.endpoint) for _ in range(MAX_PENDING_CONNECTIONS + 4)]
    try:
        crcs = send_tcp(plan, w, offer.tensors, timeout_s=60)
        result = stub.CommitWeightTransfer(
            rollout_pb2.WeightTransferCommit(transfer_id=plan.transfer_id, crc32c=crcs),
            timeout=60,
        )
        assert result.version == 4
        assert strangers[0].recv(1) == b""  # the oldest were dropped
    finally:
        for s in strangers:
            s.close()
        channel.close()
    assert core.status().weight_version == 4


def test_a_silent_connection_is_dropped_after_the_token_deadline(tiny_model_dir: Path) -> None:
    """With a short token deadline, a connection that never sends its token is closed
    by the replica while the transfer stays open; the real sender then pushes."""
    engine = HFEngine(tiny_model_dir)
    core = RolloutCore(engine, bulk_token_timeout_s=0.3)
    w = _perturbed(engine, 12)
    with _serve(core) as address:
        channel, stub, offer, plan = _open_tcp(address, w, 1)
        silent = _connect(plan.endpoint)
        try:
            silent.sendall(b"z" * 5)
            assert silent.recv(1) == b""  # closed by the replica (bounded: 30 s timeout)
            crcs = send_tcp(plan, w, offer.tensors, timeout_s=60)
            result = stub.CommitWeightTransfer(
                rollout_pb2.WeightTransferCommit(transfer_id=plan.transfer_id, crc32c=crcs),
                timeout=60,
            )
            assert result.version == 1
        finally:
            silent.close()
            channel.close()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    try:
        return make_tls(tmp_path_factory.mktemp("tls"), [])
    except OSError as e:
        pytest.skip(f"cannot make certificates: {e}")


class _Relay:
    """A TCP relay on 127.0.0.1 between a sender and ``target``: everything the
    sender writes is kept in ``seen`` (what anyone on the network could read)."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(30)
        self.endpoint = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.seen = bytearray()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with self._listener, contextlib.suppress(OSError):
            client, _ = self._listener.accept()
            with client, socket.create_connection(self._target, timeout=30) as server:
                back = threading.Thread(target=self._pipe, args=(server, client, None))
                back.start()
                self._pipe(client, server, self.seen)
                back.join(30)

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, keep: bytearray | None) -> None:
        with contextlib.suppress(OSError):
            src.settimeout(30)
            while data := src.recv(1 << 16):
                if keep is not None:
                    keep += data
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)

    def join(self) -> None:
        self._thread.join(60)


def test_with_tls_the_bulk_tcp_plane_is_encrypted_and_needs_a_client_certificate(
    tls_files: dict[str, Path], tiny_model_dir: Path
) -> None:
    """A replica whose cluster runs mTLS serves the bulk TCP plane over TLS: a sender
    that writes the token in clear and one without a client certificate are dropped;
    the real sender's push goes through a relay that sees neither the token nor any
    of the weights' bytes, and the replica serves the pushed weights."""
    tls = TLSConfig(
        cert=tls_files["cert"],
        key=tls_files["key"],
        ca=tls_files["ca"],
        require_client_cert=True,
        server_name_override="rlfleet",
    )
    engine = HFEngine(tiny_model_dir)
    core = RolloutCore(engine, bulk_tls=tls.ssl_server_context(), bulk_token_timeout_s=120.0)
    w = _perturbed(engine, 13)
    with _serve(core) as address:
        channel, stub, offer, plan = _open_tcp(address, w, 4)
        try:
            clear = _connect(plan.endpoint)
            clear.sendall(plan.token.encode())
            with contextlib.suppress(ConnectionResetError):  # not a TLS hello: dropped
                assert clear.recv(1) == b""
            clear.close()
            anonymous = TLSConfig(ca=tls_files["ca"]).ssl_client_context()
            with pytest.raises((ssl.SSLError, ConnectionError)):
                send_tcp(plan, w, offer.tensors, timeout_s=60, tls=anonymous, server_name="rlfleet")
            relay = _Relay(plan.endpoint)
            via_relay = dataclasses.replace(plan, endpoint=relay.endpoint)
            crcs = send_tcp(
                via_relay, w, offer.tensors, timeout_s=60,
                tls=tls.ssl_client_context(), server_name="rlfleet",
            )  # fmt: skip
            relay.join()
            result = stub.CommitWeightTransfer(
                rollout_pb2.WeightTransferCommit(transfer_id=plan.transfer_id, crc32c=crcs),
                timeout=60,
            )
            assert result.version == 4
        finally:
            channel.close()
        seen = bytes(relay.seen)
        assert len(seen) > offer.total_bytes  # every byte went through the relay
        assert plan.token.encode() not in seen
        for t in list(w.values())[:4]:
            piece = t.contiguous().view(torch.uint8).reshape(-1)[:64].numpy().tobytes()
            assert piece not in seen
        assert _greedy(address) == _greedy_with(tiny_model_dir, w, 4)


def test_a_push_under_the_process_tls_uses_tls_on_the_tcp_plane(
    tls_files: dict[str, Path], tiny_model_dir: Path
) -> None:
    """``send_update`` forced onto TCP takes the process's TLS (as the trainer does
    under ``security.tls``): the replica, which only speaks TLS there, applies it."""
    tls = TLSConfig(
        cert=tls_files["cert"], key=tls_files["key"], ca=tls_files["ca"],
        require_client_cert=True, server_name_override="rlfleet",
    )  # fmt: skip
    engine = HFEngine(tiny_model_dir)
    core = RolloutCore(engine, bulk_tls=tls.ssl_server_context())
    w = _perturbed(engine, 14)
    with _serve(core) as address:
        # The replica's gRPC server was started without TLS; the client side of the
        # process security is what the bulk sender reads.
        client_only = Security(
            tls=dataclasses.replace(tls, require_client_cert=False), insecure=True
        )
        with using_security(client_only):
            result = send_update(
                grpc.insecure_channel(address), w, 5, transports=("tcp",), timeout_s=60
            )
        assert result.transport == "tcp" and result.version == 5
        assert _greedy(address) == _greedy_with(tiny_model_dir, w, 5)


def _greedy_with(model_dir: Path, w: dict[str, torch.Tensor], version: int) -> list[list[int]]:
    expected = HFEngine(model_dir)
    expected.update_weights(w, version)
    [out] = expected.generate([GenerationRequest(PROMPTS, GREEDY)])
    return [s.token_ids for s in out]


def test_malformed_weight_chunks_are_refused_by_the_zero_copy_parser(served) -> None:
    """``UpdateWeights`` parses its requests with ``parse_weight_chunk`` (views, no
    protobuf copy): a truncated message and one without a chunk are refused with
    INVALID_ARGUMENT, and the replica keeps its weights."""
    core, address, _engine = served
    channel, _ = _stub(address)
    update = channel.stream_unary(
        "/rlfleet.v1.RolloutService/UpdateWeights",
        request_serializer=lambda b: b,
        response_deserializer=rollout_pb2.UpdateWeightsResponse.FromString,
    )
    for bad, says in [(b"\x08\x01\x12\x40abc", "past the end"), (b"\x08\x01", "without a chunk")]:
        with pytest.raises(grpc.RpcError) as e:
            update(iter([bad]), timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert says in e.value.details()
    channel.close()
    assert core.status().weight_version == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_weights_that_overflow_fail_generation_by_name_not_internally(
    served, temperature: float
) -> None:
    """Finite weights so large that the logits overflow (a 3e38-filled matrix) pass
    the push's value check, which only refuses NaN, Inf and all zeros; generation
    then answers FAILED_PRECONDITION (NON_FINITE_LOGITS) naming the weight version --
    not INTERNAL from an index past the vocabulary (sampled, found by ``make fuzz``)
    nor NaN log-probs (greedy) -- and sound weights pushed afterwards serve again."""
    _core, address, engine = served
    sound = _perturbed(engine.inner, 12)
    w = _perturbed(engine.inner, 11)
    w["model.layers.1.mlp.up_proj.weight"].fill_(3.0e38)
    assert send_update(address, w, 1, transports=("tcp",)).version == 1
    params = SamplingParams(temperature=temperature, max_tokens=4, logprobs=True)
    with RemoteRolloutClient(address) as client, pytest.raises(RlfleetError) as e:
        list(client.generate(PROMPTS, params))
    assert e.value.status == "FAILED_PRECONDITION", e.value
    assert e.value.code == "NON_FINITE_LOGITS" and "weight version 1" in e.value.message
    assert send_update(address, sound, 2, transports=("tcp",)).version == 2
    with RemoteRolloutClient(address) as client:
        samples = list(client.generate(PROMPTS, params))
    assert samples and all(math.isfinite(x) for s in samples for x in s.logprobs)


class GatedEngine(WatchedEngine):
    """Holds each batch until ``go`` is set: a generation that is in flight for as long
    as the test needs, whatever the machine's speed."""

    def __init__(self, inner: HFEngine) -> None:
        super().__init__(inner)
        self.go = threading.Event()

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        on_sample: SampleCallback | None = None,
        cancelled: CancelCheck | None = None,
    ) -> list[list[SampleOutput]]:
        self.started.set()
        assert self.go.wait(120)
        return super().generate(requests, on_sample, cancelled)


def test_a_draining_replica_finishes_its_work_and_still_answers_probes(
    tiny_model_dir: Path,
) -> None:
    """What a scale-down or SIGTERM does before the server stops: new Generate calls are
    refused (UNAVAILABLE, naming the drain), the one in flight finishes in full, and
    GetStatus keeps answering, so a caller's liveness probe (0.5 s here) does not give
    the replica up while its batch takes longer than that."""
    engine = GatedEngine(HFEngine(tiny_model_dir))
    core = RolloutCore(engine, replica_id="r0")  # type: ignore[arg-type]
    with _serve(core) as address:
        got: list[Any] = []
        caller = RemoteRolloutClient(address, liveness_s=0.5)

        def generate() -> None:
            try:
                got.extend(caller.generate(PROMPTS, GREEDY))
            except Exception as e:  # reported below
                got.append(e)

        thread = threading.Thread(target=generate)
        thread.start()
        assert engine.started.wait(60)
        drained: list[bool] = []
        drainer = threading.Thread(target=lambda: drained.append(core.drain(60)))
        drainer.start()
        with RemoteRolloutClient(address) as other:
            deadline = time.monotonic() + 60
            while not core._draining and time.monotonic() < deadline:  # the drain began
                time.sleep(0.01)
            with pytest.raises(RlfleetError, match="draining") as info:
                list(other.generate([[5, 6]], GREEDY))
            assert info.value.code == "UNAVAILABLE"
            time.sleep(2.0)  # four liveness periods with nothing to show
            assert other.status().queue_depth == len(PROMPTS)
        engine.go.set()
        drainer.join(60)
        thread.join(60)
        caller.close()
        assert drained == [True]
        assert not [g for g in got if isinstance(g, Exception)], got
        assert sorted(len(s.token_ids) for s in got) == [6, 6, 6]
