"""``rlfleet rollout generate``: send prompts from a JSONL file to a rollout replica.

Rows of ``--prompts`` (one JSON object per line; an optional ``"id"`` is echoed):

* ``{"prompt": "text"}``: tokenized as is (no special tokens added);
* ``{"messages": [{"role": ..., "content": ...}, ...]}``: the tokenizer's chat
  template with the generation prompt;
* ``{"token_ids": [...]}``: sent unchanged.

The tokenizer is ``--tokenizer DIR``; by default the replica's model folder (from
``GetStatus``) when it exists on this machine. Rows of token ids need none; without
a tokenizer the replica decodes the text. Prints one JSON line per sample, in the
order samples finish.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rlfleet.common import cli_args
from rlfleet.common.errors import RlfleetError

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="rollout_command", metavar="COMMAND", required=True)
    gen = sub.add_parser("generate", help="generate for prompts in a JSONL file")
    gen.add_argument("--addr", required=True, type=cli_args.address, help="replica host:port")
    gen.add_argument("--prompts", type=Path, required=True, help="JSONL file ('-': stdin)")
    gen.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the replica's)")
    gen.add_argument("--n", type=cli_args.positive_int, default=1)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--max-tokens", type=cli_args.positive_int, default=32)
    gen.add_argument("--stop-token-ids", type=int, nargs="*", default=[])
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--no-logprobs", action="store_true")
    gen.add_argument("--timeout-s", type=cli_args.positive_float, default=600.0)


class _InputError(ValueError):
    """A bad local input: exit status 2."""


def _load_rows(path: Path) -> list[dict[str, Any]]:
    try:
        text = sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise _InputError(f"--prompts {path}: cannot read it: {e}") from e
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise _InputError(f"{path}:{n}: invalid JSON: {e}") from e
        if not isinstance(row, dict) or not ({"prompt", "messages", "token_ids"} & row.keys()):
            raise _InputError(f"{path}:{n}: expected an object with prompt, messages or token_ids")
        rows.append(row)
    if not rows:
        raise _InputError(f"{path}: no prompts")
    return rows


def _tokenize(rows: list[dict[str, Any]], tokenizer: Any, path: Path) -> list[list[int]]:
    out: list[list[int]] = []
    for n, row in enumerate(rows, 1):
        if "token_ids" in row:
            out.append([int(t) for t in row["token_ids"]])
            continue
        if tokenizer is None:
            raise ValueError(
                f"{path} row {n} needs a tokenizer: pass --tokenizer DIR (the replica's model "
                "folder is not on this machine)"
            )
        if "messages" in row:
            ids = tokenizer.apply_chat_template(
                row["messages"], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in transformers 5
                ids = ids["input_ids"]
            out.append([int(t) for t in ids])
        else:
            out.append([int(t) for t in tokenizer.encode(row["prompt"], add_special_tokens=False)])
    return out


def run(args: argparse.Namespace) -> int:
    from rlfleet.rollout.client import RemoteRolloutClient
    from rlfleet.rollout.engine import SamplingParams

    try:
        rows = _load_rows(args.prompts)
        with RemoteRolloutClient(args.addr, generate_timeout_s=args.timeout_s) as client:
            tok_dir = args.tokenizer
            if tok_dir is None:
                model = client.status().model
                tok_dir = model if model and Path(model).is_dir() else None
            tokenizer = None
            needs = any("token_ids" not in r for r in rows)
            if tok_dir is not None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
            elif needs:
                raise ValueError(
                    "prompts need a tokenizer: pass --tokenizer DIR (the replica's model "
                    "folder is not on this machine)"
                )
            prompts = _tokenize(rows, tokenizer, args.prompts)
            params = SamplingParams(
                n=args.n,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                max_tokens=args.max_tokens,
                stop_token_ids=tuple(args.stop_token_ids),
                seed=args.seed,
                logprobs=not args.no_logprobs,
            )
            ids = [str(r.get("id", i)) for i, r in enumerate(rows)]
            for s in client.generate(prompts, params, detokenize=tokenizer is None, prompt_ids=ids):
                text = s.text
                if tokenizer is not None:
                    text = tokenizer.decode(s.token_ids, skip_special_tokens=True)
                print(
                    json.dumps(
                        {
                            "id": ids[s.prompt_index],
                            "prompt_index": s.prompt_index,
                            "sample_index": s.sample_index,
                            "text": text,
                            "token_ids": s.token_ids,
                            "logprobs": s.logprobs,
                            "finish_reason": s.finish_reason.name.lower(),
                            "weight_version": s.weight_version,
                        }
                    ),
                    flush=True,
                )
    except (OSError, ValueError, RlfleetError) as e:
        print(f"rlfleet rollout generate: {e}", file=sys.stderr)
        bad_input = isinstance(e, _InputError) or getattr(e, "status", "") == "INVALID_ARGUMENT"
        return 2 if bad_input else 1
    return 0
