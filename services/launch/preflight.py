"""Start-up checks of a run, before any service starts or any model loads.

:func:`preflight` returns every problem at once as :class:`ConfigIssue` lines
(``key: what is wrong (got value)``): model, tokenizer and reward-model paths, data
files, the custom reward file, ports asked for that are taken, and, for the local
launcher, whether the pools fit this machine. ``rlfleet train`` and ``rlfleet up``
print them and exit 2.

A model or tokenizer given as a Hugging Face hub id (``org/name``, not an existing
path) is left to the loader unless ``HF_HUB_OFFLINE`` is set; then it must be in the
local cache.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterable
from pathlib import Path

from rlfleet.common import auth
from rlfleet.common.config import Config, ConfigIssue
from rlfleet.common.rpc import port_taken

__all__ = ["preflight"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _cached_on_hub(repo: str, filename: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    found = try_to_load_from_cache(repo, filename)
    return isinstance(found, str)


def _model_dir(key: str, value: str | None, needs: str) -> Iterable[ConfigIssue]:
    """``value`` names a model folder holding ``needs`` (or a hub id the loader fetches)."""
    if not value:
        return
    path = Path(value)
    if path.exists():
        if not path.is_dir():
            yield ConfigIssue(key, "is a file, not a model folder", value)
        elif not (path / needs).is_file():
            yield ConfigIssue(key, f"has no {needs}: not a Hugging Face model folder", value)
        return
    # org/name is a hub id unless a folder "org" is here (models/qwen: a local path)
    if _HUB_ID.match(value) and not value.startswith((".", "/")) and not path.parent.is_dir():
        offline = os.environ.get("HF_HUB_OFFLINE", "") in ("1", "true", "yes")
        if offline and not _cached_on_hub(value, needs):
            yield ConfigIssue(
                key, "no such folder, and HF_HUB_OFFLINE is set and the hub cache lacks it", value
            )
        return
    yield ConfigIssue(key, "no such folder", value)


def _weight_shapes(folder: Path) -> dict[str, list[int]]:
    """Tensor name -> shape of a model folder's safetensors files, from their headers
    alone (8 bytes of length, then JSON); {} when there are none or one is unreadable."""
    import json
    import struct

    shapes: dict[str, list[int]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        try:
            with f.open("rb") as fh:
                (size,) = struct.unpack("<Q", fh.read(8))
                if size > 100_000_000:
                    return {}
                header = json.loads(fh.read(size))
        except (OSError, ValueError, struct.error):
            return {}
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


def _lora_targets(cfg: Config) -> Iterable[ConfigIssue]:
    """``actor.target_modules`` name modules the actor's model has (peft's matching:
    a list entry is a module name's last part(s), a string other than ``all-linear``
    a regular expression over whole names)."""
    targets = cfg.actor.target_modules
    if cfg.actor.lora_rank <= 0 or targets == "all-linear" or not cfg.actor.model_path:
        return
    shapes = _weight_shapes(Path(cfg.actor.model_path))
    modules = {k.rsplit(".", 1)[0] for k in shapes}
    if not modules:
        return  # a hub id or another format: the trainer's peft says it at load
    if isinstance(targets, str):
        if not any(re.fullmatch(targets, m) for m in modules):
            yield ConfigIssue("actor.target_modules", "matches no module of the model", targets)
        return
    missing = [t for t in targets if not any(m == t or m.endswith("." + t) for m in modules)]
    if missing:
        linear = sorted({k.rsplit(".", 2)[-2] for k, v in shapes.items()
                         if k.endswith(".weight") and len(v) == 2 and "embed" not in k})  # fmt: skip
        yield ConfigIssue(
            "actor.target_modules",
            f"the model has no module named {', '.join(missing)} (its linear layers: "
            f"{', '.join(linear)})",
            targets,
        )


def _tokenizer_dir(key: str, value: str | None) -> Iterable[ConfigIssue]:
    if not value:
        return
    path = Path(value)
    if path.is_dir() and not any(
        (path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")
    ):
        yield ConfigIssue(key, "has no tokenizer files (tokenizer.json, ...)", value)
        return
    if not path.exists():
        yield from _model_dir(key, value, "tokenizer_config.json")


def _file(key: str, value: str | None) -> Iterable[ConfigIssue]:
    if not value:
        return
    path = Path(value)
    if not path.exists():
        yield ConfigIssue(key, "no such file", value)
    elif not path.is_file():
        yield ConfigIssue(key, "is not a file", value)
    elif not os.access(path, os.R_OK):
        yield ConfigIssue(key, "is not readable", value)


def _defines(key: str, path: str, name: str) -> Iterable[ConfigIssue]:
    """``path`` (Python) defines ``name`` at its top level: read, not run (the reward
    service imports it; the driver does not execute a user's file to check it)."""
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"), filename=path)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError) as e:
        yield ConfigIssue("reward.custom_function.path", f"is not valid Python: {e}", path)
        return
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    if name not in names:
        yield ConfigIssue(key, f"{path} defines no {name!r} at its top level", name)


def _enough_rows(cfg: Config) -> Iterable[ConfigIssue]:
    """The training files hold at least one batch (parquet metadata: no data read)."""
    try:
        import pyarrow.parquet as pq

        rows = sum(pq.ParquetFile(f).metadata.num_rows for f in cfg.data.train_files)
    except Exception:  # not parquet, or unreadable: the dataset loader says what
        return
    if rows < cfg.data.train_batch_size:
        yield ConfigIssue(
            "data.train_batch_size",
            f"larger than the {rows} rows of data.train_files: not one batch to train on",
            cfg.data.train_batch_size,
        )


def _credentials_for_services(cfg: Config) -> Iterable[ConfigIssue]:
    """Services given by address (a cluster `rlfleet up` or a deployer started) with
    authentication on: the driver needs that cluster's credentials, not a fresh set."""
    s = cfg.services
    given = [k for k in ("scheduler", "trainer", "reward") if getattr(s, k)] + (
        ["rollout"] if s.rollout else []
    )
    if not given or not cfg.security.auth or cfg.security.credentials_dir:
        return
    if auth.credentials_in_env():
        return
    yield ConfigIssue(
        f"services.{given[0]}",
        "is a running service: the driver needs its cluster's credentials (set "
        f"{auth.CREDENTIALS_ENV}=<its secrets dir>/driver.json, `rlfleet up` writes "
        "<run dir>/secrets/, or security.credentials_dir: DIR)",
        getattr(s, given[0]) or ",".join(s.rollout),
    )


def preflight(
    config: Config,
    *,
    metrics_port: int | None = None,
    in_process: bool = False,
    driver: bool = True,
) -> list[ConfigIssue]:
    """Every problem a run would hit at start-up, found without starting anything.

    Only what this process or the services it launches would read is checked: not the
    models of services given by address, and with ``driver=False`` (``rlfleet up``)
    not the data or the driver's tokenizer.
    """
    cfg = config
    s = cfg.services
    issues: list[ConfigIssue] = []
    roles = set(cfg.enabled_roles())
    trainer_here = in_process or s.trainer is None
    rollout_here = in_process or not s.rollout
    reward_here = in_process or s.reward is None
    # A folder reported missing as the actor's model is not reported again as the
    # critic's model or the tokenizer read from it.
    model_missing = False
    if trainer_here:
        issues += _model_dir("actor.model_path", cfg.actor.model_path, "config.json")
        model_missing = bool(issues)
        if "critic" in roles and not (
            model_missing and cfg.critic.model_path in (None, cfg.actor.model_path)
        ):
            issues += _model_dir("critic.model_path", cfg.critic.model_path, "config.json")
        if not model_missing:
            issues += _lora_targets(cfg)
    t = cfg.trainer
    if trainer_here and t.resume_mode == "resume_path" and t.resume_from_path:
        where = Path(t.resume_from_path)
        where = where if where.is_absolute() else cfg.run_dir() / where  # as the trainer reads it
        if not where.is_dir():
            issues.append(ConfigIssue(
                "trainer.resume_from_path", "no such checkpoint folder (a relative path is "
                f"the run dir's: {where})", t.resume_from_path,
            ))  # fmt: skip
    same_folder = cfg.actor.tokenizer_path in (None, cfg.actor.model_path)
    if (driver or trainer_here) and not (model_missing and same_folder):
        issues += _tokenizer_dir("actor.tokenizer_path", cfg.actor.tokenizer_path)
    rollout_model = cfg.rollout.model_path or cfg.actor.model_path
    if rollout_here and not (trainer_here and rollout_model == cfg.actor.model_path):
        issues += _model_dir("rollout.model_path", rollout_model, "config.json")
    if reward_here and cfg.reward.reward_model.enable:
        rm = cfg.reward.reward_model
        issues += _model_dir("reward.reward_model.path", rm.path, "config.json")
    if driver and cfg.trainer.rollout_source == "external":
        if in_process:
            issues.append(ConfigIssue(
                "trainer.rollout_source", "external rollouts need rollout replicas running as "
                "services (their OpenAI endpoints and PopTrajectories): not --in-process",
                "external",
            ))  # fmt: skip
        elif not s.rollout and cfg.rollout.openai.port is None:
            issues.append(ConfigIssue(
                "rollout.openai.port", "trainer.rollout_source external trains on sessions "
                "agents run through the replicas' OpenAI endpoints: give the launched "
                "replicas one (0: a free port)", None,
            ))  # fmt: skip
    if driver:
        data = [("data.val_files", cfg.data.val_files)]
        if cfg.trainer.rollout_source != "external":  # external: the agents bring the prompts
            data.insert(0, ("data.train_files", cfg.data.train_files))
        for key, files in data:
            for i, f in enumerate(files):
                issues += _file(f"{key}[{i}]" if len(files) > 1 else key, f)
    if reward_here:
        custom = cfg.reward.custom_function
        found = list(_file("reward.custom_function.path", custom.path))
        issues += found
        if custom.path and not found:
            issues += _defines("reward.custom_function.name", custom.path, custom.name)
    if driver and cfg.trainer.rollout_source != "external" and not issues:
        issues += _enough_rows(cfg)
    openai_port = cfg.rollout.openai.port
    if openai_port and not s.rollout and not in_process and cfg.launcher == "local":
        if cfg.rollout_replicas() > 1:
            issues.append(ConfigIssue(
                "rollout.openai.port", f"a fixed port serves one replica per host and "
                f"{cfg.rollout_replicas()} replicas start here: give 0 (each a free port, "
                "reported as openai_url)", openai_port,
            ))  # fmt: skip
        elif (why := port_taken("127.0.0.1", openai_port)) is not None:
            issues.append(
                ConfigIssue("rollout.openai.port", f"cannot be bound: {why}", openai_port)
            )
    if driver and not in_process:
        issues += _credentials_for_services(cfg)
    if metrics_port:
        why = port_taken("127.0.0.1", metrics_port)
        if why is not None:
            issues.append(ConfigIssue("--metrics-port", f"cannot be bound: {why}", metrics_port))
    if not in_process and cfg.launcher == "local":
        from rlfleet.launch.cluster import LocalCluster
        from rlfleet.scheduler.placement import PlacementError

        try:
            LocalCluster(cfg, cfg.run_dir()).plan()
        except PlacementError as e:
            issues += [ConfigIssue("resource_pools", line) for line in e.shortfalls]
    return issues
