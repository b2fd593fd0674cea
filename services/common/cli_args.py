"""Argument types for every command line: a bad value is one argparse error naming
the flag and the value (exit status 2), never a traceback from deep inside a service.

    parser.add_argument("--port", type=cli_args.port, default=0)
"""

from __future__ import annotations

import argparse
import logging
import math

__all__ = [
    "add_override_argument",
    "address",
    "fraction",
    "log_level",
    "nonnegative_float",
    "nonnegative_int",
    "port",
    "port_or_off",
    "positive_float",
    "positive_int",
]

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite (got {text})")
    return value


def port(text: str) -> int:
    """A TCP port, 0-65535 (0: any free port)."""
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port, 0-65535 (got {value})")
    return value


def port_or_off(text: str) -> int:
    """A TCP port, or -1 for off."""
    value = _int(text)
    if not -1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port, 0-65535, or -1 for off (got {value})")
    return value


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {value})")
    return value


def nonnegative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (got {value})")
    return value


def positive_float(text: str) -> float:
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (got {text})")
    return value


def nonnegative_float(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (got {text})")
    return value


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = _float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (got {text})")
    return value


def log_level(text: str) -> str:
    """A Python log level by name, any case: the name in capitals."""
    name = text.upper()
    if name not in LOG_LEVELS or not isinstance(getattr(logging, name, None), int):
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)} (got {text!r})")
    return name


def address(text: str) -> str:
    """``host:port`` (``[v6]:port`` too), port 1-65535."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host.strip("[]") or not port_text.isdigit():
        raise argparse.ArgumentTypeError(f"must be host:port (got {text!r})")
    if not 1 <= int(port_text) <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 1-65535 (got {text!r})")
    return text


def add_override_argument(parser: argparse.ArgumentParser, example: str = "") -> None:
    """``-o/--override KEY=VALUE`` (repeatable), as every service takes its config's
    dotted overrides; ``args.override`` is their list."""
    parser.add_argument(
        "-o",
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"dotted config override{f', e.g. {example}' if example else ''} (repeatable)",
    )
