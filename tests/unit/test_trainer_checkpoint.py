"""Checkpoints: save -> load -> the next step is bit-exact; a crash mid-save keeps the last
good checkpoint; keep-last-K; the actor exported as a Hugging Face folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rlfleet.common.errors import InvalidArgument, NotFound
from rlfleet.trainer import checkpoint
from rlfleet.trainer.core import TrainerCore
from rlfleet.trainer.testing import make_batch, make_config


def _config(model_dir: Path, run_dir: Path) -> Any:
    return make_config(
        str(model_dir),
        algorithm={"adv_estimator": "gae"},
        actor={"shuffle": True, "ppo_micro_batch_size": 2, "lr_warmup_steps": 2},
        trainer={"default_local_dir": str(run_dir), "max_actor_ckpt_to_keep": 2},
    )


def _batch(seed: int) -> dict[str, Any]:
    return {**make_batch(seed=seed), "scores": torch.tensor([1.0, 0.0, 0.5, 0.25])}


def test_save_load_next_step_bit_exact(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = _config(tiny_model_dir, tmp_path / "run")
    a = TrainerCore(cfg)
    a.train_step(_batch(0))
    folder, nbytes, _ = checkpoint.save(a, step=1, extra_state_json='{"epoch": 0, "pos": 4}')
    assert nbytes > 0 and folder.name == "global_step_1"
    expected = a.train_step(_batch(1))
    expected_params = dict(a.backend.iter_full_params("actor"))

    b = TrainerCore(cfg)
    path, step, extra = checkpoint.load(b)
    assert (path, step, json.loads(extra)) == (folder, 1, {"epoch": 0, "pos": 4})
    assert b.weight_version == 1
    got = b.train_step(_batch(1))
    for key in ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "actor/lr"):
        assert got[key] == expected[key], key  # bit-exact on CPU
    for name, t in b.backend.iter_full_params("actor"):
        assert torch.equal(t, expected_params[name]), name


def test_crash_mid_save_keeps_last_good(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = TrainerCore(_config(tiny_model_dir, tmp_path / "run"))
    good, _, _ = checkpoint.save(core, step=1)
    core.train_step(_batch(2))

    calls = {"n": 0}
    real = checkpoint._write_state

    def failing(obj: Any, path: Path) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full (injected)")
        real(obj, path)

    monkeypatch.setattr(checkpoint, "_write_state", failing)
    with pytest.raises(OSError, match="injected"):
        checkpoint.save(core, step=2)
    monkeypatch.undo()
    root = tmp_path / "run" / "checkpoints"
    assert checkpoint.find_latest(root) == good
    assert not (root / "global_step_2").exists()
    assert not list(root.glob(".tmp-*"))
    # A leftover temporary folder (a real crash) is ignored by load.
    (root / ".tmp-global_step_3-dead").mkdir()
    assert checkpoint.load(core)[1] == 1


def test_keep_last_k_and_hf_export(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    core = TrainerCore(_config(tiny_model_dir, tmp_path / "run"))
    for step in (1, 2, 3):
        folder, _, _ = checkpoint.save(core, step=step, export_hf=(step == 3))
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [
        "global_step_2",
        "global_step_3",
    ]
    assert (root / checkpoint.LATEST_FILE).read_text() == "3"
    hf = AutoModelForCausalLM.from_pretrained(folder / "huggingface", local_files_only=True)
    ours = dict(core.backend.iter_full_params("actor"))
    for name, t in hf.named_parameters():
        assert torch.equal(t.detach(), ours[name]), name
    assert (folder / "huggingface" / "tokenizer.json").is_file()


def test_a_save_below_the_kept_steps_keeps_what_it_wrote(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A run resumed from an older checkpoint saves a step below those kept: it was
    pruned as soon as written (the save returned a folder that no longer existed,
    ``latest`` named it); now the lowest of the others goes instead."""
    core = TrainerCore(_config(tiny_model_dir, tmp_path / "run"))  # keeps 2
    for step in (5, 6):
        checkpoint.save(core, step=step)
    folder, nbytes, _ = checkpoint.save(core, step=3)
    root = tmp_path / "run" / "checkpoints"
    assert folder.is_dir() and nbytes > 0
    assert checkpoint.steps(root) == [3, 6]
    assert checkpoint.find_latest(root) == folder
    assert checkpoint.load(TrainerCore(_config(tiny_model_dir, tmp_path / "run")))[1] == 3


def test_fewer_checkpoints_than_kept_are_all_kept(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = _config(tiny_model_dir, tmp_path / "run")
    cfg.trainer.max_actor_ckpt_to_keep = 4
    core = TrainerCore(cfg)
    for step in (1, 2, 3):
        checkpoint.save(core, step=step)
        assert checkpoint.steps(tmp_path / "run" / "checkpoints") == list(range(1, step + 1))


def test_load_without_checkpoint_is_not_found(tiny_model_dir: Path, tmp_path: Path) -> None:
    core = TrainerCore(
        make_config(str(tiny_model_dir), trainer={"default_local_dir": str(tmp_path)})
    )
    with pytest.raises(NotFound):
        checkpoint.load(core)


def _write_marker(path: str) -> str:
    Path(path).write_text("code ran", encoding="utf-8")
    return path


class _RunsCodeWhenUnpickled:
    """Unpickling this calls ``_write_marker(marker)``: what a hostile checkpoint does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (_write_marker, (str(self.marker),))


def test_checkpoint_files_are_safetensors_and_json(tiny_model_dir: Path, tmp_path: Path) -> None:
    """No pickle anywhere: each state is a safetensors file (parsed by its header) and
    a JSON document; loading them gives back the states the trainer saved."""
    from safetensors import safe_open

    core = TrainerCore(_config(tiny_model_dir, tmp_path / "run"))
    folder, _, _ = checkpoint.save(core, step=1)
    assert not list(folder.glob("*.pt"))
    stems = sorted({p.name.split(".")[0] for p in folder.glob("*.safetensors")})
    assert stems == ["actor", "critic", "rng_rank0"]
    for stem in stems:
        json.loads((folder / f"{stem}.json").read_text())
        with safe_open(str(folder / f"{stem}.safetensors"), framework="pt") as f:
            assert list(f.keys())
    saved = checkpoint.read_state(folder / "actor")
    with core.lock:
        live = core.gather_states(["actor"])[0]["actor"]
    _same(saved, live, "actor")


def _same(a: Any, b: Any, where: str) -> None:
    """``a`` and ``b`` are the same nested state: equal tensors (dtype and shape
    included), equal plain values of the same types, dict keys of the same types."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_a_state_file_naming_a_missing_tensor_is_refused(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    core = TrainerCore(_config(tiny_model_dir, tmp_path / "run"))
    folder, _, _ = checkpoint.save(core, step=1)
    doc = json.loads((folder / "actor.json").read_text())
    doc["state"] = {"tensor": "t999999"}
    (folder / "actor.json").write_text(json.dumps(doc))
    with pytest.raises(checkpoint.CheckpointRefused, match="t999999"):
        checkpoint.load(core)


@pytest.mark.parametrize("name", ["actor", "rng_rank0"])
def test_legacy_checkpoint_with_a_pickled_object_is_refused(
    tiny_model_dir: Path, tmp_path: Path, name: str
) -> None:
    """A checkpoint of an earlier version (``.pt`` files) still loads with
    ``weights_only``, which refuses a pickled object instead of running it."""
    core = TrainerCore(_config(tiny_model_dir, tmp_path / "run"))
    folder, _, _ = checkpoint.save(core, step=1)
    for stem in ("actor", "critic", "rng_rank0"):  # as an earlier version wrote it
        torch.save(checkpoint.read_state(folder / stem), folder / f"{stem}.pt")
        for suffix in (".safetensors", ".json"):
            (folder / f"{stem}{suffix}").unlink()
    assert checkpoint.load(core)[1] == 1
    name = f"{name}.pt"
    # The payload is live: a plain unpickling runs it.
    probe = tmp_path / "probe"
    torch.save({"x": _RunsCodeWhenUnpickled(probe)}, tmp_path / "probe.pt")
    torch.load(tmp_path / "probe.pt", weights_only=False)
    assert probe.read_text(encoding="utf-8") == "code ran"

    marker = tmp_path / "marker"
    state = torch.load(folder / name, weights_only=True)
    state["hostile"] = _RunsCodeWhenUnpickled(marker)
    torch.save(state, folder / name)
    version = core.weight_version
    with pytest.raises(checkpoint.CheckpointRefused, match=name) as info:
        checkpoint.load(core)
    assert isinstance(info.value, InvalidArgument) and info.value.field == "path"
    assert not marker.exists()
    assert core.weight_version == version


def test_resume_path_may_name_another_runs_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    """verl resumes from any checkpoint folder (trainer.resume_from_path). The trainer
    loads from the one its own config names, outside its run dir, and only loads:
    other outside paths stay refused, and nothing is saved there."""
    a = TrainerCore(_config(tiny_model_dir, tmp_path / "run-a"))
    a.train_step(_batch(0))
    folder, _, _ = checkpoint.save(a, step=1)
    cfg = make_config(
        str(tiny_model_dir),
        algorithm={"adv_estimator": "gae"},
        trainer={
            "default_local_dir": str(tmp_path / "run-b"),
            "resume_mode": "resume_path",
            "resume_from_path": str(folder.parent),
        },
    )
    b = TrainerCore(cfg)
    path, step, _ = checkpoint.load(b, str(folder.parent))
    assert (path, step, b.weight_version) == (folder, 1, 1)
    with pytest.raises(InvalidArgument, match="outside the trainer's run directory"):
        checkpoint.load(b, str(tmp_path))  # above the configured folder
    with pytest.raises(InvalidArgument, match="outside the trainer's run directory"):
        checkpoint.save(b, str(folder.parent))


def test_kept_checkpoints_count_only_the_roles_held(tiny_model_dir: Path, tmp_path: Path) -> None:
    """With no critic, max_critic_ckpt_to_keep does not prune the actor's checkpoints;
    with one, the fewer kept wins (a step's folder holds both)."""
    for estimator, kept in (("grpo", [1, 2, 3]), ("gae", [3])):
        run = tmp_path / estimator
        cfg = make_config(
            str(tiny_model_dir),
            algorithm={"adv_estimator": estimator},
            trainer={
                "default_local_dir": str(run),
                "max_actor_ckpt_to_keep": 3,
                "max_critic_ckpt_to_keep": 1,
            },
        )
        core = TrainerCore(cfg)
        for step in (1, 2, 3):
            checkpoint.save(core, step=step)
        assert checkpoint.steps(run / "checkpoints") == kept, estimator


def test_links_in_the_run_dir_lead_neither_a_load_nor_a_save_outside(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The folder a root's latest file names is confined like a path given, and the
    latest file is written under a fresh name, never through a link left in place."""
    run = tmp_path / "run"
    outside = tmp_path / "outside"
    core = TrainerCore(_config(tiny_model_dir, run))
    elsewhere = TrainerCore(_config(tiny_model_dir, outside))
    checkpoint.save(elsewhere, step=7)
    root = run / "checkpoints"
    root.mkdir(parents=True)
    (root / "global_step_999").symlink_to(outside / "checkpoints" / "global_step_7")
    (root / "latest_checkpointed_iteration.txt").write_text("999")
    with pytest.raises(InvalidArgument, match="outside"):
        checkpoint.load(core, "checkpoints")
    (root / "global_step_999").unlink()
    (root / "latest_checkpointed_iteration.txt").unlink()
    precious = outside / "precious.txt"
    precious.write_text("keep")
    (root / ".latest_checkpointed_iteration.txt.tmp").symlink_to(precious)
    checkpoint.save(core, step=5)
    assert precious.read_text() == "keep"
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "5"


@pytest.mark.parametrize(
    "state",
    [
        "{not json",
        '{"global_step": 1, "weight_version": 1, "kl_coef": 0.0}',  # no roles
        '{"roles": "actor", "global_step": 1, "weight_version": 1, "kl_coef": 0.0}',
        '{"roles": ["actor"], "global_step": 1, "weight_version": -1, "kl_coef": 0.0}',
        '{"roles": ["actor"], "global_step": 1180591620717411303424, "weight_version": 1,'
        ' "kl_coef": 0.0}',
    ],
)
def test_a_damaged_trainer_state_is_refused_before_anything_loads(
    tiny_model_dir: Path, tmp_path: Path, state: str
) -> None:
    core = TrainerCore(_config(tiny_model_dir, tmp_path / "run"))
    folder, _, _ = checkpoint.save(core, step=1)
    (folder / checkpoint.STATE_FILE).write_text(state)
    fresh = TrainerCore(_config(tiny_model_dir, tmp_path / "run"))
    with pytest.raises(checkpoint.CheckpointRefused) as refused:
        checkpoint.load(fresh, str(folder))
    assert refused.value.field == "path"
    assert fresh.global_step == 0 and fresh.weight_version == 0


def test_a_save_path_that_names_a_file_is_refused_by_name(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    core = TrainerCore(_config(tiny_model_dir, tmp_path / "run"))
    checkpoint.save(core, step=1)
    for path in ("checkpoints/latest_checkpointed_iteration.txt", "checkpoints/x/y"):
        if path.endswith("y"):
            (tmp_path / "run" / "checkpoints" / "x").write_text("a file")
        with pytest.raises(InvalidArgument, match="not a folder") as refused:
            checkpoint.save(core, path, step=2)
        assert refused.value.field == "path"
