"""TrainerService over a real gRPC server on 127.0.0.1: every operation through the remote
client, INVALID_ARGUMENT for bad batches, and a bucketed weight push to two fake rollout
replicas in parallel."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rlfleet.common.errors import FailedPrecondition, InvalidArgument
from rlfleet.common.rpc import Server, create_server
from rlfleet.trainer.client import InProcessTrainerClient, RemoteTrainerClient
from rlfleet.trainer.core import TrainerCore
from rlfleet.trainer.servicer import TrainerServicer
from rlfleet.trainer.servicer import add_to_server as trainer_add_to_server
from rlfleet.trainer.testing import FakeRollout, make_batch, make_config
from rlfleet.v1 import rollout_pb2_grpc


@pytest.fixture(scope="module")
def core(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerCore:
    run = tmp_path_factory.mktemp("run")
    cfg = make_config(
        str(tiny_model_dir),
        algorithm={"adv_estimator": "gae"},
        actor={"use_kl_loss": True, "ppo_micro_batch_size": 2},
        trainer={"default_local_dir": str(run)},
    )
    return TrainerCore(cfg)


@pytest.fixture(scope="module")
def remote(core: TrainerCore) -> Iterator[RemoteTrainerClient]:
    server = create_server([(trainer_add_to_server, TrainerServicer(core))])
    client = RemoteTrainerClient(server.address, timeout_s=120)
    yield client
    client.close()
    server.stop(0)


def test_every_operation_over_grpc(core: TrainerCore, remote: RemoteTrainerClient) -> None:
    local = InProcessTrainerClient(core)
    batch = {**make_batch(seed=11), "scores": torch.tensor([1.0, 0.0, 0.5, 0.0])}
    status = remote.status()
    assert status["roles"] == ["actor", "critic", "ref"] and status["backend"] == "fsdp"

    lp, m = remote.compute_log_prob(batch)
    assert torch.equal(lp["old_log_probs"], local.compute_log_prob(batch)[0]["old_log_probs"])
    assert "actor/entropy" in m
    batch.update(lp)
    batch.update(remote.compute_ref_log_prob(batch)[0])
    batch.update(remote.compute_values(batch)[0])
    adv, _ = remote.compute_advantage(batch)
    assert adv["advantages"].shape == (4, 5)
    batch.update(adv)
    critic = remote.update_critic(batch)
    assert "critic/vf_loss" in critic.metrics
    actor = remote.update_actor(batch)
    assert actor.weight_version == critic.weight_version + 1
    assert {"actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/lr"} <= set(actor.metrics)
    step = remote.train_step(
        {k: batch[k] for k in ("input_ids", "attention_mask", "responses", "scores")}
    )
    assert step.global_step == actor.global_step + 1
    sft = remote.sft_step(make_batch(seed=12))
    assert "sft/loss" in sft.metrics

    saved = remote.save_checkpoint(extra_state_json='{"pos": 3}')
    assert saved.bytes > 0
    loaded = remote.load_checkpoint()
    assert loaded.path == saved.path and loaded.extra_state_json == '{"pos": 3}'


@pytest.mark.parametrize(
    ("mutate", "pattern"),
    [
        (lambda b: b.pop("attention_mask"), "attention_mask"),
        (lambda b: b.update(scores=torch.tensor([0.0, float("nan"), 1.0, 1.0])), "scores.*NaN"),
        (lambda b: b.update(token_level_scores=torch.zeros(4, 3)), r"\(4, 3\).*\(4, 5\)"),
    ],
    ids=["missing", "nan", "shape"],
)
def test_invalid_argument_over_grpc(
    core: TrainerCore, remote: RemoteTrainerClient, mutate: object, pattern: str
) -> None:
    batch = {**make_batch(seed=13), "scores": torch.ones(4)}
    mutate(batch)  # type: ignore[operator]
    before = dict(core.backend.iter_full_params("actor"))
    version = core.weight_version
    with pytest.raises(InvalidArgument, match=pattern):
        remote.train_step(batch)
    assert core.weight_version == version
    after = dict(core.backend.iter_full_params("actor"))
    assert all(torch.equal(before[k], after[k]) for k in before)


def _rollout_server(fake: FakeRollout) -> Server:
    return create_server([(rollout_pb2_grpc.add_RolloutServiceServicer_to_server, fake)])


def test_push_weights_to_two_replicas_bucketed(
    core: TrainerCore, remote: RemoteTrainerClient
) -> None:
    fakes = [FakeRollout(), FakeRollout()]
    servers = [_rollout_server(f) for f in fakes]
    try:
        bucket = 1_500_000  # the tiny model's largest tensor (embeddings) is 1 MiB
        targets = [("r0", servers[0].address), ("r1", servers[1].address), ("dead", "127.0.0.1:1")]
        out = remote.push_weights(targets, version=7, bucket_bytes=bucket)
        assert out.ok == {"r0": True, "r1": True, "dead": False}, out.errors
        assert "dead" in out.errors
        # The best available by default: these replicas serve no bulk plane
        # (OpenWeightTransfer is UNIMPLEMENTED), so each falls back to the gRPC stream.
        assert out.transports == {"r0": "grpc", "r1": "grpc"}
        ours = dict(core.backend.iter_full_params("actor"))
        assert out.version == 7 and out.bytes == sum(t.numel() * 4 for t in ours.values())
        for fake in fakes:
            assert fake.version == 7 and fake.buckets_seen[-1] > 1
            assert set(fake.weights) == set(ours)
            assert all(torch.equal(fake.weights[k], ours[k]) for k in ours)
        # Version 0 means the trainer's current version.
        assert remote.push_weights(targets[:1]).version == core.weight_version
    finally:
        for s in servers:
            s.stop(0)


def test_push_bounds_memory_to_one_bucket(core: TrainerCore) -> None:
    from rlfleet.weightsync.sender import push_weights

    fake = FakeRollout()
    server = _rollout_server(fake)
    sizes: list[int] = []
    try:
        summary = push_weights(
            core.iter_weights(),
            [("r", server.address)],
            3,
            bucket_bytes=600_000,
            on_bucket=sizes.append,
        )
    finally:
        server.stop(0)
    largest = max(t.numel() * 4 for _, t in core.backend.iter_full_params("actor"))
    assert summary.buckets == len(sizes) > 2
    assert max(sizes) <= max(600_000, largest)
    assert summary.results[0].ok


def test_missing_role_is_failed_precondition(tiny_model_dir: Path) -> None:
    grpo = TrainerCore(make_config(str(tiny_model_dir), algorithm={"adv_estimator": "grpo"}))
    server = create_server([(trainer_add_to_server, TrainerServicer(grpo))])
    client = RemoteTrainerClient(server.address)
    try:
        with pytest.raises(FailedPrecondition, match="critic"):
            client.compute_values(make_batch())
    finally:
        client.close()
        server.stop(0)


def test_set_lr_scale_over_grpc(core: TrainerCore, remote: RemoteTrainerClient) -> None:
    try:
        assert remote.set_lr_scale("actor", 0.5) == pytest.approx(0.5e-3)
        assert core.backend.lr("actor") == pytest.approx(0.5e-3)
        assert remote.set_lr_scale("critic", 0.25) == pytest.approx(0.25e-3)
        with pytest.raises(InvalidArgument, match=r"in \(0, 1\]") as e:
            remote.set_lr_scale("actor", 2.0)
        assert e.value.field == "scale"
        with pytest.raises(InvalidArgument, match="actor or critic"):
            remote.set_lr_scale("ref", 0.5)
        assert core.backend.lr("actor") == pytest.approx(0.5e-3)  # refused: unchanged
    finally:
        remote.set_lr_scale("actor", 1.0)
        remote.set_lr_scale("critic", 1.0)
