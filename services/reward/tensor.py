"""The token-level reward: a response's score placed on its last valid token.

DESIGN.md puts this step on the trainer side (the reward service is text in,
scores out); the trainer and :meth:`RewardManager.score_batch` both call this one
helper, so the placement rule lives in one place. torch when the mask is a torch
tensor, numpy otherwise: importing this module imports neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["last_valid_positions", "token_level_scores"]


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".", 1)[0] == "torch"


def last_valid_positions(response_mask: Any) -> list[int]:
    """Per row, the index of the last 1 in ``response_mask`` ``[B, T]``; -1 for an empty row."""
    mask = response_mask.detach().cpu().numpy() if _is_torch(response_mask) else response_mask
    mask = np.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"response_mask must be [batch, tokens], got shape {mask.shape}")
    valid = mask != 0
    width = mask.shape[1]
    last = width - 1 - np.argmax(valid[:, ::-1], axis=1)
    return [int(p) if row.any() else -1 for p, row in zip(last, valid, strict=True)]


def token_level_scores(scores: Sequence[float], response_mask: Any) -> Any:
    """Scores ``[B]`` -> token-level rewards ``[B, T]``, zero except at the last valid token.

    Args:
        scores: one scalar per response.
        response_mask: ``[B, T]`` 1 for response tokens, 0 for padding (torch or numpy).

    Returns:
        float32 ``[B, T]``, a torch tensor on the mask's device when the mask is a
        torch tensor, else a numpy array. A row with no valid token stays all zero.
    """
    positions = last_valid_positions(response_mask)
    if len(positions) != len(scores):
        raise ValueError(f"{len(scores)} scores for a mask of {len(positions)} rows")
    rows = [i for i, p in enumerate(positions) if p >= 0]
    cols = [positions[i] for i in rows]
    vals = [float(scores[i]) for i in rows]
    if _is_torch(response_mask):
        import torch

        out = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
        if rows:
            out[torch.tensor(rows), torch.tensor(cols)] = torch.tensor(vals, device=out.device)
        return out
    out_np = np.zeros(np.asarray(response_mask).shape, dtype=np.float32)
    if rows:
        out_np[rows, cols] = vals
    return out_np
