"""A state (nested dicts, lists and tuples of tensors and plain values) as two files
that load without running code: ``<stem>.safetensors`` holds every tensor, raw bytes
and a header; ``<stem>.json`` holds the structure, with each tensor as
``{"tensor": key}``.

::

    write_state({"model": model.state_dict(), "optimizer": opt.state_dict()}, folder / "actor")
    state = read_state(folder / "actor")          # the same structure, the same bytes

What the JSON can hold: dicts (keys str, int, float, bool or None, kept with their
type: an optimizer's per-parameter state is keyed by int), lists, tuples, str, int,
float (inf and NaN included), bool, None. Saving anything else (a function, a module,
a numpy array) raises ``TypeError`` naming where it is: a checkpoint never holds an
object that would need code to rebuild. Tensors sharing memory (tied embeddings) are
stored once and come back as one tensor under both names.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

__all__ = ["SUFFIXES", "exists", "read_state", "write_state"]

SUFFIXES = (".safetensors", ".json")
_FORMAT = "rlfleet-state-1"


def exists(stem: Path) -> bool:
    """Whether both files of ``stem`` are there."""
    return all(stem.with_name(stem.name + s).is_file() for s in SUFFIXES)


def write_state(state: Any, stem: Path) -> list[Path]:
    """Write ``state`` as ``<stem>.safetensors`` and ``<stem>.json``; the two paths."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    skeleton = _split(state, _Tensors(tensors), "state")
    files = [stem.with_name(stem.name + s) for s in SUFFIXES]
    save_file(tensors, str(files[0]), metadata={"format": _FORMAT})
    text = json.dumps({"format": _FORMAT, "state": skeleton}, allow_nan=True)
    files[1].write_text(text, encoding="utf-8")
    return files


def read_state(stem: Path) -> Any:
    """The state :func:`write_state` wrote at ``stem`` (tensors on the CPU).

    Raises:
        ValueError: the files do not hold such a state (a reference to a tensor the
            safetensors file lacks, an unknown node, another format).
    """
    from safetensors.torch import load_file

    files = [stem.with_name(stem.name + s) for s in SUFFIXES]
    doc = json.loads(files[1].read_text(encoding="utf-8"))
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
        raise ValueError(f"{files[1].name}: not an {_FORMAT} file")
    tensors = load_file(str(files[0]), device="cpu")
    return _join(doc["state"], tensors, files[1].name)


class _Tensors:
    """Collects the tensors of a state under keys ``t0``, ``t1``, ...: the same tensor
    (the same memory, shape, strides and dtype) once; a view of memory another key
    already holds, and a non-contiguous tensor, as a copy of its own (the file stores
    each key's bytes apart)."""

    def __init__(self, out: dict[str, torch.Tensor]) -> None:
        self.out = out
        self._keys: dict[tuple[Any, ...], str] = {}
        self._storages: set[int] = set()

    def add(self, tensor: torch.Tensor) -> str:
        t = tensor.detach()
        ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        ident = (ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if ptr and ident in self._keys:
            return self._keys[ident]
        key = f"t{len(self.out)}"
        if (ptr and ptr in self._storages) or not t.is_contiguous():
            t = t.clone(memory_format=torch.contiguous_format)
        self.out[key] = t.cpu()
        if ptr:
            self._keys[ident] = key
            self._storages.add(ptr)
        return key


def _split(obj: Any, tensors: _Tensors, where: str) -> Any:
    if isinstance(obj, torch.Tensor):
        return {"tensor": tensors.add(obj)}
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"float": repr(obj)}
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if not (k is None or isinstance(k, (bool, int, float, str))):
                raise TypeError(f"{where}: a key of type {type(k).__name__} ({k!r})")
            items.append([k, _split(v, tensors, f"{where}[{k!r}]")])
        return {"dict": items}
    if isinstance(obj, (list, tuple)):
        out = [_split(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
        return out if isinstance(obj, list) else {"tuple": out}
    raise TypeError(
        f"{where}: a {type(obj).__module__}.{type(obj).__qualname__} is not a tensor or a "
        "plain value: a checkpoint holds no object that needs code to rebuild"
    )


def _join(node: Any, tensors: dict[str, torch.Tensor], name: str) -> Any:
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [_join(v, tensors, name) for v in node]
    if isinstance(node, dict) and len(node) == 1:
        ((kind, value),) = node.items()
        if kind == "tensor" and isinstance(value, str):
            if value not in tensors:
                raise ValueError(f"{name}: tensor {value!r} is not in the safetensors file")
            return tensors[value]
        if kind == "float" and value in ("inf", "-inf", "nan"):
            return float(value)
        if kind == "tuple" and isinstance(value, list):
            return tuple(_join(v, tensors, name) for v in value)
        if kind == "dict" and isinstance(value, list):
            out = {}
            for item in value:
                if not (isinstance(item, list) and len(item) == 2):
                    raise ValueError(f"{name}: a dict item is not a [key, value] pair")
                key = item[0]
                if not (key is None or isinstance(key, (bool, int, float, str))):
                    raise ValueError(f"{name}: a dict key of type {type(key).__name__}")
                out[key] = _join(item[1], tensors, name)
            return out
    raise ValueError(f"{name}: an unknown node {str(node)[:80]!r}")
