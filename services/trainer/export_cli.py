"""`rlfleet export`: a saved checkpoint of a run as a Hugging Face folder.

::

    rlfleet export --run outputs/runs/rlfleet/tiny --out outputs/models/tiny-ppo
    rlfleet export --run outputs/runs/rlfleet/tiny --step 40 --out outputs/models/tiny-40

``--run`` is the run directory (``trainer.default_local_dir``: ``checkpoints/`` and
``config.yaml``); its ``checkpoints/`` folder itself is taken too. Without ``--step``, the
latest complete checkpoint. The step's ``huggingface/`` folder (every save writes one
while ``trainer.save_hf`` is on) is copied. A checkpoint saved without one is rebuilt:
the actor's weights from its state (``actor.safetensors`` + ``actor.json``, or the
``actor.pt`` of an earlier version read with ``torch.load(weights_only=True)``: no code
from the file runs), the model config and the tokenizer from ``actor.model_path``
/ ``actor.tokenizer_path`` of the run's ``config.yaml``.

The folder is written beside ``--out`` under a temporary name and renamed into place:
``--out`` ends up complete or not at all. ``--out`` must not exist or be an empty folder.
Errors are one line on stderr, exit 2: a run directory that does not exist, no
checkpoint in it, a step that was not saved (the saved ones are listed), an ``--out``
that is not empty, a checkpoint that cannot be rebuilt.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import uuid
from pathlib import Path

from rlfleet.common.errors import FailedPrecondition, InvalidArgument, NotFound, RlfleetError

__all__ = ["add_arguments", "export", "run"]

_CONFIG_FILE = "config.yaml"
_CHECKPOINTS = "checkpoints"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--run", required=True, help="run directory (trainer.default_local_dir) or its checkpoints/"
    )
    parser.add_argument(
        "--step", type=int, default=None, help="the global_step_N to export; default: the latest"
    )
    parser.add_argument(
        "--out", required=True, help="the Hugging Face folder to write (absent, or empty)"
    )


def run(args: argparse.Namespace) -> int:
    from rlfleet.common.config import ConfigError

    try:
        out, step, source = export(Path(args.run), Path(args.out), step=args.step)
    except (RlfleetError, ConfigError, OSError) as e:
        print(f"rlfleet export: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(json.dumps({"step": step, "out": str(out), "source": source}))
    return 0


def export(run_dir: Path, out: Path, *, step: int | None = None) -> tuple[Path, int, str]:
    """Write checkpoint ``step`` (None: the latest) of ``run_dir`` to ``out`` as a Hugging
    Face folder. Returns ``(out, step, source)``, ``source`` being ``"huggingface"``
    (copied) or ``"actor"`` (rebuilt from the actor's state). See the module docstring for the errors."""
    from rlfleet.trainer import checkpoint

    root, config_file = _layout(run_dir)
    folder = _step_folder(root, step)
    _check_out(out)
    saved = folder / checkpoint.HF_DIR
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{uuid.uuid4().hex[:8]}"
    try:
        if (saved / "config.json").is_file():
            shutil.copytree(saved, tmp)
            source = "huggingface"
        else:
            _rebuild(folder, config_file, tmp)
            source = "actor"
        if out.is_dir():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out, int(folder.name.removeprefix("global_step_")), source


def _layout(run_dir: Path) -> tuple[Path, Path]:
    """The checkpoint root and the config file of ``run_dir`` (a run directory, or its
    ``checkpoints/`` folder)."""
    from rlfleet.trainer import checkpoint

    if not run_dir.is_dir():
        raise NotFound(
            f"run directory {str(run_dir)!r} does not exist", field="--run", value=str(run_dir)
        )
    root = run_dir / _CHECKPOINTS
    if not root.is_dir() and checkpoint.steps(run_dir):
        return run_dir, run_dir.parent / _CONFIG_FILE
    if not checkpoint.steps(root):
        raise NotFound(
            f"no checkpoint in {str(root)!r} (a run saves them every trainer.save_freq steps)",
            field="--run",
            value=str(run_dir),
        )
    return root, run_dir / _CONFIG_FILE


def _step_folder(root: Path, step: int | None) -> Path:
    from rlfleet.trainer import checkpoint

    saved = checkpoint.steps(root)
    latest = checkpoint.find_latest(root)
    if step is None and latest is not None:
        return latest
    if step not in saved:
        raise NotFound(
            f"no checkpoint of step {step} in {str(root)!r} (saved steps: {saved})",
            field="--step",
            value=step,
        )
    return root / f"global_step_{step}"


def _check_out(out: Path) -> None:
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise InvalidArgument(
            f"{str(out)!r} exists and is not a folder; give a new or empty folder",
            field="--out",
            value=str(out),
        )
    if out.is_dir() and any(out.iterdir()):
        raise InvalidArgument(
            f"{str(out)!r} is not empty; give a new or empty folder",
            field="--out",
            value=str(out),
        )


def _rebuild(folder: Path, config_file: Path, out: Path) -> None:
    """The Hugging Face folder of a checkpoint saved without one (see the module
    docstring)."""
    from rlfleet.common.config import load_config
    from rlfleet.trainer import checkpoint

    actor_file = folder / "actor"
    has_actor = checkpoint.has_state(actor_file)
    if not config_file.is_file() or not has_actor:
        missing = [str(config_file)] if not config_file.is_file() else []
        missing += [] if has_actor else [f"{actor_file}.safetensors / .json"]
        raise FailedPrecondition(
            f"{str(folder)!r} holds no huggingface/ folder, and rebuilding one needs "
            f"{missing}, which do not exist",
            field="--run",
            value=str(folder),
        )
    config = load_config(config_file)
    state = checkpoint.read_state(actor_file)
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise FailedPrecondition(
            f"{str(actor_file)!r} holds no model state (a dict under 'model')",
            field="--run",
            value=str(actor_file),
        )
    try:
        checkpoint.write_hf_folder(state["model"], config, out)
    except OSError as e:
        raise FailedPrecondition(
            f"cannot rebuild {str(folder)!r} from actor.model_path "
            f"{config.actor.model_path!r} / actor.tokenizer_path "
            f"{config.actor.tokenizer_path!r} of {str(config_file)!r}: "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}",
            field="actor.model_path",
            value=config.actor.model_path,
        ) from e
