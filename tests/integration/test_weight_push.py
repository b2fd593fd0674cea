"""The trainer's bucketed weight push into a real rollout service (HF engine, tiny model,
gRPC on 127.0.0.1 port 0): several buckets in one ``UpdateWeights`` call arrive whole,
a corrupt, missing or truncated bucket changes nothing; over the bulk data plane
(TCP, shared memory) a one-bucket model and a many-bucket one arrive whole and once,
a corrupt middle bucket or a pusher killed between buckets changes nothing, and a
replica that refuses the bulk plane gets the gRPC stream; a sender that fails or
stops mid-update aborts it, so the replica's staged bytes go at once."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

torch = pytest.importorskip("torch")

from rlfleet.rollout.client import RemoteRolloutClient  # noqa: E402
from rlfleet.rollout.core import RolloutCore  # noqa: E402
from rlfleet.rollout.engine import SamplingParams  # noqa: E402
from rlfleet.rollout.hf_engine import HFEngine  # noqa: E402
from rlfleet.rollout.server import start_rollout_server  # noqa: E402
from rlfleet.trainer.client import InProcessTrainerClient  # noqa: E402
from rlfleet.trainer.core import TrainerCore  # noqa: E402
from rlfleet.trainer.testing import make_batch, make_config  # noqa: E402
from rlfleet.v1 import rollout_pb2, rollout_pb2_grpc  # noqa: E402
from rlfleet.weightsync import sender  # noqa: E402
from rlfleet.weightsync.checksum import tensor_crcs  # noqa: E402
from rlfleet.weightsync.sender import iter_buckets, iter_weight_chunks  # noqa: E402

pytestmark = pytest.mark.timeout(180)

BUCKET = 600_000  # the tiny model is ~4.5 MB, its largest tensor 1 MiB: 7+ buckets
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]
SAMPLING = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=3, ignore_eos=True)


@pytest.fixture(scope="module")
def trainer(tiny_model_dir: Path) -> TrainerCore:
    """A trainer whose actor took one SFT step, so its weights differ from the model
    the rollout loaded."""
    core = TrainerCore(make_config(str(tiny_model_dir), algorithm={"adv_estimator": "grpo"}))
    core.sft_step(make_batch(seed=3))
    return core


@pytest.fixture()
def rollout(tiny_model_dir: Path) -> Iterator[tuple[HFEngine, str]]:
    engine = HFEngine(tiny_model_dir)
    core = RolloutCore(engine, replica_id="r0")
    server = start_rollout_server(core)
    try:
        yield engine, server.address
    finally:
        server.stop(0)
        core.close()


def _params(engine: HFEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def _generate(address: str) -> list[tuple[list[int], list[int], list[float], int]]:
    with RemoteRolloutClient(address) as client:
        samples = list(client.generate(PROMPTS, SAMPLING))
    return [
        (PROMPTS[s.prompt_index], s.token_ids, s.logprobs, s.weight_version)
        for s in sorted(samples, key=lambda s: (s.prompt_index, s.sample_index))
    ]


def _trainer_log_probs(
    trainer: TrainerCore, samples: list[tuple[list[int], list[int], list[float], int]]
) -> torch.Tensor:
    """The trainer's teacher-forced log-probs of the rollout's samples (no padding:
    equal prompt and response lengths)."""
    prompts = torch.tensor([p for p, *_ in samples])
    responses = torch.tensor([r for _, r, *_ in samples])
    input_ids = torch.cat([prompts, responses], dim=1)
    batch = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "responses": responses,
    }
    out, _ = trainer.compute_log_prob(batch)
    log_probs: torch.Tensor = out["old_log_probs"]
    return log_probs


def _send(address: str, chunks: Iterator[rollout_pb2.WeightChunk]) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as err:
        rollout_pb2_grpc.RolloutServiceStub(channel).UpdateWeights(chunks, timeout=60)
    return err.value


def test_bucketed_push_lands_whole_in_a_real_replica(
    trainer: TrainerCore, rollout: tuple[HFEngine, str]
) -> None:
    engine, address = rollout
    ours = dict(trainer.iter_weights())
    assert any(not torch.equal(ours[n], p) for n, p in _params(engine).items())
    before = _generate(address)

    out = InProcessTrainerClient(trainer).push_weights(
        [("r0", address)], version=4, bucket_bytes=BUCKET, transports=["grpc"]
    )
    assert out.ok == {"r0": True}, out.errors
    assert out.transports == {"r0": "grpc"}
    assert out.bytes == sum(t.numel() * t.element_size() for t in ours.values())

    assert engine.info().weight_version == 4
    theirs = _params(engine)
    assert set(theirs) == set(ours)
    assert all(torch.equal(theirs[n], ours[n]) for n in ours)
    after = _generate(address)
    assert {v for *_, v in after} == {4}
    # Same seed, new weights: the log-probs moved, and they are the trainer's.
    assert [lp for *_, lp, _ in after] != [lp for *_, lp, _ in before]
    rollout_lp = torch.tensor([lp for *_, lp, _ in after])
    torch.testing.assert_close(_trainer_log_probs(trainer, after), rollout_lp, atol=1e-4, rtol=0)


def _corrupt(chunks: list[rollout_pb2.WeightChunk], bucket: int) -> None:
    first = next(
        i for i, m in enumerate(chunks) if m.chunk.meta.get("rlfleet.weights.bucket") == str(bucket)
    )
    piece = chunks[first].chunk.pieces[0]
    piece.data = bytes([piece.data[0] ^ 0xFF]) + piece.data[1:]


@pytest.mark.parametrize("damage", ["corrupt", "missing", "truncated"])
def test_a_bad_bucket_rejects_the_whole_update(
    trainer: TrainerCore, rollout: tuple[HFEngine, str], damage: str
) -> None:
    engine, address = rollout
    old, before = _params(engine), _generate(address)
    chunks = list(iter_weight_chunks(trainer.iter_weights(), 5, bucket_bytes=BUCKET))
    buckets = {m.chunk.meta["rlfleet.weights.bucket"] for m in chunks if m.chunk.seq == 0}
    assert len(buckets) > 3
    if damage == "corrupt":
        _corrupt(chunks, bucket=2)
        expected = grpc.StatusCode.DATA_LOSS
    elif damage == "missing":
        chunks = [m for m in chunks if m.chunk.stream_id != _stream_id(chunks, bucket=1)]
        expected = grpc.StatusCode.INVALID_ARGUMENT
    else:
        last = _stream_id(chunks, bucket=len(buckets) - 1)
        chunks = [m for m in chunks if m.chunk.stream_id != last]
        expected = grpc.StatusCode.DATA_LOSS
    err = _send(address, iter(chunks))
    assert err.code() == expected, err.details()

    assert engine.info().weight_version == 0
    assert all(torch.equal(p, old[n]) for n, p in _params(engine).items())
    assert _generate(address) == before  # the old weights keep serving


def _stream_id(chunks: list[rollout_pb2.WeightChunk], bucket: int) -> str:
    """The stream id of bucket ``bucket``."""
    return next(
        m.chunk.stream_id
        for m in chunks
        if m.chunk.seq == 0 and m.chunk.meta["rlfleet.weights.bucket"] == str(bucket)
    )


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_one_bucket_model_takes_the_bulk_plane(
    trainer: TrainerCore, rollout: tuple[HFEngine, str], transport: str
) -> None:
    engine, address = rollout
    client = InProcessTrainerClient(trainer)
    out = client.push_weights([("r0", address)], version=2, transports=[transport])
    assert out.ok == {"r0": True}, out.errors
    assert out.transports == {"r0": transport}
    ours = dict(trainer.iter_weights())
    assert all(torch.equal(p, ours[n]) for n, p in _params(engine).items())
    assert engine.info().weight_version == 2


@pytest.fixture(params=[60.0])
def replica(
    tiny_model_dir: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[RolloutCore, HFEngine, str]]:
    """A replica whose uncommitted transfers and idle bucketed updates expire after
    ``request.param`` seconds."""
    engine = HFEngine(tiny_model_dir)
    core = RolloutCore(engine, replica_id="r0", transfer_timeout_s=request.param)
    server = start_rollout_server(core)
    try:
        yield core, engine, server.address
    finally:
        server.stop(0)
        core.close()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_bucketed_model_takes_the_bulk_plane(
    trainer: TrainerCore, replica: tuple[RolloutCore, HFEngine, str], transport: str
) -> None:
    """Seven+ buckets, one transfer each, into a real replica next to an unreachable
    one: bit-exact, applied once, the failing target reported on its own."""
    core, engine, address = replica
    before = _generate(address)
    out = InProcessTrainerClient(trainer).push_weights(
        [("r0", address), ("gone", "127.0.0.1:1")],
        version=6,
        bucket_bytes=BUCKET,
        transports=[transport],
    )
    assert out.ok == {"r0": True, "gone": False}
    assert "gone" in out.errors and "r0" not in out.errors
    assert out.transports == {"r0": transport}
    ours = dict(trainer.iter_weights())
    theirs = _params(engine)
    assert set(theirs) == set(ours) and all(torch.equal(theirs[n], ours[n]) for n in ours)
    assert engine.info().weight_version == 6
    assert core._weights.updates == 1  # one swap for all the buckets
    assert core._bulk.staged_updates() == {}
    after = _generate(address)
    assert {v for *_, v in after} == {6} and after != before
    # One transfer per bucket, each with its buffer. The engine (CPU) adopted the
    # private staging arrays as its weights (shared memory: the copies made out of
    # the segments as the bytes landed; the segments are now the spares) and
    # releases them (as the spares) when the next update replaces them.
    buckets = len(list(iter_buckets(trainer.iter_weights(), BUCKET)))
    assert buckets >= 3
    assert core._weights.last is not None
    assert core._weights.last.adopted
    if transport == "shm":
        assert len(core._bulk._spare_shms) == buckets
    assert core._bulk._spare_arrays == []
    again = InProcessTrainerClient(trainer).push_weights(
        [("r0", address)], version=7, bucket_bytes=BUCKET, transports=[transport]
    )
    assert again.ok == {"r0": True}, again.errors
    assert all(torch.equal(p, ours[n]) for n, p in _params(engine).items())
    assert len(core._bulk._spare_arrays) == buckets


def test_bucketed_push_falls_back_to_grpc_when_the_bulk_plane_is_refused(
    trainer: TrainerCore, replica: tuple[RolloutCore, HFEngine, str]
) -> None:
    core, engine, address = replica
    core._bulk._host_id = "another-host"  # shared memory cannot be served to this sender
    out = InProcessTrainerClient(trainer).push_weights(
        [("r0", address)], version=3, bucket_bytes=BUCKET, transports=["shm", "grpc"]
    )
    assert out.ok == {"r0": True}, out.errors
    assert out.transports == {"r0": "grpc"}
    ours = dict(trainer.iter_weights())
    assert all(torch.equal(p, ours[n]) for n, p in _params(engine).items())
    assert engine.info().weight_version == 3 and core._bulk.staged_updates() == {}


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_corrupt_middle_bucket_over_the_bulk_plane_changes_nothing(
    trainer: TrainerCore,
    replica: tuple[RolloutCore, HFEngine, str],
    transport: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Bucket 1's bytes are damaged on the way (the sender commits the CRC-32Cs of the
    true bytes): DATA_LOSS, the staged bucket 0 is dropped, the old weights serve."""
    core, engine, address = replica
    old, before = _params(engine), _generate(address)
    real = getattr(sender, f"send_{transport}")
    calls = []

    def damaged(plan, named, specs, **kw):  # type: ignore[no-untyped-def]
        calls.append(len(calls))
        if len(calls) == 2:
            name = specs[len(specs) // 2].name
            bad = dict(named)
            bad[name] = named[name].clone()
            bad[name].view(-1)[0] += 1.0
            real(plan, bad, specs, **kw)
            return tensor_crcs(named, specs)
        return real(plan, named, specs, **kw)

    monkeypatch.setattr(sender, f"send_{transport}", damaged)
    out = InProcessTrainerClient(trainer).push_weights(
        [("r0", address)], version=7, bucket_bytes=BUCKET, transports=[transport]
    )
    assert out.ok == {"r0": False}
    assert "DataLoss" in out.errors["r0"] and "CRC-32C mismatch" in out.errors["r0"]
    assert len(calls) == 2  # nothing sent after the failed bucket
    assert core._bulk.staged_updates() == {}
    assert engine.info().weight_version == 0
    assert all(torch.equal(p, old[n]) for n, p in _params(engine).items())
    assert _generate(address) == before


_PUSHER = """
import sys, time
import torch
from rlfleet.weightsync.sender import push_weights

address, path, bucket_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
weights = torch.load(path)
gathered = []

def on_bucket(nbytes):
    gathered.append(nbytes)
    if len(gathered) == 3:  # buckets 0 and 1 committed, bucket 2 about to move
        print("stalled", flush=True)
        time.sleep(600)

push_weights(weights.items(), [("r0", address)], 8, bucket_bytes=bucket_bytes,
             transports=["tcp"], on_bucket=on_bucket)
print("finished", flush=True)
"""


@pytest.mark.parametrize("replica", [2.0], indirect=True)
def test_pusher_killed_between_buckets_leaves_the_old_weights(
    trainer: TrainerCore, replica: tuple[RolloutCore, HFEngine, str], tmp_path: Path
) -> None:
    """A pusher process killed (SIGKILL) after two committed buckets: the replica keeps
    serving the old weights, drops the staged buckets when the update expires, and
    takes the next push whole."""
    core, engine, address = replica
    old, before = _params(engine), _generate(address)
    torch.save(dict(trainer.iter_weights()), tmp_path / "weights.pt")
    proc = subprocess.Popen(
        [sys.executable, "-c", _PUSHER, address, str(tmp_path / "weights.pt"), str(BUCKET)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "stalled"
        assert list(core._bulk.staged_updates().values()) == [2]
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert engine.info().weight_version == 0
    assert _generate(address) == before
    deadline = time.monotonic() + 20
    while core._bulk.staged_updates() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert core._bulk.staged_updates() == {}  # expired (2 s without a bucket)
    assert all(torch.equal(p, old[n]) for n, p in _params(engine).items())

    out = InProcessTrainerClient(trainer).push_weights(
        [("r0", address)], version=8, bucket_bytes=BUCKET, transports=["tcp"]
    )
    assert out.ok == {"r0": True}, out.errors
    ours = dict(trainer.iter_weights())
    assert all(torch.equal(p, ours[n]) for n, p in _params(engine).items())
    assert engine.info().weight_version == 8


# ------------------------------------------------------------------------- abort


def _staged_bytes(address: str) -> int:
    with RemoteRolloutClient(address) as client:
        return client.status().weight_staged_bytes


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_sender_failing_mid_update_aborts_and_frees_the_staging_at_once(
    trainer: TrainerCore,
    replica: tuple[RolloutCore, HFEngine, str],
    transport: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Bucket 2's move fails on the sender (two buckets staged, a third open): the
    sender aborts, so the replica's staged bytes (GetStatus) drop to zero at once,
    well within the 60 s time-out; the old weights serve and the next push lands
    whole."""
    core, engine, address = replica
    old, before = _params(engine), _generate(address)
    real = getattr(sender, f"send_{transport}")
    held: list[int] = []

    def failing(plan, named, specs, **kw):  # type: ignore[no-untyped-def]
        if len(held) == 2:
            held.append(_staged_bytes(address))
            raise OSError("link down (test)")
        held.append(0)
        return real(plan, named, specs, **kw)

    monkeypatch.setattr(sender, f"send_{transport}", failing)
    start = time.monotonic()
    out = InProcessTrainerClient(trainer).push_weights(
        [("r0", address)], version=5, bucket_bytes=BUCKET, transports=[transport]
    )
    assert out.ok == {"r0": False} and "link down" in out.errors["r0"]
    assert held[2] > 0  # buckets 0 and 1 staged, bucket 2's buffer open
    with RemoteRolloutClient(address) as client:
        status = client.status()
    assert status.weight_staged_bytes == 0 and core._bulk.staged_updates() == {}
    assert time.monotonic() - start < 30  # not the transfer time-out (60 s)
    assert status.weight_spare_bytes > 0  # the staged buffers, kept for the next update
    assert engine.info().weight_version == 0
    assert all(torch.equal(p, old[n]) for n, p in _params(engine).items())
    assert _generate(address) == before

    monkeypatch.setattr(sender, f"send_{transport}", real)
    again = InProcessTrainerClient(trainer).push_weights(
        [("r0", address)], version=5, bucket_bytes=BUCKET, transports=[transport]
    )
    assert again.ok == {"r0": True}, again.errors
    ours = dict(trainer.iter_weights())
    assert all(torch.equal(p, ours[n]) for n, p in _params(engine).items())
    assert engine.info().weight_version == 5 and _staged_bytes(address) == 0


def test_pusher_stopping_mid_update_aborts(
    trainer: TrainerCore, replica: tuple[RolloutCore, HFEngine, str]
) -> None:
    """KeyboardInterrupt in the pusher between buckets (two committed): it propagates,
    and the target's staged buckets are aborted on the way out."""
    core, engine, address = replica
    gathered: list[int] = []

    def on_bucket(nbytes: int) -> None:
        gathered.append(nbytes)
        if len(gathered) == 3:
            assert list(core._bulk.staged_updates().values()) == [2]
            raise KeyboardInterrupt

    from rlfleet.weightsync.sender import push_weights

    with pytest.raises(KeyboardInterrupt):
        push_weights(
            trainer.iter_weights(),
            [("r0", address)],
            9,
            bucket_bytes=BUCKET,
            transports=["tcp"],
            on_bucket=on_bucket,
        )
    assert core._bulk.staged_updates() == {} and _staged_bytes(address) == 0
    assert engine.info().weight_version == 0


def test_keyboard_interrupt_in_a_bucket_move_aborts(
    trainer: TrainerCore,
    replica: tuple[RolloutCore, HFEngine, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    core, engine, address = replica
    buckets = [dict(b) for b, _ in iter_buckets(trainer.iter_weights(), BUCKET)]
    real = sender.send_tcp

    def interrupted(plan, named, specs, **kw):  # type: ignore[no-untyped-def]
        if any(core._bulk.staged_updates().values()):  # bucket 1, after bucket 0 staged
            raise KeyboardInterrupt
        return real(plan, named, specs, **kw)

    monkeypatch.setattr(sender, "send_tcp", interrupted)
    with grpc.insecure_channel(address) as channel:
        update = sender.BulkUpdate(rollout_pb2_grpc.RolloutServiceStub(channel), 2, ["tcp"])
        staged = update.send(buckets[0], final=False)
        assert staged is not None and staged.staged and update.pending
        with pytest.raises(KeyboardInterrupt):
            update.send(buckets[1], final=False)
        assert not update.pending and update.abort() is None  # sent once, already
    assert core._bulk.staged_updates() == {} and _staged_bytes(address) == 0
    assert engine.info().weight_version == 0


def test_abort_of_an_unknown_update_is_harmless(
    replica: tuple[RolloutCore, HFEngine, str],
) -> None:
    _core, engine, address = replica
    before = _generate(address)
    with grpc.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        answer = stub.AbortWeightTransfer(
            rollout_pb2.AbortWeightTransferRequest(update_id="no-such-update", reason="test")
        )
        assert (answer.aborted, answer.staged_buckets, answer.freed_bytes) == (False, 0, 0)
        with pytest.raises(grpc.RpcError) as e:
            stub.AbortWeightTransfer(rollout_pb2.AbortWeightTransferRequest())
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert engine.info().weight_version == 0 and _generate(address) == before


# ------------------------------------------------------- transport choice, fallback


def test_default_push_takes_shared_memory_on_this_host(
    trainer: TrainerCore, replica: tuple[RolloutCore, HFEngine, str]
) -> None:
    """No transports named: the trainer's rollout.weight_transport (auto), and the
    replica shares this host's /dev/shm: every bucket over shared memory."""
    core, engine, address = replica
    out = InProcessTrainerClient(trainer).push_weights(
        [("r0", address)], version=2, bucket_bytes=BUCKET
    )
    assert out.ok == {"r0": True}, out.errors
    assert out.transports == {"r0": "shm"}
    ours = dict(trainer.iter_weights())
    assert all(torch.equal(p, ours[n]) for n, p in _params(engine).items())
    assert core._weights.updates == 1


def test_auto_on_another_host_takes_tcp_and_forced_shm_fails(
    trainer: TrainerCore, replica: tuple[RolloutCore, HFEngine, str]
) -> None:
    """A replica whose host identity differs (another machine, or a container with
    its own /dev/shm) is planned TCP under auto; forced to shared memory it fails,
    naming the identities, and keeps its weights."""
    core, engine, address = replica
    core._bulk._host_id = "another-host/boot/1:2"
    client = InProcessTrainerClient(trainer)
    forced = client.push_weights([("r0", address)], version=3, transports=["shm"])
    assert forced.ok == {"r0": False}
    assert "none of the offered transports ['shm']" in forced.errors["r0"]
    assert engine.info().weight_version == 0
    out = client.push_weights([("r0", address)], version=3, bucket_bytes=BUCKET)
    assert out.ok == {"r0": True}, out.errors
    assert out.transports == {"r0": "tcp"}
    assert engine.info().weight_version == 3


def test_a_segment_not_shared_is_cancelled_and_tcp_takes_over(
    trainer: TrainerCore,
    replica: tuple[RolloutCore, HFEngine, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The identities match but the sender's /dev/shm is not the replica's (here: the
    sender looks elsewhere): the sender finds no segment, aborts the planned
    transfer (the replica frees it at once) and offers again without shared memory:
    the update lands over TCP."""
    from rlfleet.weightsync import shm

    core, engine, address = replica
    identity = core._bulk._host_id
    monkeypatch.setattr(shm, "_SHM_DIR", str(tmp_path))  # where the sender maps segments
    monkeypatch.setattr(sender, "host_identity", lambda: identity)
    caplog.set_level(logging.WARNING, logger="rlfleet.weightsync.sender")
    out = InProcessTrainerClient(trainer).push_weights(
        [("r0", address)], version=4, bucket_bytes=BUCKET
    )
    assert out.ok == {"r0": True}, out.errors
    assert out.transports == {"r0": "tcp"}
    assert any("shared memory not shared" in m for m in caplog.messages)
    ours = dict(trainer.iter_weights())
    assert all(torch.equal(p, ours[n]) for n, p in _params(engine).items())
    assert core._bulk._transfers == {} and core._bulk.staged_updates() == {}
    assert _staged_bytes(address) == 0


def test_a_segment_with_another_nonce_is_never_written(
    trainer: TrainerCore, replica: tuple[RolloutCore, HFEngine, str]
) -> None:
    """A plan whose nonce the segment does not hold (a segment of the same name that
    is not the replica's): the sender writes nothing into it."""
    from rlfleet.weightsync.shm import ShmUnavailable, send_shm
    from rlfleet.weightsync.wire import TransferPlan

    core, _engine, _address = replica
    w = dict(trainer.iter_weights())
    offer = sender.make_offer(w, 1, ["shm"])
    plan = core.open_transfer(offer)
    assert plan.transport == "shm" and plan.token
    path = Path("/dev/shm", plan.endpoint)
    before = path.read_bytes()
    with pytest.raises(ShmUnavailable, match="nonce"):
        send_shm(TransferPlan(plan.transfer_id, "shm", plan.endpoint, "0" * 32), w, offer.tensors)
    assert path.read_bytes() == before
    assert core.abort_transfer(plan.transfer_id, "test").aborted
    assert core._bulk._transfers == {}


def test_an_unreachable_tcp_endpoint_falls_back_to_grpc_under_auto(
    trainer: TrainerCore,
    replica: tuple[RolloutCore, HFEngine, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The replica plans TCP but its endpoint cannot be reached from the trainer (a
    firewall, an address only it can use): under auto the planned transfer is
    aborted and the update goes over the gRPC stream; forced to TCP it fails."""
    from rlfleet.weightsync import tcp

    core, engine, address = replica
    core._bulk._host_id = "another-host/boot/1:2"  # no shared memory either
    monkeypatch.setattr(tcp, "endpoint_of", lambda listener: "127.0.0.1:1")
    client = InProcessTrainerClient(trainer)
    forced = client.push_weights([("r0", address)], version=5, transports=["tcp"])
    assert forced.ok == {"r0": False} and "cannot connect" in forced.errors["r0"]
    out = client.push_weights([("r0", address)], version=5, bucket_bytes=BUCKET)
    assert out.ok == {"r0": True}, out.errors
    assert out.transports == {"r0": "grpc"}
    ours = dict(trainer.iter_weights())
    assert all(torch.equal(p, ours[n]) for n, p in _params(engine).items())
    assert core._bulk._transfers == {} and core._bulk.staged_updates() == {}


def test_the_trainers_own_weight_transport_applies_when_none_is_named(
    tiny_model_dir: Path, replica: tuple[RolloutCore, HFEngine, str]
) -> None:
    """PushWeights without transports: the trainer's rollout.weight_transport decides."""
    _core, engine, address = replica
    core = TrainerCore(
        make_config(
            str(tiny_model_dir),
            algorithm={"adv_estimator": "grpo"},
            rollout={"weight_transport": "grpc"},
        )
    )
    core.sft_step(make_batch(seed=5))
    out = InProcessTrainerClient(core).push_weights([("r0", address)], version=1)
    assert out.ok == {"r0": True}, out.errors
    assert out.transports == {"r0": "grpc"}
    assert engine.info().weight_version == 1


def test_one_push_gives_each_replica_its_own_transport(
    trainer: TrainerCore, tiny_model_dir: Path, replica: tuple[RolloutCore, HFEngine, str]
) -> None:
    """One bucketed push to a replica on this host and one "elsewhere": shared memory
    for the first, TCP for the second, both bit-exact (the buckets' checksums are
    computed once and serve both)."""
    _near, near_engine, near_address = replica
    far_engine = HFEngine(tiny_model_dir)
    far = RolloutCore(far_engine, replica_id="far")
    far._bulk._host_id = "another-host/boot/1:2"
    server = start_rollout_server(far)
    try:
        out = InProcessTrainerClient(trainer).push_weights(
            [("near", near_address), ("far", server.address)], version=3, bucket_bytes=BUCKET
        )
        assert out.ok == {"near": True, "far": True}, out.errors
        assert out.transports == {"near": "shm", "far": "tcp"}
        ours = dict(trainer.iter_weights())
        for engine in (near_engine, far_engine):
            assert all(torch.equal(p, ours[n]) for n, p in _params(engine).items())
            assert engine.info().weight_version == 3
    finally:
        server.stop(0)
        far.close()
