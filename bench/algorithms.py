"""Algorithms benchmark: greedy accuracy after the same wall-clock budget, from a weak start.

Prints one JSON object on stdout (progress goes to stderr).

The demo's task (``rlfleet.launch.demo``): the tiny Llama, two-digit + one-digit additions
scored by the gsm8k rule, and a short supervised warm start (``--sft-steps``, default
200: a weak start of about 40% greedy test accuracy, since half the problems were taught
without the ``#### N`` line the rule wants). From that same start each algorithm trains
with every role in this process, on its example config, until ``--budget-s`` seconds of
training have passed (the step that crosses the budget finishes); then the greedy
accuracy on the 100 held-out problems is measured (outside the budget):

* ``ppo``: PPO with a critic (GAE), ``examples/arithmetic_ppo.yaml`` -- the baseline;
* ``grpo``: ``examples/arithmetic_grpo.yaml``;
* ``dapo``: ``examples/arithmetic_dapo.yaml`` (clip-higher, dynamic sampling,
  token-level loss, overlong shaping);
* ``gspo``: ``examples/arithmetic_gspo.yaml``;
* ``cispo`` (not run by default): the GRPO example with ``policy_loss.loss_mode: cispo``.

``accuracy_vs_ppo`` is each algorithm's final accuracy over PPO's, measured in the same
run. RL on this scale is noisy: one run per algorithm is one sample, and the order of
the algorithms is the order given.

    python bench/algorithms.py                               # the four, 60 s each
    python bench/algorithms.py --budget-s 20 --algorithms grpo,gspo
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rlfleet.common.config import load_config
from rlfleet.common.tiny_model import build_tiny_model
from rlfleet.driver.loop import PPOTrainer, StepRecord
from rlfleet.launch.demo import EXAMPLES, make_data, sft_warm_start

#: name -> (example config, extra overrides)
ALGORITHMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "ppo": ("arithmetic_ppo.yaml", ()),
    "grpo": ("arithmetic_grpo.yaml", ()),
    "dapo": ("arithmetic_dapo.yaml", ()),
    "gspo": ("arithmetic_gspo.yaml", ()),
    "cispo": (
        "arithmetic_grpo.yaml",
        ("actor.policy_loss.loss_mode=cispo", "actor.clip_ratio_high=0.28"),
    ),
}
DEFAULT = ("ppo", "grpo", "dapo", "gspo")
MAX_STEPS = 10_000  # the budget ends a run long before


class _BudgetSpent(Exception):
    pass


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_one(
    name: str, model: Path, data: Path, work: Path, budget_s: float, seed: int
) -> dict[str, Any]:
    """Train ``name`` from ``model`` for ``budget_s`` seconds; its accuracy after."""
    example, extra = ALGORITHMS[name]
    cfg = load_config(
        EXAMPLES / example,
        [
            f"actor.model_path={model}",
            f"data.train_files={data / 'train.parquet'}",
            f"data.val_files={data / 'test.parquet'}",
            f"trainer.default_local_dir={work / name}",
            f"trainer.total_training_steps={MAX_STEPS}",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
            "trainer.logger=[jsonl]",
            f"trainer.seed={seed}",
            *extra,
        ],
    )
    records: list[StepRecord] = []
    with PPOTrainer(cfg) as trainer:
        trainer.init_workers()
        before = trainer.validate()["val/test_score/mean"]
        t0 = time.perf_counter()

        def on_step(record: StepRecord) -> None:
            records.append(record)
            if time.perf_counter() - t0 >= budget_s:
                raise _BudgetSpent

        trainer.on_step = on_step
        with contextlib.suppress(_BudgetSpent):  # the budget's end, not a failure
            trainer.fit()
        seconds = time.perf_counter() - t0
        after = trainer.validate()["val/test_score/mean"]
    scores = [r.metrics["critic/score/mean"] for r in records]
    samples = sum(r.metrics.get("dynamic_sampling/samples_generated", 0.0) for r in records)
    out = {
        "example": example,
        "overrides": list(extra),
        "accuracy_before": before,
        "accuracy": after,
        "steps": len(records),
        "train_seconds": round(seconds, 2),
        "sampled_reward_first_step": round(scores[0], 4) if scores else None,
        "sampled_reward_last_step": round(scores[-1], 4) if scores else None,
    }
    if samples:
        out["samples_generated"] = int(samples)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-s", type=float, default=60.0, help="training seconds each")
    parser.add_argument(
        "--algorithms", default=",".join(DEFAULT), help=f"comma-separated, of {sorted(ALGORITHMS)}"
    )
    parser.add_argument("--sft-steps", type=int, default=200, help="warm-start optimizer steps")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (as the demo)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="work folder (default: a temporary one)")
    args = parser.parse_args()
    names = [n.strip() for n in args.algorithms.split(",") if n.strip()]
    unknown = sorted(set(names) - ALGORITHMS.keys())
    if unknown:
        parser.error(f"unknown algorithm(s) {unknown}; expected some of {sorted(ALGORITHMS)}")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(max(1, args.threads))

    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-algorithms-") as tmp:
        work = Path(args.out) if args.out else Path(tmp)
        model, data, sft = work / "tiny", work / "data", work / "sft"
        _say(f"tiny model, data, {args.sft_steps}-step warm start under {work}")
        build_tiny_model(model, preset="tiny", seed=args.seed, force=True)
        make_data(data, seed=args.seed)
        t0 = time.perf_counter()
        sft_warm_start(
            model, data, sft, steps=args.sft_steps, lr=3e-3, batch_size=32, seed=args.seed
        )
        sft_s = time.perf_counter() - t0
        results: dict[str, dict[str, Any]] = {}
        for name in names:
            _say(f"{name}: {args.budget_s:.0f} s of training")
            results[name] = run_one(name, sft, data, work / "runs", args.budget_s, args.seed)
            r = results[name]
            _say(
                f"  {name}: greedy accuracy {r['accuracy_before']:.1%} -> {r['accuracy']:.1%} "
                f"in {r['steps']} steps ({r['train_seconds']:.0f} s)"
            )
    start = next(iter(results.values()))["accuracy_before"] if results else None
    baseline = results.get("ppo", {}).get("accuracy")
    out: dict[str, Any] = {
        "task": "arithmetic (two-digit + one-digit, no carry), tiny Llama, greedy test accuracy",
        "budget_s": args.budget_s,
        "sft_steps": args.sft_steps,
        "sft_seconds": round(sft_s, 1),
        "start_accuracy": start,
        "threads": args.threads,
        "algorithms": results,
        "accuracy": {name: r["accuracy"] for name, r in results.items()},
    }
    if baseline:
        out["accuracy_vs_ppo"] = {
            name: round(r["accuracy"] / baseline, 3) for name, r in results.items()
        }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
