"""LoRA weight-push benchmark: prints one JSON object on stdout (progress to stderr).

One LoRA actor (``actor.lora_rank``, peft, ``target_modules: all-linear``) on a model
built by ``rlfleet.common.tiny_model.build_tiny_model`` (``--presets``), and one real
rollout replica (HF engine behind its gRPC server on 127.0.0.1). For each transport
(``--transports``) it times, interleaved call by call, the two pushes of the same
trainer state:

* **lora**: what a LoRA run pushes, the adapters only (``TrainerCore.iter_weights()``;
  the replica merges ``W0 + B @ A`` into its kept base weights);
* **full**: the merged model, every parameter (``iter_weights(full=True)``), what a
  push without LoRA support would send.

Seconds are the trainer's wall time of ``push_weights`` until the replica applied the
update (median of ``--repeats`` after one warm-up each), bytes the payload the replica
received. ``ratio_*`` are full / lora (higher: LoRA cheaper).

    python bench/lora.py                        # tiny + small, rank 8, grpc + tcp
    python bench/lora.py --presets small --rank 16 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlfleet.common.tiny_model import build_tiny_model
from rlfleet.rollout.core import RolloutCore
from rlfleet.rollout.hf_engine import HFEngine
from rlfleet.rollout.server import start_rollout_server
from rlfleet.trainer.core import TrainerCore
from rlfleet.trainer.testing import make_batch, make_config
from rlfleet.weightsync.sender import push_weights


def log(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


def bench_preset(preset: str, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    model_dir = build_tiny_model(workdir / preset, preset=preset, seed=0)
    config = make_config(
        str(model_dir),
        algorithm={"adv_estimator": "grpo"},
        actor={"lora_rank": args.rank, "lora_alpha": 2 * args.rank, "lr": 1e-2},
        trainer={"default_local_dir": str(workdir / f"run-{preset}")},
    )
    trainer = TrainerCore(config)
    # One update so that B is not zero (a freshly initialised adapter pushes zeros).
    trainer.train_step({**make_batch(seed=1), "scores": torch.tensor([1.0, 0, 0, 1])})
    engine = HFEngine(model_dir)
    core = RolloutCore(engine, replica_id="r0")
    server = start_rollout_server(core)
    targets = [("r0", server.address)]
    version = [0]
    out: dict[str, Any] = {
        "preset": preset,
        "parameters": sum(int(t.numel()) for _, t in trainer.iter_weights(full=True)),
        "lora_rank": args.rank,
        "target_modules": "all-linear",
    }
    try:
        for transport in args.transports.split(","):

            def push(full: bool, transport: str = transport) -> tuple[float, int]:
                version[0] += 1
                t0 = time.perf_counter()
                summary = push_weights(
                    trainer.iter_weights(full=full), targets, version[0], transports=[transport]
                )
                seconds = time.perf_counter() - t0
                if not all(r.ok for r in summary.results):
                    raise RuntimeError(f"push failed: {[r.error for r in summary.results]}")
                return seconds, summary.bytes

            timings = interleaved({"lora": lambda: push(False), "full": lambda: push(True)}, args)
            lora_s, lora_b = timings["lora"]
            full_s, full_b = timings["full"]
            out[transport] = {
                "lora_bytes": lora_b,
                "full_bytes": full_b,
                "lora_s": lora_s,
                "full_s": full_s,
                "ratio_bytes": full_b / lora_b,
                "ratio_s": full_s / lora_s,
            }
            log(preset, transport, json.dumps(out[transport]))
    finally:
        server.stop(0)
        core.close()
    return out


def interleaved(
    fns: dict[str, Callable[[], tuple[float, int]]], args: argparse.Namespace
) -> dict[str, tuple[float, int]]:
    """Median seconds (and the bytes) of each of ``fns``, called in turn ``--repeats``
    times after one warm-up call each."""
    for fn in fns.values():
        fn()
    seconds: dict[str, list[float]] = {k: [] for k in fns}
    nbytes: dict[str, int] = {}
    for _ in range(args.repeats):
        for k, fn in fns.items():
            s, b = fn()
            seconds[k].append(s)
            nbytes[k] = b
    return {k: (statistics.median(v), nbytes[k]) for k, v in seconds.items()}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--presets", default="tiny,small", help="comma list of model presets")
    ap.add_argument("--rank", type=int, default=8, help="actor.lora_rank")
    ap.add_argument("--transports", default="grpc,tcp", help="comma list: grpc, tcp, shm")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-lora-") as tmp:
        results = [bench_preset(p, Path(tmp), args) for p in args.presets.split(",")]
    print(json.dumps({"bench": "lora_push", "threads": args.threads, "results": results}, indent=2))


if __name__ == "__main__":
    main()
