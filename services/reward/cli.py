"""`rlfleet reward ...`: talk to a running reward service.

    rlfleet reward score --addr HOST:PORT --input FILE.jsonl|FILE.parquet [--out FILE]
    rlfleet reward info  --addr HOST:PORT

``score`` reads rows (jsonl: one JSON object per line; parquet: verl's schema
plus a response column), sends them in batches of ``--batch-size`` and writes one
JSON object per sample, in input order, to ``--out`` (default: stdout)::

    {"index": 0, "id": "", "data_source": "openai/gsm8k", "score": 1.0,
     "scorer": "gsm8k", "details": {"extracted": "18", ...}, "error": "", "timed_out": false}

Input row keys: ``data_source``; ``response`` (or ``solution_str``, or
``responses`` with one element); ``ground_truth`` (or ``reward_model.ground_truth``
as in verl's parquet); optional ``prompt`` (text or chat list), ``extra_info``, ``id``.
A summary (count, mean score, errors) goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from rlfleet.common import cli_args
from rlfleet.common.errors import RlfleetError

__all__ = ["InputError", "add_arguments", "info_main", "main", "read_rows", "run", "score_main"]


class InputError(ValueError):
    """A bad local input (a file, a flag's value): one line, exit status 2."""


def read_rows(path: str | Path) -> Iterator[dict[str, Any]]:
    """Rows of a ``.jsonl`` (``-`` for stdin) or ``.parquet`` file.

    Raises:
        InputError: the file cannot be read, or a line is not a JSON object.
    """
    p = str(path)
    if p.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise InputError("reading parquet needs pyarrow: pip install pyarrow") from exc
        try:
            yield from pq.read_table(p).to_pylist()
        except (OSError, ValueError) as exc:  # pyarrow's errors derive from these
            raise InputError(f"--input {p}: cannot read it: {exc}") from exc
        return
    handle: IO[str]
    with contextlib.ExitStack() as stack:
        try:
            handle = sys.stdin if p == "-" else stack.enter_context(open(p, encoding="utf-8"))
        except OSError as exc:
            raise InputError(f"--input {p}: cannot read it: {exc.strerror or exc}") from exc
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{p}:{number}: not JSON: {exc}") from exc
            if not isinstance(row, dict):
                raise InputError(f"{p}:{number}: expected a JSON object, got {type(row).__name__}")
            yield row


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--addr", required=True, type=cli_args.address, help="HOST:PORT of the reward service"
    )
    parser.add_argument("--auth-token-env", metavar="VAR", help="bearer token from $VAR")
    parser.add_argument("--tls-ca", help="CA to verify the server (PEM); enables TLS")
    parser.add_argument(
        "--timeout-s", type=cli_args.positive_float, default=120.0, help="per-call deadline"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``rlfleet reward`` and its sub-commands."""
    sub = parser.add_subparsers(dest="reward_command", metavar="SUBCOMMAND")
    score = sub.add_parser("score", help="score a jsonl / parquet file of responses")
    _common(score)
    score.add_argument("--input", required=True, help="FILE.jsonl, FILE.parquet or - (stdin)")
    score.add_argument("--out", default="-", help="output jsonl (default: stdout)")
    score.add_argument(
        "--batch-size", type=cli_args.positive_int, default=256, help="samples per request"
    )
    score.set_defaults(_reward_fn=score_main)
    info = sub.add_parser("info", help="print the service's scorers and data sources")
    _common(info)
    info.set_defaults(_reward_fn=info_main)
    parser.set_defaults(_reward_parser=parser)


def _client(args: argparse.Namespace) -> Any:
    from rlfleet.common.rpc import TLSConfig
    from rlfleet.reward.client import RemoteRewardClient

    token = None
    if args.auth_token_env:
        token = os.environ.get(args.auth_token_env)
        if not token:
            raise InputError(f"--auth-token-env: ${args.auth_token_env} is not set")
    tls = None
    if args.tls_ca:
        try:
            Path(args.tls_ca).read_bytes()
        except OSError as exc:
            raise InputError(f"--tls-ca {args.tls_ca}: cannot read it: {exc.strerror}") from exc
        tls = TLSConfig(ca=args.tls_ca)
    return RemoteRewardClient(args.addr, auth_token=token, tls=tls, timeout_s=args.timeout_s)


def score_main(args: argparse.Namespace) -> int:
    from rlfleet.reward.client import sample_from_row

    rows = list(read_rows(args.input))
    n_errors = 0
    total = 0.0
    count = 0
    with contextlib.ExitStack() as stack:
        try:
            out: IO[str] = (
                sys.stdout
                if args.out == "-"
                else stack.enter_context(open(args.out, "w", encoding="utf-8"))
            )
        except OSError as exc:
            raise InputError(f"--out {args.out}: cannot write it: {exc.strerror}") from exc
        client = stack.enter_context(contextlib.closing(_client(args)))
        for start in range(0, len(rows), args.batch_size):
            chunk = rows[start : start + args.batch_size]
            try:
                samples = [sample_from_row(r, start + i) for i, r in enumerate(chunk)]
                results = client.score(samples)
            except RlfleetError as exc:
                where = (
                    f" (sample {exc.sample_index + start})" if exc.sample_index is not None else ""
                )
                print(f"rlfleet reward score: {exc.status}: {exc}{where}", file=sys.stderr)
                return 2 if exc.status == "INVALID_ARGUMENT" else 1
            for sample, result in zip(samples, results, strict=True):
                record = {
                    "index": start + result.index,
                    "id": result.id,
                    "data_source": sample.data_source,
                    "score": result.score,
                    "scorer": result.scorer,
                    "details": result.details,
                    "error": result.error,
                    "timed_out": result.timed_out,
                }
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
                total += result.score
                count += 1
                n_errors += bool(result.error)
        out.flush()
    mean = total / count if count else 0.0
    print(f"scored {count} samples: mean score {mean:.4f}, {n_errors} errors", file=sys.stderr)
    return 0


def info_main(args: argparse.Namespace) -> int:
    with contextlib.closing(_client(args)) as client:
        try:
            info = client.info()
        except RlfleetError as exc:
            print(f"rlfleet reward info: {exc.status}: {exc}", file=sys.stderr)
            return 1
    print(
        json.dumps(
            {
                "scorers": list(info.scorers),
                "data_sources": info.data_sources,
                "default_scorer": info.default_scorer,
                "reward_model": info.reward_model,
                "max_batch_size": info.max_batch_size,
                "sample_timeout_s": info.sample_timeout_s,
            },
            indent=2,
        )
    )
    return 0


def run(args: argparse.Namespace) -> int:
    fn = getattr(args, "_reward_fn", None)
    if fn is None:
        args._reward_parser.print_help()
        return 2
    try:
        code: int = fn(args)
    except InputError as exc:
        print(f"rlfleet reward {args.reward_command}: {exc}", file=sys.stderr)
        return 2
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlfleet reward", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
