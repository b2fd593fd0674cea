"""Datasets of the scheduler: preprocessing into verl's parquet schema, and reading it.

* :mod:`~rlfleet.scheduler.data.preprocess` -- ``rlfleet preprocess`` (torch-free).
* :mod:`~rlfleet.scheduler.data.recipes` -- the schema contract and per-dataset rules.
* :mod:`~rlfleet.scheduler.data.sources` -- reading jsonl / json / parquet / hub inputs.
* :mod:`~rlfleet.scheduler.data.dataset` -- :class:`RLHFDataset` and its collate function.
* :mod:`~rlfleet.scheduler.data.sampler` -- the resumable sampler and prompt loader.

Importing this package imports nothing heavy; the names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlfleet.scheduler.data.dataset import RLHFDataset, collate_fn
    from rlfleet.scheduler.data.sampler import PromptLoader, ResumableSampler

_LAZY = {
    "RLHFDataset": "rlfleet.scheduler.data.dataset",
    "collate_fn": "rlfleet.scheduler.data.dataset",
    "PromptLoader": "rlfleet.scheduler.data.sampler",
    "ResumableSampler": "rlfleet.scheduler.data.sampler",
}

__all__ = ["PromptLoader", "RLHFDataset", "ResumableSampler", "collate_fn"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
