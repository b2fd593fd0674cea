"""Batches as the trainer sees them: a dict of named tensors (verl's keys) plus columns.

A batch is ``dict[str, Any]``: ``torch.Tensor`` values indexed by sample on dim 0, and
lists (``uid``, ``data_source``, ...) with one entry per sample. Keys follow verl:

=====================  ==================  ==========================================
key                    shape / type        meaning
=====================  ==================  ==========================================
``input_ids``          (bs, L) int         prompt (left-padded) + response tokens
``attention_mask``     (bs, L)             1 on real tokens
``position_ids``       (bs, L) int         optional; derived from attention_mask
``responses``          (bs, R) int         the last R columns of ``input_ids``
``response_mask``      (bs, R)             optional; attention_mask[:, -R:]
``token_level_scores`` (bs, R) float       reward per token, or:
``scores``             (bs,) float         one score, placed on the last valid token
``old_log_probs``      (bs, R) float       log-probs under the behaviour policy
``rollout_log_probs``  (bs, R) float       the rollout engine's log-probs of the samples
``ref_log_prob``       (bs, R) float       log-probs under the reference policy
``values``             (bs, R) float       critic values at rollout time
``advantages``         (bs, R) float
``returns``            (bs, R) float
``uid`` / ``index``    list or (bs,)       prompt id for the group estimators
``reward_baselines``   (bs,) float         ReMax: reward of the greedy response
=====================  ==================  ==========================================

Validation raises :class:`~rlfleet.common.errors.InvalidArgument` naming the key and the
shapes, and happens before any model is touched, so a bad batch never half-updates.
Besides shapes it checks values, vectorised: masks hold only 0 and 1, token ids lie in
``[0, vocab_size)`` (an id outside would index past the embedding), position ids are
non-negative, and float inputs are finite everywhere, padding included (a NaN on a
masked position still reaches the gradient through ``0 * NaN``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from rlfleet.common.errors import InvalidArgument

Batch = dict[str, Any]

__all__ = [
    "Batch",
    "batch_size",
    "concat",
    "ensure_defaults",
    "index_select",
    "interleave_for_minibatches",
    "require",
    "split",
    "token_budget_groups",
    "validate_ppo_batch",
]

_INT_KEYS = ("input_ids", "responses", "position_ids")
_ID_DTYPES = (torch.int64, torch.int32)
_TOKEN_KEYS = ("input_ids", "responses")
_MASK_KEYS = ("attention_mask", "response_mask")
_SEQ_KEYS = ("input_ids", "attention_mask", "position_ids")
_RESP_KEYS = (
    "responses",
    "response_mask",
    "token_level_scores",
    "token_level_rewards",
    "old_log_probs",
    "rollout_log_probs",
    "ref_log_prob",
    "values",
    "advantages",
    "returns",
)
_FLOAT_FINITE = (
    "token_level_scores",
    "token_level_rewards",
    "scores",
    "old_log_probs",
    "rollout_log_probs",
    "ref_log_prob",
    "values",
    "advantages",
    "returns",
    "reward_baselines",
)


def _shape(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"{tuple(v.shape)} {v.dtype}".replace("torch.", "")
    if isinstance(v, list | tuple):
        return f"list of {len(v)}"
    return type(v).__name__


def batch_size(batch: Batch) -> int:
    """Rows of the batch (dim 0 of ``input_ids``, else of the first tensor)."""
    if "input_ids" in batch:
        return int(batch["input_ids"].shape[0])
    for v in batch.values():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return int(v.shape[0])
        if isinstance(v, list | tuple):
            return len(v)
    return 0


def require(batch: Batch, keys: Iterable[str], op: str) -> None:
    """Raise InvalidArgument naming every missing key and the keys present."""
    missing = [k for k in keys if k not in batch]
    if missing:
        present = {k: _shape(v) for k, v in batch.items()}
        raise InvalidArgument(
            f"{op} needs {missing}; the batch has {present}",
            field=missing[0],
            value=sorted(batch),
            code="MISSING_KEY",
        )


def _check_tensor(batch: Batch, key: str) -> torch.Tensor:
    v = batch[key]
    if not isinstance(v, torch.Tensor):
        raise InvalidArgument(f"expected a tensor, got {_shape(v)}", field=key, value=_shape(v))
    return v


def _bad_rows(bad: torch.Tensor) -> list[int]:
    rows: list[int] = torch.nonzero(bad.reshape(bad.shape[0], -1).any(dim=-1)).flatten().tolist()
    return rows


def _check_values(batch: Batch, vocab_size: int | None) -> None:
    """Masks 0/1, token ids in ``[0, vocab_size)``, position ids >= 0 (shapes checked)."""
    for key in _MASK_KEYS:
        if key not in batch:
            continue
        m = batch[key]
        if m.dtype == torch.bool:
            continue
        bad = (m != 0) & (m != 1)
        if bool(bad.any()):
            rows = _bad_rows(bad)
            found = torch.unique(m[bad])[:8].tolist()
            raise InvalidArgument(
                f"must hold only 0 and 1, found {found} in rows {rows[:8]}",
                field=key,
                value=found,
                sample_index=rows[0],
                code="BAD_MASK",
            )
    if "attention_mask" in batch and batch["attention_mask"].dim() == 2:
        empty = ~batch["attention_mask"].bool().any(dim=-1)
        if bool(empty.any()):  # no token to score, and a model forward over nothing fails
            rows = torch.nonzero(empty).flatten().tolist()
            raise InvalidArgument(
                f"rows {rows[:8]} have no real token (attention_mask all 0): every row needs "
                "at least its prompt",
                field="attention_mask",
                value=rows[:8],
                sample_index=rows[0],
                code="EMPTY_ROW",
            )
    for key in _TOKEN_KEYS:
        if key not in batch:
            continue
        ids = batch[key]
        bad = ids < 0
        if vocab_size is not None:
            bad |= ids >= vocab_size
        if bool(bad.any()):
            rows = _bad_rows(bad)
            found = ids[bad]
            span = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise InvalidArgument(
                f"token ids must lie in {span}, found {found[:8].tolist()} in rows {rows[:8]} "
                f"(min {int(found.min())}, max {int(found.max())})",
                field=key,
                value=int(found[0]),
                sample_index=rows[0],
                code="OUT_OF_VOCAB",
            )
    if "position_ids" in batch:
        pos = batch["position_ids"]
        bad = pos < 0
        if bool(bad.any()):
            rows = _bad_rows(bad)
            raise InvalidArgument(
                f"must be >= 0, found {pos[bad][:8].tolist()} in rows {rows[:8]}",
                field="position_ids",
                value=int(pos[bad][0]),
                sample_index=rows[0],
            )


def validate_ppo_batch(
    batch: Batch, op: str, required: Sequence[str], *, vocab_size: int | None = None
) -> None:
    """Check presence, dtypes, shapes and values of every trainer key in ``batch``.

    Every known key present is checked, not only ``required``: ``input_ids`` and masks
    are ``(bs, L)``, per-token keys ``(bs, R)`` with R = ``responses.shape[1]`` < L,
    ``responses`` equal the last R columns of ``input_ids``, masks hold only 0/1, token
    ids lie in ``[0, vocab_size)`` (``vocab_size`` None: only ``>= 0``), float keys are
    finite at every position, lists have ``bs`` entries.
    """
    require(batch, required, op)
    if "input_ids" in batch:
        ids = _check_tensor(batch, "input_ids")
        base, what = ids, "input_ids"
    elif "responses" in batch:  # response-side operations (compute_advantage)
        ids = None
        base, what = _check_tensor(batch, "responses"), "responses"
    else:
        return
    if base.dim() != 2:
        raise InvalidArgument(
            f"must be 2-D (bs, {'seq_len' if ids is not None else 'R'}), got {_shape(base)}",
            field=what,
            value=_shape(base),
        )
    bs, width = base.shape
    if bs == 0 or width == 0:
        raise InvalidArgument("the batch is empty", field=what, value=_shape(base))
    seq_len: int | None = int(width) if ids is not None else None
    if seq_len is None:  # the sequence keys share one length, longer than the response
        seq_keys = [k for k in _SEQ_KEYS if k in batch]
        for key in seq_keys:
            t = _check_tensor(batch, key)
            if t.dim() != 2 or t.shape[0] != bs or t.shape[1] <= width:
                raise InvalidArgument(
                    f"must be (bs={bs}, L) with L > R={width}, got {tuple(t.shape)}",
                    field=key,
                    value=_shape(t),
                    code="SHAPE_MISMATCH",
                )
        if seq_keys:
            seq_len = int(batch[seq_keys[0]].shape[1])
        if (
            op == "compute_advantage"
            and "attention_mask" not in batch
            and ("response_mask" not in batch)
        ):
            raise InvalidArgument(
                f"{op} needs attention_mask or response_mask (which response tokens count)",
                field="response_mask",
                value=sorted(batch),
                code="MISSING_KEY",
            )
    for key in _SEQ_KEYS:
        if key in batch and seq_len is not None:
            t = _check_tensor(batch, key)
            if tuple(t.shape) != (bs, seq_len):
                raise InvalidArgument(
                    f"shape {tuple(t.shape)} does not match {what} {(bs, seq_len)}",
                    field=key,
                    value=_shape(t),
                    code="SHAPE_MISMATCH",
                )
    for key in _INT_KEYS:
        if key in batch and batch[key].dtype not in _ID_DTYPES:
            dtype = str(batch[key].dtype).removeprefix("torch.")
            raise InvalidArgument(
                f"must hold int64 or int32 ids (what an embedding takes), got {dtype}",
                field=key,
                value=dtype,
            )
    resp_len: int | None = None
    if "responses" in batch:
        resp = _check_tensor(batch, "responses")
        longest = seq_len if seq_len is not None else resp.shape[1] + 1
        if resp.dim() != 2 or resp.shape[0] != bs or not 0 < resp.shape[1] < longest:
            raise InvalidArgument(
                f"must be (bs={bs}, R) with 0 < R < {longest}, got {tuple(resp.shape)}",
                field="responses",
                value=_shape(resp),
                code="SHAPE_MISMATCH",
            )
        resp_len = int(resp.shape[1])
        if ids is not None and not torch.equal(ids[:, -resp_len:], resp.to(ids.dtype)):
            raise InvalidArgument(
                f"must equal the last {resp_len} columns of input_ids {tuple(ids.shape)}",
                field="responses",
                value=_shape(resp),
            )
    for key in _RESP_KEYS[1:]:
        if key in batch:
            t = _check_tensor(batch, key)
            if resp_len is None:
                raise InvalidArgument(
                    f"{key} {tuple(t.shape)} given without responses", field="responses"
                )
            if tuple(t.shape) != (bs, resp_len):
                raise InvalidArgument(
                    f"shape {tuple(t.shape)} does not match responses {(bs, resp_len)}",
                    field=key,
                    value=_shape(t),
                    code="SHAPE_MISMATCH",
                )
    for key in ("scores", "reward_baselines"):
        if key in batch:
            t = _check_tensor(batch, key)
            if tuple(t.shape) != (bs,):
                raise InvalidArgument(
                    f"shape {tuple(t.shape)} must be ({bs},), one per sample",
                    field=key,
                    value=_shape(t),
                    code="SHAPE_MISMATCH",
                )
    for key in ("uid", "index"):
        if key in batch:
            v = batch[key]
            n = len(v) if isinstance(v, list | tuple) else int(v.shape[0]) if v.dim() else -1
            if n != bs:
                raise InvalidArgument(
                    f"has {n} entries, the batch has {bs} rows", field=key, value=_shape(v)
                )
    _check_values(batch, vocab_size)
    for key in _FLOAT_FINITE:
        if key not in batch:
            continue
        t = batch[key]
        if not t.is_floating_point():
            raise InvalidArgument("must be a float tensor", field=key, value=_shape(t))
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            rows = _bad_rows(bad.reshape(bs, -1))
            raise InvalidArgument(
                f"has NaN or inf in rows {rows[:8]} (shape {tuple(t.shape)})",
                field=key,
                value=_shape(t),
                sample_index=int(rows[0]),
                code="NOT_FINITE",
            )


def ensure_defaults(batch: Batch) -> Batch:
    """Fill the derivable keys: ``position_ids`` from the attention mask (left padding
    gives position 0 to the first real token) and ``response_mask``. Returns a new dict."""
    out = dict(batch)
    if "position_ids" not in out and "attention_mask" in out:
        am = out["attention_mask"].to(torch.int64)
        out["position_ids"] = (am.cumsum(dim=-1) - 1).clamp(min=0)
    if "response_mask" not in out and "responses" in out and "attention_mask" in out:
        r = out["responses"].shape[1]
        out["response_mask"] = out["attention_mask"][:, -r:].to(torch.float32)
    return out


def _rows(batch: Batch, start: int, end: int) -> Batch:
    """Rows ``[start, end)`` as views (no copy) of every per-sample value."""
    bs = batch_size(batch)
    out: Batch = {}
    for k, v in batch.items():
        tensor = isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == bs
        column = isinstance(v, list | tuple) and len(v) == bs
        out[k] = v[start:end] if tensor or column else v
    return out


def index_select(batch: Batch, idx: torch.Tensor) -> Batch:
    """Rows ``idx`` of every per-sample value (tensors with dim 0 == bs, lists), copied
    (a shard sent to another rank must not carry the whole batch's storage)."""
    bs = batch_size(batch)
    pos = idx.tolist()
    out: Batch = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == bs:
            out[k] = v.index_select(0, idx.to(v.device))
        elif isinstance(v, list | tuple) and len(v) == bs:
            out[k] = [v[i] for i in pos]
        else:
            out[k] = v
    return out


def split(batch: Batch, size: int) -> Iterator[Batch]:
    """Consecutive slices of ``size`` rows (the last may be shorter), as views of the
    batch (no copy: for use within a rank)."""
    bs = batch_size(batch)
    for start in range(0, bs, size):
        yield _rows(batch, start, min(start + size, bs))


def concat(parts: Sequence[Batch]) -> Batch:
    """Row-wise concatenation of batches with the same keys."""
    if len(parts) == 1:
        return dict(parts[0])
    out: Batch = {}
    for k, v in parts[0].items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.cat([p[k] for p in parts], dim=0)
        elif isinstance(v, list | tuple):
            out[k] = [x for p in parts for x in p[k]]
        else:
            out[k] = v
    return out


def interleave_for_minibatches(bs: int, mini: int, world: int) -> list[torch.Tensor]:
    """Row indices for each data-parallel rank so that, when every rank cuts its share
    into consecutive mini-batches of ``mini // world`` rows, mini-batch ``j`` of all ranks
    together is exactly rows ``[j * mini, (j + 1) * mini)`` of the batch: a 1-rank and an
    N-rank update see the same mini-batches."""
    per = mini // world
    idx = torch.arange(bs).reshape(bs // mini, world, per)
    return [idx[:, r, :].reshape(-1) for r in range(world)]


def _snake(lengths: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows longest first, dealt to ``groups`` bins back and forth (0..k-1, k-1..0, ...);
    returns each row's bin and the bins' loads."""
    order = torch.argsort(lengths, descending=True, stable=True)
    pos = torch.arange(lengths.numel())
    lap, rem = pos // groups, pos % groups
    bins = torch.where(lap % 2 == 0, rem, groups - 1 - rem)
    assignment = torch.empty_like(bins)
    assignment[order] = bins
    loads = torch.bincount(assignment, weights=lengths.to(torch.float64), minlength=groups)
    return assignment, loads


def token_budget_groups(
    lengths: torch.Tensor, budget: int, *, at_least: int = 1
) -> list[torch.Tensor]:
    """Rows cut into micro-batches of at most ``budget`` tokens (verl's dynamic batch
    size), balanced, as few as fit and at least ``at_least``.

    Args:
        lengths: ``(n,)`` tokens each row costs.
        budget: the most tokens in one group; a row longer than it is a group alone.
        at_least: the number of groups wanted when more than the fewest that fit (other
            ranks need that many); groups with the most rows are halved until there are
            that many, so none grows.

    Returns:
        Row indices of each group, ascending within a group; every row in exactly one.
    """
    n = int(lengths.numel())
    if n == 0:
        return []
    total = float(lengths.sum())
    k = min(n, max(1, -(-int(total) // max(budget, 1))))
    while True:  # at most n rounds: n groups of one row always "fit"
        assignment, loads = _snake(lengths, k)
        if k == n or float(loads.max()) <= budget:
            break
        k += 1
    groups = [torch.nonzero(assignment == g).flatten() for g in range(k)]
    groups = [g for g in groups if g.numel()]
    while len(groups) < min(at_least, n):
        big = max(range(len(groups)), key=lambda i: groups[i].numel())
        g = groups.pop(big)
        half = g.numel() // 2
        groups[big:big] = [g[:half], g[half:]]
    return groups
