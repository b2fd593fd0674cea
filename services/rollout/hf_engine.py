"""Hugging Face engine: batched generation with a KV cache on CPU or GPU.

The decode loop is ours (not ``model.generate``) so that the returned log-probs
are exactly those of the distribution each token was drawn from and so that
requests with different sampling parameters share one batch:

* every (request, prompt, sample) is one row; prompts are left-padded, position
  ids count real tokens only (pads get position 1, as in ``generate``);
* one prefill over all rows, then one ``model(...)`` call per decode step with the
  cache; temperature, top-k, top-p, stop ids and ``max_tokens`` are per-row tensors,
  so a step is vectorized across the batch;
* sampling draws ``argmax(p / E)`` with ``E ~ Exp(1)`` (the exponential race, the
  same distribution as ``multinomial(p)``); each request draws its noise from its
  own generator, seeded from ``SamplingParams.seed``, so a seeded request's samples
  do not depend on the other requests in the batch (up to floating-point rounding
  of the batched forward);
* a row that finishes is reported at once through ``on_sample``.

Log-probs: ``log_softmax(logits / T)`` of the sampled token (raw logits when
greedy), computed in fp32; see :mod:`rlfleet.rollout.engine`.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlfleet.common.errors import FailedPrecondition, InvalidArgument
from rlfleet.rollout.engine import (
    CancelCheck,
    EngineInfo,
    FinishReason,
    GenerationRequest,
    SampleCallback,
    SampleOutput,
    validate_requests,
)

if TYPE_CHECKING:
    import torch

__all__ = ["HFEngine"]

logger = logging.getLogger(__name__)


class HFEngine:
    """The :class:`~rlfleet.rollout.engine.Engine` protocol on a transformers causal LM.

    Args:
        model_path: a Hugging Face model directory (or an already built model via
            :meth:`from_model`).
        dtype: ``"float32" | "bfloat16" | "float16"``.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"`` ...
        weight_version: the version the initial weights count as.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        weight_version: int = 0,
        attn_implementation: str | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM

        torch_dtype = _torch_dtype(dtype)
        kwargs: dict[str, Any] = {"dtype": torch_dtype, "local_files_only": True}
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        model = AutoModelForCausalLM.from_pretrained(str(model_path), **kwargs)
        self._init(model, str(model_path), device, weight_version)

    @classmethod
    def from_model(
        cls, model: Any, *, name: str = "in-memory", device: str = "cpu", weight_version: int = 0
    ) -> HFEngine:
        """Wrap an already built ``PreTrainedModel`` (tests, colocated trainers)."""
        self = cls.__new__(cls)
        self._init(model, name, device, weight_version)
        return self

    def _init(self, model: Any, name: str, device: str, weight_version: int) -> None:
        import torch

        self._torch = torch
        self.model = model.to(device).eval().requires_grad_(False)
        self._name = name
        self._device = torch.device(device)
        self._dtype = next(model.parameters()).dtype
        self._version = weight_version
        self._lock = threading.RLock()
        self._sleep_level = 0
        self._weights_dropped = False
        # Set while the parameters are tensors adopted from a weight update: tells
        # their owner when they are no longer used (see ``update_weights``).
        self._release: Callable[[], None] | None = None
        cfg = model.config
        gen = getattr(model, "generation_config", None)
        eos: Any = getattr(gen, "eos_token_id", None)
        if eos is None:
            eos = cfg.eos_token_id
        self._eos: tuple[int, ...] = tuple(
            int(e) for e in ([] if eos is None else eos if isinstance(eos, list) else [eos])
        )
        pad = getattr(gen, "pad_token_id", None)
        if pad is None:
            pad = cfg.pad_token_id
        self._pad = int(pad) if pad is not None else (self._eos[0] if self._eos else 0)
        # An id must index both embedding tables (they may differ in size when untied).
        vocab_sizes = [int(model.get_output_embeddings().weight.shape[0])]
        if model.get_input_embeddings() is not None:
            vocab_sizes.append(int(model.get_input_embeddings().weight.shape[0]))
        self._vocab = min(vocab_sizes)
        self._max_len = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
        # Every name a weight update may use (tied aliases included) -> parameter.
        self._params: dict[str, torch.nn.Parameter] = dict(
            model.named_parameters(remove_duplicate=False)
        )
        self._canonical = [n for n, _ in model.named_parameters()]
        # Shapes outlive sleep(level=2), which empties the parameters.
        self._shapes = {n: tuple(int(d) for d in p.shape) for n, p in self._params.items()}

    # ------------------------------------------------------------------ info

    def info(self) -> EngineInfo:
        return EngineInfo(
            engine="hf",
            model=self._name,
            dtype=str(self._dtype).removeprefix("torch."),
            device=str(self._device),
            weight_version=self._version,
            max_model_len=self._max_len,
            eos_token_ids=self._eos,
        )

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def sleeping(self) -> bool:
        return self._sleep_level > 0

    # ------------------------------------------------------------------ generation

    def validate(self, requests: Sequence[GenerationRequest]) -> None:
        """Raise ``InvalidArgument`` naming the field of the first bad request."""
        validate_requests(requests, self._vocab, self._max_len)

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        on_sample: SampleCallback | None = None,
        cancelled: CancelCheck | None = None,
    ) -> list[list[SampleOutput]]:
        self.validate(requests)
        with self._lock:
            if self._sleep_level or self._weights_dropped:
                raise FailedPrecondition(
                    "the engine is asleep"
                    if self._sleep_level
                    else "the weights were dropped by sleep(level=2); send a weight update first",
                    code="ENGINE_ASLEEP",
                )
            with self._torch.inference_mode():
                return self._generate(requests, on_sample, cancelled)

    def _generate(
        self,
        requests: Sequence[GenerationRequest],
        on_sample: SampleCallback | None,
        cancelled: CancelCheck | None,
    ) -> list[list[SampleOutput]]:
        import torch

        dev = self._device
        # Row layout: request-major, then prompt, then sample.
        row_req: list[int] = []
        row_prompt: list[int] = []
        row_sample: list[int] = []
        prompts: list[Sequence[int]] = []
        spans: list[tuple[int, int]] = []  # rows of each request
        for r, req in enumerate(requests):
            start = len(row_req)
            for i, p in enumerate(req.prompts):
                for s in range(req.params.n):
                    row_req.append(r)
                    row_prompt.append(i)
                    row_sample.append(s)
                    prompts.append(p)
            spans.append((start, len(row_req)))
        n_rows = len(prompts)
        width = max(len(p) for p in prompts)

        def per_row(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
            t = torch.tensor(values, dtype=dtype)
            counts = torch.tensor([b - a for a, b in spans])
            return t.repeat_interleave(counts).to(dev)

        params = [req.params for req in requests]
        temp = per_row([p.temperature for p in params], torch.float32)
        top_p = per_row([p.top_p for p in params], torch.float32)
        top_k = per_row([p.top_k if p.top_k > 0 else self._vocab for p in params], torch.long)
        max_new = per_row([p.max_tokens for p in params], torch.long)
        stop_lists = [
            list(dict.fromkeys([*p.stop_token_ids, *(() if p.ignore_eos else self._eos)]))
            for p in params
        ]
        n_stop = max(1, max(len(s) for s in stop_lists))
        stop = torch.full((len(requests), n_stop), -1, dtype=torch.long)
        for r, ids in enumerate(stop_lists):
            stop[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        stop = stop.repeat_interleave(torch.tensor([b - a for a, b in spans]), dim=0).to(dev)
        want_lp = [p.logprobs for p in params]
        gens = []
        for p in params:
            g = torch.Generator(device=dev)
            g.manual_seed(p.seed if p.seed is not None else secrets.randbits(63))
            gens.append(g)
        sampled_spans = [
            (sp, g) for sp, g, p in zip(spans, gens, params, strict=True) if p.temperature > 0
        ]
        use_topk = bool((top_k < self._vocab).any())
        use_topp = bool((top_p < 1).any())

        input_ids = torch.full((n_rows, width), self._pad, dtype=torch.long)
        mask = torch.zeros((n_rows, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            mask[i, width - len(p) :] = 1
        input_ids, mask = input_ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        last_pos = pos[:, -1:]

        steps = int(max_new.max())
        out_tok = torch.full((n_rows, steps), self._pad, dtype=torch.long, device=dev)
        out_lp = torch.zeros((n_rows, steps), dtype=torch.float32, device=dev)
        lengths = torch.zeros(n_rows, dtype=torch.long, device=dev)
        finished = torch.zeros(n_rows, dtype=torch.bool, device=dev)
        results: list[list[SampleOutput | None]] = [[None] * (b - a) for a, b in spans]
        live = list(range(len(requests)))  # requests not cancelled yet

        def drop_cancelled() -> bool:
            """Mark the rows of newly cancelled requests finished (no sample); True
            when every row is finished."""
            nonlocal live
            if cancelled is None:
                return False
            gone = [r for r in live if cancelled(r)]
            if gone:
                live = [r for r in live if r not in gone]
                for r in gone:
                    a, b = spans[r]
                    finished[a:b] = True
                logger.info("generation: %d of %d requests cancelled", len(gone), len(requests))
            return bool(finished.all())

        if drop_cancelled():  # given up while waiting for this batch: no prefill
            return [[] for _ in requests]

        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            logits_to_keep=1,
        )
        cache = out.past_key_values
        logits = out.logits[:, -1, :]
        for t in range(steps):
            tok, lp = _sample_step(
                logits.float(), temp, top_k, top_p, use_topk, use_topp, sampled_spans
            )
            active = ~finished
            out_tok[:, t] = tok
            out_lp[:, t] = lp
            lengths += active.long()
            is_stop = (tok[:, None] == stop).any(-1)
            newly = active & (is_stop | (lengths >= max_new))
            finished |= newly
            if bool(newly.any()):
                idx = newly.nonzero().squeeze(-1)
                lens = lengths[idx].tolist()
                stops = is_stop[idx].tolist()
                toks = out_tok[idx, : t + 1].tolist()
                lps = out_lp[idx, : t + 1].tolist()
                for j, row in enumerate(idx.tolist()):
                    r = row_req[row]
                    n = lens[j]
                    sample = SampleOutput(
                        prompt_index=row_prompt[row],
                        sample_index=row_sample[row],
                        token_ids=toks[j][t + 1 - n :],
                        logprobs=lps[j][t + 1 - n :] if want_lp[r] else [],
                        finish_reason=FinishReason.STOP if stops[j] else FinishReason.LENGTH,
                        weight_version=self._version,
                    )
                    results[r][row - spans[r][0]] = sample
                    if on_sample is not None:
                        on_sample(r, sample)
            # Between decode steps: a caller that gave up frees the engine here.
            if bool(finished.all()) or drop_cancelled():
                break
            mask = torch.cat([mask, torch.ones((n_rows, 1), dtype=mask.dtype, device=dev)], -1)
            last_pos = last_pos + 1
            out = self.model(
                input_ids=tok[:, None],
                attention_mask=mask,
                position_ids=last_pos,
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            logits = out.logits[:, -1, :]
        del cache
        return [[s for s in rs if s is not None] for rs in results]

    # ------------------------------------------------------------------ weights

    def weight_bytes(self) -> int:
        """Bytes of the model's parameters under every name (tied ones under each)."""
        return sum(p.numel() * p.element_size() for p in self._params.values())

    def check_weights(
        self, specs: Mapping[str, tuple[str, tuple[int, ...]]], *, complete: bool = True
    ) -> None:
        covered: set[int] = set()
        for name, (dtype, shape) in specs.items():
            p = self._params.get(name)
            if p is None:
                raise InvalidArgument(
                    f"tensor {name!r} is not a parameter of the model "
                    f"({len(self._canonical)} parameters, e.g. {self._canonical[:3]})",
                    field=f"weights[{name!r}]",
                    value=name,
                    code="UNKNOWN_TENSOR",
                )
            want_dtype = str(p.dtype).removeprefix("torch.")
            if dtype != want_dtype:
                raise InvalidArgument(
                    f"tensor {name!r} has dtype {dtype}, the model holds {want_dtype}",
                    field=f"weights[{name!r}].dtype",
                    value=dtype,
                    code="DTYPE_MISMATCH",
                )
            want_shape = self._shapes[name]
            if tuple(shape) != want_shape:
                raise InvalidArgument(
                    f"tensor {name!r} has shape {list(shape)}, the model holds {list(want_shape)}",
                    field=f"weights[{name!r}].shape",
                    value=list(shape),
                    code="SHAPE_MISMATCH",
                )
            covered.add(id(p))
        missing = [n for n in self._canonical if id(self._params[n]) not in covered]
        if missing and complete:
            raise InvalidArgument(
                f"update is missing {len(missing)} of {len(self._canonical)} parameters: "
                f"{missing[:5]}{' ...' if len(missing) > 5 else ''}",
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
        """Check, then swap under the lock (between two generation batches).

        With ``on_release`` on CPU, the verified staging tensors *become* the
        parameters (``p.data = t``: no copy) when every one is a contiguous CPU
        tensor of the parameter's dtype, aligned to its element size; the tensors
        adopted by the previous such update are then released to their owner (the
        bulk receiver reuses them as the next staging buffer). Otherwise the values
        are copied into the parameters (``copy_``). Returns whether it adopted."""
        torch = self._torch
        specs = {
            name: (str(t.dtype).removeprefix("torch."), tuple(int(d) for d in t.shape))
            for name, t in named_tensors.items()
        }
        self.check_weights(specs)
        adopt = (
            on_release is not None
            and self._device.type == "cpu"
            and all(_adoptable(t, self._params[n].dtype) for n, t in named_tensors.items())
        )
        released: Callable[[], None] | None = None
        with self._lock, torch.no_grad():
            # Validated above: nothing below can fail half-way on a mismatch.
            for name, t in named_tensors.items():
                p = self._params[name]
                if adopt:
                    p.data = t
                elif self._weights_dropped:
                    p.data = t.to(p.device, copy=True).reshape(self._shapes[name])
                else:
                    p.copy_(t)  # into the adopted tensors too, if the parameters are those
            if adopt:
                released, self._release = self._release, on_release
            self._weights_dropped = False
            self._version = version
        if released is not None:  # no parameter views them any more
            released()
        logger.info(
            "weights updated to version %d (%d tensors%s)",
            version,
            len(named_tensors),
            ", adopted" if adopt else "",
        )
        return adopt

    # ------------------------------------------------------------------ sleep

    def sleep(self, level: int = 1) -> int:
        """GPU: level 1 moves the weights to host memory, level 2 drops them (empty
        tensors); the KV cache lives only during a batch, so there is nothing else
        to free. CPU: level 1 frees nothing (weights already live in host memory),
        level 2 drops the weights (empty tensors; the next full update restores
        them). Returns the bytes released on the device."""
        torch = self._torch
        if level not in (1, 2):
            raise InvalidArgument(f"sleep level must be 1 or 2, got {level}", field="level")
        with self._lock:
            if self._sleep_level:
                return 0
            unique = {id(p): p for p in self._params.values()}.values()
            nbytes = sum(p.numel() * p.element_size() for p in unique)
            freed = 0
            with torch.no_grad():
                for p in unique:
                    if level == 2:  # an empty tensor on the same device frees the storage
                        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                    elif self._device.type != "cpu":
                        p.data = p.data.to("cpu")
            if level == 2:
                self._weights_dropped = True
                freed = nbytes
                released, self._release = self._release, None
                if released is not None:  # the adopted tensors are no parameters now
                    released()
            elif self._device.type != "cpu":
                freed = nbytes
            if self._device.type == "cuda":
                torch.cuda.empty_cache()
            self._sleep_level = level
            return freed

    def wake_up(self) -> None:
        torch = self._torch
        with self._lock:
            if not self._sleep_level:
                return
            if self._sleep_level == 1 and self._device.type != "cpu":
                with torch.no_grad():
                    for p in {id(p): p for p in self._params.values()}.values():
                        p.data = p.data.to(self._device)
            self._sleep_level = 0


def _adoptable(t: Any, dtype: torch.dtype) -> bool:
    """Whether ``t`` can serve as a parameter's storage as it is."""
    import torch

    return (
        isinstance(t, torch.Tensor)
        and t.device.type == "cpu"
        and t.dtype == dtype
        and t.is_contiguous()
        and t.data_ptr() % t.element_size() == 0
    )


def _sample_step(
    logits: torch.Tensor,
    temp: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    use_topk: bool,
    use_topp: bool,
    sampled_spans: Sequence[tuple[tuple[int, int], torch.Generator]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its log-prob.

    Args:
        logits: ``(rows, vocab)`` fp32.
        temp, top_p: ``(rows,)`` fp32; top_k: ``(rows,)`` long (vocab = off).
        sampled_spans: ``((start, end), generator)`` of each request with temperature > 0.

    Returns:
        ``(tokens (rows,) long, logprobs (rows,) fp32)``; log-probs of
        ``log_softmax(logits / T)`` (``T = 1`` for greedy rows).
    """
    import torch

    greedy = temp <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temp), temp)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    tok = scaled.argmax(-1)
    if sampled_spans:
        filtered = scaled
        if use_topk or use_topp:
            sorted_logits, order = scaled.sort(dim=-1, descending=True)
            vocab = scaled.shape[-1]
            ranks = torch.arange(vocab, device=scaled.device)[None, :]
            drop = ranks >= top_k[:, None]
            if use_topp:
                probs_sorted = sorted_logits.softmax(-1)
                # Keep the smallest prefix whose mass reaches top_p (the first token always).
                before = probs_sorted.cumsum(-1) - probs_sorted
                drop = drop | (before >= top_p[:, None])
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            filtered = torch.empty_like(scaled).scatter_(-1, order, sorted_logits)
        probs = filtered.softmax(-1)
        noise = torch.ones_like(probs)
        for (a, b), g in sampled_spans:
            noise[a:b].exponential_(generator=g)
        drawn = (probs / noise).argmax(-1)
        tok = torch.where(greedy, tok, drawn)
    lp = logp.gather(-1, tok[:, None]).squeeze(-1)
    return tok, lp


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise InvalidArgument(f"dtype must be one of {sorted(dtypes)}, got {name!r}", field="dtype")
    return dtypes[name]
