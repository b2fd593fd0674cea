"""Every rlfleet.v1 message, every field set to a non-default value, round-trips
through the binary wire format and through JSON."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from google.protobuf import json_format, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from rlfleet.v1 import common_pb2, reward_pb2, rollout_pb2, scheduler_pb2, tools_pb2, trainer_pb2

MODULES = [common_pb2, rollout_pb2, reward_pb2, trainer_pb2, scheduler_pb2, tools_pb2]
F = FieldDescriptor
WELL_KNOWN = {"google.protobuf.Struct", "google.protobuf.Value", "google.protobuf.ListValue"}


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _is_repeated(field: FieldDescriptor) -> bool:
    return bool(field.is_repeated)


def all_messages() -> Iterator[Descriptor]:
    def walk(desc: Descriptor) -> Iterator[Descriptor]:
        if desc.GetOptions().map_entry:
            return
        yield desc
        for nested in desc.nested_types:
            yield from walk(nested)

    for mod in MODULES:
        for desc in mod.DESCRIPTOR.message_types_by_name.values():
            yield from walk(desc)


def scalar(field: FieldDescriptor, salt: int) -> Any:
    """A non-default value of the field's type (distinct per salt)."""
    t = field.type
    if t in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return 1.5 + salt  # exact in float32
    if t in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
        return -7 - salt
    if t in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64):
        return -(2**40) - salt
    if t in (F.TYPE_UINT32, F.TYPE_FIXED32):
        return 7 + salt
    if t in (F.TYPE_UINT64, F.TYPE_FIXED64):
        return 2**40 + salt
    if t == F.TYPE_BOOL:
        return True
    if t == F.TYPE_STRING:
        return f"{field.name}-\u00e9-{salt}"
    if t == F.TYPE_BYTES:
        return b"\x00\xff" + field.name.encode() + bytes([salt])
    if t == F.TYPE_ENUM:
        nonzero = [v.number for v in field.enum_type.values if v.number != 0]
        return nonzero[salt % len(nonzero)]
    raise AssertionError(f"no filler for {field.full_name} type {t}")


def fill_well_known(msg: Message) -> None:
    name = msg.DESCRIPTOR.full_name
    if name == "google.protobuf.Struct":
        msg.update({"n": 1.5, "s": "x", "b": True, "z": None, "l": [1.0, "y"], "o": {"k": 2.0}})  # type: ignore[attr-defined]
    elif name == "google.protobuf.Value":
        msg.struct_value.update({"answer": "42", "ok": [True, None]})  # type: ignore[attr-defined]
    elif name == "google.protobuf.ListValue":
        msg.extend([1.0, "x", {"k": None}])  # type: ignore[attr-defined]


def _recursive(field: Any, seen: frozenset[str]) -> bool:
    """A message field whose type is already on the path (``GenerateResult.more``):
    filled and expected one level deep only."""
    return field.type == F.TYPE_MESSAGE and field.message_type.full_name in seen


def fill(msg: Message, variant: int, depth: int = 0, seen: frozenset[str] = frozenset()) -> None:
    """Set every field; in each oneof, member number ``variant % len(members)``."""
    desc = msg.DESCRIPTOR
    if desc.full_name in WELL_KNOWN:
        fill_well_known(msg)
        return
    assert depth < 8, f"recursion too deep at {desc.full_name}"
    inner = seen | {desc.full_name}
    for field in desc.fields:
        if _recursive(field, seen):
            continue
        oneof = field.containing_oneof
        chosen = (
            oneof is None
            or _is_synthetic(oneof)
            or oneof.fields[variant % len(oneof.fields)] is field
        )
        if not chosen:
            continue
        value = getattr(msg, field.name)
        if _is_map(field):
            key_f, val_f = (
                field.message_type.fields_by_name["key"],
                field.message_type.fields_by_name["value"],
            )
            for salt in range(2):
                key = scalar(key_f, salt)
                if val_f.type == F.TYPE_MESSAGE:
                    fill(value[key], variant, depth + 1, inner)
                else:
                    value[key] = scalar(val_f, salt)
        elif _is_repeated(field):
            for salt in range(2):
                if field.type == F.TYPE_MESSAGE:
                    fill(value.add(), variant + salt, depth + 1, inner)
                else:
                    value.append(scalar(field, salt))
        elif field.type == F.TYPE_MESSAGE:
            fill(value, variant, depth + 1, inner)
        else:
            setattr(msg, field.name, scalar(field, variant))


def _is_synthetic(oneof: Any) -> bool:
    # proto3 `optional` fields sit in a one-member synthetic oneof.
    return len(oneof.fields) == 1 and oneof.name == "_" + oneof.fields[0].name


def set_fields(msg: Message, prefix: str = "") -> set[str]:
    """Paths of the fields that hold a non-default value, recursively."""
    out: set[str] = set()
    desc = msg.DESCRIPTOR
    if desc.full_name in WELL_KNOWN:
        return {prefix + "<wkt>"} if msg.ByteSize() else set()
    for field in desc.fields:
        path = prefix + field.name
        value = getattr(msg, field.name)
        if _is_map(field) or _is_repeated(field):
            if len(value):
                out.add(path)
                if field.type == F.TYPE_MESSAGE and not _is_map(field):
                    for item in value:
                        out |= set_fields(item, path + ".")
                elif (
                    _is_map(field)
                    and field.message_type.fields_by_name["value"].type == F.TYPE_MESSAGE
                ):
                    for item in value.values():
                        out |= set_fields(item, path + "[].")
        elif field.type == F.TYPE_MESSAGE:
            if msg.HasField(field.name):
                out.add(path)
                out |= set_fields(value, path + ".")
        elif field.has_presence:
            if msg.HasField(field.name):
                out.add(path)
        elif value != field.default_value:
            out.add(path)
    return out


def all_field_paths(
    desc: Descriptor, prefix: str = "", depth: int = 0, seen: frozenset[str] = frozenset()
) -> set[str]:
    """Every field path a fully filled message of this type should have."""
    if desc.full_name in WELL_KNOWN:
        return {prefix + "<wkt>"}
    inner = seen | {desc.full_name}
    out: set[str] = set()
    for field in desc.fields:
        if _recursive(field, seen):
            continue
        path = prefix + field.name
        out.add(path)
        if field.type != F.TYPE_MESSAGE:
            continue
        if _is_map(field):
            val = field.message_type.fields_by_name["value"]
            if val.type == F.TYPE_MESSAGE:
                out |= all_field_paths(val.message_type, path + "[].", depth + 1, inner)
        else:
            out |= all_field_paths(field.message_type, path + ".", depth + 1, inner)
    return out


def variants(desc: Descriptor) -> int:
    """Enough fills to set each member of the largest oneof, anywhere inside."""

    def widest(d: Descriptor, seen: frozenset[str]) -> int:
        if d.full_name in seen or d.full_name in WELL_KNOWN:
            return 1
        n = max([len(o.fields) for o in d.oneofs if not _is_synthetic(o)], default=1)
        for f in d.fields:
            if f.type == F.TYPE_MESSAGE:
                n = max(n, widest(f.message_type, seen | {d.full_name}))
        return n

    return widest(desc, frozenset())


DESCRIPTORS = list(all_messages())


def test_found_the_messages() -> None:
    names = {d.full_name for d in DESCRIPTORS}
    assert {"rlfleet.v1.TensorBatch", "rlfleet.v1.TensorBatchChunk", "rlfleet.v1.Column"} <= names
    assert len(names) >= 40, sorted(names)


@pytest.mark.parametrize("desc", DESCRIPTORS, ids=lambda d: d.full_name)
def test_roundtrip_every_field(desc: Descriptor) -> None:
    cls = message_factory.GetMessageClass(desc)
    covered: set[str] = set()
    for variant in range(variants(desc)):
        msg = cls()
        fill(msg, variant)
        covered |= set_fields(msg)

        wire = msg.SerializeToString()
        assert cls.FromString(wire) == msg
        assert cls.FromString(msg.SerializeToString(deterministic=True)) == msg

        text = json_format.MessageToJson(msg)
        assert json_format.Parse(text, cls()) == msg
        as_dict = json_format.MessageToDict(msg, preserving_proto_field_name=True)
        assert json_format.ParseDict(as_dict, cls()) == msg

    missing = all_field_paths(desc) - covered
    assert not missing, f"{desc.full_name}: fields left at their default: {sorted(missing)}"


def test_filler_would_notice_a_default_field() -> None:
    # The check above can fail: an unfilled field shows up as missing.
    msg = common_pb2.TensorPiece()
    fill(msg, 0)
    msg.offset = 0
    assert "offset" in all_field_paths(msg.DESCRIPTOR) - set_fields(msg)
