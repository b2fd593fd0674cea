"""`rlfleet preprocess`: raw public datasets -> parquet in verl's schema.

    rlfleet preprocess gsm8k --input data/gsm8k --out outputs/data/gsm8k
    rlfleet preprocess math --input data/math500 --out outputs/data/math500
    rlfleet preprocess hellaswag --input hellaswag/data --out outputs/data/hellaswag
    rlfleet preprocess full_hh_rlhf --input hh-rlhf/harmless-base --out DIR --mode rm
    rlfleet preprocess arithmetic --out outputs/data/arithmetic --n 2000 --seed 0
    rlfleet preprocess calculator --out outputs/data/calculator --n 2000 --seed 0
    rlfleet preprocess apps --input apps/ --out outputs/data/apps
    rlfleet preprocess taco --input taco/ --out outputs/data/taco

Always writes ``DIR/train.parquet`` and ``DIR/test.parquet`` with the columns
described in :mod:`rlfleet.driver.data.recipes` (``data_source, prompt,
ability, reward_model, extra_info``; ``--mode rm`` adds ``chosen, rejected`` and
``--mode sft`` adds ``response``). A split the input does not have is written
with zero rows and the same schema (MATH-500 has only a test split), unless
``--test-fraction F`` asks for a seeded split of a single-split input.

A malformed record stops the run with ``file:line: field 'x': reason``. With
``--skip-invalid`` every such record is reported on stderr the same way, counted,
and left out; the summary says how many. Blank lines in JSON-lines files hold no
record and are passed over. Progress goes to stderr every ``--progress-every``
records. This module imports pyarrow and the standard library only.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import pyarrow as pa
import pyarrow.parquet as pq

from rlfleet.common import cli_args
from rlfleet.driver.data import recipes
from rlfleet.driver.data.sources import (
    SPLITS,
    InputError,
    Item,
    Location,
    RecordError,
    Split,
    iter_file,
    iter_hub,
    looks_like_hub_name,
    plan_splits,
)

DATASETS = (
    "gsm8k",
    "math",
    "hellaswag",
    "full_hh_rlhf",
    "arithmetic",
    "calculator",
    "apps",
    "taco",
)
#: Default hub configs (the dataset's own config name) for hub inputs.
_HUB_CONFIG = {"gsm8k": "main"}


class PreprocessError(ValueError):
    """A record or input that stops the run; the message names where and why."""


@dataclass
class Report:
    """What one run did: rows written and records skipped, per split."""

    rows: dict[str, int] = field(default_factory=lambda: {"train": 0, "test": 0})
    skipped: list[str] = field(default_factory=list)
    paths: dict[str, Path] = field(default_factory=dict)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dataset", choices=DATASETS, help="which dataset layout to convert")
    parser.add_argument(
        "--input",
        help="file or folder (jsonl, jsonl.gz, json, parquet), or a hub dataset name "
        "(owner/name) when no such path exists; not used by arithmetic and calculator",
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for train/test.parquet")
    parser.add_argument(
        "--mode",
        choices=("rl", "rm", "sft"),
        default="rl",
        help="full_hh_rlhf only: rl prompts, rm (chosen, rejected) or sft (response)",
    )
    parser.add_argument(
        "--skip-invalid",
        action="store_true",
        help="report and skip malformed records instead of stopping at the first",
    )
    parser.add_argument(
        "--test-fraction",
        type=cli_args.fraction,
        default=None,
        help="for an input with one split only: hold out this seeded fraction as test",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of --test-fraction, arithmetic, calculator"
    )
    parser.add_argument(
        "--n",
        type=cli_args.positive_int,
        default=2000,
        help="arithmetic, calculator: train problems",
    )
    parser.add_argument(
        "--n-test",
        type=cli_args.nonnegative_int,
        default=200,
        help="arithmetic, calculator: test problems",
    )
    parser.add_argument(
        "--digits",
        type=cli_args.positive_int,
        default=2,
        help="arithmetic, calculator: digits per operand",
    )
    parser.add_argument("--ops", default="+-", help="arithmetic: operations, a subset of '+-*'")
    parser.add_argument("--hub-config", default=None, help="hub inputs: the dataset config")
    parser.add_argument(
        "--progress-every",
        type=cli_args.positive_int,
        default=50_000,
        help="records between progress lines",
    )


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    try:
        report = preprocess(
            args.dataset,
            args.input,
            args.out,
            mode=args.mode,
            skip_invalid=args.skip_invalid,
            test_fraction=args.test_fraction,
            seed=args.seed,
            n=args.n,
            n_test=args.n_test,
            digits=args.digits,
            ops=args.ops,
            hub_config=args.hub_config,
            progress_every=args.progress_every,
        )
    except (PreprocessError, InputError, ValueError, OSError) as err:
        print(f"rlfleet preprocess: {err}", file=sys.stderr)
        return 2  # the input or the options: nothing was written
    elapsed = time.perf_counter() - start
    for split in SPLITS:
        print(f"wrote {report.paths[split]}: {report.rows[split]} rows")
    if report.skipped:
        print(
            f"rlfleet preprocess: skipped {len(report.skipped)} invalid records (listed above)",
            file=sys.stderr,
        )
    print(f"done in {elapsed:.1f}s")
    return 0


def preprocess(
    dataset: str,
    input_path: str | os.PathLike[str] | None,
    out: str | os.PathLike[str],
    *,
    mode: str = "rl",
    skip_invalid: bool = False,
    test_fraction: float | None = None,
    seed: int = 0,
    n: int = 2000,
    n_test: int = 200,
    digits: int = 2,
    ops: str = "+-",
    hub_config: str | None = None,
    progress_every: int = 50_000,
    stderr: TextIO | None = None,
) -> Report:
    """Convert one dataset and write ``out/train.parquet`` and ``out/test.parquet``.

    Raises:
        PreprocessError: a malformed record (without ``skip_invalid``), naming
            ``file:line`` and the field.
        InputError: a missing input, an unknown format, or no data files.
        ValueError: inconsistent options.
    """
    err = stderr if stderr is not None else sys.stderr
    out_dir = Path(out)
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")
    if mode not in ("rl", "rm", "sft"):
        raise ValueError(f"--mode must be rl, rm or sft, got {mode!r}")
    if mode != "rl" and dataset != "full_hh_rlhf":
        raise ValueError(f"--mode {mode} applies to full_hh_rlhf only, not {dataset}")
    if test_fraction is not None and not 0.0 < test_fraction < 1.0:
        raise ValueError(f"--test-fraction must be in (0, 1), got {test_fraction}")
    report = Report()

    if dataset == "arithmetic":
        if input_path is not None:
            raise ValueError("arithmetic is generated: it takes no --input")
        rows = recipes.arithmetic(n, n_test, seed=seed, digits=digits, ops=ops)
        for split in SPLITS:
            report.paths[split] = _write(rows[split], recipes.ARITHMETIC_SCHEMA, out_dir, split)
            report.rows[split] = len(rows[split])
        return report

    if dataset == "calculator":
        if input_path is not None:
            raise ValueError("calculator is generated: it takes no --input")
        rows = recipes.calculator(n, n_test, seed=seed, digits=digits)
        for split in SPLITS:
            report.paths[split] = _write(rows[split], recipes.CALCULATOR_SCHEMA, out_dir, split)
            report.rows[split] = len(rows[split])
        return report

    if input_path is None:
        raise ValueError(f"{dataset} needs --input (a file, a folder or a hub dataset name)")
    convert, schema = recipes.converter(dataset, mode)
    items = _read_items(
        dataset, str(input_path), hub_config=hub_config, progress_every=progress_every, err=err
    )
    if test_fraction is not None:
        items = _split_off(items, test_fraction, seed)

    for split in SPLITS:
        out_rows: list[dict[str, Any]] = []
        for loc, rec in items[split]:
            try:
                if isinstance(rec, RecordError):
                    raise rec
                out_rows.append(convert(rec, split, len(out_rows)))
            except RecordError as e:
                message = f"{loc}: {e}"
                if not skip_invalid:
                    raise PreprocessError(
                        f"{message} (use --skip-invalid to skip such records)"
                    ) from e
                report.skipped.append(message)
                print(f"skipped {message}", file=err)
        report.paths[split] = _write(out_rows, schema, out_dir, split)
        report.rows[split] = len(out_rows)
    return report


def _read_items(
    dataset: str, input_path: str, *, hub_config: str | None, progress_every: int, err: TextIO
) -> dict[Split, list[Item]]:
    prefer_val = dataset == "hellaswag"  # its upstream test split has no labels
    path = Path(input_path).expanduser()
    sources: dict[Split, Iterator[Item]]
    if not path.exists() and looks_like_hub_name(input_path):
        config = hub_config or _HUB_CONFIG.get(dataset)
        sources = iter_hub(input_path, config=config, prefer_val=prefer_val)
    else:
        plan = plan_splits(path, prefer_val=prefer_val)
        for p, why in plan.ignored:
            print(f"ignored {p}: {why}", file=err)
        sources = {split: _chain(plan.files[split]) for split in SPLITS}
    items: dict[Split, list[Item]] = {"train": [], "test": []}
    count = 0
    for split in SPLITS:
        for item in sources[split]:
            items[split].append(item)
            count += 1
            if progress_every > 0 and count % progress_every == 0:
                print(f"{dataset}: read {count} records", file=err)
    return items


def _chain(files: list[Path]) -> Iterator[Item]:
    for f in files:
        yield from iter_file(f)


def _split_off(
    items: dict[Split, list[Item]], fraction: float, seed: int
) -> dict[Split, list[Item]]:
    """Split the one non-empty split into train and test (seeded, order kept)."""
    present = [s for s in SPLITS if items[s]]
    if len(present) != 1:
        raise ValueError(
            f"--test-fraction applies to an input with exactly one split; this one has "
            f"{', '.join(f'{s}: {len(items[s])}' for s in SPLITS)} records"
        )
    pool = items[present[0]]
    n_test = max(1, round(fraction * len(pool))) if len(pool) > 1 else 0
    test_ids = set(random.Random(seed).sample(range(len(pool)), n_test))
    return {
        "train": [it for i, it in enumerate(pool) if i not in test_ids],
        "test": [it for i, it in enumerate(pool) if i in test_ids],
    }


def _write(rows: list[dict[str, Any]], schema: pa.Schema, out_dir: Path, split: str) -> Path:
    """Write one split atomically (a temporary file, then a rename)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{split}.parquet"
    tmp = out_dir / f".{split}.parquet.tmp"
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return path


__all__ = [
    "DATASETS",
    "Location",
    "PreprocessError",
    "Report",
    "add_arguments",
    "preprocess",
    "run",
]
