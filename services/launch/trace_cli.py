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

__all__ = [
    "Attempt",
    "Span",
    "add_arguments",
    "critical_path",
    "load_spans",
    "prompt_path",
    "run",
    "step_trace",
]

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
        if not path.is_file():
            continue
        # A line that is not UTF-8 is not a span (skipped below, as any other).
        with open(path, encoding="utf-8", errors="replace") as f:
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


@dataclass
class Attempt:
    """One generation of a prompt (a step redone after a fault generates it again)."""

    step: int
    root: str  # the trace's root span: "step" (synchronous) or "produce" (pipelined)
    start_ns: int
    parts: list[Span]  # its shards (an errored one: re-queued), reward calls, train


def prompt_path(spans: Iterable[Span], prompt: int) -> list[Attempt]:
    """Where dataset prompt ``prompt`` went, in time order: every ``generate`` call that
    carried it, with the shards that generated it (which replica, the weight versions,
    an error where the replica failed and the prompt was re-queued), the reward calls
    that scored it, and the ``train`` call and weight push of the step that trained it
    (that step's own trace: in pipelined runs, generation has a trace of its own)."""
    spans = list(spans)
    by_id = {s.span_id: s for s in spans}
    roots = {s.trace_id: s for s in spans if s.name in ("step", "produce") and not s.parent_id}
    steps: dict[int, list[Span]] = {}  # step -> its "step" root spans (one per attempt)
    for s in roots.values():
        if s.name == "step":
            steps.setdefault(int(s.attributes.get("step", 0)), []).append(s)
    gens = sorted((s for s in spans if s.name == "generate"), key=lambda s: s.start_ns)
    carrying = [g for g in gens if prompt in (g.attributes.get("prompts") or ())]
    out: list[Attempt] = []
    for k, gen in enumerate(carrying):
        place = gen.attributes["prompts"].index(prompt)
        root = roots.get(gen.trace_id)
        step = int(root.attributes.get("step", 0)) if root is not None else 0
        parts = [
            s
            for s in spans
            if s.name in ("generate.shard", "reward")
            and place in (s.attributes.get("prompt_indices") or ())
            and _under(s, gen, by_id)
        ]
        # The step attempts that trained this generation: a synchronous step its own
        # trace; a pipelined batch every attempt of its step that began after it was
        # generated and before the prompt was generated again (a batch kept across a
        # trainer's restart is trained by the attempt after the restart too).
        if root is not None and root.name == "step":
            trained = [root]
        else:
            again = carrying[k + 1].end_ns if k + 1 < len(carrying) else float("inf")
            trained = [r for r in steps.get(step, []) if gen.end_ns <= r.start_ns < again]
        ids = {r.trace_id for r in trained}
        parts += [s for s in spans if s.trace_id in ids and s.name in ("train", "weight_sync")]
        parts.sort(key=lambda s: s.start_ns)
        out.append(Attempt(step, root.name if root else "?", gen.start_ns, parts))
    return out


def _under(span: Span, ancestor: Span, by_id: dict[str, Span]) -> bool:
    seen = 0
    while span.parent_id and seen < 64:
        if span.parent_id == ancestor.span_id:
            return True
        parent = by_id.get(span.parent_id)
        if parent is None:
            return False
        span, seen = parent, seen + 1
    return False


def _prompt_report(run_dir: Path, prompt: int, as_json: bool) -> int:
    attempts = prompt_path(load_spans(run_dir), prompt)
    if not attempts:
        print(f"rlfleet trace: prompt {prompt} is in no traced step under "
              f"{run_dir / 'traces'}", file=sys.stderr)  # fmt: skip
        return 2
    if as_json:
        print(json.dumps([
            {"step": a.step, "root": a.root,
             "parts": [{"name": p.name, "service": p.service, "seconds": p.seconds,
                        "attributes": p.attributes} for p in a.parts]}
            for a in attempts
        ]))  # fmt: skip
        return 0
    origin = attempts[0].start_ns
    steps = sorted({a.step for a in attempts})
    print(f"prompt {prompt}: step(s) {steps}, generated {len(attempts)} time(s)")
    for a in attempts:
        print(f"step {a.step} ({a.root} trace) +{(a.start_ns - origin) / 1e9:.3f}s")
        for p in a.parts:
            extra = ""
            if p.name == "generate.shard":
                versions = p.attributes.get("versions") or []
                extra = f" weights v{','.join(map(str, versions))}" if versions else ""
                if "error" in p.attributes:
                    extra += " (re-queued)"
            print(f"  {p.label()}{extra}  +{(p.start_ns - origin) / 1e9:.3f}s  {p.seconds:.3f}s")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--run", required=True, help="the run directory (trainer.default_local_dir)"
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--step", type=int, help="the step to show")
    which.add_argument(
        "--prompt",
        type=int,
        help="a prompt's dataset index: every generation of it (replica, weights, "
        "re-queues), its scoring and the step that trained it",
    )
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
    if args.prompt is not None:
        return _prompt_report(run_dir, args.prompt, args.json)
    root = step_trace(load_spans(run_dir), args.step)
    if root is None:
        print(f"rlfleet trace: no trace of step {args.step} under {run_dir / 'traces'}",
              file=sys.stderr)  # fmt: skip
        return 2
    out = Path(args.out) if args.out else run_dir / "traces" / f"step-{args.step}.html"
    if out.suffix.lower() not in (".html", ".htm"):
        print(f"rlfleet trace: --out {out}: the timeline is an HTML page; give a .html path",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        out.write_text(_html(root, args.step), encoding="utf-8")
    except OSError as e:
        print(f"rlfleet trace: cannot write the timeline to {out}: {e.strerror or e}",
              file=sys.stderr)  # fmt: skip
        return 2
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
