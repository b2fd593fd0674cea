"""rlfleet.weightsync's own pieces: the transport table and the config key that picks
one, the host identity that decides shared memory, the value scan's fast path, and
the receiver's verifier (CRC-32C and value scan per run of tensors, as bytes land)."""

from __future__ import annotations

import math
import os
import typing
from pathlib import Path

import google_crc32c
import numpy as np
import pytest

from rlfleet.common.config import RolloutConfig, config_from_dict
from rlfleet.common.errors import InvalidArgument
from rlfleet.v1 import rollout_pb2
from rlfleet.weightsync import wire

torch = pytest.importorskip("torch")

from rlfleet.weightsync import checksum  # noqa: E402
from rlfleet.weightsync.checksum import StreamVerifier, ValueScan, scan_values  # noqa: E402
from rlfleet.weightsync.receiver import check_weight_values  # noqa: E402
from rlfleet.weightsync.sender import make_offer  # noqa: E402
from rlfleet.weightsync.shm import host_identity  # noqa: E402

# ------------------------------------------------------------------ the transports


def test_one_table_of_transport_names_and_codes() -> None:
    assert wire.TRANSPORT_CODES["shm"] == rollout_pb2.WEIGHT_TRANSPORT_SHM
    assert wire.TRANSPORT_CODES["tcp"] == rollout_pb2.WEIGHT_TRANSPORT_TCP
    assert wire.TRANSPORT_CODES["grpc"] == rollout_pb2.WEIGHT_TRANSPORT_GRPC
    named = {v for k, v in rollout_pb2.WeightTransport.items() if not k.endswith("UNSPECIFIED")}
    assert set(wire.TRANSPORT_NAMES) == named  # every code of the enum has a name
    assert wire.AUTO == ("shm", "tcp", "grpc")
    assert wire.transport_names(wire.transport_codes(["tcp", "grpc"])) == ["tcp", "grpc"]
    assert wire.transport_names([]) == ["shm", "tcp", "grpc"]  # empty: the best available
    with pytest.raises(InvalidArgument) as e:
        wire.transport_names([rollout_pb2.WEIGHT_TRANSPORT_NCCL])
    assert e.value.field == "transports" and "not implemented" in str(e.value)
    with pytest.raises(ValueError, match="unknown weight transports"):
        wire.transport_codes(["carrier-pigeon"])


def test_weight_transport_modes() -> None:
    assert wire.transports_for("auto") == ("shm", "tcp", "grpc")
    assert [wire.transports_for(m) for m in ("shm", "tcp", "grpc")] == [
        ("shm",),
        ("tcp",),
        ("grpc",),
    ]
    with pytest.raises(ValueError, match="weight transport must be one of"):
        wire.transports_for("nccl")


def test_config_key_validates_and_defaults_to_auto() -> None:
    assert config_from_dict({}).rollout.weight_transport == "auto"
    assert config_from_dict({}, ["rollout.weight_transport=tcp"]).rollout.weight_transport == "tcp"
    with pytest.raises(ValueError, match="weight_transport"):
        config_from_dict({}, ["rollout.weight_transport=udp"])
    # The config's values are weight sync's modes (the schema imports no weightsync).
    field = RolloutConfig.model_fields["weight_transport"]
    assert typing.get_args(field.annotation) == wire.WEIGHT_TRANSPORT_MODES


def test_config_key_passes_through_a_verl_shaped_config() -> None:
    """verl has no such key: in a verl-layout config it is rlfleet's own, kept as is."""
    verl = {"actor_rollout_ref": {"rollout": {"name": "hf"}}, "trainer": {"device": "cpu"}}
    cfg = config_from_dict(verl, ["rollout.weight_transport=grpc"])
    assert cfg.rollout.engine == "hf" and cfg.rollout.weight_transport == "grpc"


# ------------------------------------------------------------------ same host


def test_host_identity_names_this_hosts_dev_shm() -> None:
    ident = host_identity()
    if not Path("/dev/shm").is_dir():
        assert ident == ""
        return
    st = os.stat("/dev/shm")
    assert ident.endswith(f"/{st.st_dev}:{st.st_ino}") and ident == host_identity()
    assert make_offer({"w": torch.ones(2)}, 1).sender_host == ident


def test_host_identity_differs_for_another_dev_shm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process whose /dev/shm is another mount (a container of the same host) has
    another identity, and one without /dev/shm none at all."""
    from rlfleet.weightsync import shm

    ours = host_identity()
    monkeypatch.setattr(shm, "_SHM_DIR", str(tmp_path))
    assert host_identity() not in ("", ours)
    monkeypatch.setattr(shm, "_SHM_DIR", str(tmp_path / "missing"))
    assert host_identity() == ""


# ------------------------------------------------------------------ the value scan


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
@pytest.mark.parametrize("where", [0, 1, 4096, 99_999])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_scan_finds_one_bad_value_anywhere(dtype: str, where: int, bad: float) -> None:
    t = torch.randn(100_000, generator=torch.Generator().manual_seed(0)).to(getattr(torch, dtype))
    assert scan_values(t) == (True, True)
    t[where] = bad
    assert scan_values(t) == (False, True)


def test_scan_tells_zeros_and_overflowing_sums_apart() -> None:
    assert scan_values(torch.zeros(10)) == (True, False)
    assert scan_values(-torch.zeros(10, dtype=torch.bfloat16)) == (True, False)
    assert scan_values(torch.tensor([1.0, -1.0])) == (True, True)  # sums to 0, not zeros
    big = torch.full((4,), torch.finfo(torch.float16).max, dtype=torch.float16)
    assert scan_values(big) == (True, True)  # the sum overflows; the values are finite
    assert scan_values(torch.empty(0)) == (True, False)


def test_check_weight_values_uses_a_scan_done_earlier() -> None:
    tensors = {"a": torch.ones(3), "b": torch.zeros(2)}
    check_weight_values(tensors, ValueScan(frozenset({"a"}), (), True))
    with pytest.raises(InvalidArgument) as e:
        check_weight_values(tensors, ValueScan(frozenset({"a", "b"}), ("b",), True))
    assert (e.value.field, e.value.code) == ("weights['b']", "NON_FINITE_WEIGHTS")
    with pytest.raises(InvalidArgument) as e:
        check_weight_values(tensors, ValueScan(frozenset({"a", "b"}), (), False))
    assert e.value.code == "ZERO_WEIGHTS"
    merged = ValueScan(frozenset({"a"}), (), False) | ValueScan(frozenset({"b"}), ("b",), True)
    assert merged == ValueScan(frozenset({"a", "b"}), ("b",), True)


# ------------------------------------------------------------------ the verifier


def _verify(
    tensors: dict[str, torch.Tensor], block: int, monkeypatch: pytest.MonkeyPatch, copy: bool
) -> tuple[StreamVerifier, np.ndarray]:
    """Pack ``tensors`` like a transfer and verify them as they "land" in steps."""
    monkeypatch.setattr(checksum, "_FOLLOW_BLOCK", block)
    offer = make_offer(tensors, 1, ["tcp"])
    src = np.concatenate([checksum.as_u8(checksum.tensor_bytes(t)) for t in tensors.values()])
    copy_to = np.zeros_like(src) if copy else None
    dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors.values()]
    landed = checksum.Progress()
    v = StreamVerifier(offer.tensors, dtypes, src, landed, copy_to)
    for end in range(0, src.nbytes, 2999):  # the bytes land in uneven steps
        landed.advance(end)
    landed.advance(src.nbytes)
    landed.close()
    assert v.finish(30) and v.error is None
    return v, (src if copy_to is None else copy_to)


@pytest.mark.parametrize("block", [5, 4096 + 3, 1 << 22])
@pytest.mark.parametrize("copy", [False, True])
def test_verifier_checksums_and_names_the_bad_tensor_among_many(
    block: int, copy: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """300 small tensors of mixed dtypes, one NaN in one of them: the per-tensor
    CRC-32Cs are google-crc32c's, and exactly that tensor is named, whatever the
    step (cutting tensors and elements anywhere)."""
    g = torch.Generator().manual_seed(1)
    dtypes = [torch.bfloat16, torch.float32, torch.int64]
    tensors = {
        f"t{i}": torch.randn(7 + i % 5, generator=g).to(dtypes[(i // 40) % 3]) for i in range(300)
    }
    tensors["t123"][3] = math.nan  # t123 is float32 (block 1 of dtypes)
    v, out = _verify(tensors, block, monkeypatch, copy)
    expected = [google_crc32c.value(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
                for t in tensors.values()]  # fmt: skip
    assert v.crcs == expected
    scan = v.values()
    assert scan.nonfinite == ("t123",) and scan.nonzero
    assert scan.names == {n for n, t in tensors.items() if t.is_floating_point()}
    if copy:
        assert out.tobytes() == b"".join(
            t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in tensors.values()
        )


def test_verifier_sees_an_all_zero_update(monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = {f"z{i}": torch.zeros(33, dtype=torch.bfloat16) for i in range(10)}
    v, _ = _verify(tensors, 17, monkeypatch, False)
    assert v.values() == ValueScan(frozenset(tensors), (), False)


# ------------------------------------------------------------------ the sender's CRCs


def test_source_crcs_are_computed_once_by_the_first_claimant() -> None:
    g = torch.Generator().manual_seed(2)
    tensors = {f"t{i}": torch.randn(1000 + i, generator=g) for i in range(5)}
    specs = make_offer(tensors, 1).tensors
    expected = checksum.tensor_crcs(tensors, specs)
    crcs = checksum.SourceCrcs.of(tensors, specs)
    assert crcs.claim() and not crcs.claim()  # one claimant; the others wait
    crcs.publish(expected)
    assert crcs.result(5) == expected
    crcs.close()
    # Unclaimed: computed by a thread when someone waits.
    alone = checksum.SourceCrcs.of(tensors, specs)
    assert alone.result(30) == expected
    alone.close()
    # A claimant that fails abandons them: a thread computes them for the others.
    failed = checksum.SourceCrcs.of(tensors, specs)
    assert failed.claim()
    failed.abandon()
    assert not failed.claim() and failed.result(30) == expected
    failed.close()


def test_source_crcs_abandoned_by_another_thread_while_closing() -> None:
    """A push gives up a frozen replica from its probing thread (``abandon``) while its
    own thread closes the bucket's checksums: the close joined a thread assigned but
    not yet started ("cannot join thread before it is started", found by `make fuzz`);
    an abandon after the close starts nothing."""
    import threading

    tensors = {"t": torch.ones(4096)}
    specs = make_offer(tensors, 1).tensors
    for _ in range(300):
        crcs = checksum.SourceCrcs.of(tensors, specs)
        assert crcs.claim()
        other = threading.Thread(target=crcs.abandon)
        other.start()
        crcs.close()
        other.join()
    crcs = checksum.SourceCrcs.of(tensors, specs)
    crcs.claim()
    crcs.close()
    crcs.abandon()
    assert crcs._thread is None


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")
def test_the_sender_keeps_a_segments_mapping_until_the_segment_goes() -> None:
    """The sender maps a segment once and reuses the mapping while the replica reuses
    the segment; once the replica destroyed it, the next transfer drops the mapping
    (so it holds none of the freed memory longer)."""
    from rlfleet.weightsync import shm

    maps = shm._Mappings()
    seg = shm.create_segment(shm.HEADER + 100)
    other = shm.create_segment(shm.HEADER + 10)
    try:
        path = f"/dev/shm/{seg.name}"
        first = maps.get(path, shm.HEADER + 100)
        assert maps.get(path, shm.HEADER + 50) is first
        shm.destroy_segment(seg)
        maps.get(f"/dev/shm/{other.name}", shm.HEADER)
        assert first.closed and list(maps._maps) == [f"/dev/shm/{other.name}"]
        with pytest.raises(shm.ShmUnavailable, match="does not exist"):
            maps.get(path, shm.HEADER)
    finally:
        maps.clear()
        shm.destroy_segment(other)
