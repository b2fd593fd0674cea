"""The trainer on a CUDA device: FSDP2 (bf16 mixed precision, CPU offload) and the
megatron-core backend without any CPU shim. Skipped where there is no GPU.

Each case runs in a fresh subprocess: a process holds one process group and one
megatron ``parallel_state``, and the cases must not share them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from rlfleet.trainer import batch as B
    from rlfleet.trainer.core import TrainerCore
    from rlfleet.trainer.megatron_testing import scored_batch
    from rlfleet.trainer.models import forward_log_prob, load_actor
    from rlfleet.trainer.testing import make_batch, make_config

    model_dir, overrides = sys.argv[1], sys.argv[2:]
    cfg = make_config(
        model_dir,
        ["trainer.device=cuda", "algorithm.use_kl_in_reward=true", *overrides],
        algorithm={"adv_estimator": "gae"},
    )
    core = TrainerCore(cfg)
    out = {"backend": core.backend.name, "roles": list(core.roles)}

    # log-probs against the Hugging Face model on CPU (fp32)
    batch = make_batch(bs=6, seed=3, pad_rows=3)
    got, _ = core.compute_log_prob(batch)
    view = B.ensure_defaults(dict(batch))
    with torch.no_grad():
        want, _ = forward_log_prob(load_actor(model_dir), view)
    mask = view["response_mask"].bool()
    out["logprob_max_diff"] = float((got["old_log_probs"] - want)[mask].abs().max())

    # a PPO update with positive advantages raises those tokens' log-probs
    b = make_batch(seed=7)
    b["old_log_probs"] = core.compute_log_prob(b)[0]["old_log_probs"]
    b["advantages"] = torch.ones(b["responses"].shape)
    before = b["old_log_probs"]
    for _ in range(3):
        core.update_actor(dict(b))
    after = core.compute_log_prob(b)[0]["old_log_probs"]
    m = B.ensure_defaults(dict(b))["response_mask"].bool()
    out["logprob_gain"] = float((after - before)[m].mean())

    # whole PPO steps: finite metrics, and HF-named full weights for a push
    for step in range(2):
        metrics = core.train_step(scored_batch(step))
    out["finite"] = all(v == v and abs(v) != float("inf") for v in metrics.values())
    weights = dict(core.iter_weights())
    hf = dict(load_actor(model_dir).named_parameters())
    out["same_names"] = sorted(weights) == sorted(hf)
    out["same_shapes"] = all(tuple(weights[k].shape) == tuple(v.shape) for k, v in hf.items())
    out["peak_memory_bytes"] = torch.cuda.max_memory_allocated()

    # the same core behind the gRPC service: a step, a checkpoint, a bucketed push
    from rlfleet.common.rpc import create_server
    from rlfleet.trainer.client import RemoteTrainerClient
    from rlfleet.trainer.servicer import TrainerServicer
    from rlfleet.trainer.testing import FakeRollout
    from rlfleet.v1 import rollout_pb2_grpc, trainer_pb2_grpc

    server = create_server(
        [(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, TrainerServicer(core))]
    )
    fake = FakeRollout({k: tuple(v.shape) for k, v in hf.items()})
    replica = create_server([(rollout_pb2_grpc.add_RolloutServiceServicer_to_server, fake)])
    client = RemoteTrainerClient(server.address, timeout_s=300)
    remote = client.train_step(scored_batch(3))
    saved = client.save_checkpoint(step=core.global_step)
    loaded = client.load_checkpoint(saved.path)
    pushed = client.push_weights([("r0", replica.address)], bucket_bytes=64 * 1024)
    weights = dict(core.iter_weights())
    out["grpc_ok"] = (
        all(v == v for v in remote.metrics.values())
        and loaded.step == saved.step
        and pushed.ok == {"r0": True}
        and fake.buckets_seen[-1] > 1
        and all(torch.equal(fake.weights[k], weights[k].to(fake.weights[k].dtype)) for k in weights)
    )
    client.close()
    server.stop(0)
    replica.stop(0)
    print("RESULT " + json.dumps(out))
    """
)


def _run(model_dir: Path, *overrides: str) -> dict[str, object]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(model_dir), *overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    result: dict[str, object] = json.loads(lines[-1][len("RESULT ") :])
    return result


@pytest.mark.parametrize(
    ("backend", "overrides", "tol"),
    [
        ("fsdp", [], 1e-4),
        ("fsdp", ["actor.dtype=bfloat16", "critic.dtype=bfloat16"], 0.1),
        ("fsdp", ["actor.param_offload=true", "actor.gradient_checkpointing=true"], 1e-4),
        ("megatron", ["actor.backend=megatron", "critic.backend=megatron"], 1e-4),
        (
            "megatron",
            [
                "actor.backend=megatron",
                "critic.backend=megatron",
                "actor.dtype=bfloat16",
                "critic.dtype=bfloat16",
                "actor.gradient_checkpointing=true",
            ],
            0.1,
        ),
    ],
    ids=["fsdp-fp32", "fsdp-bf16", "fsdp-offload-ckpt", "megatron-fp32", "megatron-bf16-ckpt"],
)
def test_backend_on_cuda(
    tiny_model_dir: Path, backend: str, overrides: list[str], tol: float
) -> None:
    r = _run(tiny_model_dir, *overrides)
    assert r["backend"] == backend
    assert r["roles"] == ["actor", "critic", "ref"]
    assert float(r["logprob_max_diff"]) < tol  # type: ignore[arg-type]
    assert float(r["logprob_gain"]) > 0  # type: ignore[arg-type]
    assert r["finite"] and r["same_names"] and r["same_shapes"]
    assert r["grpc_ok"]
