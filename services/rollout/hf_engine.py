"""Hugging Face engine: batched generation with a KV cache on CPU or GPU.

The decode loop is ours (not ``model.generate``) so that the returned log-probs
are exactly those of the distribution each token was drawn from and so that
requests with different sampling parameters share one batch:

* every (request, prompt, sample) is one row; prompts are left-padded, position
  ids count real tokens only (pads get position 1, as in ``generate``);
* rows form generation batches: all of them at once, or, with
  ``max_num_batched_tokens``, sorted by prompt length and cut so that each batch's
  padded size (rows x (longest prompt + largest ``max_tokens``)) stays within that
  many tokens -- similar lengths together, little padding;
* per batch one prefill, then one ``model(...)`` call per decode step with the
  cache (for grouped-KV models loaded here, decode-step attention without
  repeating the cached keys per query head: :func:`_grouped_decode_sdpa`);
  temperature, top-k, top-p, stop ids and ``max_tokens`` are per-row tensors, so a
  step is vectorized across the batch; once half of a batch's rows are done they
  are dropped from it (and from the cache);
* sampling is by inversion of the cumulative distribution with one number per row
  and step from a counter-based hash of (seed, prompt index, sample index, step):
  the same distribution as ``multinomial``, one number per row instead of one
  per vocabulary entry (what makes ``generate``'s sampler slow), and a seeded
  request's samples do not depend on the other rows of its batch or on how rows
  are batched (up to floating-point rounding of the batched forward);
* a row that finishes is reported at once through ``on_sample``;
* **partial rollouts** (``partial_rollout=True``): a weight update that arrives
  while a batch generates is applied between two decode steps instead of waiting
  for the batch to end; the KV cache of every row (prompt + tokens so far) is then
  recomputed under the new weights in one prefill and decoding goes on, so the
  later tokens and their log-probs come from the new weights. Each sample lists the
  version of every token (``SampleOutput.token_weight_versions``).

Log-probs: ``log_softmax(logits / T)`` of the sampled token (raw logits when
greedy), computed in fp32; see :mod:`rlfleet.rollout.engine`.
"""

from __future__ import annotations

import copy
import itertools
import logging
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
        max_num_batched_tokens: padded tokens (rows x (longest prompt + largest
            ``max_tokens``)) per generation batch; rows are grouped by prompt length
            to fill it. None: every row of a ``generate`` call in one batch.
        partial_rollout: apply a weight update between two decode steps of a
            running batch (module docstring) instead of after the batch.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        weight_version: int = 0,
        attn_implementation: str | None = None,
        max_num_batched_tokens: int | None = None,
        partial_rollout: bool = False,
        trust_remote_code: bool = False,
    ) -> None:
        from transformers import AutoModelForCausalLM

        torch_dtype = _torch_dtype(dtype)
        kwargs: dict[str, Any] = {
            "dtype": torch_dtype,
            "local_files_only": True,
            "trust_remote_code": trust_remote_code,
        }
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        model = AutoModelForCausalLM.from_pretrained(str(model_path), **kwargs)
        _grouped_decode_attention(model)
        self._init(
            model, str(model_path), device, weight_version, max_num_batched_tokens, partial_rollout
        )

    @classmethod
    def from_model(
        cls,
        model: Any,
        *,
        name: str = "in-memory",
        device: str = "cpu",
        weight_version: int = 0,
        max_num_batched_tokens: int | None = None,
        partial_rollout: bool = False,
    ) -> HFEngine:
        """Wrap an already built ``PreTrainedModel`` (tests, colocated trainers)."""
        self = cls.__new__(cls)
        self._init(model, name, device, weight_version, max_num_batched_tokens, partial_rollout)
        return self

    def _init(
        self,
        model: Any,
        name: str,
        device: str,
        weight_version: int,
        max_num_batched_tokens: int | None,
        partial_rollout: bool = False,
    ) -> None:
        import torch

        if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
            raise InvalidArgument(
                f"max_num_batched_tokens must be >= 1 or None, got {max_num_batched_tokens}",
                field="max_num_batched_tokens",
                value=max_num_batched_tokens,
            )
        self._max_batched_tokens = max_num_batched_tokens

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
        # Partial rollouts: an update waiting to be applied between two decode steps.
        self.partial_rollout = partial_rollout
        self._handover = WeightHandOver(self._lock)
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
        # LoRA: the base weight W0 of every module a LoRA update adapted (see
        # rlfleet.weightsync.lora); emptied by a full update, which is the new base.
        self._lora_base: dict[str, torch.Tensor] = {}

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

    @property
    def update_pending(self) -> bool:
        """Partial rollouts: a weight update waits for the running batch's next step."""
        return self._handover.pending

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
        if not requests:
            return []
        rows = _Rows.build(requests, self._eos)
        results: list[list[SampleOutput | None]] = [
            [None] * (len(r.prompts) * r.params.n) for r in requests
        ]
        gone = np.zeros(len(requests), dtype=bool)  # requests whose caller gave up

        def drop_cancelled() -> np.ndarray:
            """Newly cancelled requests (bool per request), now counted as gone."""
            if cancelled is None:
                return np.zeros(len(requests), dtype=bool)
            now = np.array([not g and cancelled(r) for r, g in enumerate(gone)], dtype=bool)
            if now.any():
                gone[now] = True
                logger.info(
                    "generation: %d of %d requests cancelled", int(gone.sum()), len(requests)
                )
            return now

        for group in rows.groups(self._max_batched_tokens):
            drop_cancelled()
            group = group[~gone[rows.req[group]]]
            if len(group):  # given up while waiting for this batch: no prefill
                if self.partial_rollout:
                    self._take_pending()
                self._run_group(rows, group, results, on_sample, drop_cancelled)
        return [[s for s in rs if s is not None] for rs in results]

    def _run_group(
        self,
        rows: _Rows,
        group: np.ndarray,
        results: list[list[SampleOutput | None]],
        on_sample: SampleCallback | None,
        drop_cancelled: Callable[[], np.ndarray],
    ) -> None:
        """Generate for the rows ``group`` as one batch: one prefill, then one forward
        per decode step with the KV cache; the sampling, stop checks and bookkeeping
        of a step are batched tensor ops over the rows. Partial rollouts: a weight
        update waiting between two steps is applied there, and the cache is rebuilt
        under the new weights (one prefill of prompt + tokens so far)."""
        torch = self._torch
        dev = self._device
        input_ids, mask, pos = rows.left_padded(group, self._pad)
        input_ids, pos = input_ids.to(dev), pos.to(dev)
        width = input_ids.shape[1]
        batch = _Batch.of(rows, group, self._vocab, self._pad, dev)
        steps = int(rows.max_new[group].max())
        # Attention mask of every step, written once: the prompt's, then ones.
        full_mask = torch.ones((len(group), width + steps), dtype=torch.long, device=dev)
        full_mask[:, :width] = mask.to(dev)
        next_pos = pos[:, -1] + 1
        # (first step, weight version) of each stretch of steps under one set of weights.
        switches = [(0, self._version)]
        out = self.model(
            input_ids=input_ids,
            attention_mask=full_mask[:, :width],
            position_ids=pos,
            use_cache=True,
            logits_to_keep=1,
        )
        cache = out.past_key_values
        logits = out.logits[:, -1, :]
        for t in range(steps):
            tok, lp = _sample(logits.float(), batch, t)
            newly = batch.record(t, tok, lp)
            live = ~batch.finished
            # The step's one device sync: how many rows finished, how many go on, and
            # how many log-probs are not finite (only weights that overflow make them).
            n_new, n_live, n_bad = torch.stack(
                (newly.sum(), live.sum(), lp.isfinite().logical_not_().sum())
            ).tolist()
            if n_bad:
                raise FailedPrecondition(
                    f"the model's logits are not finite at decode step {t} ({n_bad} of "
                    f"{len(batch.rows)} rows) under weight version {self._version}: the "
                    "weights overflow; push sound weights",
                    field="weights",
                    value=self._version,
                    code="NON_FINITE_LOGITS",
                )
            if n_new:
                self._emit(rows, batch, newly, t, results, on_sample, switches)
            # Between decode steps: a caller that gave up frees the engine here.
            gone = drop_cancelled()
            if gone.any():
                batch.finished |= torch.from_numpy(gone).to(dev)[batch.req]
                live = ~batch.finished
                n_live = int(live.sum())
            if n_live == 0 or t == steps - 1:
                break
            if n_live <= len(batch.rows) // 2 and len(batch.rows) >= 8:
                # Half the rows are done: drop them from the batch and the cache (one
                # copy of the live rows' cache, which halves every later step).
                keep = live.nonzero().squeeze(-1)
                batch = batch.select(keep)
                full_mask = full_mask[keep]
                next_pos = next_pos[keep]
                tok = tok[keep]
                cache.reorder_cache(keep)
                if self.partial_rollout:
                    input_ids, pos = input_ids[keep], pos[keep]
            if self.partial_rollout and self._take_pending():
                # New weights: the cache of prompt + tokens so far is recomputed under
                # them, so the next token (and its log-prob) is theirs.
                switches.append((t + 1, self._version))
                n = t + 1
                del cache, out
                out = self.model(
                    input_ids=torch.cat((input_ids, batch.tokens[:, :n]), 1),
                    attention_mask=full_mask[:, : width + n],
                    position_ids=torch.cat(
                        (pos, next_pos[:, None] + torch.arange(n, device=dev)), 1
                    ),
                    use_cache=True,
                    logits_to_keep=1,
                )
            else:
                out = self.model(
                    input_ids=tok[:, None],
                    attention_mask=full_mask[:, : width + t + 1],
                    position_ids=(next_pos + t)[:, None],
                    past_key_values=cache,
                    use_cache=True,
                )
            cache = out.past_key_values
            logits = out.logits[:, -1, :]
        del cache

    def _emit(
        self,
        rows: _Rows,
        batch: _Batch,
        newly: torch.Tensor,
        t: int,
        results: list[list[SampleOutput | None]],
        on_sample: SampleCallback | None,
        switches: Sequence[tuple[int, int]],
    ) -> None:
        """Hand out the samples of the rows that finished at step ``t`` (each has
        ``t + 1`` tokens); ``switches``: (first step, weight version) of the batch's
        stretches of steps under one set of weights."""
        token_versions: list[int] = []
        if self.partial_rollout:
            firsts = [s for s, _ in switches if s <= t] + [t + 1]
            token_versions = np.repeat(
                [v for _, v in switches[: len(firsts) - 1]], np.diff(firsts)
            ).tolist()
        idx = newly.nonzero().squeeze(-1)
        stops = batch.stopped[idx].tolist()
        toks = batch.tokens[idx, : t + 1].tolist()
        lps = batch.logprobs[idx, : t + 1].tolist()
        for j, row in enumerate(batch.rows[idx.cpu().numpy()].tolist()):
            r = int(rows.req[row])
            sample = SampleOutput(
                prompt_index=int(rows.prompt[row]),
                sample_index=int(rows.sample[row]),
                token_ids=toks[j],
                logprobs=lps[j] if rows.want_logprobs[r] else [],
                finish_reason=FinishReason.STOP if stops[j] else FinishReason.LENGTH,
                weight_version=switches[0][1],
                token_weight_versions=list(token_versions),
            )
            results[r][int(rows.slot[row])] = sample
            if on_sample is not None:
                on_sample(r, sample)

    # ------------------------------------------------------------------ weights

    def weight_bytes(self) -> int:
        """Bytes of the model's parameters under every name (tied ones under each)."""
        return sum(p.numel() * p.element_size() for p in self._params.values())

    def check_weights(
        self, specs: Mapping[str, tuple[str, tuple[int, ...]]], *, complete: bool = True
    ) -> None:
        if any(is_lora_name(n) for n in specs):
            self._check_lora(specs, complete=complete)
            return
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

    def _check_lora(
        self, specs: Mapping[str, tuple[str, tuple[int, ...]]], *, complete: bool
    ) -> None:
        """A LoRA update (:func:`rlfleet.weightsync.lora.check_lora_update`), into base
        weights this engine still holds."""
        want = str(self._dtype).removeprefix("torch.")
        model = {name: (want, shape) for name, shape in self._shapes.items()}
        check_lora_update(specs, model, complete=complete)
        if self._weights_dropped:
            raise InvalidArgument(
                "a LoRA update merges into the base weights, which sleep(level=2) dropped: "
                "send a full update first",
                field="weights",
                code="WEIGHTS_DROPPED",
            )

    def _apply_lora(self, named_tensors: Mapping[str, Any]) -> None:
        """Set every adapted weight to ``W0 + lora_B @ lora_A`` and every module adapted
        before but not now back to ``W0`` (caller holds the lock, under no_grad)."""
        adapted = set(lora_modules(named_tensors))
        for module in adapted:
            name = f"{module}.weight"
            p = self._params[name]
            base = self._lora_base.get(name)
            if base is None:
                base = self._lora_base[name] = p.detach().clone()
            p.copy_(
                lora_merge(base, named_tensors[module + LORA_A], named_tensors[module + LORA_B])
            )
        for name, base in self._lora_base.items():
            if name.removesuffix(".weight") not in adapted:
                self._params[name].copy_(base)

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
        are copied into the parameters (``copy_``). Returns whether it adopted.

        Partial rollouts: a running batch takes the update at its next decode step
        (this call returns once it is applied); with no batch running it is applied
        here at once."""
        specs = {
            name: (str(t.dtype).removeprefix("torch."), tuple(int(d) for d in t.shape))
            for name, t in named_tensors.items()
        }
        self.check_weights(specs)
        if any(is_lora_name(n) for n in specs):
            # Between two batches, also with partial rollouts (an adapter update is
            # small; its merge is not split across a batch's decode steps).
            with self._lock, self._torch.no_grad():
                self._apply_lora(named_tensors)
                self._version = version
            logger.info(
                "weights updated to version %d (LoRA: %d adapted modules)",
                version,
                len(named_tensors) // 2,
            )
            return False
        adopt = (
            on_release is not None
            and self._device.type == "cpu"
            and all(_adoptable(t, self._params[n].dtype) for n, t in named_tensors.items())
        )
        update = _PendingUpdate(named_tensors, version, adopt, on_release)
        if self.partial_rollout:
            self._handover.post(lambda: self._apply(update))
        else:
            with self._lock:
                self._apply(update)
        if update.released is not None:  # no parameter views them any more
            update.released()
        logger.info(
            "weights updated to version %d (%d tensors%s)",
            version,
            len(named_tensors),
            ", adopted" if adopt else "",
        )
        return adopt

    def _apply(self, u: _PendingUpdate) -> None:
        """Swap the weights in (the caller holds the lock); validated before, so
        nothing here fails half-way on a mismatch."""
        with self._torch.no_grad():
            for name, t in u.tensors.items():
                p = self._params[name]
                if u.adopt:
                    p.data = t
                elif self._weights_dropped:
                    p.data = t.to(p.device, copy=True).reshape(self._shapes[name])
                else:
                    p.copy_(t)  # into the adopted tensors too, if the parameters are those
        if u.adopt:
            u.released, self._release = self._release, u.on_release
        self._lora_base.clear()  # new base weights: a LoRA update merges into these
        self._weights_dropped = False
        self._version = u.version

    def _take_pending(self) -> bool:
        """Partial rollouts, on the generating thread (which holds the lock): apply a
        posted weight update now. Returns whether one was applied."""
        if not self._handover.take():
            return False
        logger.info("weights version %d applied between two decode steps", self._version)
        return True

    # ------------------------------------------------------------------ sleep

    def sleep(self, level: int = 1) -> int:
        """GPU: level 1 moves the weights to host memory, level 2 drops them (empty
        tensors); the KV cache lives only during a batch, so there is nothing else
        to free. CPU: level 1 frees nothing (weights already live in host memory),
        level 2 drops the weights (empty tensors; the next full update restores
        them). Asleep at level 1, level 2 drops the weights (host memory). Returns the
        bytes released on the device."""
        torch = self._torch
        if level not in (1, 2):
            raise InvalidArgument(
                f"sleep level must be 1 or 2, got {level}", field="level", value=level
            )
        with self._lock:
            if self._sleep_level >= level:
                return 0
            deeper = self._sleep_level == 1  # level 2 now: the weights (on the host) go
            unique = {id(p): p for p in self._params.values()}.values()
            nbytes = sum(p.numel() * p.element_size() for p in unique)
            freed = 0
            with torch.no_grad():
                for p in unique:
                    if level == 2:  # an empty tensor on the engine's device frees the storage
                        p.data = torch.empty(0, dtype=p.dtype, device=self._device)
                    elif self._device.type != "cpu":
                        p.data = p.data.to("cpu")
                if level == 1 and self._device.type != "cpu":
                    for name, base in self._lora_base.items():
                        self._lora_base[name] = base.to("cpu")
            if level == 2:
                self._weights_dropped = True
                self._lora_base.clear()
                freed = 0 if deeper and self._device.type != "cpu" else nbytes
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
                    for name, base in self._lora_base.items():
                        self._lora_base[name] = base.to(self._device)
            self._sleep_level = 0


_GROUPED_DECODE = "rlfleet_grouped_decode_sdpa"


@dataclass(slots=True, eq=False)
class _PendingUpdate:
    """A checked weight update on its way into the parameters."""

    tensors: Mapping[str, Any]
    version: int
    adopt: bool
    on_release: Callable[[], None] | None
    released: Callable[[], None] | None = None  # to call once applied, off the lock


def _grouped_decode_sdpa(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, except for a decode step (one query per row) of
    a model with grouped KV heads: there each KV head's group of query heads attends
    as one ``(groups, head_dim)`` block, so the cached keys and values are not
    repeated per query head (``repeat_kv`` copies the whole cache every step when a
    padding mask is present, which is always the case for left-padded batches)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = int(getattr(module, "num_key_value_groups", 1))
    plain = (
        query.shape[2] != 1
        or groups == 1
        or kwargs.get("position_bias") is not None
        or kwargs.get("cache") is not None
        or kwargs.get("output_attentions", False)
    )
    if plain:
        out: tuple[torch.Tensor, None] = sdpa_attention_forward(
            module, query, key, value, attention_mask,
            dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs,
        )  # fmt: skip
        return out
    rows, heads, _, dim = query.shape
    grouped = query.reshape(rows, key.shape[1], groups, dim)  # head h = kv * groups + g
    attn = torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )
    return attn.reshape(rows, 1, heads, dim), None


def _grouped_decode_attention(model: Any) -> None:
    """Switch a model the engine loaded itself from sdpa to :func:`_grouped_decode_sdpa`
    (same masks, same numbers; decode steps without the KV repeat). Models handed in
    through ``from_model`` may be shared with a trainer and are left as they are."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    cfg = model.config
    heads = getattr(cfg, "num_attention_heads", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if getattr(cfg, "_attn_implementation", None) != "sdpa" or not heads or kv_heads == heads:
        return
    AttentionInterface.register(_GROUPED_DECODE, _grouped_decode_sdpa)
    AttentionMaskInterface.register(_GROUPED_DECODE, sdpa_mask)
    model.set_attn_implementation(_GROUPED_DECODE)


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


# --------------------------------------------------------------------------- rows


_M32 = 0xFFFFFFFF


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on uint64 (wrapping arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@dataclass(frozen=True, slots=True)
class _Rows:
    """Every (request, prompt, sample) of a ``generate`` call as one row, in numpy.

    Rows are request-major, then prompt, then sample. Per row: its request, prompt
    index in the request, sample index, place in the request's results (``slot``),
    prompt (``uprompt``, an index into the call's prompts), prompt length, sampling
    parameters and its noise key (``key``, from the request's seed, the prompt index
    and the sample index: a row draws the same numbers whatever batch it runs in).
    """

    req: np.ndarray
    prompt: np.ndarray
    sample: np.ndarray
    slot: np.ndarray
    uprompt: np.ndarray
    length: np.ndarray
    max_new: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray  # 0: off
    top_p: np.ndarray
    key: np.ndarray  # uint64
    stop: np.ndarray  # (requests, n) stop ids per request, -1 padded
    flat: np.ndarray  # every prompt's tokens, back to back
    start: np.ndarray  # where each prompt starts in ``flat``
    want_logprobs: list[bool]

    @classmethod
    def build(cls, requests: Sequence[GenerationRequest], eos: Sequence[int]) -> _Rows:
        params = [r.params for r in requests]
        prompts = [p for r in requests for p in r.prompts]
        lens = np.fromiter((len(p) for p in prompts), np.int64, len(prompts))
        flat = np.fromiter(itertools.chain.from_iterable(prompts), np.int64, int(lens.sum()))
        per_req = np.array([len(r.prompts) for r in requests], dtype=np.int64)
        n = np.array([p.n for p in params], dtype=np.int64)
        prompt_req = np.repeat(np.arange(len(requests)), per_req)
        uprompt = np.repeat(np.arange(len(prompts)), n[prompt_req])
        req = prompt_req[uprompt]
        prompt = uprompt - (np.cumsum(per_req) - per_req)[req]
        first_row = np.cumsum(n[prompt_req]) - n[prompt_req]
        sample = np.arange(len(uprompt)) - first_row[uprompt]
        seeds = np.array(
            [(p.seed if p.seed is not None else secrets.randbits(64)) % (1 << 64) for p in params],
            dtype=np.uint64,
        )
        # Each prompt's seed index (its index in its request unless the caller gave one).
        seed_index = np.concatenate(
            [
                np.arange(len(r.prompts), dtype=np.uint64)
                if r.seed_indices is None
                else np.asarray(r.seed_indices, dtype=np.uint64)
                for r in requests
            ]
        )[uprompt]
        key = _splitmix64(
            _splitmix64(_splitmix64(seeds[req]) ^ seed_index) ^ sample.astype(np.uint64)
        )
        stop_lists = [
            list(dict.fromkeys([*p.stop_token_ids, *(() if p.ignore_eos else eos)])) for p in params
        ]
        stop = np.full((len(requests), max(1, *map(len, stop_lists))), -1, dtype=np.int64)
        for r, ids in enumerate(stop_lists):
            stop[r, : len(ids)] = ids
        return cls(
            req=req,
            prompt=prompt,
            sample=sample,
            slot=prompt * n[req] + sample,
            uprompt=uprompt,
            length=lens[uprompt],
            max_new=np.array([p.max_tokens for p in params], dtype=np.int64)[req],
            temperature=np.array([p.temperature for p in params], dtype=np.float32)[req],
            top_k=np.array([max(p.top_k, 0) for p in params], dtype=np.int64)[req],
            top_p=np.array([p.top_p for p in params], dtype=np.float32)[req],
            key=key,
            stop=stop,
            flat=flat,
            start=np.cumsum(lens) - lens,
            want_logprobs=[p.logprobs for p in params],
        )

    def groups(self, max_tokens: int | None) -> list[np.ndarray]:
        """Rows split into generation batches. ``max_tokens`` None: one batch of every
        row. Otherwise rows sorted by prompt length and cut so that a batch's padded
        size, rows x (longest prompt + largest ``max_tokens``), stays within it (a
        row larger than that alone is a batch of its own)."""
        if max_tokens is None:
            return [np.arange(len(self.req))]
        order = np.argsort(self.length, kind="stable")
        out: list[np.ndarray] = []
        begin, width, new = 0, 0, 0
        for i, (length, max_new) in enumerate(
            zip(self.length[order].tolist(), self.max_new[order].tolist(), strict=True)
        ):
            w, m = max(width, length), max(new, max_new)
            if i > begin and (i - begin + 1) * (w + m) > max_tokens:
                out.append(order[begin:i])
                begin, w, m = i, length, max_new
            width, new = w, m
        out.append(order[begin:])
        return out

    def left_padded(
        self, group: np.ndarray, pad: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask, position_ids)`` of ``group``'s prompts, left
        padded to the longest; position ids count real tokens only (pads get 1, as in
        ``generate``)."""
        import torch

        lens = self.length[group]
        width = int(lens.max())
        ids = np.full((len(group), width), pad, dtype=np.int64)
        within = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
        ids[np.repeat(np.arange(len(group)), lens), np.repeat(width - lens, lens) + within] = (
            self.flat[np.repeat(self.start[self.uprompt[group]], lens) + within]
        )
        offset = np.arange(width)[None, :] - (width - lens)[:, None]
        mask = offset >= 0
        pos = np.where(mask, offset, 1)
        return (
            torch.from_numpy(ids),
            torch.from_numpy(mask.astype(np.int64)),
            torch.from_numpy(pos),
        )


@dataclass(slots=True)
class _Batch:
    """The per-row state of one generation batch, as tensors on the engine's device.

    ``rows`` maps batch positions to rows of :class:`_Rows` (numpy); the flags say
    which sampling work a step needs at all."""

    rows: np.ndarray
    req: torch.Tensor
    scale: torch.Tensor  # temperature, 1 for greedy rows
    greedy: torch.Tensor
    top_k: torch.Tensor  # vocabulary size when off
    top_p: torch.Tensor
    stop: torch.Tensor  # (rows, n) ids that end a sample
    max_new: torch.Tensor
    key_lo: torch.Tensor  # the row key's halves, int64 in [0, 2**32)
    key_hi: torch.Tensor
    tokens: torch.Tensor  # (rows, steps)
    logprobs: torch.Tensor  # (rows, steps) fp32
    lengths: torch.Tensor
    finished: torch.Tensor
    stopped: torch.Tensor  # finished on a stop id (else: max_tokens, or cancelled)
    any_sampled: bool
    all_sampled: bool
    scaled: bool
    truncate_k: bool
    truncate_p: bool

    @classmethod
    def of(cls, rows: _Rows, group: np.ndarray, vocab: int, pad: int, dev: torch.device) -> _Batch:
        import torch

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

        temp = rows.temperature[group]
        sampled = temp > 0
        top_k = rows.top_k[group]
        top_p = rows.top_p[group]
        steps = int(rows.max_new[group].max())
        n = len(group)
        key = rows.key[group]
        return cls(
            rows=group,
            req=t(rows.req[group]),
            scale=t(np.where(sampled, temp, np.float32(1))),
            greedy=t(~sampled),
            top_k=t(np.where(top_k > 0, top_k, vocab)),
            top_p=t(top_p),
            stop=t(rows.stop[rows.req[group]]),
            max_new=t(rows.max_new[group]),
            key_lo=t((key & np.uint64(_M32)).astype(np.int64)),
            key_hi=t((key >> np.uint64(32)).astype(np.int64)),
            tokens=torch.full((n, steps), pad, dtype=torch.long, device=dev),
            logprobs=torch.zeros((n, steps), dtype=torch.float32, device=dev),
            lengths=torch.zeros(n, dtype=torch.long, device=dev),
            finished=torch.zeros(n, dtype=torch.bool, device=dev),
            stopped=torch.zeros(n, dtype=torch.bool, device=dev),
            any_sampled=bool(sampled.any()),
            all_sampled=bool(sampled.all()),
            scaled=bool((temp[sampled] != 1).any()),
            truncate_k=bool(((top_k > 0) & (top_k < vocab) & sampled).any()),
            truncate_p=bool(((top_p < 1) & sampled).any()),
        )

    def record(self, t: int, tok: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
        """Store step ``t``'s tokens; returns the rows that finished at it (a stop id,
        or ``max_tokens`` reached)."""
        self.tokens[:, t] = tok
        self.logprobs[:, t] = lp
        active = ~self.finished
        self.lengths += active
        is_stop = (tok[:, None] == self.stop).any(-1)
        newly = active & (is_stop | (self.lengths >= self.max_new))
        self.finished |= newly
        self.stopped |= newly & is_stop
        return newly

    def select(self, keep: torch.Tensor) -> _Batch:
        """The batch of the rows at ``keep`` only."""
        out = copy.copy(self)
        out.rows = self.rows[keep.cpu().numpy()]
        for name in (
            "req", "scale", "greedy", "top_k", "top_p", "stop", "max_new", "key_lo",
            "key_hi", "tokens", "logprobs", "lengths", "finished", "stopped",
        ):  # fmt: skip
            setattr(out, name, getattr(self, name)[keep])
        return out


# --------------------------------------------------------------------------- sampling


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32 constants) on int64 tensors holding
    values in [0, 2**32): every product stays below 2**63, so no overflow."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def _uniform(key_lo: torch.Tensor, key_hi: torch.Tensor, step: int) -> torch.Tensor:
    """One number per row in [0, 1 - 2**-24], fp32, a function of the row key and the
    step only (counter-based: no generator state, any batch composition)."""
    import torch

    bits = _mix32(key_lo ^ _mix32((key_hi + step) & _M32))
    return (bits >> 8).to(torch.float32) * (1.0 / (1 << 24))


def _sample(logits: torch.Tensor, b: _Batch, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its log-prob.

    Args:
        logits: ``(rows, vocab)`` fp32, the step's logits (scaled in place).
        b: the batch's per-row parameters.

    Returns:
        ``(tokens (rows,) long, logprobs (rows,) fp32)``: log-probs of
        ``log_softmax(logits / T)`` (``T = 1`` for greedy rows), before top-k / top-p.

    Sampling is by inversion: with ``w = exp(logits / T - max)`` (top-k / top-p
    zero the dropped weights) the row draws the first token whose cumulative weight
    exceeds ``u * sum(w)`` for its counter-based ``u`` -- a draw from the same
    distribution as ``multinomial``, from one number per row instead of one per
    vocabulary entry. Full-vocabulary work per step: one scale, max, exp, sum and
    in-place cumulative sum over a single ``(rows, vocab)`` buffer.
    """
    import torch

    if b.scaled:
        logits.div_(b.scale[:, None])
    top = logits.amax(-1, keepdim=True)
    w = torch.sub(logits, top).exp_()
    log_z = w.sum(-1, keepdim=True).log_()
    if b.any_sampled:
        if b.truncate_k or b.truncate_p:
            _truncate(w, log_z, b)
        cdf = w.cumsum_(-1)
        total = cdf[:, -1:]
        # Strictly below the total: the drawn token always has weight > 0.
        x = torch.minimum(
            _uniform(b.key_lo, b.key_hi, step)[:, None] * total,
            torch.nextafter(total, torch.zeros_like(total)),
        )
        # Clamped: a row whose sampling weights are NaN (broken model weights) finds no
        # token; its log-prob is NaN and the step refuses it (``_run_group``).
        tok = torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)
        if not b.all_sampled:
            tok = torch.where(b.greedy, logits.argmax(-1), tok)
    else:
        tok = logits.argmax(-1)
    lp = (logits.gather(-1, tok[:, None]) - top - log_z).squeeze(-1)
    return tok, lp


def _truncate(w: torch.Tensor, log_z: torch.Tensor, b: _Batch) -> None:
    """Zero the weights top-k / top-p drop, in place: outside the ``top_k`` largest;
    past the smallest prefix (by weight) whose probability reaches ``top_p`` (the
    first token always stays)."""
    import torch

    sorted_w, order = w.sort(dim=-1, descending=True)
    ranks = torch.arange(w.shape[-1], device=w.device)[None, :]
    drop = ranks >= b.top_k[:, None]
    if b.truncate_p:
        before = sorted_w.cumsum(-1) - sorted_w
        drop |= before >= b.top_p[:, None] * log_z.exp()
    w.scatter_(-1, order, sorted_w.masked_fill_(drop, 0))


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise InvalidArgument(f"dtype must be one of {sorted(dtypes)}, got {name!r}", field="dtype")
    return dtypes[name]
