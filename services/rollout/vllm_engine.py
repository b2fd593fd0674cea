"""vLLM engine: the :class:`~rlfleet.rollout.engine.Engine` protocol on ``vllm.LLM``.

* Token ids in (``TokensPrompt``), one ``vllm.SamplingParams`` per request (vLLM
  batches them continuously), ``n``, per-request ``seed``, greedy at temperature 0.
* Log-probs: ``logprobs=0`` returns the sampled token's log-prob only, and the
  engine is built with ``logprobs_mode="processed_logprobs"`` so the value is that
  of the temperature-scaled distribution, as in the HF engine (module docstring of
  ``engine``). With top-k / top-p on, vLLM's processed log-probs are those of the
  truncated, renormalised distribution; with them off (PPO's usual setting) both
  engines report ``log_softmax(logits / T)``.
* Weights are loaded into the running engine with ``collective_rpc`` on every
  worker (``model_runner.model.load_weights``, which takes Hugging Face names and
  handles vLLM's fused layers), after the names / shapes / dtypes were checked
  against the Hugging Face model built on the meta device.
* ``sleep`` / ``wake_up`` use vLLM's sleep mode (``enable_sleep_mode=True``) where
  the platform supports it (CUDA); elsewhere level 1 only resets the prefix cache
  and level 2 is refused.
* ``on_sample`` is called when the batch returns: the offline ``LLM`` API does not
  stream; continuous batching still happens inside the batch.

vLLM is imported inside the class, so this module imports without it. Scripts
that build a ``VLLMEngine`` need an ``if __name__ == "__main__":`` guard (vLLM
spawns worker processes).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlfleet.common.errors import FailedPrecondition, InvalidArgument
from rlfleet.rollout.engine import (
    EngineInfo,
    FinishReason,
    GenerationRequest,
    SampleCallback,
    SampleOutput,
)

__all__ = ["VLLMEngine"]

logger = logging.getLogger(__name__)


def _load_weights_on_worker(worker: Any, weights: list[tuple[str, Any]]) -> int:
    """Runs inside each vLLM worker (via ``collective_rpc``)."""
    model = worker.model_runner.model
    device = next(model.parameters()).device
    model.load_weights((name, t.to(device)) for name, t in weights)
    return len(weights)


class VLLMEngine:
    """Generation on ``vllm.LLM``.

    Args:
        model_path: Hugging Face model directory.
        dtype: ``"float32" | "bfloat16" | "float16"``.
        gpu_memory_utilization: fraction of device memory for weights + KV cache.
        enable_sleep_mode: ``None``: on when CUDA is available.
        llm_kwargs: more ``vllm.LLM`` arguments.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        gpu_memory_utilization: float = 0.5,
        enable_sleep_mode: bool | None = None,
        weight_version: int = 0,
        seed: int = 0,
        **llm_kwargs: Any,
    ) -> None:
        import torch
        import vllm
        from transformers import AutoConfig, AutoModelForCausalLM

        # collective_rpc pickles our weight-loading function to vLLM's engine-core
        # process; vLLM v1 refuses pickled callables unless this is set. The peer is
        # a child process of this one, not a network party.
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        if enable_sleep_mode is None:
            enable_sleep_mode = torch.cuda.is_available()
        self._name = str(model_path)
        self._sleep_mode = enable_sleep_mode
        self.llm = vllm.LLM(
            model=self._name,
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=enable_sleep_mode,
            logprobs_mode="processed_logprobs",
            enforce_eager=True,
            **llm_kwargs,
        )
        self._vllm = vllm
        self._dtype = dtype
        self._version = weight_version
        self._sleep_level = 0
        self._lock = threading.RLock()
        model_config = self.llm.llm_engine.model_config
        self._max_len = int(model_config.max_model_len)
        config = AutoConfig.from_pretrained(self._name, local_files_only=True)
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
        self._specs = {
            n: (str(p.dtype).removeprefix("torch."), tuple(int(d) for d in p.shape))
            for n, p in meta.named_parameters(remove_duplicate=False)
        }
        self._ids = {n: id(p) for n, p in meta.named_parameters(remove_duplicate=False)}
        self._canonical = [n for n, _ in meta.named_parameters()]
        self._vocab = int(config.vocab_size)
        from transformers import GenerationConfig

        try:
            gen = GenerationConfig.from_pretrained(self._name, local_files_only=True)
            eos = gen.eos_token_id
        except OSError:
            eos = config.eos_token_id
        self._eos = tuple(
            int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else [])
        )
        self._device = "cuda" if torch.cuda.is_available() else "cpu"

    def info(self) -> EngineInfo:
        return EngineInfo(
            engine="vllm",
            model=self._name,
            dtype=self._dtype,
            device=self._device,
            weight_version=self._version,
            max_model_len=self._max_len,
            eos_token_ids=self._eos,
            extra={"vllm_version": str(getattr(self._vllm, "__version__", "?"))},
        )

    def validate(self, requests: Sequence[GenerationRequest]) -> None:
        for r, req in enumerate(requests):
            if not req.prompts:
                raise InvalidArgument("no prompts", field=f"requests[{r}].prompts")
            for i, p in enumerate(req.prompts):
                if len(p) == 0:
                    raise InvalidArgument(
                        "prompt has no tokens", field=f"prompts[{i}].token_ids", sample_index=i
                    )
                bad = [t for t in p if not 0 <= t < self._vocab]
                if bad:
                    raise InvalidArgument(
                        f"token ids {bad[:5]} outside the vocabulary [0, {self._vocab})",
                        field=f"prompts[{i}].token_ids",
                        value=bad[:5],
                        sample_index=i,
                    )
                total = len(p) + req.params.max_tokens
                if total > self._max_len:
                    raise InvalidArgument(
                        f"prompt of {len(p)} tokens + max_tokens {req.params.max_tokens} = "
                        f"{total} exceeds the model's limit of {self._max_len} tokens",
                        field="sampling.max_tokens",
                        value=req.params.max_tokens,
                        sample_index=i,
                    )

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        on_sample: SampleCallback | None = None,
    ) -> list[list[SampleOutput]]:
        self.validate(requests)
        vllm = self._vllm
        from vllm.inputs import TokensPrompt

        prompts: list[Any] = []
        params: list[Any] = []
        owner: list[tuple[int, int]] = []
        for r, req in enumerate(requests):
            p = req.params
            sp = vllm.SamplingParams(
                n=p.n,
                temperature=p.temperature,
                top_p=p.top_p,
                top_k=p.top_k if p.top_k > 0 else -1,
                max_tokens=p.max_tokens,
                stop_token_ids=list(p.stop_token_ids),
                seed=p.seed,
                logprobs=0 if p.logprobs else None,
                ignore_eos=p.ignore_eos,
                detokenize=False,
            )
            for i, ids in enumerate(req.prompts):
                prompts.append(TokensPrompt(prompt_token_ids=list(ids)))
                params.append(sp)
                owner.append((r, i))
        with self._lock:
            if self._sleep_level:
                raise FailedPrecondition("the engine is asleep", code="ENGINE_ASLEEP")
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
            version = self._version
        results: list[list[SampleOutput]] = [[] for _ in requests]
        for (r, i), out in zip(owner, outputs, strict=True):
            want_lp = requests[r].params.logprobs
            for k, comp in enumerate(sorted(out.outputs, key=lambda c: c.index)):
                tokens = list(comp.token_ids)
                lps: list[float] = []
                if want_lp and comp.logprobs is not None:
                    lps = [
                        float(step[t].logprob)
                        for step, t in zip(comp.logprobs, tokens, strict=True)
                    ]
                sample = SampleOutput(
                    prompt_index=i,
                    sample_index=k,
                    token_ids=tokens,
                    logprobs=lps,
                    finish_reason=FinishReason.LENGTH
                    if comp.finish_reason == "length"
                    else FinishReason.STOP,
                    weight_version=version,
                )
                results[r].append(sample)
                if on_sample is not None:
                    on_sample(r, sample)
        return results

    def check_weights(self, specs: Mapping[str, tuple[str, tuple[int, ...]]]) -> None:
        covered: set[int] = set()
        for name, (dtype, shape) in specs.items():
            want = self._specs.get(name)
            if want is None:
                raise InvalidArgument(
                    f"tensor {name!r} is not a parameter of the model",
                    field=f"weights[{name!r}]",
                    value=name,
                    code="UNKNOWN_TENSOR",
                )
            if dtype != want[0]:
                raise InvalidArgument(
                    f"tensor {name!r} has dtype {dtype}, the model holds {want[0]}",
                    field=f"weights[{name!r}].dtype",
                    value=dtype,
                    code="DTYPE_MISMATCH",
                )
            if tuple(shape) != want[1]:
                raise InvalidArgument(
                    f"tensor {name!r} has shape {list(shape)}, the model holds {list(want[1])}",
                    field=f"weights[{name!r}].shape",
                    value=list(shape),
                    code="SHAPE_MISMATCH",
                )
            covered.add(self._ids[name])
        missing = [n for n in self._canonical if self._ids[n] not in covered]
        if missing:
            raise InvalidArgument(
                f"update is missing {len(missing)} of {len(self._canonical)} parameters: "
                f"{missing[:5]}",
                field="weights",
                value=missing[:5],
                code="MISSING_TENSORS",
            )

    def update_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        self.check_weights(
            {
                n: (str(t.dtype).removeprefix("torch."), tuple(int(d) for d in t.shape))
                for n, t in named_tensors.items()
            }
        )
        with self._lock:
            self.llm.collective_rpc(_load_weights_on_worker, args=(list(named_tensors.items()),))
            self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
            self._version = version

    def sleep(self, level: int = 1) -> int:
        if level not in (1, 2):
            raise InvalidArgument(f"sleep level must be 1 or 2, got {level}", field="level")
        with self._lock:
            if self._sleep_level:
                return 0
            if self._sleep_mode:
                self.llm.sleep(level=level)
            elif level == 2:
                raise FailedPrecondition(
                    "sleep level 2 needs vLLM sleep mode, which this platform lacks",
                    field="level",
                )
            else:
                self.llm.reset_prefix_cache()
            self._sleep_level = level
            return 0  # vLLM logs what it freed; it does not return the amount

    def wake_up(self) -> None:
        with self._lock:
            if self._sleep_level and self._sleep_mode:
                self.llm.wake_up()
            self._sleep_level = 0
