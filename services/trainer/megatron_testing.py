"""Running the megatron backend on CPU, for tests only.

megatron-core's model code is plain PyTorch except for two calls that insist on CUDA:
RoPE moves its frequencies to ``torch.cuda.current_device()``, and attention dropout
forks the CUDA RNG tracker (dropout is 0 here). :func:`cpu_shim` replaces those two for
the duration of a test; every other line that runs is megatron's own. The multi-stage
(1F1B) schedule allocates on CUDA as well, so on CPU pipeline parallelism is checked
for loading and gathering weights only. The GPU tests (``-m gpu``) need no shim.

``python -m rlfleet.trainer.megatron_testing --model DIR --out FILE --tp N --pp M`` under
``torchrun`` (gloo) is the multi-rank check: rank 0 drives a :class:`TrainerCore` (the
other ranks follow, as under ``rlfleet serve trainer``), and writes what it saw to
``FILE`` for the test to compare with one FSDP rank.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from rlfleet.common.config import Config
from rlfleet.trainer.testing import make_batch, make_config

__all__ = ["cpu_shim", "megatron_config", "scored_batch"]


@contextlib.contextmanager
def cpu_shim() -> Iterator[None]:
    """Let megatron-core's forward run on CPU (see the module docstring)."""
    from megatron.core.tensor_parallel import random as mg_random

    tracker = mg_random.get_cuda_rng_tracker()
    saved_device = torch.cuda.current_device
    saved_fork = tracker.fork
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    tracker.fork = lambda *a, **k: contextlib.nullcontext()
    try:
        yield
    finally:
        torch.cuda.current_device = saved_device
        tracker.fork = saved_fork


def megatron_config(model_dir: str, tp: int = 1, pp: int = 1, **sections: Any) -> Config:
    """:func:`~rlfleet.trainer.testing.make_config` with actor and critic on megatron.

    The config check refuses megatron without ``trainer.device: cuda``; the CPU tests
    switch the backend after validation, on purpose."""
    cfg = make_config(model_dir, **sections)
    layout = cfg.actor.megatron.model_copy(
        update={"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp}
    )
    update = {"backend": "megatron", "megatron": layout}
    return cfg.model_copy(
        update={
            "actor": cfg.actor.model_copy(update=update),
            "critic": cfg.critic.model_copy(update=update),
        }
    )


def scored_batch(seed: int) -> dict[str, Any]:
    """A 4-row batch with a reward on two of the rows' second-to-last token."""
    batch = make_batch(seed=seed)
    scores = torch.zeros(batch["responses"].shape, dtype=torch.float32)
    scores[:, -2] = torch.tensor([1.0, 0.0, 1.0, 0.0])
    batch["token_level_scores"] = scores
    return batch


def _main() -> None:
    import torch.distributed as dist

    from rlfleet.trainer.core import TrainerCore
    from rlfleet.trainer.dispatch import follow
    from rlfleet.trainer.megatron import MegatronBackend

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2, help="0: load and gather only")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    cfg = megatron_config(args.model, args.tp, args.pp, algorithm={"adv_estimator": "gae"})
    with cpu_shim():
        core = TrainerCore(cfg, MegatronBackend(cfg, device=torch.device("cpu")))
        if dist.get_rank() != 0:
            follow(core.ops)
        else:
            result: dict[str, Any] = {"layout": core.layout, "metrics": []}
            if args.steps:
                lp, _ = core.compute_log_prob(make_batch(seed=0))
                result["log_prob"] = lp["old_log_probs"]
            for step in range(args.steps):
                result["metrics"].append(core.train_step(scored_batch(step)))
            result["weights"] = dict(core.iter_weights())
            result["state"] = core.gather_states(["actor"])[0]["actor"]
            core.shutdown()
            torch.save(result, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _main()
