"""Checkpoints: atomic, versioned by step, the last K kept, the actor exportable to HF.

Layout under the checkpoint root (``<run dir>/checkpoints`` by default)::

    global_step_12/
        actor.pt             model, optimizer and lr scheduler state (full, unsharded)
        critic.pt            the same for the critic, when there is one
        rng_rank0.pt ...     each rank's torch / python / numpy (/ cuda) RNG states
        trainer_state.json   global_step, weight_version, kl_coef, world_size, roles,
                             extra_state_json (e.g. the dataloader position)
        huggingface/         the actor as a Hugging Face folder (on request)
    latest_checkpointed_iteration.txt   "12" (verl's name)

Atomicity: everything is written into a hidden ``.tmp-global_step_12-<id>`` folder,
every file and the folder fsync-ed, then the folder is renamed into place and the
``latest`` file replaced (write, fsync, rename). A crash at any point leaves the previous
checkpoint complete and ``latest`` pointing at it; leftover temporary folders are
ignored by :func:`load` and removed by the next save.

States are full (unsharded) state dicts, so a checkpoint written by N ranks loads on any
number of ranks (RNG states are restored per rank when the world size is the same).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlfleet.common.errors import NotFound

if TYPE_CHECKING:
    from rlfleet.trainer.core import TrainerCore

__all__ = ["LATEST_FILE", "checkpoint_root", "find_latest", "load", "read_rank_state", "save"]

logger = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.json"
_PREFIX = "global_step_"


def checkpoint_root(core: TrainerCore, path: str | None = None) -> Path:
    return Path(path) if path else core.config.run_dir() / "checkpoints"


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            _fsync_file(Path(dirpath) / name)
        _fsync_file(Path(dirpath))


def _write_torch(obj: Any, path: Path) -> None:
    torch.save(obj, path)


def _write_text(text: str, path: Path) -> None:
    path.write_text(text, encoding="utf-8")


def save(
    core: TrainerCore,
    path: str | None = None,
    *,
    step: int | None = None,
    extra_state_json: str = "",
    export_hf: bool = False,
) -> tuple[Path, int, float]:
    """Save every model, optimizer, scheduler, RNG state and the counters atomically.

    Returns ``(checkpoint folder, bytes written, seconds)``. Collective: called on rank
    0 of a multi-rank trainer, it runs the gathers on every rank.
    """
    start = time.perf_counter()
    root = checkpoint_root(core, path)
    step = core.global_step if step is None or step == 0 else step
    roles = [r for r in ("actor", "critic") if r in core.roles]
    with core.lock:
        results = core.gather_states(roles)
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale_tmp(root)
        final = root / f"{_PREFIX}{step}"
        tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            for role in roles:
                _write_torch(results[0][role], tmp / f"{role}.pt")
            for rank, res in enumerate(results):
                _write_torch(res["rng"], tmp / f"rng_rank{rank}.pt")
            state = {
                "step": step,
                "global_step": core.state.global_step,
                "weight_version": core.state.weight_version,
                "kl_coef": core.kl_ctrl.value,
                "world_size": core.world_size,
                "roles": roles,
                "extra_state_json": extra_state_json,
            }
            _write_text(json.dumps(state, indent=2), tmp / STATE_FILE)
            if export_hf:
                core.export_hf(str(tmp / "huggingface"))
            _fsync_tree(tmp)
            if final.exists():  # re-saving the same step: replace it
                old = root / f".tmp-old-{final.name}-{uuid.uuid4().hex[:8]}"
                final.rename(old)
                shutil.rmtree(old, ignore_errors=True)
            tmp.rename(final)
            _fsync_file(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        latest_tmp = root / f".{LATEST_FILE}.tmp"
        _write_text(str(step), latest_tmp)
        _fsync_file(latest_tmp)
        latest_tmp.replace(root / LATEST_FILE)
        _fsync_file(root)
    _keep_last(root, _keep(core))
    nbytes = sum(p.stat().st_size for p in final.rglob("*") if p.is_file())
    seconds = time.perf_counter() - start
    logger.info("checkpoint %s: %d bytes in %.2fs", final, nbytes, seconds)
    return final, nbytes, seconds


def _keep(core: TrainerCore) -> int | None:
    t = core.config.trainer
    keeps = [k for k in (t.max_actor_ckpt_to_keep, t.max_critic_ckpt_to_keep) if k is not None]
    return min(keeps) if keeps else None


def _steps(root: Path) -> list[int]:
    out = []
    for p in root.iterdir() if root.is_dir() else ():
        if p.is_dir() and p.name.startswith(_PREFIX) and (p / STATE_FILE).is_file():
            suffix = p.name.removeprefix(_PREFIX)
            if suffix.isdigit():
                out.append(int(suffix))
    return sorted(out)


def _keep_last(root: Path, keep: int | None) -> None:
    if keep is None:
        return
    for step in _steps(root)[:-keep]:
        shutil.rmtree(root / f"{_PREFIX}{step}", ignore_errors=True)


def _remove_stale_tmp(root: Path) -> None:
    for p in root.glob(".tmp-*"):
        shutil.rmtree(p, ignore_errors=True)


def find_latest(root: Path) -> Path | None:
    """The checkpoint ``latest`` names (if complete), else the highest complete step."""
    latest = root / LATEST_FILE
    if latest.is_file():
        text = latest.read_text(encoding="utf-8").strip()
        candidate = root / f"{_PREFIX}{text}"
        if text.isdigit() and (candidate / STATE_FILE).is_file():
            return candidate
    steps = _steps(root)
    return root / f"{_PREFIX}{steps[-1]}" if steps else None


def read_rank_state(
    path: str, roles: list[str], rank: int, world_size: int
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """What one rank loads: the full states of ``roles`` and its RNG state (None when the
    checkpoint was written by a different number of ranks)."""
    folder = Path(path)
    states = {
        role: torch.load(folder / f"{role}.pt", map_location="cpu", weights_only=False)
        for role in roles
    }
    meta = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
    rng = None
    rng_file = folder / f"rng_rank{rank}.pt"
    if meta.get("world_size") == world_size and rng_file.is_file():
        rng = torch.load(rng_file, map_location="cpu", weights_only=False)
    return states, rng


def load(core: TrainerCore, path: str | None = None) -> tuple[Path, int, str]:
    """Load a checkpoint folder, or the latest one under a root (None: the configured
    root). Returns ``(folder, step it was saved as, extra_state_json)``."""
    given = checkpoint_root(core, path)
    folder = given if (given / STATE_FILE).is_file() else find_latest(given)
    if folder is None:
        raise NotFound(f"no checkpoint in {given}", field="path", value=str(given))
    meta = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
    roles = [r for r in meta["roles"] if r in core.roles]
    with core.lock:
        core._check(
            core.dispatcher.run(
                "load_checkpoint", None, path=str(folder), roles=roles, world_size=core.world_size
            )
        )
        core.state.global_step = int(meta["global_step"])
        core.state.weight_version = int(meta["weight_version"])
        core.kl_ctrl.value = float(meta["kl_coef"])
        core.state.kl_coef = core.kl_ctrl.value
    return (
        folder,
        int(meta.get("step", core.state.global_step)),
        str(meta.get("extra_state_json", "")),
    )
