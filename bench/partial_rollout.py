"""Partial rollouts: how long a weight push waits for a running generation batch.

One ``RolloutCore`` (HF engine, a model from ``build_tiny_model``) generates one
request of ``--prompts`` x ``--n`` rows, exactly ``--max-tokens`` new tokens each
(``ignore_eos``, temperature 1, seeded); after ``--push-at`` decode steps (a forward
hook starts it, so it lands at the same step every run) a full weight update is
pushed in-process (``RolloutCore.update_weights``, as a colocated trainer or the
driver's in-process push does). Measured, per mode, medians of ``--repeats`` runs
after one warm-up, the modes interleaved run by run:

* ``push_wait_s``: from the push's start until ``update_weights`` returns;
* ``batch_s``: the generation request from submit to its last sample;
* ``tokens``: tokens the batch returned (nothing is thrown away in either mode);
* ``rebuilds``: weight updates applied between two decode steps (partial: 1).

``off`` is the default (the push waits for the batch: every token the old weights');
``partial`` is ``trainer.pipeline.partial_rollout`` (the push lands between two decode
steps; the engine rebuilds the batch's cache under the new weights with one prefill).
``ratio`` = partial push wait / off push wait (lower is better); ``batch_ratio`` =
partial batch time / off batch time (the cost of the rebuild prefill).

    python bench/partial_rollout.py [--preset tiny] [--prompts 16] [--n 4]
                                    [--max-tokens 128] [--push-at 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlfleet.common.tiny_model import build_tiny_model
from rlfleet.rollout.core import RolloutCore
from rlfleet.rollout.engine import SamplingParams
from rlfleet.rollout.hf_engine import HFEngine


def one_run(
    model_dir: Path, partial: bool, args: argparse.Namespace, version: int
) -> dict[str, float]:
    engine = HFEngine(model_dir, partial_rollout=partial)
    core = RolloutCore(engine, replica_id="bench")
    weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 1000, size=args.prompt_len).tolist() for _ in range(args.prompts)]
    params = SamplingParams(
        n=args.n, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=1
    )
    state: dict[str, Any] = {"calls": 0}

    def push() -> None:
        t0 = time.perf_counter()
        core.update_weights(weights, version)
        state["push_wait_s"] = time.perf_counter() - t0

    def hook(module: Any, inputs: Any, output: Any) -> None:
        state["calls"] += 1
        if state["calls"] == args.push_at + 1:  # the prefill is the first forward
            state["thread"] = threading.Thread(target=push)
            state["thread"].start()
            deadline = time.monotonic() + 60
            if partial:  # posted before this step ends: lands at the next boundary
                while not engine.update_pending and time.monotonic() < deadline:
                    time.sleep(0.001)

    handle = engine.model.register_forward_hook(hook)
    try:
        t0 = time.perf_counter()
        samples = list(core.generate(prompts, params))
        batch_s = time.perf_counter() - t0
    finally:
        handle.remove()
        state["thread"].join(timeout=120)
        core.close()
    switched = sum(len(set(s.token_weight_versions)) > 1 for s in samples)
    return {
        "push_wait_s": state["push_wait_s"],
        "batch_s": batch_s,
        "tokens": float(sum(len(s.token_ids) for s in samples)),
        "rebuilds": float(switched > 0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--push-at", type=int, default=16, help="decode steps before the push")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()
    if not 0 < args.push_at < args.max_tokens - 1:
        ap.error("--push-at must be in [1, --max-tokens - 2]")
    torch.set_num_threads(args.threads)
    runs: dict[str, list[dict[str, float]]] = {"off": [], "partial": []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / args.preset, preset=args.preset, seed=0)
        for r in range(args.repeats + 1):  # run 0: warm-up
            for mode in ("off", "partial"):
                out = one_run(model_dir, mode == "partial", args, version=1)
                print(f"run {r} {mode}: {out}", file=sys.stderr)
                if r:
                    runs[mode].append(out)
    med = {
        mode: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for mode, rs in runs.items()
    }
    print(
        json.dumps(
            {
                "bench": "partial_rollout",
                "preset": args.preset,
                "rows": args.prompts * args.n,
                "max_tokens": args.max_tokens,
                "push_at": args.push_at,
                "repeats": args.repeats,
                "off": med["off"],
                "partial": med["partial"],
                "ratio": med["partial"]["push_wait_s"] / med["off"]["push_wait_s"],
                "batch_ratio": med["partial"]["batch_s"] / med["off"]["batch_s"],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
