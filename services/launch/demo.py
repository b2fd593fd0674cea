"""`rlfleet demo` (`make demo`): PPO raises a tiny model's arithmetic accuracy on a CPU.

Steps, each skipped when its output already exists (``--fresh`` redoes them):

1. ``outputs/models/tiny`` -- the tiny Llama and its tokenizer (``rlfleet init-model``);
2. ``outputs/data/arithmetic`` -- two-digit + one-digit additions in GSM8K's format
   (:func:`make_data`), scored by the gsm8k rule (``#### N``);
3. ``outputs/models/tiny-sft`` -- a short supervised warm start with the trainer's
   ``sft_step`` on the reference answers, so the model gets some problems right;
4. PPO with a critic (GAE, ``examples/arithmetic_ppo.yaml``) from the warm start,
   then the GRPO variant (``examples/arithmetic_grpo.yaml``), each printing greedy
   test accuracy before and after.

By default every role runs in this process (no start-up cost); ``--services`` runs
the same PPO through ``rlfleet train``'s local cluster, every service a process.

``--preset tiny-deep --ops +- --sft-steps 300`` runs the same example configs on the
second model the project builds (narrower, twice as deep, its own tokenizer) from a
weak warm start on additions and subtractions: the recipe-robustness check of
``tests/e2e/test_recipe_robustness.py`` (numbers in BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from rlfleet.common import cli_args

__all__ = [
    "add_arguments",
    "data_dir_name",
    "main",
    "make_data",
    "run",
    "run_example",
    "sft_warm_start",
]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

# The data set: "What is a + b?" with a two-digit first and a one-digit second
# operand whose units do not carry ("43 + 5 = 48\n#### 48"), in GSM8K's answer format,
# scored by the gsm8k rule. Test problems never occur in train, but they are made of
# the same parts (the tens digit is copied, the units digit is one of 55 one-digit
# sums), which a ~1M-parameter model learns in a few hundred CPU steps; the
# two-digit + two-digit problems of `rlfleet preprocess arithmetic` take a model of
# this size far longer.
OPS = "+"
N_TEST = 100
_OP_NAMES = {"+": "add", "-": "sub", "*": "mul"}


def data_dir_name(ops: str) -> str:
    """``arithmetic`` for the demo's additions (the example configs' path), else
    ``arithmetic-<ops>`` (``+-``: ``arithmetic-add-sub``)."""
    if ops == OPS:
        return "arithmetic"
    return "arithmetic-" + "-".join(_OP_NAMES[op] for op in ops)


def make_data(
    out: Path, *, seed: int = 0, n_test: int = N_TEST, ops: str = OPS, carry: bool = False
) -> None:
    """Write ``out/{train,test}.parquet`` (verl's schema, data_source rlfleet/arithmetic):
    every ``a op b`` with ``10 <= a <= 99``, ``0 <= b <= 9`` (``-``: ``b <= a``; without
    ``carry``: ``a % 10 + b <= 9`` for ``+``, ``b <= a % 10`` for ``-``), shuffled, the
    first ``n_test`` for test."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlfleet.driver.data.recipes import (
        ARITHMETIC_SCHEMA,
        GSM8K_INSTRUCTION,
        arithmetic_problem,
    )

    space = [
        (a, op, b)
        for a in range(10, 100)
        for op in ops
        for b in range(10)
        if carry or (a % 10 + b <= 9 if op == "+" else b <= a % 10)
    ]
    random.Random(seed).shuffle(space)
    splits = {"test": space[:n_test], "train": space[n_test:]}
    out.mkdir(parents=True, exist_ok=True)
    for split, problems in splits.items():
        rows = []
        for index, (a, op, b) in enumerate(problems):
            question, answer, value = arithmetic_problem(a, op, b)
            rows.append(
                {
                    "data_source": "rlfleet/arithmetic",
                    "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
                    "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": str(value)},
                    "extra_info": {
                        "split": split,
                        "index": index,
                        "answer": answer,
                        "question": question,
                    },
                }
            )
        tmp = out / f".{split}.parquet.tmp"
        pq.write_table(pa.Table.from_pylist(rows, schema=ARITHMETIC_SCHEMA), tmp)
        tmp.replace(out / f"{split}.parquet")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="outputs", help="where models, data and runs go")
    from rlfleet.common.tiny_model import PRESETS  # torch-free

    parser.add_argument(
        "--preset", default="tiny", choices=sorted(PRESETS), help="the model to build"
    )
    parser.add_argument(
        "--ops",
        default=OPS,
        help="operators of the problems, from '+-*' (a two-digit and a one-digit operand, "
        "no carry or borrow)",
    )
    parser.add_argument(
        "--sft-steps", type=cli_args.positive_int, default=250, help="warm-start optimizer steps"
    )
    parser.add_argument("--sft-lr", type=cli_args.positive_float, default=3e-3)
    parser.add_argument(
        "--format-fraction",
        type=float,
        default=0.5,
        help="share of warm-start problems taught with the final '#### N' line",
    )
    parser.add_argument("--sft-batch", type=cli_args.positive_int, default=32)
    parser.add_argument(
        "--ppo-steps", type=cli_args.positive_int, default=None, help="override PPO steps"
    )
    parser.add_argument(
        "--variant", choices=["gae", "grpo", "both"], default="both", help="which PPO runs"
    )
    parser.add_argument("--services", action="store_true", help="run PPO as local services")
    parser.add_argument("--fresh", action="store_true", help="rebuild model, data and warm start")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for the PPO runs, repeatable "
        "(e.g. --set trainer.device=cuda --set actor.backend=megatron)",
    )
    parser.add_argument(
        "--threads",
        type=cli_args.positive_int,
        default=1,
        help="torch threads (1: the trainer and the rollout engine each keep one core busy "
        "instead of fighting over both)",
    )


_STAMP = ".rlfleet-demo.json"


def _stamped(path: Path, key: dict[str, Any]) -> bool:
    stamp = path / _STAMP
    try:
        return bool(json.loads(stamp.read_text(encoding="utf-8")) == key)
    except (OSError, ValueError):
        return False


def _stamp(path: Path, key: dict[str, Any]) -> None:
    (path / _STAMP).write_text(json.dumps(key), encoding="utf-8")


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def sft_warm_start(
    model_dir: Path,
    data_dir: Path,
    out_dir: Path,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int = 0,
    format_fraction: float = 0.5,
) -> dict[str, float]:
    """Supervised steps on the reference answers (``extra_info.answer``), then the
    actor is written to ``out_dir`` as a Hugging Face folder.

    ``format_fraction`` of the problems keep the final ``#### N`` line; the others
    are taught the equation line alone.
    """
    import numpy as np
    import torch
    from transformers import AutoTokenizer

    from rlfleet.common.config import config_from_dict
    from rlfleet.driver.data.dataset import RLHFDataset
    from rlfleet.trainer.core import TrainerCore

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    ds = RLHFDataset(data_dir / "train.parquet", tok, max_prompt_length=128, tensor_type="torch")
    everything = ds.collate(np.arange(len(ds)))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    # Half of the problems (a fixed, seeded half) are taught with the full answer
    # ("47 + 5 = 52\n#### 52"), the rest with the equation alone ("47 + 5 = 52"): the
    # model learns the sums but not which answer format the gsm8k rule wants. PPO
    # has to learn that from the reward.
    full = np.random.default_rng(seed + 1).random(len(ds)) < format_fraction
    answers = [
        info["answer"] if keep else info["answer"].split("\n")[0]
        for info, keep in zip(everything["extra_info"], full, strict=True)
    ]
    targets = [[*ids, end] for ids in tok(answers, add_special_tokens=False)["input_ids"]]
    cfg = config_from_dict(
        {
            "actor": {
                "model_path": str(model_dir),
                "lr": lr,
                "weight_decay": 0.0,
                "ppo_mini_batch_size": batch_size,
            },
            "data": {"train_batch_size": batch_size},
            "rollout": {"n": 1},
            "algorithm": {"adv_estimator": "reinforce_plus_plus"},
            "trainer": {"seed": seed, "default_local_dir": str(out_dir.parent / "sft-run")},
        }
    )
    torch.manual_seed(seed)
    core = TrainerCore(cfg)
    rng = np.random.default_rng(seed)
    prompts: list[list[int]] = everything["raw_prompt_ids"]
    pad = ds.pad_token_id
    loss = float("nan")
    t0 = time.perf_counter()
    for step in range(steps):
        idx = rng.choice(len(ds), size=batch_size, replace=len(ds) < batch_size)
        batch = _sft_batch([prompts[i] for i in idx], [targets[i] for i in idx], pad)
        loss = core.sft_step(batch)["sft/loss"]
        if (step + 1) % 100 == 0 or step + 1 == steps:
            _say(f"  sft step {step + 1}/{steps}  loss {loss:.3f}")
    core.export_hf(str(out_dir))
    core.shutdown()
    return {"sft/loss": loss, "sft/seconds": time.perf_counter() - t0}


def _sft_batch(prompts: list[list[int]], responses: list[list[int]], pad: int) -> dict[str, Any]:
    import torch

    p_len = max(len(p) for p in prompts)
    r_len = max(len(r) for r in responses)
    n = len(prompts)
    ids = torch.full((n, p_len + r_len), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for j, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[j, p_len - len(p) : p_len] = torch.tensor(p)
        ids[j, p_len : p_len + len(r)] = torch.tensor(r)
        mask[j, p_len - len(p) : p_len + len(r)] = 1
    return {"input_ids": ids, "attention_mask": mask, "responses": ids[:, p_len:]}


def run_example(
    example: str,
    model: Path,
    data: Path,
    out: Path,
    *,
    steps: int | None = None,
    services: bool = False,
    extra: list[str] | tuple[str, ...] = (),
) -> dict[str, Any]:
    """Train with ``examples/<example>`` as it is, but for the model and data paths
    (and ``steps``, ``extra`` overrides when given), every role in this process
    (``services``: as local services); :func:`rlfleet.launch.train.train`'s summary
    plus ``seconds``. The run goes to ``out/runs/<example's stem>``."""
    from rlfleet.launch.train import train

    cfg = example_config(example, model, data, out, steps=steps, extra=extra)
    t0 = time.perf_counter()
    summary = train(cfg, in_process=not services, scheduler=False)
    summary["seconds"] = time.perf_counter() - t0
    return summary


def example_config(
    example: str,
    model: Path,
    data: Path,
    out: Path,
    *,
    steps: int | None = None,
    extra: list[str] | tuple[str, ...] = (),
) -> Any:
    """The :class:`~rlfleet.common.config.Config` :func:`run_example` trains with
    (the model and data need not exist yet: checked before minutes of warm start).

    Raises:
        ConfigError: ``extra`` (or ``steps``) makes it invalid.
    """
    from rlfleet.common.config import load_config

    name = Path(example).stem
    overrides = [
        f"actor.model_path={model}",
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'test.parquet'}",
        f"trainer.default_local_dir={out / 'runs' / name}",
        "trainer.resume_mode=disable",
    ]
    if steps is not None:
        overrides.append(f"trainer.total_training_steps={steps}")
    return load_config(EXAMPLES / example, [*overrides, *extra])


def run(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING)
    import torch

    torch.set_num_threads(args.threads)
    from rlfleet.common.config import ConfigError
    from rlfleet.common.tiny_model import build_tiny_model

    out = Path(args.out)
    unknown = sorted(set(args.ops) - set(_OP_NAMES))
    if not args.ops or unknown:
        print(f"rlfleet demo: --ops takes operators from '+-*', got {args.ops!r}", file=sys.stderr)
        return 2
    if not 0 <= args.format_fraction <= 1:
        print(f"rlfleet demo: --format-fraction must be in [0, 1], got {args.format_fraction}",
              file=sys.stderr)  # fmt: skip
        return 2
    model = out / "models" / args.preset
    data = out / "data" / data_dir_name(args.ops)
    sft = out / "models" / f"{args.preset}-sft"
    runs = {"gae": "arithmetic_ppo.yaml", "grpo": "arithmetic_grpo.yaml"}
    chosen = ["gae", "grpo"] if args.variant == "both" else [args.variant]
    try:  # --set and --ppo-steps checked now, not after the warm start
        for variant in chosen:
            example_config(runs[variant], sft, data, out, steps=args.ppo_steps,
                           extra=args.overrides)  # fmt: skip
    except ConfigError as e:
        print(e.lines("rlfleet demo: "), file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    # Each output records what made it (.rlfleet-demo.json); one made otherwise (an
    # `rlfleet preprocess arithmetic` into the same folder, other warm-start settings)
    # is rebuilt, and so is everything after it.
    model_key = {"preset": args.preset, "seed": args.seed}
    data_key = {"ops": args.ops, "carry": False, "n_test": N_TEST, "seed": args.seed}
    sft_key = {
        "steps": args.sft_steps, "lr": args.sft_lr, "batch": args.sft_batch,
        "format_fraction": args.format_fraction, "seed": args.seed, "data": data_key,
    }  # fmt: skip
    fresh = args.fresh or not _stamped(model, model_key)
    if fresh:
        _say(f"[1/4] building the {args.preset} model -> {model}")
        build_tiny_model(model, preset=args.preset, seed=args.seed, force=True)
        _stamp(model, model_key)
    else:
        _say(f"[1/4] {args.preset} model: {model} (exists)")
    fresh = fresh or not _stamped(data, data_key)
    if fresh:
        _say(f"[2/4] arithmetic data (two-digit {args.ops} one-digit, no carry) -> {data}")
        make_data(data, seed=args.seed, ops=args.ops)
        _stamp(data, data_key)
    else:
        _say(f"[2/4] arithmetic data: {data} (exists)")
    if fresh or not _stamped(sft, sft_key):
        _say(f"[3/4] supervised warm start: {args.sft_steps} steps -> {sft}")
        sft_warm_start(
            model, data, sft, steps=args.sft_steps, lr=args.sft_lr,
            batch_size=args.sft_batch, seed=args.seed, format_fraction=args.format_fraction,
        )  # fmt: skip
        _stamp(sft, sft_key)
    else:
        _say(f"[3/4] warm start: {sft} (exists)")
    results: dict[str, Any] = {}
    for i, variant in enumerate(chosen):
        _say(f"[4/4] PPO ({variant}) from the warm start, run {i + 1}/{len(chosen)}")
        summary = run_example(
            runs[variant], sft, data, out,
            steps=args.ppo_steps, services=args.services, extra=args.overrides,
        )  # fmt: skip
        vals = summary["validation"]
        before = vals[0]["val/test_score/mean"] if vals else float("nan")
        after = vals[-1]["val/test_score/mean"] if vals else float("nan")
        results[variant] = {
            "accuracy_before": before,
            "accuracy_after": after,
            "steps": summary["global_steps"],
            "seconds": round(summary["seconds"], 1),
            "run_dir": summary["run_dir"],
        }
        _say(
            f"  {variant}: greedy test accuracy {before:.1%} -> {after:.1%} "
            f"in {summary['global_steps']} steps ({summary['seconds']:.0f}s)"
        )
    _say("")
    _say("rlfleet demo: greedy accuracy on the held-out arithmetic test set")
    for variant, r in results.items():
        _say(
            f"  {variant:5s} before PPO {r['accuracy_before']:6.1%}   after PPO "
            f"{r['accuracy_after']:6.1%}   ({r['steps']} steps, {r['seconds']:.0f}s)"
        )
    _say(f"  total {time.perf_counter() - t_start:.0f}s; metrics in <run dir>/metrics.jsonl")
    print(json.dumps(results))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlfleet demo", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
