"""The agentic calculator demo: a tiny model learns to call a tool, on a CPU.

    python -m rlfleet.launch.agentic_demo --out outputs        # 2 to 4 minutes on 2 cores

Steps, each skipped when its output already exists (``--fresh`` redoes them):

1. ``outputs/models/tiny`` -- the tiny Llama and its tokenizer;
2. ``outputs/data/calculator`` -- remainders of three-digit numbers by a one-digit
   divisor (``482 % 7``) whose prompt says a calculator tool is available (:func:`rlfleet.driver.data.recipes.calculator`),
   scored by the gsm8k rule (``#### N``);
3. ``outputs/models/tiny-calculator-sft`` -- a supervised warm start on
   conversations the project writes (:func:`sft_warm_start`): a ``tool_fraction`` of
   the problems as the tool-call transcript (the call, the calculator's answer as a
   tool turn, ``#### N``), the others answered directly. A ~1M-parameter model cannot
   take remainders of three-digit numbers, so its direct answers are mostly wrong and its
   copied tool answers mostly right;
4. GRPO with multi-turn rollouts and the built-in calculator
   (``examples/agentic_calculator.yaml``): the reward rises as the policy learns to
   call the tool instead of guessing. Greedy test accuracy before and after is
   printed (one JSON line: ``accuracy_before``, ``accuracy_after``, ``steps``,
   ``seconds``).

The warm start builds each conversation's tokens exactly as the multi-turn rollout
does (the model's turns, then the tool turn from
:class:`~rlfleet.rollout.multiturn.ToolTurnRenderer`), with the loss on the model's
tokens only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

__all__ = [
    "fixed_call_model",
    "main",
    "make_data",
    "run_ppo",
    "sft_batch",
    "sft_batches",
    "sft_fragments",
    "sft_warm_start",
]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "agentic_calculator.yaml"


def make_data(out: Path, *, seed: int = 0, n_train: int = 6000, n_test: int = 64) -> None:
    """``out/{train,test}.parquet`` of :func:`rlfleet.driver.data.recipes.calculator`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlfleet.driver.data.recipes import CALCULATOR_SCHEMA, calculator

    rows = calculator(n_train, n_test, seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    for split, items in rows.items():
        tmp = out / f".{split}.parquet.tmp"
        pq.write_table(pa.Table.from_pylist(items, schema=CALCULATOR_SCHEMA), tmp)
        tmp.replace(out / f"{split}.parquet")


def sft_batches(
    tokenizer: Any, rows: list[dict[str, Any]], tool: list[bool]
) -> tuple[list[list[int]], list[list[int]]]:
    """Each row's warm-start response tokens and loss mask: the tool-call transcript
    (``tool[i]``) or the direct answer, each model turn closed by ``<|im_end|>``."""
    from rlfleet.driver.data.recipes import calculator_transcript
    from rlfleet.rollout.multiturn import ToolTurnRenderer

    renderer = ToolTurnRenderer(tokenizer)
    end = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))

    def enc(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    responses, masks = [], []
    for row, use_tool in zip(rows, tool, strict=True):
        call, result, answer = (m["content"] for m in calculator_transcript(row))
        if use_tool:
            first, inserted, last = [*enc(call), end], renderer.tokens([result], end), enc(answer)
            ids = [*first, *inserted, *last, end]
            mask = [1] * len(first) + [0] * len(inserted) + [1] * (len(last) + 1)
        else:
            ids = [*enc(answer), end]
            mask = [1] * len(ids)
        responses.append(ids)
        masks.append(mask)
    return responses, masks


def sft_fragments(
    tokenizer: Any, rows: list[dict[str, Any]], prompts: list[list[int]]
) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Two short pieces of each row's tool conversation, as ``(prompts, responses,
    masks)``: the call after the row's prompt (``prompts``: token ids), and the
    final answer after the tool's turn alone (the tool's answer at the same distance
    as in the whole conversation). Mixed into the warm start, they teach the two copies the task needs
    (the expression into the call, the tool's answer into the reply) in a fraction
    of the steps the whole conversations take, at a fraction of their tokens."""
    from rlfleet.driver.data.recipes import calculator_transcript
    from rlfleet.rollout.multiturn import ToolTurnRenderer

    renderer = ToolTurnRenderer(tokenizer)
    end = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))

    def enc(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    empty = [{"role": "user", "content": ""}]
    head = enc(tokenizer.apply_chat_template(empty, tokenize=False, add_generation_prompt=True))
    responses: list[list[int]] = []
    out_prompts: list[list[int]] = []
    for row, prompt in zip(rows, prompts, strict=True):
        call, result, answer = (m["content"] for m in calculator_transcript(row))
        out_prompts.append(list(prompt))
        responses.append([*enc(call), end])
        out_prompts.append([*head, *enc("<tool_call>"), end, *renderer.tokens([result], end)])
        responses.append([*enc(answer), end])
    masks = [[1] * len(r) for r in responses]
    return out_prompts, responses, masks


def sft_warm_start(
    model_dir: Path,
    data_dir: Path,
    out_dir: Path,
    *,
    steps: int = 260,
    lr: float = 3e-3,
    batch_size: int = 32,
    seed: int = 0,
    tool_fraction: float = 0.3,
    tool_first: int = 200,
    fragments: int = 16,
) -> dict[str, float]:
    """Supervised steps on the calculator conversations (module docstring), then the
    actor is written to ``out_dir`` as a Hugging Face folder.

    The first ``tool_first`` steps see tool conversations only, the rest a
    ``tool_fraction`` of them and direct answers otherwise; each step also trains on
    ``fragments`` pairs of :func:`sft_fragments` (0: none). The two copies the tool
    path needs set in abruptly (after 150 to 300 steps here); direct answers come last,
    so that the policy RL starts from mostly answers without the tool."""
    import numpy as np
    import torch
    from transformers import AutoTokenizer

    from rlfleet.common.config import config_from_dict
    from rlfleet.driver.data.dataset import RLHFDataset
    from rlfleet.trainer.core import TrainerCore

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    ds = RLHFDataset(data_dir / "train.parquet", tok, max_prompt_length=256, tensor_type="torch")
    # Each problem at most once (while there are enough): with few distinct problems
    # the model memorizes answers instead of learning to copy the expression into the
    # call and the tool's answer into its own, which it does after ~250 steps here.
    rng = np.random.default_rng(seed)
    order = np.resize(rng.permutation(len(ds)), steps * batch_size)
    used = ds.collate(order)
    prompts: list[list[int]] = used["raw_prompt_ids"]
    rows = [{"extra_info": info} for info in used["extra_info"]]
    tool = list(np.random.default_rng(seed + 1).random(len(order)) < tool_fraction)
    tool[: tool_first * batch_size] = [True] * min(len(tool), tool_first * batch_size)
    responses, masks = sft_batches(tok, rows, tool)
    extra = ds.collate(np.resize(rng.permutation(len(ds)), steps * fragments))
    pieces = sft_fragments(
        tok, [{"extra_info": i} for i in extra["extra_info"]], extra["raw_prompt_ids"]
    )
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
    loss = float("nan")
    t0 = time.perf_counter()
    for step in range(steps):
        idx = range(step * batch_size, (step + 1) * batch_size)
        frag = range(2 * step * fragments, 2 * (step + 1) * fragments)
        batch = sft_batch(
            [prompts[i] for i in idx] + [pieces[0][i] for i in frag],
            [responses[i] for i in idx] + [pieces[1][i] for i in frag],
            [masks[i] for i in idx] + [pieces[2][i] for i in frag],
            ds.pad_token_id,
        )
        loss = core.sft_step(batch)["sft/loss"]
    core.export_hf(str(out_dir))
    core.shutdown()
    return {"sft/loss": loss, "sft/seconds": time.perf_counter() - t0}


def sft_batch(
    prompts: list[list[int]], responses: list[list[int]], masks: list[list[int]], pad: int
) -> dict[str, Any]:
    import torch

    p_len = max(len(p) for p in prompts)
    r_len = max(len(r) for r in responses)
    n = len(prompts)
    ids = torch.full((n, p_len + r_len), pad, dtype=torch.long)
    attn = torch.zeros_like(ids)
    loss = torch.zeros((n, r_len), dtype=torch.long)
    for j, (p, r, m) in enumerate(zip(prompts, responses, masks, strict=True)):
        ids[j, p_len - len(p) : p_len] = torch.tensor(p)
        ids[j, p_len : p_len + len(r)] = torch.tensor(r)
        attn[j, p_len - len(p) : p_len + len(r)] = 1
        loss[j, : len(m)] = torch.tensor(m)
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "responses": ids[:, p_len:],
        "response_mask": loss,
    }


def fixed_call_model(model_dir: Path, out_dir: Path, *, steps: int = 60, seed: int = 0) -> Path:
    """``model_dir`` after ``steps`` supervised steps on one fixed conversation, whatever
    the prompt: the calculator call on ``6 * 7``, then ``#### 42``. Its rollouts have
    tool turns (tests and ``bench/tools.py``); it learns no arithmetic."""
    import numpy as np
    import torch
    from transformers import AutoTokenizer

    from rlfleet.common.config import config_from_dict
    from rlfleet.driver.data.recipes import calculator, calculator_call
    from rlfleet.trainer.core import TrainerCore

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    rows = calculator(64, 0, seed=seed)["train"]
    texts = [
        tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
        for r in rows
    ]
    prompts = [list(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]
    fixed = {"expression": "6 * 7", "tool_call": calculator_call("6 * 7")}
    responses, masks = sft_batches(tok, [{"extra_info": fixed}] * len(rows), [True] * len(rows))
    cfg = config_from_dict(
        {
            "actor": {"model_path": str(model_dir), "lr": 3e-3, "ppo_mini_batch_size": 16},
            "data": {"train_batch_size": 16},
            "algorithm": {"adv_estimator": "reinforce_plus_plus"},  # no critic to build
            "trainer": {"seed": seed, "default_local_dir": str(out_dir.parent / "fixed-call-run")},
        }
    )
    torch.manual_seed(seed)
    core = TrainerCore(cfg)
    rng = np.random.default_rng(seed)
    pad = int(tok.pad_token_id)
    for _ in range(steps):
        idx = rng.choice(len(rows), size=16)
        batch = sft_batch(
            [prompts[i] for i in idx], [responses[i] for i in idx], [masks[i] for i in idx], pad
        )
        core.sft_step(batch)
    core.export_hf(str(out_dir))
    core.shutdown()
    return out_dir


def run_ppo(
    model: Path, data: Path, run_dir: Path, *, overrides: list[str] | None = None
) -> dict[str, Any]:
    """GRPO with ``examples/agentic_calculator.yaml`` on ``model`` and ``data``, every
    role in this process; returns the run summary (``validation``: before and after)."""
    from rlfleet.common.config import load_config
    from rlfleet.launch.train import train

    cfg = load_config(
        EXAMPLE,
        [
            f"actor.model_path={model}",
            f"data.train_files={data / 'train.parquet'}",
            f"data.val_files={data / 'test.parquet'}",
            f"trainer.default_local_dir={run_dir}",
            "trainer.resume_mode=disable",
            *(overrides or []),
        ],
    )
    summary: dict[str, Any] = train(cfg, in_process=True, scheduler=False)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlfleet.launch.agentic_demo", description=__doc__
    )
    parser.add_argument("--out", default="outputs", help="where models, data and runs go")
    parser.add_argument("--sft-steps", type=int, default=260)
    parser.add_argument("--tool-fraction", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fresh", action="store_true", help="rebuild model, data and warm start")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="config override for the PPO run, repeatable",
    )  # fmt: skip
    args = parser.parse_args(argv)
    import logging

    import torch

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(max(1, args.threads))
    from rlfleet.common.tiny_model import build_tiny_model

    out = Path(args.out)
    model, data = out / "models" / "tiny", out / "data" / "calculator"
    sft = out / "models" / "tiny-calculator-sft"
    t0 = time.perf_counter()
    if args.fresh or not (model / "config.json").exists():
        build_tiny_model(model, preset="tiny", seed=args.seed, force=True)
    if args.fresh or not (data / "train.parquet").exists():
        make_data(data, seed=args.seed)
    if args.fresh or not (sft / "config.json").exists():
        print(f"warm start: {args.sft_steps} steps -> {sft}", file=sys.stderr, flush=True)
        sft_warm_start(
            model, data, sft, steps=args.sft_steps, seed=args.seed,
            tool_fraction=args.tool_fraction,
        )  # fmt: skip
    summary = run_ppo(sft, data, out / "runs" / "agentic_calculator", overrides=args.overrides)
    vals = summary["validation"]
    result = {
        "accuracy_before": vals[0]["val/test_score/mean"] if vals else None,
        "accuracy_after": vals[-1]["val/test_score/mean"] if vals else None,
        "steps": summary["global_steps"],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
