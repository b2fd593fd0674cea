"""Weight updates: staged, verified, checked, swapped; rejected updates change nothing."""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from rlfleet.common.codec.wire import iter_chunks  # noqa: E402
from rlfleet.common.errors import (  # noqa: E402
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from rlfleet.rollout.hf_engine import HFEngine  # noqa: E402
from rlfleet.weightsync import checksum, receiver, shm, tcp  # noqa: E402
from rlfleet.weightsync.checksum import (  # noqa: E402
    CRC_RELEASES_GIL,
    crc32c_extend,
    tensor_bytes,
    tensor_crcs,
)
from rlfleet.weightsync.receiver import BulkReceiver, WeightReceiver  # noqa: E402
from rlfleet.weightsync.sender import make_offer  # noqa: E402
from rlfleet.weightsync.shm import HEADER as _SHM_HEADER  # noqa: E402
from rlfleet.weightsync.shm import send_shm  # noqa: E402
from rlfleet.weightsync.tcp import send_tcp  # noqa: E402
from rlfleet.weightsync.wire import AbortResult, TransferPlan  # noqa: E402


@pytest.fixture()
def engine(tiny_model_dir: Path) -> HFEngine:
    return HFEngine(tiny_model_dir)


def new_weights(engine: HFEngine, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: p.detach() + 0.05 * torch.randn(p.shape, generator=g)
        for n, p in engine.model.named_parameters()
    }


def snapshot(engine: HFEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def assert_weights(engine: HFEngine, expected: dict[str, torch.Tensor]) -> None:
    for n, p in engine.model.named_parameters():
        assert torch.equal(p, expected[n]), n


def chunks(weights: dict[str, torch.Tensor], version: int, **kw: object):
    return [(version, c) for c in iter_chunks(weights, max_chunk_bytes=64_000, **kw)]


def test_chunk_stream_update_applies_exactly(engine: HFEngine) -> None:
    w = new_weights(engine)
    result = WeightReceiver(engine).receive_chunks(chunks(w, 3))
    assert (result.version, result.tensors) == (3, len(w))
    assert result.bytes == sum(t.numel() * 4 for t in w.values())
    assert_weights(engine, w)
    assert engine.info().weight_version == 3


def test_corrupt_chunk_is_rejected_and_old_weights_serve(engine: HFEngine) -> None:
    old = snapshot(engine)
    stream = chunks(new_weights(engine), 1)
    version, bad = stream[5]
    piece = bad.pieces[0]
    data = bytearray(piece.data)
    data[0] ^= 0xFF
    piece.data = bytes(data)
    stream[5] = (version, bad)
    with pytest.raises(DataLoss, match=f"{piece.name}|crc32") as e:
        WeightReceiver(engine).receive_chunks(stream)
    assert e.value.status == "DATA_LOSS"
    assert_weights(engine, old)
    assert engine.info().weight_version == 0


def test_truncated_stream_is_rejected(engine: HFEngine) -> None:
    old = snapshot(engine)
    with pytest.raises(DataLoss, match="without its last chunk"):
        WeightReceiver(engine).receive_chunks(chunks(new_weights(engine), 1)[:-1])
    assert_weights(engine, old)


def test_mismatched_tensor_is_named(engine: HFEngine) -> None:
    old = snapshot(engine)
    w = new_weights(engine)
    w["model.layers.1.self_attn.q_proj.weight"] = torch.zeros(4, 4)
    with pytest.raises(InvalidArgument, match=r"model\.layers\.1\.self_attn\.q_proj\.weight"):
        WeightReceiver(engine).receive_chunks(chunks(w, 1))
    assert_weights(engine, old)


def test_versions_never_go_back(engine: HFEngine) -> None:
    rx = WeightReceiver(engine)
    rx.receive_chunks(chunks(new_weights(engine), 5))
    with pytest.raises(FailedPrecondition, match="older"):
        rx.receive_chunks(chunks(new_weights(engine, 2), 4))
    mixed = chunks(new_weights(engine), 6)
    mixed[1] = (7, mixed[1][1])
    with pytest.raises(InvalidArgument, match="version 7"):
        rx.receive_chunks(mixed)
    assert engine.info().weight_version == 5


def send(transport: str, plan: TransferPlan, w: dict[str, torch.Tensor], specs: Any) -> list[int]:
    return (send_tcp if transport == "tcp" else send_shm)(plan, w, specs)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_bulk_transfer_is_bit_exact(engine: HFEngine, transport: str) -> None:
    bulk = BulkReceiver(WeightReceiver(engine), engine)
    w = {k: v.to(torch.float32) for k, v in new_weights(engine).items()}
    offer = make_offer(w, 2, [transport])
    plan = bulk.open(offer)
    assert plan.transport == transport
    crcs = send(transport, plan, w, offer.tensors)
    assert crcs == tensor_crcs(w, offer.tensors)
    result = bulk.commit(plan.transfer_id, crcs)
    assert (result.version, result.transport) == (2, transport)
    assert_weights(engine, w)
    bulk.close()


def test_gil_free_crc32c_matches_google_crc32c() -> None:
    """The bulk plane's ``crc32c_extend`` (without the GIL where a C implementation
    loads: awscrt's, else google-crc32c's through ctypes) gives google-crc32c's
    values, extended block by block."""
    data = np.random.default_rng(0).integers(0, 256, size=3 * 65_536 + 7, dtype=np.uint8)
    assert crc32c_extend(0, data[:0]) == 0
    assert crc32c_extend(0, data) == google_crc32c.value(data.tobytes())
    crc = 0
    for i in range(0, len(data), 1000):
        crc = crc32c_extend(crc, data[i : i + 1000])
    assert crc == google_crc32c.value(data.tobytes())
    from rlfleet.common.crc32c import _load_awscrt

    c_loaded = _load_awscrt() is not None or google_crc32c.implementation == "c"
    assert c_loaded == CRC_RELEASES_GIL


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_bulk_blocks_across_tensor_boundaries(
    engine: HFEngine, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks smaller than the tensors and not aligned to them (sender and receiver
    alike): each tensor's CRC-32C is still its own, and the update is bit-exact."""
    monkeypatch.setattr(tcp, "_SEND_BLOCK", 4096 + 3)
    monkeypatch.setattr(shm, "_SHM_BLOCK", 4096 + 3)
    monkeypatch.setattr(tcp, "_BLOCK", 1000)
    # The receiver's verifier steps cut tensors, and elements, anywhere.
    monkeypatch.setattr(checksum, "_FOLLOW_BLOCK", 4096 + 5)
    bulk = BulkReceiver(WeightReceiver(engine), engine)
    w = new_weights(engine, seed=7)
    offer = make_offer(w, 3, [transport])
    plan = bulk.open(offer)
    crcs = send(transport, plan, w, offer.tensors)
    assert crcs == tensor_crcs(w, offer.tensors)
    assert bulk.commit(plan.transfer_id, crcs).version == 3
    assert_weights(engine, w)
    bulk.close()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_bulk_staging_buffer_is_reused(engine: HFEngine, transport: str) -> None:
    """A committed transfer's buffer (segment) serves the next one that fits; each
    update still applies exactly its own bytes."""
    bulk = BulkReceiver(WeightReceiver(engine), engine)
    endpoints = []
    for version in (1, 2, 3):
        w = new_weights(engine, seed=version)
        offer = make_offer(w, version, [transport])
        plan = bulk.open(offer)
        endpoints.append(plan.endpoint)
        bulk.commit(plan.transfer_id, send(transport, plan, w, offer.tensors))
        assert_weights(engine, w)
    spares = bulk._spare_arrays if transport == "tcp" else bulk._spare_shms
    assert len(spares) == 1
    if transport == "shm":  # the same segment every time
        assert len(set(endpoints)) == 1
    # Two transfers open at once: the second cannot share the first's buffer.
    w1, w2 = new_weights(engine, seed=11), new_weights(engine, seed=12)
    o1, o2 = make_offer(w1, 4, [transport]), make_offer(w2, 5, [transport])
    p1, p2 = bulk.open(o1), bulk.open(o2)
    if transport == "shm":
        assert p1.endpoint != p2.endpoint
    c2 = send(transport, p2, w2, o2.tensors)
    c1 = send(transport, p1, w1, o1.tensors)
    bulk.commit(p1.transfer_id, c1)
    assert_weights(engine, w1)
    bulk.commit(p2.transfer_id, c2)
    assert_weights(engine, w2)
    bulk.close()
    if transport == "shm":
        assert not any(Path("/dev/shm", e).exists() for e in {*endpoints, p1.endpoint, p2.endpoint})


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_corrupted_bulk_transfer_is_rejected(engine: HFEngine, transport: str) -> None:
    """Bytes that differ from what the sender checksummed (here: sent tampered,
    committed with the true CRC-32Cs) are refused, naming the tensor."""
    old = snapshot(engine)
    bulk = BulkReceiver(WeightReceiver(engine), engine)
    w = new_weights(engine)
    offer = make_offer(w, 2, [transport])
    plan = bulk.open(offer)
    tampered = dict(w)
    name = "model.layers.2.mlp.down_proj.weight"
    tampered[name] = w[name].clone()
    tampered[name][0, 0] += 1.0
    send(transport, plan, tampered, offer.tensors)
    with pytest.raises(DataLoss, match=rf"CRC-32C mismatch in 1 of .*{name}") as e:
        bulk.commit(plan.transfer_id, tensor_crcs(w, offer.tensors))
    assert e.value.status == "DATA_LOSS"
    assert_weights(engine, old)
    bulk.close()


def test_shm_commit_before_every_byte_is_written_is_rejected(engine: HFEngine) -> None:
    """The receiver counts what the sender published; a commit short of the offer is
    refused even with the right checksums."""
    old = snapshot(engine)
    bulk = BulkReceiver(WeightReceiver(engine), engine)
    w = new_weights(engine)
    offer = make_offer(w, 2, ["shm"])
    plan = bulk.open(offer)
    first = offer.tensors[0]
    with open(f"/dev/shm/{plan.endpoint}", "r+b") as f:  # only the first tensor
        f.seek(_SHM_HEADER + first.offset)
        f.write(tensor_bytes(w[first.name]))
        f.seek(0)
        f.write(struct.pack("<Q", first.nbytes))
    with pytest.raises(DataLoss, match=f"after writing {first.nbytes} of {offer.total_bytes}"):
        bulk.commit(plan.transfer_id, tensor_crcs(w, offer.tensors))
    assert_weights(engine, old)
    bulk.close()


def test_bulk_commit_needs_one_crc_per_tensor(engine: HFEngine) -> None:
    bulk = BulkReceiver(WeightReceiver(engine), engine)
    w = new_weights(engine)
    offer = make_offer(w, 1, ["tcp"])
    plan = bulk.open(offer)
    crcs = send_tcp(plan, w, offer.tensors)
    with pytest.raises(InvalidArgument, match=f"carries {len(crcs) - 1} CRC-32Cs"):
        bulk.commit(plan.transfer_id, crcs[:-1])
    assert engine.info().weight_version == 0
    bulk.close()


def test_bulk_tcp_rejects_short_streams_and_wrong_tokens(engine: HFEngine) -> None:
    bulk = BulkReceiver(WeightReceiver(engine), engine, timeout_s=20)
    w = new_weights(engine)
    offer = make_offer(w, 1, ["tcp"])
    plan = bulk.open(offer)
    host, port = plan.endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:  # wrong token: dropped
        s.sendall(b"x" * len(plan.token))
    with socket.create_connection((host, int(port))) as s:
        s.sendall(plan.token.encode() + b"\0" * 1000)
    with pytest.raises(DataLoss, match="sender closed after 1000 of"):
        bulk.commit(plan.transfer_id, tensor_crcs(w, offer.tensors))
    assert engine.info().weight_version == 0
    bulk.close()


def test_bulk_offer_checked_before_bytes_move(engine: HFEngine) -> None:
    bulk = BulkReceiver(WeightReceiver(engine), engine)
    w = new_weights(engine)
    w["model.norm.weight"] = torch.zeros(7)
    with pytest.raises(InvalidArgument, match=r"model\.norm\.weight"):
        bulk.open(make_offer(w, 1, ["tcp"]))
    other_host = make_offer(new_weights(engine), 1, ["shm", "tcp"])
    object.__setattr__(other_host, "sender_host", "elsewhere")
    assert bulk.open(other_host).transport == "tcp"
    bulk.close()


# ------------------------------------------------------------- bucketed bulk updates


def split(w: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    """``w`` in ``n`` buckets of consecutive tensors."""
    names = list(w)
    step = -(-len(names) // n)
    return [{k: w[k] for k in names[i : i + step]} for i in range(0, len(names), step)]


def send_bucket(
    bulk: BulkReceiver,
    transport: str,
    bucket: dict[str, torch.Tensor],
    version: int,
    index: int,
    final: bool,
    update_id: str,
    *,
    tamper: bool = False,
) -> tuple[str, list[int], str]:
    """Offer, move (tampered: one value changed, the true CRC-32Cs returned); returns
    ``(transfer_id, crcs, update_id)``."""
    offer = make_offer(bucket, version, [transport], bucket=index, final=final, update_id=update_id)
    plan = bulk.open(offer)
    assert plan.transport == transport and plan.update_id
    assert update_id in ("", plan.update_id)
    sent = bucket
    if tamper:
        name = next(iter(bucket))
        sent = {**bucket, name: bucket[name].clone()}
        sent[name].view(-1)[0] += 1.0
    send(transport, plan, sent, offer.tensors)
    return plan.transfer_id, tensor_crcs(bucket, offer.tensors), plan.update_id


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_bucketed_bulk_update_applies_once_after_the_final_bucket(
    engine: HFEngine, transport: str
) -> None:
    old = snapshot(engine)
    bulk = BulkReceiver(WeightReceiver(engine), engine)
    serving = 0
    for version in (3, 4):  # twice: the second update reuses the first one's buffers
        w = new_weights(engine, seed=version)
        buckets = split(w, 4)
        assert len(buckets) >= 3
        update_id = ""
        for i, b in enumerate(buckets):
            final = i == len(buckets) - 1
            tid, crcs, update_id = send_bucket(bulk, transport, b, version, i, final, update_id)
            result = bulk.commit(tid, crcs)
            if not final:
                assert result.staged and result.version == serving
                assert bulk.staged_updates() == {update_id: i + 1}
                assert_weights(engine, old)  # nothing applied before the final bucket
            else:
                assert not result.staged and result.version == version
                assert (result.tensors, result.bytes) == (
                    len(w),
                    sum(t.numel() * t.element_size() for t in w.values()),
                )
        assert_weights(engine, w)
        assert bulk.staged_updates() == {}
        old, serving = w, version
    spares = bulk._spare_arrays if transport == "tcp" else bulk._spare_shms
    assert len(spares) == len(buckets)  # one update's buffers, kept for the next
    bulk.close()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_corrupt_middle_bucket_drops_the_staged_update(engine: HFEngine, transport: str) -> None:
    old = snapshot(engine)
    bulk = BulkReceiver(WeightReceiver(engine), engine)
    buckets = split(new_weights(engine), 3)
    tid, crcs, uid = send_bucket(bulk, transport, buckets[0], 1, 0, False, "")
    bulk.commit(tid, crcs)
    tid, crcs, _ = send_bucket(bulk, transport, buckets[1], 1, 1, False, uid, tamper=True)
    with pytest.raises(DataLoss, match=r"bucket 1.*CRC-32C mismatch"):
        bulk.commit(tid, crcs)
    assert bulk.staged_updates() == {}
    with pytest.raises(NotFound, match="no bucketed weight update"):
        bulk.open(make_offer(buckets[2], 1, [transport], bucket=2, update_id=uid))
    assert_weights(engine, old)
    assert engine.info().weight_version == 0
    bulk.close()


def test_bucket_offers_are_checked_against_the_earlier_buckets(engine: HFEngine) -> None:
    """Out of order, a tensor twice, or a final bucket that leaves the model
    uncovered: refused before any byte moves, and the staged buckets are dropped."""
    bulk = BulkReceiver(WeightReceiver(engine), engine)
    w = new_weights(engine)
    b0, b1, b2 = split(w, 3)

    def staged_update() -> str:
        tid, crcs, uid = send_bucket(bulk, "tcp", b0, 1, 0, False, "")
        bulk.commit(tid, crcs)
        return uid

    for offer, match in [
        (lambda u: make_offer(b2, 1, ["tcp"], bucket=2, final=False, update_id=u), "in order"),
        (lambda u: make_offer(b0, 1, ["tcp"], bucket=1, final=False, update_id=u), "repeats"),
        (lambda u: make_offer(b1, 1, ["tcp"], bucket=1, final=True, update_id=u), "missing"),
        (lambda u: make_offer(b1, 2, ["tcp"], bucket=1, final=False, update_id=u), "version 2"),
    ]:
        uid = staged_update()
        with pytest.raises(InvalidArgument, match=match):
            bulk.open(offer(uid))
        assert bulk.staged_updates() == {}
    with pytest.raises(InvalidArgument, match="without an update_id"):
        bulk.open(make_offer(b1, 1, ["tcp"], bucket=1, final=False))
    with pytest.raises(InvalidArgument, match="missing"):  # one "final" bucket 0 is whole
        bulk.open(make_offer(b0, 1, ["tcp"]))
    assert engine.info().weight_version == 0
    bulk.close()


def test_an_abandoned_bucketed_update_expires(engine: HFEngine) -> None:
    """The pusher stops after bucket 0: the reaper drops the staged bucket after the
    time-out, with no further traffic; nothing was applied."""
    old = snapshot(engine)
    bulk = BulkReceiver(WeightReceiver(engine), engine, timeout_s=0.5)
    b0 = split(new_weights(engine), 3)[0]
    tid, crcs, uid = send_bucket(bulk, "shm", b0, 1, 0, False, "")
    bulk.commit(tid, crcs)
    assert bulk.staged_updates() == {uid: 1}
    deadline = time.monotonic() + 10
    while bulk.staged_updates() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert bulk.staged_updates() == {}
    assert_weights(engine, old)
    bulk.close()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_abort_drops_the_staged_buckets_at_once(engine: HFEngine, transport: str) -> None:
    """The sender gives up after two staged buckets with a third one open: every
    staging buffer leaves the update at once (the staged ones become spares, the open
    one is released), nothing was applied, and the update's id is gone."""
    old = snapshot(engine)
    bulk = BulkReceiver(WeightReceiver(engine), engine)
    buckets = split(new_weights(engine), 4)
    uid = ""
    for i in (0, 1):
        tid, crcs, uid = send_bucket(bulk, transport, buckets[i], 1, i, False, uid)
        bulk.commit(tid, crcs)
    staged = bulk.staged_bytes()
    bulk.open(make_offer(buckets[2], 1, [transport], bucket=2, final=False, update_id=uid))
    held = bulk.staged_bytes()
    assert 0 < staged < held and bulk.spare_bytes() == 0

    result = bulk.abort(uid, "test")
    assert result == AbortResult(True, staged_buckets=2, freed_bytes=held)
    assert bulk.staged_bytes() == 0 and bulk.staged_updates() == {}
    assert bulk.spare_bytes() == staged  # kept for the next update, as after any update
    assert_weights(engine, old)
    assert engine.info().weight_version == 0
    with pytest.raises(NotFound, match="no bucketed weight update"):
        bulk.open(make_offer(buckets[3], 1, [transport], bucket=3, update_id=uid))
    # Again, or an id never seen: a no-op.
    assert bulk.abort(uid) == AbortResult(False)
    assert bulk.abort("never-seen") == AbortResult(False)
    bulk.close()


# ------------------------------------------------- adopted staging tensors (no apply copy)


def buffer_start(engine: HFEngine) -> int:
    """Where the parameters' bytes start, checking they lie in one packed buffer."""
    params = list(engine.model.parameters())
    start = min(p.data_ptr() for p in params)
    total = sum(p.numel() * p.element_size() for p in params)
    assert all(start <= p.data_ptr() < start + total for p in params)
    return start


def push_bulk(bulk: BulkReceiver, w: dict[str, torch.Tensor], version: int, transport: str) -> Any:
    offer = make_offer(w, version, [transport])
    plan = bulk.open(offer)
    return bulk.commit(plan.transfer_id, send(transport, plan, w, offer.tensors))


def test_tcp_update_adopts_the_staging_buffer_and_recycles_the_old_one(engine: HFEngine) -> None:
    """The HF engine on CPU takes a TCP transfer's verified tensors as its parameters
    (no copy); the buffer it held before becomes the next transfer's staging buffer,
    and filling that one leaves the weights serving untouched."""
    bulk = BulkReceiver(WeightReceiver(engine), engine)
    w1, w2, w3 = (new_weights(engine, seed=s) for s in (1, 2, 3))
    assert push_bulk(bulk, w1, 1, "tcp").adopted
    assert_weights(engine, w1)
    a = buffer_start(engine)  # every parameter views the one staging buffer
    assert bulk._spare_arrays == []  # the engine holds it
    assert push_bulk(bulk, w2, 2, "tcp").adopted
    assert_weights(engine, w2)
    b = buffer_start(engine)
    assert b != a and [x.ctypes.data for x in bulk._spare_arrays] == [a]
    # Update 3 lands in buffer a while w2 (in b) serves; a corrupt commit changes nothing.
    offer = make_offer(w3, 3, ["tcp"])
    plan = bulk.open(offer)
    tampered = {**w3, "model.norm.weight": w3["model.norm.weight"] + 1}
    send_tcp(plan, tampered, offer.tensors)
    with pytest.raises(DataLoss):
        bulk.commit(plan.transfer_id, tensor_crcs(w3, offer.tensors))
    assert_weights(engine, w2)
    assert push_bulk(bulk, w3, 3, "tcp").adopted
    assert_weights(engine, w3)
    assert buffer_start(engine) == a  # ping-pong: two buffers, no fresh one
    # The gRPC stream copies into the adopted tensors; sleep(2) releases them.
    w4 = new_weights(engine, seed=4)
    assert not WeightReceiver(engine).receive_chunks(chunks(w4, 4)).adopted
    assert_weights(engine, w4)
    assert buffer_start(engine) == a
    engine.sleep(level=2)
    assert sorted(x.ctypes.data for x in bulk._spare_arrays) == [a]
    engine.wake_up()
    bulk.close()


@pytest.mark.parametrize("private", [False, True])
def test_shared_memory_never_backs_the_weights(engine: HFEngine, private: bool) -> None:
    """A segment stays writable by the sender's process, so the weights never view
    it: without ``private_shm`` its tensors are copied into the parameters; with it
    (the default on CPU) the receiver checks and applies its own copy, made as the
    bytes landed, which the engine adopts. Either way, bytes written into the
    segment after the commit change nothing."""
    bulk = BulkReceiver(WeightReceiver(engine), engine, private_shm=private)
    w = new_weights(engine)
    offer = make_offer(w, 1, ["shm"])
    plan = bulk.open(offer)
    result = bulk.commit(plan.transfer_id, send("shm", plan, w, offer.tensors))
    assert result.adopted is private
    if not private:
        assert not result.adopted
    assert_weights(engine, w)
    assert len(bulk._spare_shms) == 1
    with open(f"/dev/shm/{plan.endpoint}", "r+b") as f:  # the sender writes again
        f.seek(_SHM_HEADER)
        f.write(b"\xff" * offer.total_bytes)
    assert_weights(engine, w)
    bulk.close()


def test_spare_pool_takes_the_smallest_fit_among_arrays() -> None:
    """Several spare arrays of different sizes (a bucketed update's): the smallest that
    fits is taken, by identity (arrays do not compare with ``==``); none fits: the
    largest is dropped."""
    pool = [np.zeros(n, dtype=np.uint8) for n in (64, 16, 32)]
    small, mid, big = pool[1], pool[2], pool[0]
    assert receiver._take_smallest(pool, 20, lambda a: a.nbytes) is mid
    assert receiver._take_smallest(pool, 8, lambda a: a.nbytes) is small
    assert receiver._take_smallest(pool, 100, lambda a: a.nbytes) is None
    assert pool == [] and big.nbytes == 64


def test_staged_updates_and_streamed_plans_hold_nothing_past_their_bound(
    engine: HFEngine,
) -> None:
    """Bucketed updates left unfinished (a sender that stopped, or an abuser with the
    trainer's credential): at most MAX_STAGED_UPDATES stage at once, a newer one drops
    the one touched longest ago, so the staged bytes stay bounded; an offer planned
    for the gRPC stream keeps nothing on the replica."""
    from rlfleet.weightsync.receiver import MAX_STAGED_UPDATES

    bulk = BulkReceiver(WeightReceiver(engine), engine)
    w = {k: v.to(torch.float32) for k, v in new_weights(engine).items()}
    first = dict(list(w.items())[:1])
    updates = []
    for _ in range(MAX_STAGED_UPDATES + 2):
        offer = make_offer(first, 2, ["tcp"], bucket=0, final=False)
        plan = bulk.open(offer)
        crcs = send("tcp", plan, first, offer.tensors)
        bulk.commit(plan.transfer_id, crcs)  # bucket 0 staged
        updates.append(plan.update_id)
    staged = bulk.staged_updates()
    assert list(staged) == updates[-MAX_STAGED_UPDATES:]
    assert bulk.staged_bytes() <= MAX_STAGED_UPDATES * sum(
        t.numel() * t.element_size() for t in first.values()
    )
    for _ in range(50):
        assert bulk.open(make_offer(w, 3, ["grpc"])).transport == "grpc"
    assert len(bulk._transfers) == 0
    bulk.close()


def test_a_trickling_sender_does_not_outlive_its_transfer(engine: HFEngine) -> None:
    """A sender that presents the token, then a byte now and then: the commit ends at
    its deadline, and the receive thread (its socket, its buffer) ends with the
    transfer, not one receive time-out after another."""
    import socket
    import threading
    import time

    from rlfleet.common.errors import DeadlineExceeded

    bulk = BulkReceiver(WeightReceiver(engine), engine, timeout_s=30.0)
    w = {k: v.to(torch.float32) for k, v in new_weights(engine).items()}
    offer = make_offer(w, 2, ["tcp"])
    plan = bulk.open(offer)
    host, _, port = plan.endpoint.rpartition(":")
    conn = socket.create_connection((host, int(port)), timeout=5)
    conn.sendall(plan.token.encode())
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.5):
            try:
                conn.send(b"\0")
            except OSError:
                return

    threading.Thread(target=trickle, daemon=True).start()
    name = f"rlfleet-weights-{plan.transfer_id[:8]}"
    try:
        with pytest.raises(DeadlineExceeded):
            bulk.commit(plan.transfer_id, [0] * len(offer.tensors), timeout_s=1.5)
        deadline = time.monotonic() + 10
        while any(t.name == name for t in threading.enumerate()):
            assert time.monotonic() < deadline, "the receive thread outlived its transfer"
            time.sleep(0.1)
    finally:
        stop.set()
        conn.close()
        bulk.close()
