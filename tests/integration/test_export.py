"""Models out: every checkpoint holds ``huggingface/`` (config, tokenizer, safetensors of
the actor) that transformers loads and generates with, equal to the trainer's actor;
``rlfleet export`` writes a step's folder (the latest by default), rebuilding it from
the actor's state and the run's config.yaml for a checkpoint saved without one; its errors
are one line, exit 2. Also the 2-rank FSDP trainer (torchrun, gloo, CPU) over gRPC."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from rlfleet.cli import main as cli_main
from rlfleet.common.config import save_resolved
from rlfleet.trainer import checkpoint
from rlfleet.trainer.core import TrainerCore
from rlfleet.trainer.testing import make_batch, make_config


def _config(model_dir: Path, run_dir: Path, **trainer: Any) -> Any:
    return make_config(
        str(model_dir),
        actor={"lr": 1e-3, "ppo_micro_batch_size": 2},
        trainer={"default_local_dir": str(run_dir), **trainer},
    )


def _batch(seed: int) -> dict[str, Any]:
    return {**make_batch(seed=seed), "scores": torch.tensor([1.0, 0.0, 0.5, 0.25])}


def _actor(core: TrainerCore) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in core.backend.iter_full_params("actor")}


def _load_hf(folder: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model, tokenizer


def _assert_weights(folder: Path, expected: dict[str, torch.Tensor]) -> None:
    """Every parameter of the loaded model is in ``expected`` (a tied head may be there
    too, or not), and every tensor of ``expected`` equals the loaded one."""
    model, _ = _load_hf(folder)
    params = {k for k, _ in model.named_parameters()}
    assert params <= set(expected), sorted(params - set(expected))
    loaded = model.state_dict()
    for name, t in expected.items():
        assert torch.equal(loaded[name], t), name


def _export(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()  # what came before (model loading's progress bars)
    code = cli_main(["export", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def trained_run(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    """A run dir with checkpoints of steps 1 and 2 (the actor differs between them),
    and the actor's weights at each."""
    run_dir = tmp_path_factory.mktemp("run")
    cfg = _config(tiny_model_dir, run_dir)
    save_resolved(cfg, run_dir)
    core = TrainerCore(cfg)
    weights: dict[int, dict[str, torch.Tensor]] = {}
    for step in (1, 2):
        core.train_step(_batch(step))
        checkpoint.save(core, step=step)
        weights[step] = _actor(core)
    return run_dir, weights


def test_checkpoint_holds_a_hf_folder_equal_to_the_actor(
    trained_run: tuple[Path, dict[int, dict[str, torch.Tensor]]], tiny_model_dir: Path
) -> None:
    run_dir, weights = trained_run
    folder = run_dir / "checkpoints" / "global_step_2" / "huggingface"
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not any(n.endswith((".bin", ".pt", ".pth")) for n in names)
    _assert_weights(folder, weights[2])
    # The training moved the weights: the folder is not the starting model.
    start, _ = _load_hf(tiny_model_dir)
    assert any(not torch.equal(p.detach(), weights[2][n]) for n, p in start.named_parameters())

    model, tokenizer = _load_hf(folder)
    ids = tokenizer("1+2=", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids["input_ids"].shape[1] + 4)
    assert isinstance(tokenizer.decode(out[0]), str)


def test_save_hf_off_and_export_hf_on_request(tiny_model_dir: Path, tmp_path: Path) -> None:
    core = TrainerCore(_config(tiny_model_dir, tmp_path / "run", save_hf=False))
    plain, _, _ = checkpoint.save(core, step=1)
    assert not (plain / "huggingface").exists()
    asked, _, _ = checkpoint.save(core, step=2, export_hf=True)
    _assert_weights(asked / "huggingface", _actor(core))


def test_crash_while_writing_hf_keeps_the_previous_checkpoint(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = TrainerCore(_config(tiny_model_dir, tmp_path / "run"))
    good, _, _ = checkpoint.save(core, step=1)

    def failing(*_args: Any) -> None:
        raise OSError("disk full (injected)")

    monkeypatch.setattr(checkpoint, "write_hf_folder", failing)
    with pytest.raises(OSError, match="injected"):
        checkpoint.save(core, step=2)
    root = tmp_path / "run" / "checkpoints"
    assert checkpoint.find_latest(root) == good
    assert (good / "huggingface" / "model.safetensors").is_file()
    assert not (root / "global_step_2").exists() and not list(root.glob(".tmp-*"))


def test_export_latest_and_a_given_step(
    trained_run: tuple[Path, dict[int, dict[str, torch.Tensor]]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run_dir, weights = trained_run
    code, out, err = _export(
        "--run", str(run_dir), "--out", str(tmp_path / "latest"), capsys=capsys
    )
    assert code == 0, err
    assert '"step": 2' in out and '"source": "huggingface"' in out
    _assert_weights(tmp_path / "latest", weights[2])

    (tmp_path / "one").mkdir()  # an empty --out is fine
    args = ("--run", str(run_dir), "--step", "1", "--out", str(tmp_path / "one"))
    code, out, err = _export(*args, capsys=capsys)
    assert code == 0, err
    _assert_weights(tmp_path / "one", weights[1])
    # The checkpoints' folders are the run's own: the export copied them.
    assert (run_dir / "checkpoints" / "global_step_1" / "huggingface").is_dir()
    assert not list(tmp_path.glob(".tmp-*"))


def test_export_rebuilds_a_checkpoint_saved_without_hf(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    cfg = _config(tiny_model_dir, run_dir, save_hf=False)
    save_resolved(cfg, run_dir)
    core = TrainerCore(cfg)
    core.train_step(_batch(0))
    folder, _, _ = checkpoint.save(core, step=1)
    assert not (folder / "huggingface").exists()

    code, out, err = _export("--run", str(run_dir), "--out", str(tmp_path / "hf"), capsys=capsys)
    assert code == 0, err
    assert '"source": "actor"' in out
    _assert_weights(tmp_path / "hf", _actor(core))
    _, tokenizer = _load_hf(tmp_path / "hf")
    assert tokenizer("1+2=")["input_ids"]
    # Its checkpoints/ folder names the run too.
    code, _, err = _export(
        "--run", str(run_dir / "checkpoints"), "--out", str(tmp_path / "hf2"), capsys=capsys
    )
    assert code == 0, err


def test_export_errors_are_one_line_exit_2(
    trained_run: tuple[Path, dict[int, dict[str, torch.Tensor]]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run_dir, _ = trained_run
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    (tmp_path / "empty_run").mkdir()
    out = str(tmp_path / "out")
    cases = {
        "does not exist": ("--run", str(tmp_path / "nope"), "--out", out),
        "no checkpoint in": ("--run", str(tmp_path / "empty_run"), "--out", out),
        "no checkpoint of step 7": ("--run", str(run_dir), "--step", "7", "--out", out),
        "is not empty": ("--run", str(run_dir), "--out", str(full)),
        "is not a folder": ("--run", str(run_dir), "--out", str(a_file)),
    }
    for needle, args in cases.items():
        code, stdout, err = _export(*args, capsys=capsys)
        assert code == 2, (needle, err)
        assert stdout == ""
        assert err.startswith("rlfleet export: ") and err.count("\n") == 1, err
        assert needle in err, err
    assert "saved steps: [1, 2]" in _export(*cases["no checkpoint of step 7"], capsys=capsys)[2]
    assert (full / "keep.txt").read_text() == "mine" and not (tmp_path / "out").exists()


def test_export_rebuild_refuses_pickled_objects_and_needs_the_config(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    core = TrainerCore(_config(tiny_model_dir, run_dir, save_hf=False))
    folder, _, _ = checkpoint.save(core, step=1)
    out = str(tmp_path / "out")

    code, _, err = _export("--run", str(run_dir), "--out", out, capsys=capsys)
    assert code == 2 and "config.yaml" in err and err.count("\n") == 1, err

    save_resolved(core.config, run_dir)
    marker = tmp_path / "ran"
    # A checkpoint of an earlier version (actor.pt), made hostile.
    for suffix in (".safetensors", ".json"):
        (folder / f"actor{suffix}").unlink()
    torch.save({"model": _RunsCodeWhenUnpickled(marker)}, folder / "actor.pt")
    code, _, err = _export("--run", str(run_dir), "--out", out, capsys=capsys)
    assert code == 2 and "refusing to unpickle" in err and err.count("\n") == 1, err
    assert not marker.exists() and not (tmp_path / "out").exists()


def _write_marker(path: str) -> str:
    Path(path).write_text("code ran", encoding="utf-8")
    return path


class _RunsCodeWhenUnpickled:
    """Unpickling this calls ``_write_marker(marker)``: what a hostile checkpoint does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (_write_marker, (str(self.marker),))


# ------------------------------------------------------------------ two ranks


def _wait_for(path: Path, proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file():
            return path.read_text()
        if proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            raise AssertionError(f"torchrun exited with {proc.returncode}:\n{out[-4000:]}")
        time.sleep(0.2)
    raise AssertionError(f"trainer did not come up within {timeout_s}s")


@pytest.mark.slow
def test_two_rank_fsdp_checkpoint_holds_the_full_actor(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlfleet.trainer.client import RemoteTrainerClient

    run_dir = tmp_path / "run"
    raw = {
        "actor": {"model_path": str(tiny_model_dir), "lr": 1e-3, "ppo_mini_batch_size": 2},
        "rollout": {"n": 2},
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"seed": 0, "default_local_dir": str(run_dir)},
    }
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(yaml.safe_dump(raw))
    address_file = tmp_path / "address"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "rlfleet.trainer.server", "--config", str(cfg_file),
        "--address-file", str(address_file), "--insecure",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        two = RemoteTrainerClient(_wait_for(address_file, proc, 240), timeout_s=120)
        assert two.status()["world_size"] == 2
        batch = make_batch(bs=4, seed=3)
        lp, _ = two.compute_log_prob(batch)
        g = torch.Generator().manual_seed(0)
        batch.update(old_log_probs=lp["old_log_probs"], advantages=torch.randn(4, 5, generator=g))
        two.update_actor(batch)
        saved = two.save_checkpoint("checkpoints", step=1)
        two.close()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    folder = Path(saved.path)
    assert folder == (run_dir / "checkpoints" / "global_step_1").resolve()
    actor = checkpoint.read_state(folder / "actor")["model"]
    _assert_weights(folder / "huggingface", actor)
    start, _ = _load_hf(tiny_model_dir)
    assert any(not torch.equal(p.detach(), actor[n]) for n, p in start.named_parameters())

    code, _, err = _export("--run", str(run_dir), "--out", str(tmp_path / "hf"), capsys=capsys)
    assert code == 0, err
    _assert_weights(tmp_path / "hf", actor)


def test_megatron_checkpoint_holds_a_hf_folder_equal_to_the_actor(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The megatron backend's full state (Hugging Face names, gathered over TP / PP)
    becomes the same kind of folder."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from rlfleet.trainer.megatron import MegatronBackend
    from rlfleet.trainer.megatron_testing import cpu_shim, megatron_config, scored_batch

    cfg = megatron_config(
        str(tiny_model_dir),
        algorithm={"adv_estimator": "grpo"},
        actor={"lr": 1e-3},
        trainer={"default_local_dir": str(tmp_path / "run")},
    )
    with cpu_shim():
        core = TrainerCore(cfg, MegatronBackend(cfg, device=torch.device("cpu")))
        core.train_step({**scored_batch(0), "uid": torch.tensor([0, 0, 1, 1])})
        folder, _, _ = checkpoint.save(core, step=1)
        weights = dict(core.iter_weights())
    _assert_weights(folder / "huggingface", weights)
    start, _ = _load_hf(tiny_model_dir)
    assert any(not torch.equal(p.detach(), weights[n]) for n, p in start.named_parameters())


def test_a_state_that_does_not_fit_the_model_is_refused(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from rlfleet.common.errors import FailedPrecondition

    cfg = _config(tiny_model_dir, tmp_path / "run")
    start, _ = _load_hf(tiny_model_dir)
    state = {k: v.detach() for k, v in start.state_dict().items()}
    del state["model.norm.weight"]
    with pytest.raises(FailedPrecondition, match=r"missing \['model.norm.weight'\]") as e:
        checkpoint.write_hf_folder(state, cfg, tmp_path / "hf")
    assert e.value.field == "actor.model_path"
    assert not (tmp_path / "hf").exists()
