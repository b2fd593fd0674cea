"""Checkpoints: atomic, versioned by step, the last K kept, the actor exportable to HF.

Layout under the checkpoint root (``<run dir>/checkpoints`` by default)::

    global_step_12/
        actor.safetensors    model, optimizer and lr scheduler state (full, unsharded;
        actor.json           a LoRA actor's model state is its adapters only): the
                             tensors, and the structure around them (state_file)
        critic.*             the same for the critic, when there is one
        rng_rank0.* ...      each rank's torch / python / numpy (/ cuda) RNG states
        trainer_state.json   global_step, weight_version, kl_coef, kl_loss_coef, world_size,
                             roles, extra_state_json (e.g. the dataloader position)
        huggingface/         the actor as a Hugging Face folder: config.json, the tokenizer,
                             safetensors weights (``trainer.save_hf``, on by default);
                             a LoRA actor's adapters merged into actor.model_path's weights
    latest_checkpointed_iteration.txt   "12" (verl's name)

Atomicity: everything is written into a hidden ``.tmp-global_step_12-<id>`` folder,
every file and the folder fsync-ed, then the folder is renamed into place and the
``latest`` file replaced (write, fsync, rename). A crash at any point leaves the previous
checkpoint complete and ``latest`` pointing at it; leftover temporary folders are
ignored by :func:`load` and removed by the next save.

States are full (unsharded) state dicts, so a checkpoint written by N ranks loads on any
number of ranks (RNG states are restored per rank when the world size is the same).

No code from a file: a state is a safetensors file (tensors: a header and raw bytes)
and a JSON file (the dicts, lists, numbers and strings around them), see
:mod:`rlfleet.trainer.state_file`; nothing is unpickled. The python and numpy RNG
states, which ``random`` / ``numpy`` give as tuples holding a numpy array, are stored as
a dict of tensors and numbers and rebuilt on load. A checkpoint of an earlier version
(``actor.pt`` ...) still loads, with ``torch.load(weights_only=True)``, which only
rebuilds tensors and plain containers and refuses any other pickled object
(:class:`CheckpointRefused`).

Hugging Face folder: written on rank 0 from the actor's full state the save has already
gathered (no second gather; on a GPU or multi-rank trainer it is on CPU, complete on rank
0), with the model config and the tokenizer of ``actor.model_path`` /
``actor.tokenizer_path`` (:func:`write_hf_folder`). It is part of the temporary folder, so
it appears atomically with the rest. ``rlfleet export`` (:mod:`rlfleet.trainer.export_cli`)
copies it out, or rebuilds it the same way for a checkpoint saved without one.

Paths: a checkpoint path given to :func:`save` or :func:`load` (from a ``SaveCheckpoint``
/ ``LoadCheckpoint`` call, say) must resolve, symlinks and ``..`` followed, inside the
trainer's run directory (``trainer.default_local_dir``); a relative path is taken
relative to it. Anything else is ``InvalidArgument`` on ``path``
(:func:`checkpoint_root`), so a save and its stale-folder cleanup never write or delete
outside the run directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import pickle
import shutil
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rlfleet.common.errors import FailedPrecondition, InvalidArgument, NotFound
from rlfleet.trainer import state_file
from rlfleet.trainer.lora import is_adapter_name, merge_state

if TYPE_CHECKING:
    from rlfleet.common.config import Config
    from rlfleet.trainer.core import TrainerCore

__all__ = [
    "HF_DIR",
    "LATEST_FILE",
    "CheckpointRefused",
    "checkpoint_root",
    "find_latest",
    "has_state",
    "load",
    "read_rank_state",
    "read_state",
    "read_torch",
    "save",
    "steps",
    "write_hf_folder",
]

logger = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.json"
HF_DIR = "huggingface"
_PREFIX = "global_step_"


class CheckpointRefused(InvalidArgument):
    """A checkpoint file holds something other than tensors and plain containers (a
    pickled object whose loading could run code): it is not loaded."""


def resume_root(core: TrainerCore) -> Path | None:
    """The checkpoint the trainer's own config names for ``resume_mode: resume_path``
    (absolute; relative ones are the run dir's), resolved: a folder outside the run dir
    that loads (never saves) may read, as verl resumes from another run's checkpoint.
    It comes from the operator's config at start, never from a request."""
    t = core.config.trainer
    if t.resume_mode != "resume_path" or not t.resume_from_path:
        return None
    given = Path(t.resume_from_path)
    if not given.is_absolute():
        return None  # under the run dir: confined as it is
    return given.resolve()


def checkpoint_root(
    core: TrainerCore, path: str | None = None, *, also: Path | None = None
) -> Path:
    """The resolved folder ``path`` names, confined to the run directory (or to
    ``also``, a folder from the trainer's own config: :func:`resume_root`).

    None or ``""``: ``<run dir>/checkpoints``. A relative path is relative to the run
    dir. The result (symlinks and ``..`` resolved) must be the run dir or below it,
    else ``InvalidArgument`` on ``path``.
    """
    run_dir = core.config.run_dir().resolve()
    if path and (
        "\x00" in path
        or any(len(p.encode()) > 255 for p in Path(path).parts)
        or len(str(run_dir / path).encode()) > 3072  # with the step folder and its files:
    ):  # under PATH_MAX (4,096 on Linux)
        raise InvalidArgument(
            f"checkpoint path {path[:200]!r} is no file name (a NUL byte, a part over 255 "
            "bytes, or over 3,072 bytes in all)",
            field="path",
            value=path[:200],
        )
    if not path:
        given = run_dir / "checkpoints"
    else:
        given = Path(path)
        if not given.is_absolute():
            given = run_dir / given
    resolved = given.resolve()
    if also is not None and resolved.is_relative_to(also):
        return resolved
    if not resolved.is_relative_to(run_dir):
        raise InvalidArgument(
            f"checkpoint path {path!r} resolves to {str(resolved)!r}, outside the trainer's "
            f"run directory {str(run_dir)!r} (trainer.default_local_dir); give a path "
            "inside it, or relative to it",
            field="path",
            value=path,
        )
    return resolved


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


def _write_state(obj: Any, stem: Path) -> None:
    state_file.write_state(obj, stem)


def has_state(stem: Path) -> bool:
    """Whether a state is saved at ``stem``, in this version's files or an earlier
    version's ``<stem>.pt``."""
    return state_file.exists(stem) or stem.with_name(stem.name + ".pt").is_file()


def read_state(stem: Path) -> Any:
    """A state :func:`save` wrote as ``<stem>.safetensors`` + ``<stem>.json``, or, in a
    checkpoint of an earlier version, as ``<stem>.pt`` (:func:`read_torch`).

    Raises:
        NotFound: neither is there.
        CheckpointRefused: the files do not hold such a state.
    """
    if state_file.exists(stem):
        try:
            return state_file.read_state(stem)
        except (ValueError, OSError, json.JSONDecodeError) as e:
            raise CheckpointRefused(
                f"{stem.name}: {e}", field="path", value=str(stem.parent)
            ) from e
    legacy = stem.with_name(stem.name + ".pt")
    if legacy.is_file():
        return read_torch(legacy)
    raise NotFound(
        f"{stem.name}.safetensors / {stem.name}.json not in {stem.parent}",
        field="path",
        value=str(stem.parent),
    )


def read_torch(path: Path) -> Any:
    """``torch.load`` that never unpickles an object: a file holding anything but
    tensors and plain containers raises :class:`CheckpointRefused`."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointRefused(
            f"{path.name} holds objects other than tensors and plain containers; "
            f"refusing to unpickle it ({str(e).splitlines()[0]})",
            field="path",
            value=str(path),
        ) from e


def _rng_to_file(rng: dict[str, Any]) -> dict[str, Any]:
    """RNG states as tensors and numbers (what ``weights_only`` loads); see
    :func:`_rng_from_file`."""
    version, mt, gauss = rng["python"]
    name, keys, pos, has_gauss, cached = rng["numpy"]
    out: dict[str, Any] = {
        "torch": rng["torch"],
        "python_version": int(version),
        "python_mt": torch.tensor(mt, dtype=torch.int64),
        "python_gauss": gauss,
        "numpy_name": str(name),
        "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "numpy_pos": int(pos),
        "numpy_has_gauss": int(has_gauss),
        "numpy_cached_gaussian": float(cached),
    }
    if "cuda" in rng:
        out["cuda"] = list(rng["cuda"])
    return out


def _rng_from_file(state: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`_rng_to_file`: the states ``random.setstate`` and
    ``np.random.set_state`` take."""
    rng: dict[str, Any] = {
        "torch": state["torch"],
        "python": (
            int(state["python_version"]),
            tuple(int(x) for x in state["python_mt"].tolist()),
            state["python_gauss"],
        ),
        "numpy": (
            state["numpy_name"],
            state["numpy_keys"].numpy().astype(np.uint32),
            int(state["numpy_pos"]),
            int(state["numpy_has_gauss"]),
            float(state["numpy_cached_gaussian"]),
        ),
    }
    if "cuda" in state:
        rng["cuda"] = list(state["cuda"])
    return rng


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
    """Save every model, optimizer, scheduler, RNG state and the counters atomically,
    and the actor as ``huggingface/`` when ``export_hf`` or ``trainer.save_hf``.

    Returns ``(checkpoint folder, bytes written, seconds)``. Collective: called on rank
    0 of a multi-rank trainer, it runs the gathers on every rank.
    """
    start = time.perf_counter()
    root = checkpoint_root(core, path)
    step = core.global_step if step is None or step == 0 else step
    if not 0 <= step < 2**53:  # a JSON integer, and a folder name the loader sorts
        raise InvalidArgument("must be in [0, 2^53)", field="step", value=step)
    if extra_state_json:
        try:
            json.loads(extra_state_json)
        except (ValueError, RecursionError) as e:  # loaded back with the checkpoint
            raise InvalidArgument(
                f"is not JSON: {str(e)[:200]}",
                field="extra_state_json",
                value=extra_state_json[:64],
            ) from e
    roles = [r for r in ("actor", "critic") if r in core.roles]
    try:  # before any state is gathered: a path that names a file is the caller's
        root.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        raise InvalidArgument(
            f"checkpoint path {str(root)!r} is not a folder ({e.strerror})",
            field="path",
            value=path or str(root),
        ) from None
    with core.lock:
        results = core.gather_states(roles)
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale_tmp(root)
        final = root / f"{_PREFIX}{step}"
        tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            for role in roles:
                _write_state(results[0][role], tmp / role)
            for rank, res in enumerate(results):
                _write_state(_rng_to_file(res["rng"]), tmp / f"rng_rank{rank}")
            state = {
                "step": step,
                "global_step": core.state.global_step,
                "weight_version": core.state.weight_version,
                "kl_coef": core.kl_ctrl.value,
                "kl_loss_coef": core.kl_loss_ctrl.value,
                "world_size": core.world_size,
                "roles": roles,
                "extra_state_json": extra_state_json,
            }
            _write_text(json.dumps(state, indent=2), tmp / STATE_FILE)
            if export_hf or core.config.trainer.save_hf:
                write_hf_folder(results[0]["actor"]["model"], core.config, tmp / HF_DIR)
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
        # A fresh name, created here (never a link someone left in its place).
        latest_tmp = root / f".{LATEST_FILE}.{uuid.uuid4().hex[:8]}.tmp"
        fd = os.open(latest_tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(str(step))
        _fsync_file(latest_tmp)
        latest_tmp.replace(root / LATEST_FILE)
        _fsync_file(root)
    _keep_last(root, _keep(core), step)
    nbytes = sum(p.stat().st_size for p in final.rglob("*") if p.is_file())
    seconds = time.perf_counter() - start
    logger.info("checkpoint %s: %d bytes in %.2fs", final, nbytes, seconds)
    return final, nbytes, seconds


def write_hf_folder(model_state: Mapping[str, torch.Tensor], config: Config, out: Path) -> None:
    """Write the actor as a Hugging Face folder that ``AutoModelForCausalLM`` and
    ``AutoTokenizer`` load: ``config.json`` (and ``generation_config.json``) of
    ``actor.model_path``, safetensors of ``model_state`` (Hugging Face names, as both
    backends' full states have them; moved to CPU, dtype kept), the tokenizer of
    ``actor.tokenizer_path``.

    A state that does not fill that model (a parameter missing, or a name it does not
    have) is ``FailedPrecondition`` on ``actor.model_path``, and nothing is written.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    actor = config.actor
    kw: dict[str, Any] = {"trust_remote_code": actor.trust_remote_code, "local_files_only": True}
    hf_config = AutoConfig.from_pretrained(actor.model_path, **kw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            hf_config, trust_remote_code=actor.trust_remote_code
        )
    state = {name: t.detach().to("cpu") for name, t in model_state.items()}
    if any(is_adapter_name(name) for name in state):
        state = _merged_lora_state(state, config)
    result = model.load_state_dict(state, strict=False, assign=True)
    if getattr(hf_config, "tie_word_embeddings", False):
        model.tie_weights()  # a tied head is absent from some states (megatron's)
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing or result.unexpected_keys:
        raise FailedPrecondition(
            f"the actor's saved state does not fit the model at {actor.model_path!r}: "
            f"missing {missing[:5]} ({len(missing)} in all), unknown "
            f"{list(result.unexpected_keys)[:5]} ({len(result.unexpected_keys)} in all)",
            field="actor.model_path",
            value=actor.model_path,
        )
    # A model folder without generation_config.json keeps the one config.json gives.
    with contextlib.suppress(OSError):
        model.generation_config = GenerationConfig.from_pretrained(
            actor.model_path, local_files_only=True
        )
    model.save_pretrained(out)
    tokenizer = actor.tokenizer_path or actor.model_path
    AutoTokenizer.from_pretrained(tokenizer, **kw).save_pretrained(out)


def _merged_lora_state(adapter: dict[str, torch.Tensor], config: Config) -> dict[str, Any]:
    """A LoRA actor's saved adapters merged into the base weights of
    ``actor.model_path`` (:func:`rlfleet.trainer.lora.merge_state`)."""
    from safetensors.torch import load_file

    actor = config.actor
    if actor.lora_rank <= 0:
        raise FailedPrecondition(
            "the actor's saved state holds LoRA adapters but the run's actor.lora_rank is "
            f"{actor.lora_rank}",
            field="actor.lora_rank",
            value=actor.lora_rank,
        )
    folder = Path(actor.model_path)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FailedPrecondition(
            f"merging the LoRA adapters needs the base model's safetensors in "
            f"actor.model_path {actor.model_path!r}, which holds none",
            field="actor.model_path",
            value=actor.model_path,
        )
    base: dict[str, torch.Tensor] = {}
    for f in files:
        base.update(load_file(str(f)))
    try:
        return merge_state(base, adapter, actor.lora_alpha / actor.lora_rank)
    except KeyError as e:
        raise FailedPrecondition(
            f"the LoRA adapters do not fit the model at {actor.model_path!r}: {e.args[0]}",
            field="actor.model_path",
            value=actor.model_path,
        ) from e


def _keep(core: TrainerCore) -> int | None:
    t = core.config.trainer
    # A step's folder holds every role: the fewer kept wins, among the roles held.
    critic = t.max_critic_ckpt_to_keep if "critic" in core.roles else None
    keeps = [k for k in (t.max_actor_ckpt_to_keep, critic) if k is not None]
    return min(keeps) if keeps else None


def steps(root: Path) -> list[int]:
    """The steps of the complete checkpoints under ``root``, ascending."""
    out = []
    for p in root.iterdir() if root.is_dir() else ():
        if p.is_dir() and p.name.startswith(_PREFIX) and (p / STATE_FILE).is_file():
            suffix = p.name.removeprefix(_PREFIX)
            if suffix.isdigit():
                out.append(int(suffix))
    return sorted(out)


def _keep_last(root: Path, keep: int | None, saved: int) -> None:
    """Keep ``saved`` (the step just saved, which ``latest`` names) and the ``keep - 1``
    highest other steps. A save below steps already there (a run resumed from an older
    checkpoint) drops the lowest others, never the checkpoint it just wrote."""
    if keep is None:
        return
    others = [s for s in steps(root) if s != saved]
    for step in others[: max(0, len(others) - (keep - 1))]:
        shutil.rmtree(root / f"{_PREFIX}{step}", ignore_errors=True)


def _remove_stale_tmp(root: Path) -> None:
    """Remove the leftovers of interrupted saves directly under ``root`` (a confined
    root, see :func:`checkpoint_root`); a symlink is unlinked, never followed."""
    for p in root.glob(".tmp-*"):
        if p.is_symlink() or not p.is_dir():
            p.unlink(missing_ok=True)
        else:
            shutil.rmtree(p, ignore_errors=True)


def find_latest(root: Path) -> Path | None:
    """The checkpoint ``latest`` names (if complete), else the highest complete step."""
    latest = root / LATEST_FILE
    if latest.is_file():
        text = latest.read_text(encoding="utf-8").strip()
        candidate = root / f"{_PREFIX}{text}"
        if text.isdigit() and (candidate / STATE_FILE).is_file():
            return candidate
    found = steps(root)
    return root / f"{_PREFIX}{found[-1]}" if found else None


def read_rank_state(
    path: str, roles: list[str], rank: int, world_size: int
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """What one rank loads: the full states of ``roles`` and its RNG state (None when the
    checkpoint was written by a different number of ranks)."""
    folder = Path(path)
    states = {role: read_state(folder / role) for role in roles}
    meta = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
    rng = None
    rng_stem = folder / f"rng_rank{rank}"
    if meta.get("world_size") == world_size and has_state(rng_stem):
        rng = _rng_from_file(read_state(rng_stem))
    return states, rng


def _read_meta(folder: Path, path: str | None) -> dict[str, Any]:
    """``trainer_state.json`` of ``folder``, checked before anything is restored:
    counters are integers in [0, 2^53), ``roles`` a list of known roles with the actor.

    Raises:
        CheckpointRefused: naming ``path``.
    """
    try:
        meta = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointRefused(
            f"{folder / STATE_FILE} is unreadable: {e}", field="path", value=path or str(folder)
        ) from None

    def counter(key: str, required: bool = True) -> bool:
        v = meta.get(key)
        if v is None and not required:
            return True
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**53

    def number(key: str, required: bool = True) -> bool:
        v = meta.get(key)
        if v is None and not required:
            return True
        return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

    roles = meta.get("roles") if isinstance(meta, dict) else None
    ok = (
        isinstance(meta, dict)
        and isinstance(roles, list)
        and "actor" in roles
        and all(r in ("actor", "critic", "ref") for r in roles)
        and counter("global_step")
        and counter("weight_version")
        and counter("step", required=False)
        and number("kl_coef")
        and number("kl_loss_coef", required=False)
    )
    if not ok:
        raise CheckpointRefused(
            f"{folder / STATE_FILE} is not a trainer state (roles a list with the actor; "
            "global_step, weight_version and step integers in [0, 2^53); finite KL "
            "coefficients)",
            field="path",
            value=path or str(folder),
        )
    return dict(meta)


def load(core: TrainerCore, path: str | None = None) -> tuple[Path, int, str]:
    """Load a checkpoint folder, or the latest one under a root (None: the configured
    root). Returns ``(folder, step it was saved as, extra_state_json)``."""
    also = resume_root(core)
    given = checkpoint_root(core, path, also=also)
    folder = given if (given / STATE_FILE).is_file() else find_latest(given)
    if folder is None:
        raise NotFound(f"no checkpoint in {given}", field="path", value=str(given))
    # The folder the root's latest file (or its newest step) names: confined as well
    # (a link in the run dir must not lead the load outside it).
    folder = checkpoint_root(core, str(folder), also=also)
    meta = _read_meta(folder, path)
    roles = [r for r in meta["roles"] if r in core.roles]
    with core.lock:
        core.run_on_ranks(
            "load_checkpoint", path=str(folder), roles=roles, world_size=core.world_size
        )
        # The schedules are the checkpoint's now, their total included: the next
        # TrainStep's total_steps applies again even if it equals the one before.
        core.total_training_steps = None
        core.restore_state(
            global_step=int(meta["global_step"]),
            weight_version=int(meta["weight_version"]),
            kl_coef=float(meta["kl_coef"]),
            kl_loss_coef=float(meta["kl_loss_coef"]) if "kl_loss_coef" in meta else None,
        )
    return (
        folder,
        int(meta.get("step", core.state.global_step)),
        str(meta.get("extra_state_json", "")),
    )
