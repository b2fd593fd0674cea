"""Tools: call throughput through the tools service, and rollout tokens/s with tools.

Prints one JSON object:

* ``calculator``: calls/s of ``--clients`` threads calling the ``calculator`` through
  the tools service (``rlfleet serve tools`` as a process, gRPC on loopback), against
  the same calls made in this process on a :class:`ToolCore` (one thread: the
  ceiling without the service); ``ratio`` = service / in-process.
* ``python``: the same for the sandboxed ``python`` tool (one sandbox process per
  call), against the sandbox run directly with as many threads; each call prints a
  number.
* ``rollout``: tokens/s of a rollout replica (HF engine, the tiny model taught to
  call the calculator) on the same prompts, single-turn (no tools) and multi-turn
  with the built-in calculator; ``model_tokens_per_s`` counts the tokens the model
  generated (what the engine did), ``tokens_per_s`` all response tokens (tool turns
  included); ``ratio`` = multi-turn model tokens/s / single-turn tokens/s: the cost
  of the rounds, the tool calls and the longer contexts.

    python bench/tools.py [--seconds 3] [--clients 4] [--prompts 32] [--n 2]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

CALC_ARGS = json.dumps({"expression": "123456 * 789 + 42 // 5"})
PY_ARGS = json.dumps({"code": "print(sum(range(1000)))"})


def _rate(fn: Any, seconds: float, threads: int) -> float:
    """Calls/s of ``fn`` run in a loop on ``threads`` threads for ``seconds``."""
    stop = time.perf_counter() + seconds
    counts = [0] * threads

    def loop(i: int) -> None:
        while time.perf_counter() < stop:
            fn()
            counts[i] += 1

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as ex:
        list(ex.map(loop, range(threads)))
    return sum(counts) / (time.perf_counter() - t0)


def start_tools_service(tmp: Path) -> tuple[subprocess.Popen[str], str]:
    config = tmp / "tools.yaml"
    config.write_text("tools:\n  builtin: [calculator, python]\n  max_concurrent_calls: 32\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlfleet.tools.server", "--config", str(config), "--insecure",
         "--port", "0", "--log-level", "WARNING"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise RuntimeError("the tools service did not start")
    return proc, json.loads(line)["address"]


def bench_tools(seconds: float, clients: int) -> dict[str, Any]:
    from rlfleet.common.rpc import Security, using_security
    from rlfleet.common.sandbox import Sandbox, SandboxLimits
    from rlfleet.tools.builtin import Calculator, PythonTool
    from rlfleet.tools.client import RemoteToolClient
    from rlfleet.tools.core import ToolCore

    out: dict[str, Any] = {}
    sandbox = Sandbox(SandboxLimits(timeout_s=10, cpu_time_s=10))
    core = ToolCore([Calculator(), PythonTool(sandbox)])
    in_calc = _rate(lambda: core.call("calculator", CALC_ARGS), seconds, 1)
    in_py = _rate(
        lambda: sandbox.run_python(["main.py"], files={"main.py": b"print(sum(range(1000)))"}),
        seconds,
        clients,
    )
    core.close()
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = start_tools_service(Path(tmp))
        try:
            with using_security(Security(credentials=None, insecure=True)):
                client = RemoteToolClient(address)
                client.list_tools()
                svc_calc = _rate(
                    lambda: client.call("calculator", CALC_ARGS, timeout_s=10), seconds, clients
                )
                svc_py = _rate(
                    lambda: client.call("python", PY_ARGS, timeout_s=10), seconds, clients
                )
                client.close()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    out["calculator"] = {
        "in_process_calls_per_s": round(in_calc, 1),
        "service_calls_per_s": round(svc_calc, 1),
        "clients": clients,
        "ratio": round(svc_calc / in_calc, 3),
    }
    out["python"] = {
        "sandbox_runs_per_s": round(in_py, 2),
        "service_calls_per_s": round(svc_py, 2),
        "clients": clients,
        "isolation": sandbox.report.mode,
        "ratio": round(svc_py / in_py, 3),
    }
    return out


def bench_rollout(prompts_n: int, n: int, max_tokens: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from rlfleet.common.tiny_model import build_tiny_model
    from rlfleet.driver.data.recipes import calculator
    from rlfleet.launch.agentic_demo import fixed_call_model
    from rlfleet.rollout.core import RolloutCore
    from rlfleet.rollout.engine import SamplingParams
    from rlfleet.rollout.hf_engine import HFEngine
    from rlfleet.rollout.multiturn import MultiTurn, MultiTurnSettings, ToolBox
    from rlfleet.tools.builtin import Calculator
    from rlfleet.tools.client import InProcessToolClient
    from rlfleet.tools.core import ToolCore

    with tempfile.TemporaryDirectory() as tmp:
        base = build_tiny_model(Path(tmp) / "tiny", preset="tiny", seed=0)
        model = fixed_call_model(Path(base), Path(tmp) / "tools")
        tok = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
        rows = calculator(prompts_n, 0, seed=3)["train"]
        texts = [
            tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
            for r in rows
        ]
        prompts = [list(x) for x in tok(texts, add_special_tokens=False)["input_ids"]]
        params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, seed=5)
        results: dict[str, Any] = {}
        for mode in ("single_turn", "multi_turn"):
            mt = None
            if mode == "multi_turn":
                box = ToolBox([(InProcessToolClient(ToolCore([Calculator()]), own=True), None)])
                mt = MultiTurn(tok, box, MultiTurnSettings(max_turns=3))
            core = RolloutCore(HFEngine(str(model)), multi_turn=mt)
            try:
                core.submit(prompts[:2], params).result()  # warm-up
                t0 = time.perf_counter()
                samples = core.submit(prompts, params).result()
                wall = time.perf_counter() - t0
            finally:
                core.close()
            total = sum(len(s.token_ids) for s in samples)
            model_tokens = sum(
                sum(s.loss_mask) if s.loss_mask else len(s.token_ids) for s in samples
            )
            results[mode] = {
                "samples": len(samples),
                "seconds": round(wall, 3),
                "tokens_per_s": round(total / wall, 1),
                "model_tokens_per_s": round(model_tokens / wall, 1),
                "tool_turns": sum(1 for s in samples if 0 in s.loss_mask),
            }
        results["ratio"] = round(
            results["multi_turn"]["model_tokens_per_s"] / results["single_turn"]["tokens_per_s"], 3
        )
        return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=3.0, help="per call-rate measurement")
    parser.add_argument("--clients", type=int, default=4, help="threads calling the service")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=2, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    out: dict[str, Any] = {"cpus": len(os.sched_getaffinity(0)), "threads": args.threads}
    out.update(bench_tools(args.seconds, args.clients))
    out["rollout"] = bench_rollout(args.prompts, args.n, args.max_tokens)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    sys.exit(main())
