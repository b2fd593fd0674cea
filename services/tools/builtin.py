"""The built-in tools: ``calculator`` and ``python``.

``calculator`` evaluates arithmetic without ``eval``: the expression is parsed with
:mod:`ast` and only numbers (``int``, ``float``), ``+ - * / // % **``, unary ``-``
and ``+`` and parentheses are allowed; anything else (names, calls, attributes,
strings, comparisons) is refused. Sizes are bounded: the expression's length, its
number of operators, every intermediate integer's bits (a power is refused *before*
it is computed when its result would be too large), and floats must stay finite.

``python`` runs the model's code in :mod:`rlfleet.common.sandbox` (one process per
call: no network, read-only file system but a fresh ``/tmp``, CPU, memory, process
and output limits, killed at the call's time-out) and answers its stdout; a program
that fails answers its stderr (the traceback) as the error, so the model reads what
went wrong.
"""

from __future__ import annotations

import ast
import logging
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rlfleet.common.sandbox import IsolationReport, Sandbox, SandboxLimits
from rlfleet.tools.core import Tool, ToolCore, ToolError, ToolLimits, ToolSpec

__all__ = [
    "BUILTIN_TOOLS",
    "Calculator",
    "PythonTool",
    "builtin_tool",
    "evaluate",
    "tool_core_from_config",
]

logger = logging.getLogger(__name__)

BUILTIN_TOOLS = ("calculator", "python")


# --------------------------------------------------------------------- calculator

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_SYMBOL = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
}


def evaluate(
    expression: str, *, max_chars: int = 256, max_ops: int = 64, max_bits: int = 1024
) -> str:
    """The value of an arithmetic ``expression``, as text.

    Integers stay exact; a float result is written with up to 12 significant digits
    (``7 / 2`` -> ``3.5``, ``6 / 2`` -> ``3``).

    Raises:
        ToolError: not arithmetic (says which part), too long, too many operators,
            a number over ``max_bits`` bits, division by zero, a non-finite result.
    """
    if len(expression) > max_chars:
        raise ToolError(f"the expression has {len(expression)} characters; at most {max_chars}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ToolError(f"not an arithmetic expression: {getattr(e, 'msg', e)}") from e
    ops = sum(isinstance(n, ast.BinOp | ast.UnaryOp) for n in ast.walk(tree))
    if ops > max_ops:
        raise ToolError(f"the expression has {ops} operators; at most {max_ops}")
    value = _eval(tree.body, max_bits)
    return _format(value)


def _check(value: Any, max_bits: int) -> Any:
    if isinstance(value, int) and value.bit_length() > max_bits:
        raise ToolError(f"a number in the calculation exceeds {max_bits} bits")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("the result is not a finite number")
    return value


def _eval(node: ast.expr, max_bits: int) -> int | float:
    if isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ToolError(f"only numbers are allowed, got {v!r}"[:120])
        return _check(v, max_bits)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check(_UNARY[type(node.op)](_eval(node.operand, max_bits)), max_bits)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left = _eval(node.left, max_bits)
        right = _eval(node.right, max_bits)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right, max_bits)
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError as e:
            raise ToolError("division by zero") from e
        except OverflowError as e:
            raise ToolError(f"{_SYMBOL[type(node.op)]}: the result is too large") from e
        if isinstance(value, complex):  # (-8) ** 0.5
            raise ToolError("the result is not a real number")
        return _check(value, max_bits)
    what = type(node).__name__
    if isinstance(node, ast.BinOp | ast.UnaryOp):
        what = type(node.op).__name__
    raise ToolError(f"{what} is not allowed: only numbers, + - * / // % ** and parentheses")


def _check_power(base: int | float, exponent: int | float, max_bits: int) -> None:
    """Refuse a power whose result would be too large, before computing it."""
    if isinstance(base, int) and isinstance(exponent, int):
        if exponent < 0 or abs(base) < 2:
            return
        if (abs(base).bit_length() - 1) * exponent > max_bits:
            raise ToolError(f"**: the result would exceed {max_bits} bits")
        return
    magnitude = abs(float(base))
    if magnitude > 1 and float(exponent) * math.log2(magnitude) > 1024:
        raise ToolError("**: the result is too large")


def _format(value: int | float) -> str:
    if isinstance(value, int):
        return str(value)
    text = format(value, ".12g")
    return "0" if text == "-0" else text


@dataclass(frozen=True)
class Calculator:
    """The ``calculator`` tool: ``{"expression": "12 * (3 + 4)"}`` -> ``"84"``."""

    max_chars: int = 256
    max_ops: int = 64
    max_bits: int = 1024

    @property
    def spec(self) -> ToolSpec:
        return ToolSpec(
            "calculator",
            "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
            {
                "type": "object",
                "properties": {
                    "expression": {
                        "type": "string",
                        "description": "the expression, e.g. 12 * (3 + 4)",
                    }
                },
                "required": ["expression"],
                "additionalProperties": False,
            },
        )

    def call(self, arguments: Mapping[str, Any], timeout_s: float) -> str:
        return evaluate(
            str(arguments["expression"]),
            max_chars=self.max_chars,
            max_ops=self.max_ops,
            max_bits=self.max_bits,
        )


# ------------------------------------------------------------------------ python


class PythonTool:
    """The ``python`` tool: ``{"code": "print(2 ** 10)"}`` -> ``"1024\\n"``.

    Args:
        sandbox: where the code runs; its limits bound every call (the wall-clock
            limit is the smaller of the sandbox's and the call's time-out).
    """

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox

    @property
    def isolation(self) -> IsolationReport:
        return self.sandbox.report

    @property
    def spec(self) -> ToolSpec:
        return ToolSpec(
            "python",
            "Run a Python 3 program and get what it prints (stdout). No network; only "
            "/tmp is writable.",
            {
                "type": "object",
                "properties": {
                    "code": {"type": "string", "description": "the program"},
                },
                "required": ["code"],
                "additionalProperties": False,
            },
        )

    def call(self, arguments: Mapping[str, Any], timeout_s: float) -> str:
        code = str(arguments["code"])
        lim = self.sandbox.limits
        limits = replace(lim, timeout_s=min(lim.timeout_s, timeout_s))
        result = self.sandbox.run_python(
            ["main.py"], files={"main.py": code.encode("utf-8", "replace")}, limits=limits
        )
        out = result.stdout.decode("utf-8", "replace")
        if result.setup_error:
            raise RuntimeError(f"the sandbox could not start the program: {result.setup_error}")
        if result.timed_out:
            raise ToolError(f"timed out after {limits.timeout_s:g}s" + _partial(out))
        if result.output_truncated:
            raise ToolError(
                f"the program wrote more than {limits.max_output_bytes} bytes" + _partial(out)
            )
        if result.exit_code != 0:
            err = result.stderr.decode("utf-8", "replace").strip()
            tail = err[-2000:] if err else f"exit code {result.exit_code}"
            raise ToolError(tail + _partial(out))
        return out


def _partial(stdout: str) -> str:
    return f"\nstdout before that:\n{stdout[-2000:]}" if stdout else ""


def builtin_tool(
    name: str,
    *,
    sandbox: Sandbox | None = None,
    sandbox_limits: SandboxLimits | None = None,
    calculator: Calculator | None = None,
) -> Tool:
    """The built-in tool ``name`` (:data:`BUILTIN_TOOLS`).

    ``python`` runs in ``sandbox``, else in a new one with ``sandbox_limits`` and the
    best isolation that works here (:func:`rlfleet.common.sandbox.probe`; raises
    ``SandboxUnavailable`` when none does).
    """
    if name == "calculator":
        return calculator or Calculator()
    if name == "python":
        box = sandbox or Sandbox(sandbox_limits or SandboxLimits(timeout_s=10.0, cpu_time_s=10.0))
        logger.info("python tool: sandbox isolation %s", box.report.describe())
        return PythonTool(box)
    raise ValueError(f"no built-in tool {name!r}; the built-ins are {', '.join(BUILTIN_TOOLS)}")


def tool_core_from_config(config: Any, names: Sequence[str] | None = None) -> ToolCore:
    """A :class:`ToolCore` with the built-in tools ``names`` (None: ``config.builtin``)
    and the limits of ``config`` (a :class:`rlfleet.common.config.ToolsConfig`).

    Raises:
        SandboxUnavailable: ``python`` is asked for and no isolation works here (and
            ``tools.python.allow_unisolated`` is off).
    """
    from rlfleet.common.sandbox import probe

    py = config.python
    sandbox: Sandbox | None = None
    wanted = list(config.builtin if names is None else names)
    if "python" in wanted:
        limits = SandboxLimits(
            timeout_s=config.max_timeout_s,
            cpu_time_s=py.cpu_time_s,
            memory_mb=py.memory_mb,
            max_output_bytes=py.max_output_bytes,
            max_processes=py.max_processes,
            tmp_mb=py.tmp_mb,
        )
        report = probe(
            isolation=py.isolation, python=py.python, allow_unisolated=py.allow_unisolated
        )
        sandbox = Sandbox(limits, report=report, setting="tools.python")
    calc = Calculator(
        max_chars=config.calculator.max_chars,
        max_ops=config.calculator.max_ops,
        max_bits=config.calculator.max_bits,
    )
    tools = [builtin_tool(n, sandbox=sandbox, calculator=calc) for n in dict.fromkeys(wanted)]
    limits = ToolLimits(
        default_timeout_s=config.default_timeout_s,
        max_timeout_s=config.max_timeout_s,
        max_concurrent_calls=config.max_concurrent_calls,
        max_arguments_bytes=config.max_arguments_bytes,
        max_content_bytes=config.max_content_bytes,
    )
    return ToolCore(tools, limits)
