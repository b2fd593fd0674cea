"""The TrainerService refuses what it must not act on, through a real gRPC server on
127.0.0.1: checkpoint paths outside its run dir, batch streams over
``trainer.max_request_bytes`` (early, without reading the rest), malformed chunk
sequences, and batches whose values the models cannot take."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from rlfleet.common.codec.wire import iter_chunks
from rlfleet.common.errors import InvalidArgument, ResourceExhausted, RlfleetError
from rlfleet.common.rpc import create_channel, create_server, to_rlfleet_error
from rlfleet.trainer.client import RemoteTrainerClient
from rlfleet.trainer.core import TrainerCore
from rlfleet.trainer.servicer import TrainerServicer
from rlfleet.trainer.servicer import add_to_server as trainer_add_to_server
from rlfleet.trainer.testing import make_batch, make_config
from rlfleet.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc

MAX_REQUEST_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hardening") / "run"


@pytest.fixture(scope="module")
def core(tiny_model_dir: Path, run_dir: Path) -> TrainerCore:
    cfg = make_config(
        str(tiny_model_dir),
        algorithm={"adv_estimator": "gae"},
        actor={"ppo_micro_batch_size": 2},
        trainer={"default_local_dir": str(run_dir), "max_request_bytes": MAX_REQUEST_BYTES},
    )
    return TrainerCore(cfg)


@pytest.fixture(scope="module")
def address(core: TrainerCore) -> Iterator[str]:
    server = create_server([(trainer_add_to_server, TrainerServicer(core))])
    yield server.address
    server.stop(0)


@pytest.fixture(scope="module")
def remote(address: str) -> Iterator[RemoteTrainerClient]:
    client = RemoteTrainerClient(address, timeout_s=120)
    yield client
    client.close()


@pytest.fixture(scope="module")
def stub(address: str) -> Iterator[trainer_pb2_grpc.TrainerServiceStub]:
    channel = create_channel(address)
    yield trainer_pb2_grpc.TrainerServiceStub(channel)
    channel.close()


def _params(core: TrainerCore) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in core.backend.iter_full_params("actor")}


def _refused_without_update(core: TrainerCore, call: Callable[[], Any]) -> RlfleetError:
    """Run ``call``, which must fail with an rlfleet error, and check that neither the
    weights nor the counters moved."""
    before = _params(core)
    counters = (core.global_step, core.weight_version)
    with pytest.raises(RlfleetError) as info:
        call()
    after = _params(core)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert (core.global_step, core.weight_version) == counters
    return info.value


# ------------------------------------------------------------------ checkpoint paths


def _assert_path_refused(err: RlfleetError, path: str) -> None:
    assert isinstance(err, InvalidArgument), err
    assert err.field == "path" and err.value == path, (err.field, err.value)


def test_checkpoint_path_traversal_is_refused(remote: RemoteTrainerClient, run_dir: Path) -> None:
    for path in ("../escaped", "checkpoints/../../escaped", "../" + run_dir.name + "-sibling"):
        with pytest.raises(InvalidArgument) as save:
            remote.save_checkpoint(path)
        _assert_path_refused(save.value, path)
        with pytest.raises(InvalidArgument) as load:
            remote.load_checkpoint(path)
        _assert_path_refused(load.value, path)
    assert not (run_dir.parent / "escaped").exists()
    assert not (run_dir.parent / (run_dir.name + "-sibling")).exists()


def test_a_checkpoint_path_too_long_in_all_is_refused_by_name(
    remote: RemoteTrainerClient, run_dir: Path
) -> None:
    """25 parts of 200 bytes: each part is a name, the whole is past PATH_MAX (it was
    INTERNAL OSError ENAMETOOLONG)."""
    path = "/".join(["a" * 200] * 25)
    for call in (remote.save_checkpoint, remote.load_checkpoint):
        with pytest.raises(InvalidArgument) as info:
            call(path)
        assert info.value.field == "path" and "3,072 bytes" in info.value.message


def test_checkpoint_step_and_extra_state_are_checked(
    remote: RemoteTrainerClient, run_dir: Path
) -> None:
    """A step past 2^53 (it would sort as the latest for good) and extra state that is
    not JSON (it is loaded back with the checkpoint) are refused before anything is
    written."""
    with pytest.raises(InvalidArgument) as info:
        remote.save_checkpoint("steps", step=2**64 - 1)
    assert info.value.field == "step"
    with pytest.raises(InvalidArgument) as info:
        remote.save_checkpoint("steps", extra_state_json="{not json")
    assert info.value.field == "extra_state_json"
    assert not (run_dir / "steps").exists()


def test_absolute_checkpoint_path_outside_is_refused(
    remote: RemoteTrainerClient, run_dir: Path
) -> None:
    outside = run_dir.parent / "outside-abs"
    with pytest.raises(InvalidArgument) as save:
        remote.save_checkpoint(str(outside))
    _assert_path_refused(save.value, str(outside))
    assert not outside.exists()
    with pytest.raises(InvalidArgument) as load:
        remote.load_checkpoint("/")
    _assert_path_refused(load.value, "/")


def test_symlink_pointing_outside_is_refused(remote: RemoteTrainerClient, run_dir: Path) -> None:
    outside = run_dir.parent / "outside-link-target"
    outside.mkdir()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "link").symlink_to(outside, target_is_directory=True)
    for path in ("link", "link/ckpt", str(run_dir / "link")):
        with pytest.raises(InvalidArgument) as save:
            remote.save_checkpoint(path)
        _assert_path_refused(save.value, path)
        with pytest.raises(InvalidArgument) as load:
            remote.load_checkpoint(path)
        _assert_path_refused(load.value, path)
    assert list(outside.iterdir()) == []


def test_checkpoint_path_inside_the_run_dir_works(
    remote: RemoteTrainerClient, run_dir: Path
) -> None:
    saved = remote.save_checkpoint("mine", extra_state_json='{"k": 1}')
    assert Path(saved.path) == (run_dir / "mine" / "global_step_0").resolve()
    loaded = remote.load_checkpoint("mine")
    assert loaded.path == saved.path and loaded.extra_state_json == '{"k": 1}'
    # An absolute path inside, and one with a ".." that stays inside, name the same root.
    assert remote.load_checkpoint(str(run_dir / "mine")).path == saved.path
    assert remote.load_checkpoint("other/../mine").path == saved.path
    assert remote.load_checkpoint(saved.path).path == saved.path


def test_stale_tmp_cleanup_stays_in_the_checkpoint_root(
    remote: RemoteTrainerClient, run_dir: Path
) -> None:
    root = run_dir / "cleanup"
    root.mkdir(parents=True)
    victim = run_dir.parent / "cleanup-victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    (root / ".tmp-global_step_9-evil").symlink_to(victim, target_is_directory=True)
    (root / ".tmp-global_step_8-dead").mkdir()
    remote.save_checkpoint("cleanup", step=1)
    assert (victim / "keep.txt").read_text() == "precious"
    assert sorted(p.name for p in root.iterdir()) == [
        "global_step_1",
        "latest_checkpointed_iteration.txt",
    ]


# ------------------------------------------------------------------ stream bounds


class _Counting:
    """Yields ``chunks`` (at most ``limit``) and counts how many the client took."""

    def __init__(self, chunks: Iterator[common_pb2.TensorBatchChunk], limit: int) -> None:
        self.chunks = chunks
        self.limit = limit
        self.yielded = 0

    def __iter__(self) -> Iterator[common_pb2.TensorBatchChunk]:
        for chunk in self.chunks:
            if self.yielded >= self.limit:
                return
            self.yielded += 1
            yield chunk


def _train_step(stub: trainer_pb2_grpc.TrainerServiceStub, chunks: Any) -> Any:
    """A raw TrainStep stream of ``chunks``, each wrapped as it is taken."""
    requests = (trainer_pb2.TrainStepRequest(chunk=c) for c in chunks)
    try:
        return stub.TrainStep(requests, timeout=120)
    except grpc.RpcError as e:
        raise to_rlfleet_error(e) from e


def test_oversize_tensor_is_refused_at_its_first_chunk(
    core: TrainerCore, stub: trainer_pb2_grpc.TrainerServiceStub
) -> None:
    big = {**make_batch(seed=1), "big": torch.zeros(16 * 1024 * 1024)}  # 64 MiB
    total = sum(1 for _ in iter_chunks(big, max_chunk_bytes=64 * 1024))
    assert total > 1000
    sent = _Counting(iter_chunks(big, max_chunk_bytes=64 * 1024), total)
    err = _refused_without_update(core, lambda: _train_step(stub, sent))
    assert isinstance(err, ResourceExhausted), err
    assert err.field == "big" and "max_request_bytes" in err.message
    assert sent.yielded < total  # refused before the client had sent everything


def test_stream_over_the_cap_in_many_small_tensors_is_refused_early(
    core: TrainerCore, stub: trainer_pb2_grpc.TrainerServiceStub
) -> None:
    # 16 KiB tensors, each under the cap; together 32 MiB, 512x the cap.
    batch = {f"t{i:04d}": torch.zeros(4096) for i in range(2048)}
    total = sum(1 for _ in iter_chunks(batch, max_chunk_bytes=64 * 1024))
    assert total > 500
    sent = _Counting(iter_chunks(batch, max_chunk_bytes=64 * 1024), total)
    err = _refused_without_update(core, lambda: _train_step(stub, sent))
    assert isinstance(err, ResourceExhausted), err
    assert err.field.startswith("t") and isinstance(err.value, str)
    assert int(err.value) > MAX_REQUEST_BYTES
    assert sent.yielded < total


def test_declared_total_over_the_cap_is_refused(
    core: TrainerCore, stub: trainer_pb2_grpc.TrainerServiceStub
) -> None:
    first = next(iter_chunks(make_batch(seed=2)))
    first.total_bytes = 2**40
    err = _refused_without_update(core, lambda: _train_step(stub, [first]))
    assert isinstance(err, ResourceExhausted) and err.field == "total_bytes", err


def _small_chunks(seed: int) -> list[common_pb2.TensorBatchChunk]:
    batch = {**make_batch(seed=seed), "scores": torch.ones(4)}
    chunks = list(iter_chunks(batch, max_chunk_bytes=300))
    assert len(chunks) >= 3
    return chunks


def test_chunk_out_of_order_is_refused(
    core: TrainerCore, stub: trainer_pb2_grpc.TrainerServiceStub
) -> None:
    chunks = _small_chunks(3)
    chunks[1], chunks[2] = chunks[2], chunks[1]
    err = _refused_without_update(core, lambda: _train_step(stub, chunks))
    assert isinstance(err, InvalidArgument) and err.field == "seq", err
    assert "expected seq 1" in err.message


def test_chunk_after_the_last_is_refused(
    core: TrainerCore, stub: trainer_pb2_grpc.TrainerServiceStub
) -> None:
    chunks = _small_chunks(4)
    extra = common_pb2.TensorBatchChunk()
    extra.CopyFrom(chunks[0])
    extra.seq = len(chunks)
    err = _refused_without_update(core, lambda: _train_step(stub, [*chunks, extra]))
    assert isinstance(err, InvalidArgument) and err.field == "seq", err
    assert "after the last chunk" in err.message
    # The same stream without the extra chunk is a good batch.
    assert _train_step(stub, chunks).global_step == core.global_step


def test_batch_under_the_cap_still_works(remote: RemoteTrainerClient) -> None:
    lp, _ = remote.compute_log_prob(make_batch(seed=5))
    assert lp["old_log_probs"].shape == (4, 5)


# ------------------------------------------------------------------ batch values


def _scored(seed: int) -> dict[str, Any]:
    return {**make_batch(seed=seed), "scores": torch.ones(4)}


def _set(key: str, row: int, col: int, value: float) -> Callable[[dict[str, Any]], None]:
    def mutate(batch: dict[str, Any]) -> None:
        t = batch[key].clone()
        t[row, col] = value
        batch[key] = t
        if key == "input_ids" and "responses" in batch:
            batch["responses"] = t[:, -batch["responses"].shape[1] :]

    return mutate


def _lp(batch: dict[str, Any]) -> None:
    batch["old_log_probs"] = torch.zeros(4, 5)


@pytest.mark.parametrize(
    ("mutate", "field", "code"),
    [
        (_set("attention_mask", 1, 3, 2), "attention_mask", "BAD_MASK"),
        (_set("attention_mask", 2, 0, -1), "attention_mask", "BAD_MASK"),
        (
            lambda b: b.update(response_mask=torch.full((4, 5), 0.5)),
            "response_mask",
            "BAD_MASK",
        ),
        (_set("input_ids", 0, 2, 10**9), "input_ids", "OUT_OF_VOCAB"),
        (_set("input_ids", 3, 0, -5), "input_ids", "OUT_OF_VOCAB"),
        (_set("input_ids", 2, -2, 10**9), "input_ids", "OUT_OF_VOCAB"),  # also responses
        (
            lambda b: b.update(responses=torch.full((4, 5), 10**9)),
            "responses",
            None,
        ),
        (_set("position_ids", 1, 1, -3), "position_ids", None),
        (
            lambda b: (_lp(b), _set("old_log_probs", 0, 4, float("nan"))(b)),
            "old_log_probs",
            "NOT_FINITE",
        ),
        (
            lambda b: b.update(token_level_scores=torch.full((4, 5), float("inf"))),
            "token_level_scores",
            "NOT_FINITE",
        ),
        (
            lambda b: b.update(scores=torch.tensor([1.0, float("-inf"), 0.0, 0.0])),
            "scores",
            "NOT_FINITE",
        ),
        (lambda b: b.update(values=torch.full((4, 5), float("nan"))), "values", "NOT_FINITE"),
    ],
    ids=[
        "mask-2",
        "mask-neg",
        "response-mask-half",
        "id-over-vocab",
        "id-negative",
        "response-id-over-vocab",
        "responses-not-input-ids",
        "position-negative",
        "nan-old-log-prob-on-padding",
        "inf-token-scores",
        "inf-score",
        "nan-values",
    ],
)
def test_bad_values_are_invalid_argument_over_grpc(
    core: TrainerCore,
    remote: RemoteTrainerClient,
    mutate: Callable[[dict[str, Any]], Any],
    field: str,
    code: str | None,
) -> None:
    batch = _scored(21)
    batch.setdefault("position_ids", (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0))
    mutate(batch)
    err = _refused_without_update(core, lambda: remote.train_step(batch))
    assert isinstance(err, InvalidArgument), err
    assert err.field == field, (err.field, err.message)
    if code is not None:
        assert err.code == code, err


def test_out_of_vocab_id_is_refused_by_every_operation(
    core: TrainerCore, remote: RemoteTrainerClient
) -> None:
    assert core.vocab_size is not None
    batch = _scored(22)
    _set("input_ids", 1, 1, core.vocab_size)(batch)
    lp = torch.zeros(4, 5)
    calls: list[Callable[[], Any]] = [
        lambda: remote.compute_log_prob(batch),
        lambda: remote.compute_values(batch),
        lambda: remote.update_critic({**batch, "values": lp, "returns": lp}),
        lambda: remote.update_actor({**batch, "old_log_probs": lp, "advantages": lp}),
        lambda: remote.sft_step(batch),
        lambda: remote.train_step(batch),
    ]
    for call in calls:
        err = _refused_without_update(core, call)
        assert isinstance(err, InvalidArgument) and err.field == "input_ids", err
        assert str(core.vocab_size) in err.message
    # The largest valid id goes through.
    ok = _scored(22)
    _set("input_ids", 1, 1, core.vocab_size - 1)(ok)
    assert remote.compute_log_prob(ok)[0]["old_log_probs"].shape == (4, 5)


def test_a_row_without_tokens_is_refused_by_name(
    core: TrainerCore, remote: RemoteTrainerClient
) -> None:
    """An all-padding row (a whole all-padding batch used to reach the model and fail
    there with INTERNAL IndexError)."""
    for rows in ([2], [0, 1, 2, 3]):
        batch = _scored(23)
        mask = batch["attention_mask"].clone()
        mask[rows] = 0
        batch["attention_mask"] = mask
        for op in (remote.compute_values, remote.train_step):
            err = _refused_without_update(core, lambda op=op, b=batch: op(b))
            assert isinstance(err, InvalidArgument), err
            assert (err.field, err.code, err.sample_index) == (
                "attention_mask",
                "EMPTY_ROW",
                rows[0],
            )


def test_compute_advantage_without_input_ids_checks_the_response_side(
    core: TrainerCore, remote: RemoteTrainerClient
) -> None:
    """compute_advantage needs no input_ids; what it is given is still checked (shapes,
    masks, ids, finiteness), and a batch with no mask at all is refused by name (it
    was INTERNAL KeyError 'response_mask')."""
    resp = torch.ones(4, 5, dtype=torch.long)
    zeros = torch.zeros(4, 5)
    rm = torch.ones(4, 5, dtype=torch.long)
    cases: list[tuple[dict[str, Any], str, str | None]] = [
        ({"responses": resp, "token_level_scores": zeros, "values": zeros}, "response_mask",
         "MISSING_KEY"),
        ({"responses": resp, "response_mask": rm, "token_level_scores": zeros,
          "values": torch.zeros(4, 7)}, "values", "SHAPE_MISMATCH"),
        ({"responses": resp, "attention_mask": torch.ones(4, 9, dtype=torch.long),
          "scores": torch.tensor([float("nan"), 1, 0, 0]), "values": zeros}, "scores",
         "NOT_FINITE"),
        ({"responses": resp, "attention_mask": torch.full((4, 9), 7),
          "token_level_scores": zeros, "values": zeros}, "attention_mask", "BAD_MASK"),
        ({"responses": torch.full((4, 5), -5), "response_mask": rm,
          "token_level_scores": zeros, "values": zeros}, "responses", "OUT_OF_VOCAB"),
        ({"responses": resp, "attention_mask": torch.ones(4, 3, dtype=torch.long),
          "token_level_scores": zeros, "values": zeros}, "attention_mask", "SHAPE_MISMATCH"),
    ]  # fmt: skip
    for batch, field, code in cases:
        with pytest.raises(InvalidArgument) as info:
            remote.compute_advantage({**batch, "uid": ["a", "a", "b", "b"]})
        assert (info.value.field, info.value.code) == (field, code), info.value
    out, _ = remote.compute_advantage(
        {"responses": resp, "response_mask": rm, "token_level_scores": zeros, "values": zeros,
         "uid": ["a", "a", "b", "b"]}
    )  # fmt: skip
    assert out["advantages"].shape == (4, 5)


def test_nan_advantage_on_padding_is_refused(
    core: TrainerCore, remote: RemoteTrainerClient
) -> None:
    batch = make_batch(seed=23)  # row 0's last response token is padding
    assert int(batch["attention_mask"][0, -1]) == 0
    adv = torch.ones(4, 5)
    adv[0, -1] = float("nan")
    err = _refused_without_update(
        core,
        lambda: remote.update_actor(
            {**batch, "old_log_probs": torch.zeros(4, 5), "advantages": adv}
        ),
    )
    assert isinstance(err, InvalidArgument) and err.field == "advantages", err
    assert err.code == "NOT_FINITE" and err.sample_index == 0


_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.bool,
)


def test_any_dtype_on_any_key_is_accepted_or_refused_by_name(core: TrainerCore) -> None:
    """Every tensor of a full PPO batch, cast to each dtype, through every operation
    that takes a batch: the operation runs, or it raises InvalidArgument naming that
    key -- never an error from inside the model (``make fuzz`` found token ids of
    dtype bool reaching the embedding as INTERNAL)."""

    def full() -> dict[str, Any]:
        batch = _scored(31)
        g = torch.Generator().manual_seed(5)
        for key in ("old_log_probs", "values", "advantages", "returns"):
            batch[key] = torch.randn(4, 5, generator=g) * 0.1
        batch["token_level_scores"] = torch.zeros(4, 5)
        batch["token_level_rewards"] = torch.zeros(4, 5)
        batch["response_mask"] = batch["attention_mask"][:, -5:].clone()
        return batch

    ops = {
        "compute_log_prob": core.compute_log_prob,
        "compute_values": core.compute_values,
        "compute_advantage": core.compute_advantage,
        "update_critic": core.update_critic,
        "update_actor": core.update_actor,
    }
    keys = sorted(k for k, v in full().items() if isinstance(v, torch.Tensor))
    assert {"input_ids", "responses", "attention_mask", "advantages"} <= set(keys)
    refused_ids = []
    for key in keys:
        for dtype in _DTYPES:
            for name, op in ops.items():
                batch = full()
                batch[key] = batch[key].to(dtype)
                try:
                    op(batch)
                except InvalidArgument as e:
                    assert e.field == key, (key, dtype, name, e.field, e.message)
                    if key == "input_ids" and dtype in (torch.bool, torch.int16):
                        refused_ids.append(dtype)
    assert set(refused_ids) == {torch.bool, torch.int16}


def test_a_stalled_replica_holds_the_trainer_no_longer_than_the_push_deadline(
    address: str, stub: trainer_pb2_grpc.TrainerServiceStub
) -> None:
    """A replica (a fake one here) whose data endpoint takes the connection and never
    reads: the push ends within its caller's deadline, and the trainer, whose weights
    the push held, serves the next call at once (before, 600 s per socket wait)."""
    import socket
    import time

    from rlfleet.v1 import rollout_pb2, rollout_pb2_grpc

    sink = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    class Stalled(rollout_pb2_grpc.RolloutServiceServicer):
        def OpenWeightTransfer(self, request: Any, context: grpc.ServicerContext) -> Any:
            return rollout_pb2.WeightTransferPlan(
                transfer_id="t",
                transport=rollout_pb2.WEIGHT_TRANSPORT_TCP,
                endpoint=f"127.0.0.1:{sink.getsockname()[1]}",
                token="ab" * 16,
            )

        def AbortWeightTransfer(self, request: Any, context: grpc.ServicerContext) -> Any:
            return rollout_pb2.AbortWeightTransferResponse()

    import threading

    def accept() -> None:
        conn, _ = sink.accept()  # and never read
        held.append(conn)

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    fake = create_server(
        [(lambda s, srv: rollout_pb2_grpc.add_RolloutServiceServicer_to_server(s, srv), Stalled())]
    )
    try:
        push = trainer_pb2.PushWeightsRequest(
            targets=[trainer_pb2.RolloutTarget(replica_id="stalled", address=fake.address)],
            transports=[rollout_pb2.WEIGHT_TRANSPORT_TCP],
            bucket_bytes=64 << 10,  # buckets: the weights stay held between them
        )
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            stub.PushWeights(push, timeout=5.0)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # A checkpoint needs the weights the push held: it is written right away.
        saved = stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(step=1), timeout=20)
        assert saved.path and time.monotonic() - t0 < 25
    finally:
        fake.stop(0)
        for conn in held:
            conn.close()
        sink.close()
