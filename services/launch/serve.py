"""`rlfleet serve <service> [options]`: run one service in the foreground.

Each service module provides `add_serve_arguments(parser)` and `serve_main(args) -> int`
and keeps its heavy imports (torch, transformers) inside `serve_main`. Only the chosen
service's module is imported, so `rlfleet serve reward` runs in a reward-only install
(no torch, no pyarrow).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any

# service -> (module, help)
SERVICES: dict[str, tuple[str, str]] = {
    "scheduler": (
        "rlfleet.scheduler.server",
        "registry, placement, Prometheus /sd (SchedulerService)",
    ),
    "reward": ("rlfleet.reward.server", "rule and model rewards (torch-free for rules)"),
    "rollout": ("rlfleet.rollout.server", "generation replica (HF or vLLM engine)"),
    "tools": ("rlfleet.tools.server", "tools for multi-turn rollouts (calculator, python)"),
    "trainer": (
        "rlfleet.trainer.server",
        "actor / critic / reference (FSDP2; torchrun for N ranks)",
    ),
}


def _attr(module: str, name: str) -> Callable[..., Any]:
    fn: Callable[..., Any] = getattr(importlib.import_module(module), name)
    return fn


def add_arguments(parser: argparse.ArgumentParser) -> None:
    lines = "\n".join(f"  {name:<10} {help_text}" for name, (_, help_text) in SERVICES.items())
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = f"services:\n{lines}\n\n`rlfleet serve SERVICE --help` lists its options."
    parser.add_argument("service", choices=sorted(SERVICES), metavar="SERVICE")
    parser.add_argument("options", nargs=argparse.REMAINDER, help="the service's own options")


def run(args: argparse.Namespace) -> int:
    module, help_text = SERVICES[args.service]
    parser = argparse.ArgumentParser(prog=f"rlfleet serve {args.service}", description=help_text)
    _attr(module, "add_serve_arguments")(parser)
    code: int = _attr(module, "serve_main")(parser.parse_args(args.options))
    return code
