"""`rlfleet serve <service>`: run one service in the foreground.

Each service module provides `add_serve_arguments(parser)` and `serve_main(args) -> int`
and keeps its heavy imports (torch, transformers) inside `serve_main`.
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
    "trainer": (
        "rlfleet.trainer.server",
        "actor / critic / reference (FSDP2; torchrun for N ranks)",
    ),
}


def _attr(module: str, name: str) -> Callable[..., Any]:
    fn: Callable[..., Any] = getattr(importlib.import_module(module), name)
    return fn


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="service", metavar="SERVICE", required=True)
    for name, (module, help_text) in SERVICES.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(_serve_module=module)
        _attr(module, "add_serve_arguments")(p)


def run(args: argparse.Namespace) -> int:
    code: int = _attr(args._serve_module, "serve_main")(args)
    return code
