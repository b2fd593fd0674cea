"""`rlfleet trace --run DIR --step N`: where a step's time went.

Reads the spans the driver and the services wrote to ``DIR/traces/*.jsonl``
(:mod:`rlfleet.common.tracing`), takes step N's trace (the last attempt, when a step
was redone after a fault), and prints its tree with durations, the critical path (at
each level, the child that ended last: what the step waited for) and, per phase, the
slowest part (which replica's shard, which trainer phase). ``--out FILE.html`` (by
default ``DIR/traces/step-N.html``) gets a timeline a browser opens: one bar per span,
one row per process, no script and nothing fetched.

    rlfleet trace --run outputs/runs/rlfleet/tiny --step 3 [--out step3.html] [--json]
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Span", "add_arguments", "critical_path", "load_spans", "run", "step_trace"]

_MAX_LINE = 1 << 20  # a longer line is not a span this project wrote


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    children: list[Span] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    def label(self) -> str:
        a = self.attributes
        parts = [self.name]
        for key in ("replica", "step", "rows", "samples", "version"):
            if key in a and key != "step":
                parts.append(f"{key}={a[key]}")
        if "error" in a:
            parts.append(f"ERROR {str(a['error'])[:80]}")
        return " ".join(parts) + f" [{self.service}]"


def load_spans(run_dir: Path) -> list[Span]:
    """Every span under ``run_dir/traces`` (lines that are not spans are skipped)."""
    out = []
    for path in sorted((run_dir / "traces").glob("*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if len(line) > _MAX_LINE:
                    continue
                try:
                    d = json.loads(line)
                    out.append(
                        Span(
                            str(d["traceId"]),
                            str(d["spanId"]),
                            str(d.get("parentSpanId", "")),
                            str(d["name"]),
                            str(d.get("service", "")),
                            int(d["startTimeUnixNano"]),
                            int(d["endTimeUnixNano"]),
                            dict(d.get("attributes") or {}),
                        )
                    )
                except (ValueError, KeyError, TypeError):
                    continue
    return out


def step_trace(spans: Iterable[Span], step: int) -> Span | None:
    """The tree of step ``step``'s last attempt (its root span ``step``), or None."""
    spans = list(spans)
    roots = [s for s in spans if s.name == "step" and s.attributes.get("step") == step]
    if not roots:
        return None
    root = max(roots, key=lambda s: s.start_ns)
    by_id = {s.span_id: s for s in spans if s.trace_id == root.trace_id}
    for s in by_id.values():
        s.children = []
    for s in sorted(by_id.values(), key=lambda s: s.start_ns):
        parent = by_id.get(s.parent_id)
        if parent is not None and s is not root:
            parent.children.append(s)
    return root


def critical_path(span: Span, depth: int = 0) -> list[tuple[int, Span]]:
    """The spans the step waited for, with their depth: among a span's children, the
    one that ended last, then the one that ended last before it started, and so on
    back to the span's start (parts that ran alongside, such as the other replicas'
    shards, drop out); then the same inside each of those."""
    chain: list[Span] = []
    t = span.end_ns
    for child in sorted(span.children, key=lambda s: s.end_ns, reverse=True):
        if child.end_ns <= t:
            chain.append(child)
            t = child.start_ns
    out: list[tuple[int, Span]] = []
    for child in reversed(chain):
        out.append((depth, child))
        out.extend(critical_path(child, depth + 1))
    return out


def _tree_lines(span: Span, origin: int, depth: int = 0) -> list[str]:
    start = (span.start_ns - origin) / 1e9
    lines = [f"{'  ' * depth}{span.label()}  +{start:.3f}s  {span.seconds:.3f}s"]
    for child in span.children:
        lines.extend(_tree_lines(child, origin, depth + 1))
    return lines


def _slowest(root: Span) -> list[str]:
    """Per phase with several parts (shards, trainer phases): the slowest part."""
    out = []

    def walk(span: Span) -> None:
        if len(span.children) > 1:
            worst = max(span.children, key=lambda s: s.seconds)
            out.append(f"{span.name}: slowest part {worst.label()} {worst.seconds:.3f}s")
        for c in span.children:
            walk(c)

    walk(root)
    return out


def _html(root: Span, step: int) -> str:
    spans: list[tuple[Span, int]] = []

    def walk(span: Span, depth: int) -> None:
        spans.append((span, depth))
        for c in span.children:
            walk(c, depth + 1)

    walk(root, 0)
    total = max(1, root.end_ns - root.start_ns)
    width, row_h, left = 1000, 22, 360
    rows = []
    for i, (s, depth) in enumerate(spans):
        x = left + (s.start_ns - root.start_ns) / total * width
        w = max(1.0, (s.end_ns - s.start_ns) / total * width)
        y = 10 + i * row_h
        color = "#d9534f" if "error" in s.attributes else ("#5b8def" if depth % 2 else "#3fb37f")
        title = html.escape(f"{s.label()} {s.seconds:.3f}s {json.dumps(s.attributes)[:400]}")
        name = html.escape(("  " * depth + s.label())[:60])
        rows.append(
            f'<text x="4" y="{y + 15}" font-size="12" xml:space="preserve">{name}</text>'
            f'<rect x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="{row_h - 6}" '
            f'fill="{color}"><title>{title}</title></rect>'
            f'<text x="{x + w + 4:.1f}" y="{y + 15}" font-size="11">{s.seconds:.3f}s</text>'
        )
    height = 20 + len(spans) * row_h
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>rlfleet step {step}</title></head><body style='font-family:sans-serif'>"
        f"<h3>step {step}: {root.seconds:.3f}s</h3>"
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 120}" '
        f'height="{height}">' + "".join(rows) + "</svg></body></html>\n"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--run", required=True, help="the run directory (trainer.default_local_dir)"
    )
    parser.add_argument("--step", type=int, required=True, help="the step to show")
    parser.add_argument(
        "--out", default=None, help="timeline HTML (default: RUN/traces/step-N.html)"
    )
    parser.add_argument("--json", action="store_true", help="print the tree as JSON instead")


def _as_json(span: Span) -> dict[str, Any]:
    return {
        "name": span.name,
        "service": span.service,
        "seconds": span.seconds,
        "attributes": span.attributes,
        "children": [_as_json(c) for c in span.children],
    }


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run)
    if not (run_dir / "traces").is_dir():
        print(f"rlfleet trace: no traces under {run_dir} (trainer.trace off, or not a run "
              "directory)", file=sys.stderr)  # fmt: skip
        return 2
    root = step_trace(load_spans(run_dir), args.step)
    if root is None:
        print(f"rlfleet trace: no trace of step {args.step} under {run_dir / 'traces'}",
              file=sys.stderr)  # fmt: skip
        return 2
    out = Path(args.out) if args.out else run_dir / "traces" / f"step-{args.step}.html"
    out.write_text(_html(root, args.step), encoding="utf-8")
    if args.json:
        print(json.dumps(_as_json(root)))
        return 0
    print(f"step {args.step}: {root.seconds:.3f}s, {len(root.attributes.get('prompts', []))} "
          f"prompts, {root.attributes.get('samples', '?')} samples")  # fmt: skip
    print("\n".join(_tree_lines(root, root.start_ns)))
    print("critical path:")
    for depth, s in critical_path(root):
        print(f"  {'  ' * depth}{s.label()} {s.seconds:.3f}s")
    for line in _slowest(root):
        print(line)
    print(f"timeline: {out}")
    return 0
