"""THE 2-rank check: `rlfleet.trainer.server` under torchrun with 2 gloo ranks on CPU (FSDP2,
rank 0 serving gRPC, rank 1 following) gives the same log-probs, the same PPO actor and
critic updates and the same pushed weights as one in-process rank (packed sequences;
the actor's micro-batches by a token budget, the critic's by size); and so does a LoRA
actor (sharded adapters, the reference as the base with adapters disabled, a push of the
adapters only)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from rlfleet.common.rpc import create_server
from rlfleet.trainer.client import InProcessTrainerClient, RemoteTrainerClient
from rlfleet.trainer.core import TrainerCore
from rlfleet.trainer.testing import FakeRollout, make_batch, make_config
from rlfleet.v1 import rollout_pb2_grpc

TOL = 1e-5  # log-probs: fp32 forward, differently ordered reductions
# Weights after 4 AdamW steps at lr 1e-3: Adam's per-element normalisation turns tiny
# reduction-order differences in near-zero gradients into differences of ~1e-5.
WEIGHT_TOL = 5e-5


def _raw_config(model_dir: Path, run: Path) -> dict[str, object]:
    return {
        "data": {"train_batch_size": 4, "max_prompt_length": 8, "max_response_length": 8},
        "actor": {
            "model_path": str(model_dir),
            "lr": 1e-3,
            "ppo_mini_batch_size": 2,  # x rollout.n 2 = 4 samples: 2 mini-batches of 8
            "ppo_micro_batch_size": 1,
            "ppo_epochs": 2,
            "entropy_coeff": 0.01,
            # Token-budget micro-batches (packed rows of 8 or 11 tokens): the ranks need
            # different numbers of micro-batches and must agree on the largest.
            "use_dynamic_bsz": True,
            "ppo_max_token_len_per_gpu": 16,
        },
        "critic": {"lr": 1e-3, "ppo_micro_batch_size": 1, "use_dynamic_bsz": False},
        "rollout": {"n": 2},
        "algorithm": {"adv_estimator": "gae"},
        "trainer": {"seed": 0, "default_local_dir": str(run)},
    }


def _wait_for(path: Path, proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file():
            return path.read_text()
        if proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            raise AssertionError(f"torchrun exited with {proc.returncode}:\n{out[-4000:]}")
        time.sleep(0.2)
    raise AssertionError(f"trainer did not come up within {timeout_s}s")


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_one_rank_and_two_ranks_agree(tiny_model_dir: Path, tmp_path: Path, lora_rank: int) -> None:
    raw = _raw_config(tiny_model_dir, tmp_path / "run")
    if lora_rank:
        raw["actor"].update(lora_rank=lora_rank, use_kl_loss=True)  # type: ignore[attr-defined]
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(yaml.safe_dump(raw))
    address_file = tmp_path / "address"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "rlfleet.trainer.server", "--config", str(cfg_file),
        "--address-file", str(address_file), "--insecure",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        # The one-rank reference, in this process, while the two ranks start up.
        one = InProcessTrainerClient(TrainerCore(make_config(str(tiny_model_dir), **raw)))  # type: ignore[arg-type]
        g = torch.Generator().manual_seed(0)
        batch = make_batch(bs=8, seed=21, pad_rows=3)
        lp1, _ = one.compute_log_prob(batch)
        values1, _ = one.compute_values(batch)
        batch.update(
            old_log_probs=lp1["old_log_probs"],
            values=values1["values"],
            advantages=torch.randn(8, 5, generator=g),
            returns=torch.randn(8, 5, generator=g),
        )

        two = RemoteTrainerClient(_wait_for(address_file, proc, 240), timeout_s=120)
        assert two.status()["world_size"] == 2
        lp2, _ = two.compute_log_prob(batch)
        lp_diff = (lp2["old_log_probs"] - lp1["old_log_probs"]).abs().max().item()
        if lora_rank:  # the reference: the sharded actor with its adapters disabled
            ref1, _ = one.compute_ref_log_prob(batch)
            ref2, _ = two.compute_ref_log_prob(batch)
            torch.testing.assert_close(ref2["ref_log_prob"], ref1["ref_log_prob"], atol=TOL, rtol=0)
            batch["ref_log_prob"] = ref1["ref_log_prob"]

        c1, c2 = one.update_critic(batch), two.update_critic(batch)
        a1, a2 = one.update_actor(batch), two.update_actor(batch)
        for key in ("critic/vf_loss", "actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            r1 = c1.metrics.get(key, a1.metrics.get(key))
            r2 = c2.metrics.get(key, a2.metrics.get(key))
            assert r2 == pytest.approx(r1, rel=1e-4, abs=1e-5), key

        fake = FakeRollout()
        server = create_server([(rollout_pb2_grpc.add_RolloutServiceServicer_to_server, fake)])
        try:
            out = two.push_weights([("r0", server.address)], bucket_bytes=1 << 20)
        finally:
            server.stop(0)
        assert out.ok == {"r0": True}, out.errors
        ref = dict(one.core.iter_weights())  # a LoRA actor's: the adapters only
        assert set(fake.weights) == set(ref)
        assert all(k.endswith((".lora_A", ".lora_B")) for k in ref) == bool(lora_rank)
        w_diff = max((fake.weights[k] - ref[k]).abs().max().item() for k in ref)
        initial = _initial(tiny_model_dir, raw)
        moved = max((ref[k] - v).abs().max().item() for k, v in initial.items())
        print(f"1-rank vs 2-rank: log-prob max diff {lp_diff:.3g}, weights max diff {w_diff:.3g} "
              f"(the update moved weights by up to {moved:.3g})")  # fmt: skip
        assert lp_diff < TOL
        assert w_diff < WEIGHT_TOL and moved > 50 * WEIGHT_TOL
        two.close()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    # torchrun's agent itself exits non-zero on SIGTERM; what matters is that the ranks
    # stopped (rank 0 drained and released rank 1) within the time limit.
    assert proc.returncode is not None


def _initial(model_dir: Path, raw: dict[str, object]) -> dict[str, torch.Tensor]:
    """What a fresh trainer of ``raw`` pushes (the model; a LoRA actor's initial
    adapters, seeded like the trained one's)."""
    return dict(TrainerCore(make_config(str(model_dir), **raw)).iter_weights())  # type: ignore[arg-type]
