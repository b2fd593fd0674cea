"""Batch values as typed bytes: what a tensor, an array or a column is on the wire.

A *batch* is ``name -> value`` (:data:`Batch`). This module turns its values into
typed bytes and back; :mod:`rlfleet.common.codec.wire` frames those bytes as
protobuf messages (``TensorBatch``, chunk streams). Torch-free at import time:
torch is only touched when a value already is a torch tensor, or when a caller
asks for ``to="torch"``.

Value rules (encode):

* torch tensors of every dtype torch has a ``DType`` for (float32/64/16,
  bfloat16, int8/16/32/64, uint8/16/32/64, bool, complex64/128, float8 e4m3fn /
  e5m2), on any device (moved to CPU), any strides (made contiguous), 0-d or
  empty; ``requires_grad`` is dropped. Sparse and quantized tensors are refused.
* numpy arrays of the numpy twins of those dtypes (any byte order, any strides).
* a list (or tuple) whose items are all ``str`` becomes a column of strings; any
  other list becomes a JSON column, one JSON document per row (numpy scalars and
  arrays inside rows are converted with ``.tolist()``; NaN and infinities are
  written as Python's json writes them). Rows decode as lists.
* anything else raises :class:`CodecError`.

Decode rule: the wire does not record whether a tensor was torch or numpy.
``to="torch"`` returns every tensor as a CPU ``torch.Tensor`` (torch must be
installed); ``to="numpy"`` returns every tensor as an ``np.ndarray`` and raises
:class:`CodecError` for bfloat16 and float8 tensors, which numpy cannot hold
(decode those with ``to="torch"``).

Bytes are little-endian, C order.

**Flat buffers** -- :func:`tensor_specs`, :func:`pack_into` and :func:`unpack` lay
a batch's tensors out in one flat buffer, for a bulk TCP or shared-memory
transport (no protobuf involved).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import numpy as np
import numpy.typing as npt

from rlfleet.v1 import common_pb2  # the DType codes

if TYPE_CHECKING:
    import torch

__all__ = [
    "Batch",
    "CodecError",
    "ColumnKind",
    "ColumnRows",
    "TensorBytes",
    "TensorSpec",
    "To",
    "U8Array",
    "as_value",
    "check_byteorder",
    "check_to",
    "decode_rows",
    "destination_bytes",
    "dtype_name",
    "expected_nbytes",
    "pack_into",
    "packed_size",
    "split_batch",
    "tensor_specs",
    "unpack",
]

#: A batch: name -> torch tensor | numpy array | list (a column).
Batch: TypeAlias = dict[str, Any]
To = Literal["torch", "numpy"]
ColumnKind = Literal["strings", "json"]
U8Array = npt.NDArray[np.uint8]


class CodecError(ValueError):
    """A batch cannot be encoded, or a message / chunk stream is malformed.

    ``field`` names the offending chunk field or tensor where the assembler knows it
    (``"seq"``, ``"total_bytes"``, a tensor or column name), else ``""``; ``value`` is
    the offending value.
    """

    def __init__(self, message: str, *, field: str = "", value: object = None) -> None:
        super().__init__(message)
        self.field = field
        self.value = value


# --------------------------------------------------------------------------- dtypes

_D = common_pb2
_ITEMSIZE: dict[int, int] = {
    _D.FLOAT32: 4,
    _D.FLOAT64: 8,
    _D.FLOAT16: 2,
    _D.BFLOAT16: 2,
    _D.INT8: 1,
    _D.UINT8: 1,
    _D.INT16: 2,
    _D.INT32: 4,
    _D.INT64: 8,
    _D.BOOL: 1,
    _D.UINT16: 2,
    _D.UINT32: 4,
    _D.UINT64: 8,
    _D.COMPLEX64: 8,
    _D.COMPLEX128: 16,
    _D.FLOAT8_E4M3FN: 1,
    _D.FLOAT8_E5M2: 1,
}
# Every DType but BFLOAT16 and the FLOAT8 types has a numpy twin.
_NUMPY_DTYPE: dict[int, np.dtype[Any]] = {
    _D.FLOAT32: np.dtype("<f4"),
    _D.FLOAT64: np.dtype("<f8"),
    _D.FLOAT16: np.dtype("<f2"),
    _D.INT8: np.dtype("i1"),
    _D.UINT8: np.dtype("u1"),
    _D.INT16: np.dtype("<i2"),
    _D.INT32: np.dtype("<i4"),
    _D.INT64: np.dtype("<i8"),
    _D.BOOL: np.dtype("?"),
    _D.UINT16: np.dtype("<u2"),
    _D.UINT32: np.dtype("<u4"),
    _D.UINT64: np.dtype("<u8"),
    _D.COMPLEX64: np.dtype("<c8"),
    _D.COMPLEX128: np.dtype("<c16"),
}
_NUMPY_CODE: dict[np.dtype[Any], int] = {v: k for k, v in _NUMPY_DTYPE.items()}
_TORCH_NAME: dict[int, str] = {
    _D.FLOAT32: "float32",
    _D.FLOAT64: "float64",
    _D.FLOAT16: "float16",
    _D.BFLOAT16: "bfloat16",
    _D.INT8: "int8",
    _D.UINT8: "uint8",
    _D.INT16: "int16",
    _D.INT32: "int32",
    _D.INT64: "int64",
    _D.BOOL: "bool",
    _D.UINT16: "uint16",
    _D.UINT32: "uint32",
    _D.UINT64: "uint64",
    _D.COMPLEX64: "complex64",
    _D.COMPLEX128: "complex128",
    _D.FLOAT8_E4M3FN: "float8_e4m3fn",
    _D.FLOAT8_E5M2: "float8_e5m2",
}


def dtype_name(code: int) -> str:
    """The ``DType`` name of a code, for messages."""
    try:
        return str(common_pb2.DType.Name(code))
    except ValueError:
        return f"<unknown DType {code}>"


@cache
def _torch_dtypes() -> tuple[dict[int, torch.dtype], dict[torch.dtype, int]]:
    import torch

    to_torch: dict[int, torch.dtype] = {}
    for code, name in _TORCH_NAME.items():
        dt = getattr(torch, name, None)
        if isinstance(dt, torch.dtype):
            to_torch[code] = dt
    return to_torch, {v: k for k, v in to_torch.items()}


def _is_torch_tensor(value: object) -> bool:
    # A torch tensor can only exist if torch is already imported: no import here.
    torch_mod = sys.modules.get("torch")
    return torch_mod is not None and isinstance(value, torch_mod.Tensor)


def check_byteorder() -> None:
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        raise CodecError("the codec assumes a little-endian host")


# --------------------------------------------------------------------------- values


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Where one tensor's bytes are: ``dtype`` is a ``common_pb2.DType`` value;
    ``offset`` is the start inside a packed buffer (flat buffers only)."""

    name: str
    dtype: int
    shape: tuple[int, ...]
    nbytes: int
    offset: int = 0


@dataclass(slots=True)
class TensorBytes:
    """One tensor as typed bytes."""

    name: str
    dtype: int
    shape: tuple[int, ...]
    data: U8Array  # 1-D, C-contiguous, len == nbytes; may alias the caller's tensor

    @property
    def nbytes(self) -> int:
        return int(self.data.shape[0])


def _plain_u8(t: torch.Tensor) -> U8Array | None:
    """The bytes of a dense, C-contiguous CPU tensor without grad, conj or neg bits,
    at least 1-D and not empty, as a flat uint8 view of its memory: the common case,
    in a few cheap calls (a weight stream has hundreds of tensors); None otherwise."""
    torch = sys.modules["torch"]
    if not (
        t.is_cpu
        and t.layout == torch.strided
        and not t.requires_grad
        and t.dim()
        and t.numel()
        and t.is_contiguous()
        and t.stride(-1) == 1
        and not (t.is_quantized or t.is_conj() or t.is_neg())
    ):
        return None
    data: U8Array = t.view(torch.uint8).numpy().reshape(-1)
    # Relaxed strides on size-1 dims could make numpy's flatten a copy: not a view.
    return data if data.flags.c_contiguous and data.base is not None else None


def _torch_as_u8(name: str, t: torch.Tensor) -> tuple[int, tuple[int, ...], U8Array]:
    import torch

    code = _torch_dtypes()[1].get(t.dtype)
    if code is None:
        raise CodecError(f"tensor {name!r}: dtype {t.dtype} has no DType on the wire")
    plain = _plain_u8(t)
    if plain is not None:
        return code, tuple(t.shape), plain
    if t.layout != torch.strided or t.is_quantized:
        raise CodecError(f"tensor {name!r}: layout {t.layout} is not supported; send it dense")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    shape = tuple(int(d) for d in t.shape)
    if t.numel() == 0:  # may carry stride 0, which view(uint8) refuses
        return code, shape, np.empty(0, dtype=np.uint8)
    # reshape(-1) is a view when contiguous; otherwise one copy into C order.
    flat = t.contiguous().reshape(-1)
    if flat.stride(0) != 1:  # "contiguous" size-1 tensors may keep any stride
        flat = flat.as_strided((flat.numel(),), (1,))
    data: U8Array = flat.view(torch.uint8).numpy()
    return code, shape, data


def _numpy_as_u8(name: str, a: npt.NDArray[Any]) -> tuple[int, tuple[int, ...], U8Array]:
    dt = a.dtype
    if dt.byteorder == ">":
        dt = dt.newbyteorder("<")
        a = a.astype(dt)
    code = _NUMPY_CODE.get(dt)
    if code is None:
        raise CodecError(
            f"tensor {name!r}: numpy dtype {a.dtype} has no DType on the wire "
            "(strings go as a list of str, objects as a list of JSON values)"
        )
    shape = tuple(int(d) for d in a.shape)
    flat = np.ascontiguousarray(a).reshape(-1)
    return code, shape, flat.view(np.uint8)


def _as_tensor(name: str, value: Any) -> TensorBytes | None:
    if _is_torch_tensor(value):
        code, shape, data = _torch_as_u8(name, value)
    elif isinstance(value, np.ndarray):
        code, shape, data = _numpy_as_u8(name, value)
    else:
        return None
    return TensorBytes(name, code, shape, data)


def _torch_layout_note(value: Any) -> str:
    """``contiguous: True/False``, or the layout where it is not strided (a sparse
    tensor cannot say whether it is contiguous)."""
    torch = sys.modules["torch"]
    if value.layout != torch.strided:
        return f"layout {value.layout}"
    return f"contiguous: {value.is_contiguous()}"


def destination_bytes(name: str, value: Any) -> TensorBytes:
    """A writable uint8 view of a CPU tensor's or an array's memory, to decode bytes
    into in place (``ChunkAssembler(out=...)``). Raises :class:`CodecError` unless it
    is dense, C-contiguous, writable and on the CPU (numpy: little-endian)."""
    if _is_torch_tensor(value):
        code = _torch_dtypes()[1].get(value.dtype)
        plain = _plain_u8(value) if code is not None else None
        if code is not None and plain is not None:  # the common case, checked in one go
            return TensorBytes(name, code, tuple(value.shape), plain)
        ok = (
            code is not None
            and value.device.type == "cpu"
            and value.layout == sys.modules["torch"].strided
            and value.is_contiguous()
            and not (value.is_conj() or value.is_neg() or value.requires_grad)
        )
        if code is None or not ok:
            raise CodecError(
                f"destination {name!r} must be a contiguous CPU tensor without grad, got "
                f"{value.dtype} on {value.device} ({_torch_layout_note(value)})",
                field=name,
            )
        shape = tuple(int(d) for d in value.shape)
        if value.numel() == 0:
            return TensorBytes(name, code, shape, np.empty(0, dtype=np.uint8))
        data: U8Array = value.reshape(-1).view(sys.modules["torch"].uint8).numpy()
        return TensorBytes(name, code, shape, data)
    if isinstance(value, np.ndarray):
        code = _NUMPY_CODE.get(value.dtype)
        if code is None or not value.flags.c_contiguous or not value.flags.writeable:
            raise CodecError(
                f"destination {name!r} must be a writable C-contiguous little-endian array "
                f"of a wire dtype, got {value.dtype}",
                field=name,
            )
        return TensorBytes(
            name, code, tuple(int(d) for d in value.shape), value.reshape(-1).view(np.uint8)
        )
    raise CodecError(
        f"destination {name!r} is a {type(value).__name__}; expected a torch tensor or "
        "a numpy array",
        field=name,
    )


def _json_default(obj: Any) -> Any:
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):
        return tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


@dataclass(frozen=True, slots=True)
class ColumnRows:
    """A list value as it travels: ``strings`` rows as they are, ``json`` rows as one
    JSON document each."""

    name: str
    kind: ColumnKind
    rows: list[str]


def _as_column(name: str, value: Sequence[Any]) -> ColumnRows:
    rows = list(value)
    if all(isinstance(r, str) for r in rows):
        return ColumnRows(name, "strings", rows)
    docs: list[str] = []
    for i, row in enumerate(rows):
        try:
            docs.append(json.dumps(row, ensure_ascii=False, default=_json_default))
        except (TypeError, ValueError) as exc:
            raise CodecError(f"column {name!r} row {i}: not JSON-encodable: {exc}") from exc
    return ColumnRows(name, "json", docs)


def split_batch(batch: Mapping[str, Any]) -> tuple[list[TensorBytes], list[ColumnRows]]:
    """The batch's tensors as typed bytes (viewing the caller's memory where it is
    contiguous on the CPU) and its lists as column rows, each in mapping order."""
    check_byteorder()
    tensors: list[TensorBytes] = []
    columns: list[ColumnRows] = []
    for name, value in batch.items():
        if not isinstance(name, str):
            raise CodecError(f"batch keys must be str, got {type(name).__name__} {name!r}")
        t = _as_tensor(name, value)
        if t is not None:
            tensors.append(t)
        elif isinstance(value, list | tuple):
            columns.append(_as_column(name, value))
        else:
            raise CodecError(
                f"value {name!r} is a {type(value).__name__}; expected a torch tensor, "
                "a numpy array, or a list"
            )
    return tensors, columns


def decode_rows(name: str, kind: str, rows: list[str]) -> list[Any]:
    """The values of a column's rows (``kind`` as in :class:`ColumnRows`)."""
    if kind == "strings":
        return rows
    out: list[Any] = []
    for i, doc in enumerate(rows):
        try:
            out.append(json.loads(doc))
        except ValueError as exc:
            raise CodecError(f"column {name!r} row {i}: invalid JSON: {exc}") from exc
        except RecursionError as exc:  # nested past the interpreter's stack
            raise CodecError(f"column {name!r} row {i}: JSON nested too deeply") from exc
    return out


def expected_nbytes(name: str, dtype: int, shape: Sequence[int]) -> int:
    """``prod(shape) x itemsize``; CodecError for an unknown dtype or a negative size."""
    itemsize = _ITEMSIZE.get(dtype)
    if itemsize is None:
        raise CodecError(
            f"tensor {name!r}: unknown dtype {dtype_name(dtype)}", field=name, value=dtype
        )
    if any(d < 0 for d in shape):
        raise CodecError(
            f"tensor {name!r}: negative dimension in shape {list(shape)}",
            field=name,
            value=list(shape),
        )
    return math.prod(shape) * itemsize


def as_value(buf: U8Array, name: str, dtype: int, shape: tuple[int, ...], to: To) -> Any:
    """Turn an owned uint8 buffer into the requested tensor type without copying."""
    if to == "numpy":
        np_dtype = _NUMPY_DTYPE.get(dtype)
        if np_dtype is None:
            raise CodecError(
                f"tensor {name!r}: {dtype_name(dtype)} has no numpy dtype; decode with to='torch'"
            )
        return buf.view(np_dtype).reshape(shape)
    if to != "torch":
        raise CodecError(f"to must be 'torch' or 'numpy', got {to!r}")
    try:
        import torch
    except ImportError as exc:
        raise CodecError("to='torch' needs torch installed; use to='numpy'") from exc
    torch_dtype = _torch_dtypes()[0].get(dtype)
    if torch_dtype is None:
        raise CodecError(f"tensor {name!r}: this torch has no dtype for {dtype_name(dtype)}")
    if buf.size == 0:  # torch.from_numpy gives stride 0 here, which view(dtype) refuses
        return torch.empty(shape, dtype=torch_dtype)
    return torch.from_numpy(buf).view(torch_dtype).reshape(shape)


def check_to(to: str) -> None:
    """CodecError unless ``to`` is ``"torch"`` or ``"numpy"``."""
    if to not in ("torch", "numpy"):
        raise CodecError(f"to must be 'torch' or 'numpy', got {to!r}")


# --------------------------------------------------------------------------- flat buffers


def _spec_parts(name: str, value: Any) -> tuple[int, tuple[int, ...], int]:
    """(dtype code, shape, nbytes) without touching the data."""
    if _is_torch_tensor(value):
        code = _torch_dtypes()[1].get(value.dtype)
        if code is None:
            raise CodecError(f"tensor {name!r}: dtype {value.dtype} has no DType on the wire")
        shape = tuple(int(d) for d in value.shape)
        return code, shape, value.numel() * value.element_size()
    if isinstance(value, np.ndarray):
        dt = value.dtype.newbyteorder("<") if value.dtype.byteorder == ">" else value.dtype
        code = _NUMPY_CODE.get(dt)
        if code is None:
            raise CodecError(f"tensor {name!r}: numpy dtype {value.dtype} has no DType on the wire")
        return code, tuple(int(d) for d in value.shape), int(value.nbytes)
    raise CodecError(
        f"value {name!r} is a {type(value).__name__}; the raw layer takes tensors only"
    )


def tensor_specs(batch: Mapping[str, Any], *, align: int = 64) -> list[TensorSpec]:
    """Lay the tensors of ``batch`` out back to back in one flat buffer, each
    starting at a multiple of ``align`` bytes. Send the specs out of band (e.g. as a
    ``TensorBatch`` whose tensors have no data), then the buffer."""
    specs: list[TensorSpec] = []
    offset = 0
    for name, value in batch.items():
        code, shape, nbytes = _spec_parts(name, value)
        offset = -(-offset // align) * align
        specs.append(TensorSpec(name, code, shape, nbytes, offset))
        offset += nbytes
    return specs


def packed_size(specs: Sequence[TensorSpec]) -> int:
    """Bytes a buffer needs to hold ``specs``."""
    return max((s.offset + s.nbytes for s in specs), default=0)


def pack_into(batch: Mapping[str, Any], buffer: Any, specs: Sequence[TensorSpec]) -> None:
    """Copy each tensor's bytes to its place in the writable ``buffer`` (bytearray,
    mmap, ``SharedMemory.buf``, a numpy uint8 array ...): one copy per tensor."""
    dst = np.frombuffer(buffer, dtype=np.uint8)
    if len(dst) < packed_size(specs):
        raise CodecError(f"buffer of {len(dst)} bytes is smaller than {packed_size(specs)}")
    for s in specs:
        t = _as_tensor(s.name, batch[s.name])
        if t is None or (t.dtype, t.shape, t.nbytes) != (s.dtype, s.shape, s.nbytes):
            raise CodecError(f"tensor {s.name!r} does not match its spec {s}")
        dst[s.offset : s.offset + s.nbytes] = t.data


def unpack(
    buffer: Any, specs: Sequence[TensorSpec], *, to: To = "torch", copy: bool = True
) -> dict[str, Any]:
    """Tensors from a buffer filled by :func:`pack_into`. With ``copy=False`` they
    are views into ``buffer`` (zero-copy; writable only if ``buffer`` is)."""
    check_to(to)
    src = np.frombuffer(buffer, dtype=np.uint8)
    if len(src) < packed_size(specs):
        raise CodecError(f"buffer of {len(src)} bytes is smaller than {packed_size(specs)}")
    out: dict[str, Any] = {}
    for s in specs:
        expected = expected_nbytes(s.name, s.dtype, s.shape)
        if expected != s.nbytes:
            raise CodecError(
                f"tensor {s.name!r}: spec nbytes={s.nbytes}, dtype x shape = {expected}"
            )
        view = src[s.offset : s.offset + s.nbytes]
        out[s.name] = as_value(view.copy() if copy else view, s.name, s.dtype, s.shape, to)
    return out
