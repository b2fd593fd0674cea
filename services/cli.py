"""The `rlfleet` command line: one entry point, one subcommand per job.

Each subcommand lives in the module that owns it and is imported only when it
runs, so `rlfleet --help` stays fast and a torch-free install can use the
subcommands that do not need torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence

# name -> (module, help). The module defines `add_arguments(parser)` and `run(args) -> int`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": (
        "rlfleet.launch.train",
        "train with PPO: start the services, run the driver, stop them",
    ),
    "demo": (
        "rlfleet.launch.demo",
        "the embedded demo: tiny model, arithmetic, warm start, PPO, GRPO",
    ),
    "init-model": ("rlfleet.common.tiny_model", "build a tiny Llama model and tokenizer offline"),
    "serve": (
        "rlfleet.launch.serve",
        "run one service (scheduler, reward, rollout, tools, trainer) in the foreground",
    ),
    "status": ("rlfleet.launch.cli", "show the cluster's services and training status"),
    "up": (
        "rlfleet.launch.cli",
        "start a local cluster that keeps running (see `rlfleet down`)",
    ),
    "down": ("rlfleet.launch.cli", "stop the cluster `rlfleet up` started"),
    "scale": (
        "rlfleet.launch.scale_cli",
        "ask a running cluster for N rollout replicas (its launcher adds or removes them)",
    ),
    "reward": ("rlfleet.reward.cli", "score files against a running reward service (score, info)"),
    "rollout": ("rlfleet.rollout.cli", "talk to a rollout replica (generate)"),
    "secrets": (
        "rlfleet.common.secrets_cli",
        "make or rotate a cluster's credential set, or its TLS certificates",
    ),
    "trace": (
        "rlfleet.launch.trace_cli",
        "where a step's time went: its spans, critical path and a timeline (HTML)",
    ),
    "export": (
        "rlfleet.trainer.export_cli",
        "write a run's checkpoint (the latest, or --step N) as a Hugging Face folder",
    ),
    "preprocess": (
        "rlfleet.driver.data.preprocess",
        "convert raw datasets (gsm8k, math, hellaswag, full_hh_rlhf, apps, taco, ...) or make "
        "arithmetic / calculator data, as verl parquet",
    ),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only `command`'s module is imported (all of them when None), so a
    slim install (say, reward only: no pyarrow, no torch) runs its own commands."""
    parser = argparse.ArgumentParser(prog="rlfleet", description=__doc__)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(_module=module)
        if name == command:
            _load(module, "add_arguments")(p)
    return parser


def _version() -> str:
    from rlfleet import __version__

    return f"rlfleet {__version__}"


def _load(module: str, attr: str) -> Callable[..., int]:
    fn: Callable[..., int] = getattr(importlib.import_module(module), attr)
    return fn


def _is_override(arg: str) -> bool:
    """``key.path=value`` (Hydra's ``+key=value`` and ``~key`` too), not a flag."""
    return not arg.startswith("-") and ("=" in arg or arg.startswith("~"))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in SUBCOMMANDS else None)
    args, extra = parser.parse_known_args(argv)
    # Overrides anywhere on the line, as Hydra takes them (`train --config X a=1
    # --in-process b=2`): what argparse left over after a flag joins the rest.
    if extra and isinstance(getattr(args, "overrides", None), list):
        overrides = [a for a in extra if _is_override(a)]
        args.overrides.extend(overrides)
        extra = [a for a in extra if not _is_override(a)]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 2
    # Client commands (status, rollout generate, reward score, train against running
    # services) present the credentials their environment names; `serve` replaces
    # this with the service's own (or refuses to start without any).
    from rlfleet.common.auth import CredentialError
    from rlfleet.common.rpc import client_security_from_env, set_security

    try:
        set_security(client_security_from_env())
    except CredentialError as e:
        print(f"rlfleet {args.command}: {e}", file=sys.stderr)
        return 2
    from rlfleet.launch.cli import StateFileError

    try:
        return _load(args._module, "run")(args)
    except StateFileError as e:  # status, scale, up, down on a broken state file
        print(f"rlfleet {args.command}: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`rlfleet reward score ... | head`): stop quietly, as
        # Unix tools do; stdout is pointed at /dev/null so the flush at exit is quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
