"""`state_file`: a nested state as safetensors + JSON, back bit for bit; objects that
need code to rebuild are refused at save; a tampered JSON fails at load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlfleet.trainer.state_file import exists, read_state, write_state


def test_optimizer_and_scheduler_states_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied, as an LM head often is
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.tensor([1, 2])).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "misc": (1, float("inf"), float("-inf"), None, "s", True, [2.5, {3: "x", None: 0}]),
        "view": torch.arange(6.0).view(2, 3).t(),  # not contiguous
        "half": torch.randn(3, dtype=torch.bfloat16),
        "empty": torch.empty(0),
    }
    write_state(state, tmp_path / "s")
    assert exists(tmp_path / "s")
    back = read_state(tmp_path / "s")
    assert back["model"]["0.weight"] is back["model"]["1.weight"]  # stored once
    assert torch.equal(back["model"]["0.weight"], model[0].weight.detach())
    assert back["misc"] == state["misc"] and isinstance(back["misc"], tuple)
    assert list(back["optimizer"]["state"]) == [0]  # int keys stay ints
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert torch.equal(back["view"], state["view"]) and back["half"].dtype == torch.bfloat16
    assert back["empty"].shape == (0,)
    again = torch.optim.AdamW(model.parameters(), lr=1e-3)
    again.load_state_dict(back["optimizer"])
    assert back["scheduler"] == {**state["scheduler"]}
    nan = {"x": float("nan")}
    write_state(nan, tmp_path / "n")
    assert read_state(tmp_path / "n")["x"] != read_state(tmp_path / "n")["x"]  # NaN


@pytest.mark.parametrize(
    ("state", "where"),
    [
        ({"f": lambda: 1}, "state['f']: a builtins.function"),
        ({"a": [1, object()]}, "state['a'][1]: a builtins.object"),
        ({(1, 2): 3}, "a key of type tuple"),
        ({"np": __import__("numpy").zeros(2)}, "numpy.ndarray"),
    ],
)
def test_objects_that_need_code_to_rebuild_are_refused(
    tmp_path: Path, state: dict[object, object], where: str
) -> None:
    with pytest.raises(TypeError, match=where.replace("[", r"\[").replace("(", r"\(")):
        write_state(state, tmp_path / "s")


def test_tampered_json_fails_at_load(tmp_path: Path) -> None:
    write_state({"w": torch.ones(2)}, tmp_path / "s")
    doc = json.loads((tmp_path / "s.json").read_text())
    for bad, why in [
        ({"tensor": "t7"}, "'t7' is not in the safetensors file"),
        ({"module": "os.system"}, "an unknown node"),
        ({"dict": [[{"k": 1}, 2]]}, "a dict key of type dict"),
    ]:
        (tmp_path / "s.json").write_text(json.dumps({**doc, "state": bad}))
        with pytest.raises(ValueError, match=why):
            read_state(tmp_path / "s")
    (tmp_path / "s.json").write_text(json.dumps({"format": "other", "state": None}))
    with pytest.raises(ValueError, match="not an rlfleet-state-1 file"):
        read_state(tmp_path / "s")
