"""The LoRA actor (``actor.lora_rank > 0``) on the tiny model: only the adapters train
and the base stays equal; the reference is the base (adapters disabled); a push into a
real rollout service (HF engine, gRPC / TCP on 127.0.0.1 port 0) carries exactly the
adapter bytes, and the replica then generates what the merged model generates; a
checkpoint holds the adapters, resumes bit-exact, and its Hugging Face folder (and
``rlfleet export`` rebuilt from the actor's state) is the merged model transformers loads."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from rlfleet.common.errors import InvalidArgument  # noqa: E402
from rlfleet.rollout.core import RolloutCore  # noqa: E402
from rlfleet.rollout.engine import GenerationRequest, SamplingParams  # noqa: E402
from rlfleet.rollout.hf_engine import HFEngine  # noqa: E402
from rlfleet.rollout.server import start_rollout_server  # noqa: E402
from rlfleet.trainer import checkpoint, export_cli  # noqa: E402
from rlfleet.trainer.client import InProcessTrainerClient  # noqa: E402
from rlfleet.trainer.core import TrainerCore  # noqa: E402
from rlfleet.trainer.testing import make_batch, make_config  # noqa: E402

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]
GREEDY = SamplingParams(n=1, temperature=0.0, max_tokens=8, ignore_eos=True)


def _config(model_dir: Path, run_dir: Path, **actor: Any) -> Any:
    return make_config(
        str(model_dir),
        algorithm={"adv_estimator": "grpo"},
        actor={
            "lora_rank": 4,
            "lora_alpha": 8,
            "lr": 2e-2,
            "use_kl_loss": True,
            "shuffle": True,
            **actor,
        },
        trainer={"default_local_dir": str(run_dir)},
    )


def _batch(seed: int) -> dict[str, Any]:
    return {**make_batch(seed=seed), "scores": torch.tensor([1.0, 0.0, 0.5, 0.25])}


def _base_params(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _adapter(core: TrainerCore) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().clone()
        for n, p in core.backend.models["actor"].named_parameters()  # type: ignore[attr-defined]
        if p.requires_grad
    }


@pytest.fixture(scope="module")
def trained(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerCore:
    """A LoRA trainer that took two GRPO steps with the KL loss (so a reference ran)."""
    core = TrainerCore(_config(tiny_model_dir, tmp_path_factory.mktemp("run")))
    before = _adapter(core)
    core.train_step(_batch(0))
    core.train_step(_batch(1))
    after = _adapter(core)
    assert set(after) == set(before) and before
    assert all(".lora_" in n for n in after)
    assert any(not torch.equal(after[n], before[n]) for n in after)  # the adapters trained
    return core


@pytest.fixture()
def rollout(tiny_model_dir: Path) -> Iterator[tuple[HFEngine, str]]:
    engine = HFEngine(tiny_model_dir)
    core = RolloutCore(engine, replica_id="r0")
    server = start_rollout_server(core)
    try:
        yield engine, server.address
    finally:
        server.stop(0)
        core.close()


def _greedy(engine: HFEngine) -> list[list[int]]:
    [samples] = engine.generate([GenerationRequest(PROMPTS, GREEDY)])
    return [s.token_ids for s in samples]


def test_only_the_adapters_train_and_the_base_stays(
    trained: TrainerCore, tiny_model_dir: Path
) -> None:
    backend = trained.backend
    model = backend.models["actor"]  # type: ignore[attr-defined]
    optimized = {id(p) for g in backend.optimizers["actor"].param_groups for p in g["params"]}  # type: ignore[attr-defined]
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert optimized == trainable
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) < 0.05 * sum(
        p.numel() for p in model.parameters()
    )
    base = _base_params(tiny_model_dir)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            hf = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            assert torch.equal(p.detach(), base[hf]), name
    assert "ref" not in backend.models  # type: ignore[attr-defined]  # no second copy


def test_the_reference_is_the_base_model(trained: TrainerCore, tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    batch = make_batch(seed=5)
    ref, _ = trained.compute_ref_log_prob(batch)
    actor, _ = trained.compute_log_prob(batch)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    r = batch["responses"].shape[1]
    with torch.no_grad():
        logits = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[
            :, -r - 1 : -1
        ]
    want = torch.log_softmax(logits.float(), -1).gather(-1, batch["responses"][..., None])[..., 0]
    mask = batch["attention_mask"][:, -r:].bool()
    torch.testing.assert_close(ref["ref_log_prob"][mask], want[mask], atol=1e-4, rtol=0)
    assert not torch.allclose(actor["old_log_probs"][mask], want[mask], atol=1e-3)


@pytest.mark.parametrize(
    ("transport", "bucket_bytes"),
    [("grpc", 0), ("tcp", 0), ("grpc", 40_000), ("tcp", 40_000)],  # 40 kB: 8+ buckets
)
def test_push_carries_only_the_adapters_and_generation_is_the_merged_models(
    trained: TrainerCore,
    rollout: tuple[HFEngine, str],
    tmp_path: Path,
    transport: str,
    bucket_bytes: int,
) -> None:
    engine, address = rollout
    adapter = dict(trained.iter_weights())
    merged = dict(trained.iter_weights(full=True))
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    full_bytes = sum(t.numel() * t.element_size() for t in merged.values())
    assert all(n.endswith((".lora_A", ".lora_B")) for n in adapter)
    assert adapter_bytes < 0.05 * full_bytes
    base_greedy = _greedy(engine)

    out = InProcessTrainerClient(trained).push_weights(
        [("r0", address)], version=3, transports=[transport], bucket_bytes=bucket_bytes
    )
    assert out.ok == {"r0": True}, out.errors
    assert out.bytes == adapter_bytes
    assert engine.info().weight_version == 3
    theirs = {n: p.detach() for n, p in engine.model.named_parameters()}
    assert set(theirs) == set(merged)
    for name, t in merged.items():
        assert torch.equal(theirs[name], t), name

    # The exported merged model generates exactly what the replica now generates.
    export = tmp_path / "hf"
    trained.export_hf(str(export))
    reference = HFEngine(export)
    for name, p in reference.model.named_parameters():
        assert torch.equal(p.detach(), merged[name]), name
    assert _greedy(engine) == _greedy(reference)
    assert _greedy(engine) != base_greedy

    # A second push merges into the base again, not into the first merge.
    trained.train_step(_batch(2))
    merged2 = dict(trained.iter_weights(full=True))
    out = InProcessTrainerClient(trained).push_weights(
        [("r0", address)], version=4, transports=[transport], bucket_bytes=bucket_bytes
    )
    assert out.ok == {"r0": True}, out.errors
    for name, p in engine.model.named_parameters():
        assert torch.equal(p.detach(), merged2[name]), name


def test_a_full_push_then_a_lora_push(trained: TrainerCore, tiny_model_dir: Path) -> None:
    engine = HFEngine(tiny_model_dir)
    base = _base_params(tiny_model_dir)
    adapter = dict(trained.iter_weights())
    engine.update_weights(adapter, 1)
    # A full update is the new base: the base weights, then adapters merge into them.
    engine.update_weights(base, 2)
    for name, p in engine.model.named_parameters():
        assert torch.equal(p.detach(), base[name]), name
    engine.update_weights(adapter, 3)
    merged = dict(trained.iter_weights(full=True))
    for name, p in engine.model.named_parameters():
        assert torch.equal(p.detach(), merged[name]), name


@pytest.mark.parametrize(
    ("bad", "code"),
    [
        ("mixed", "MIXED_UPDATE"),
        ("half", "MISSING_TENSORS"),
        ("shape", "SHAPE_MISMATCH"),
        ("unknown", "UNKNOWN_TENSOR"),
    ],
)
def test_a_bad_lora_update_changes_nothing(
    trained: TrainerCore, tiny_model_dir: Path, bad: str, code: str
) -> None:
    engine = HFEngine(tiny_model_dir)
    adapter = dict(trained.iter_weights())
    first = next(iter(adapter))
    if bad == "mixed":
        adapter["model.norm.weight"] = torch.ones(128)
    elif bad == "half":
        del adapter[first]
    elif bad == "shape":
        adapter[first] = torch.zeros(3, 5)
    else:
        adapter["model.nope.lora_A"] = torch.zeros(4, 128)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    with pytest.raises(InvalidArgument) as err:
        engine.update_weights(adapter, 1)
    assert err.value.code == code
    assert engine.info().weight_version == 0
    for name, p in engine.model.named_parameters():
        assert torch.equal(p.detach(), before[name]), name


def test_checkpoint_holds_the_adapter_resumes_exactly_and_exports_merged(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    cfg = _config(tiny_model_dir, run)
    a = TrainerCore(cfg)
    a.train_step(_batch(0))
    folder, _, _ = checkpoint.save(a, step=1, export_hf=True)
    saved = checkpoint.read_state(folder / "actor")
    assert set(saved["model"]) == set(_adapter(a))  # the adapters only
    merged = dict(a.iter_weights(full=True))
    expected = a.train_step(_batch(1))
    expected_adapter = _adapter(a)

    b = TrainerCore(cfg)
    checkpoint.load(b)
    got = b.train_step(_batch(1))
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/lr", "actor/kl_loss"):
        assert got[key] == expected[key], key  # bit-exact on CPU
    for name, t in _adapter(b).items():
        assert torch.equal(t, expected_adapter[name]), name

    loaded = AutoModelForCausalLM.from_pretrained(folder / "huggingface", local_files_only=True)
    for name, p in loaded.named_parameters():
        assert torch.equal(p.detach(), merged[name]), name
    # rlfleet export rebuilds the same merged model from the actor's state alone.
    from rlfleet.common.config import save_resolved

    save_resolved(cfg, run)
    shutil.rmtree(folder / "huggingface")
    out, step, source = export_cli.export(run, tmp_path / "out")
    assert (step, source) == (1, "actor")
    rebuilt = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    for name, p in rebuilt.named_parameters():
        assert torch.equal(p.detach(), merged[name]), name


def test_a_full_model_state_is_refused_by_a_lora_actor(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    core = TrainerCore(_config(tiny_model_dir, tmp_path / "run"))
    with pytest.raises(ValueError, match="lora_rank"):
        core.backend.load_state_dict("actor", {"model": _base_params(tiny_model_dir)})


@pytest.mark.parametrize(
    ("targets", "module"),
    [(["q_proj", "lm_head"], "lm_head"), (["q_proj", "embed_tokens"], "embed_tokens")],
)
def test_adapters_on_embeddings_or_a_tied_head_are_refused(
    tiny_model_dir: Path, tmp_path: Path, targets: list[str], module: str
) -> None:
    """The tiny model ties its output head to its input embeddings: an adapter there
    would change both when merged (the rollout would sample a policy the trainer never
    had) and the export dropped it; peft's embedding adapters are not pushed or
    exported at all. Both are refused when the trainer builds the actor, naming the key."""
    from rlfleet.common.errors import FailedPrecondition

    with pytest.raises(FailedPrecondition, match=rf"actor\.target_modules: .*{module}"):
        TrainerCore(_config(tiny_model_dir, tmp_path / "run", target_modules=targets))
