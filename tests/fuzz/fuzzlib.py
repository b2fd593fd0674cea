"""Hostile requests for the four gRPC services, and the storm that sends them.

One copy, shared by the short suite (``tests/fuzz/test_fuzz_*.py``, part of ``make
test``) and the long runner (``tools/fuzz.py``, ``make fuzz``).

A *target* is a real server of one service, started in-process on 127.0.0.1 port 0
with authentication on (a fresh credential set), with its method table (from the
protobuf descriptors), examples of valid requests and the generators of its own
attacks. A *storm* sends ``count`` requests, request ``i`` drawn from
``random.Random(f"{seed}:{service}:{i}")`` (so any one can be replayed alone), each
with a deadline, over a channel that carries no credentials of its own: every request
names the ``authorization`` metadata it presents (the driver's token unless it tests
authentication). Every outcome is classified by status code:

* a *crash* is INTERNAL or UNKNOWN (a handler raised something the servicer does not
  map: a bug, whatever the input);
* a *hang* is DEADLINE_EXCEEDED on a method that is not legitimately long, or a call
  that returned later than its deadline plus :data:`SLACK_S`;
* a *policy* violation is an authentication/authorization case answered with another
  code than the one the policy says (no or bad token: UNAUTHENTICATED; a role the
  method is not open to: PERMISSION_DENIED; an unknown method: UNIMPLEMENTED or, for
  callers without a valid token, UNAUTHENTICATED).

Only 127.0.0.1 is ever dialed: fields that name an address to dial (``address``,
``metrics_address``, ``endpoint``, ``sender_host``) only ever hold loopback literals
(:data:`SAFE_ADDRESSES`), whatever generator made the request, random bytes included
(:func:`loopback_only` rewrites any that parse otherwise).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from rlfleet.common.auth import allowed, credential_set, generate_tokens
from rlfleet.common.roles import PRINCIPALS
from rlfleet.common.rpc import AUTH_METADATA_KEY, Security, create_channel, using_security
from rlfleet.v1 import (
    common_pb2,
    reward_pb2,
    rollout_pb2,
    scheduler_pb2,
    tools_pb2,
    trainer_pb2,
)

SLACK_S = 5.0
"""How much later than its deadline a call may return before it counts as a hang."""

MAX_RESPONSES = 100_000
"""Response messages read from one streaming call before it is cancelled."""

CRASH_CODES = frozenset({"INTERNAL", "UNKNOWN"})

SAFE_ADDRESSES = (
    "127.0.0.1:1",
    "127.0.0.1:9",
    "127.0.0.2:1",
    "127.0.0.1:0",
    "[::1]:1",
    "",
)
"""The only values an address field of a hostile request ever holds: loopback
literals with a valid port nothing listens on (so nothing needs a name lookup, and
nothing that parses them falls back to one)."""

_ADDRESS_FIELDS = frozenset({"address", "metrics_address", "endpoint", "sender_host"})

_I32 = (-(2**31), 2**31 - 1)
_I64 = (-(2**63), 2**63 - 1)
_U32 = 2**32 - 1
_U64 = 2**64 - 1


# ------------------------------------------------------------------------ the requests


@dataclasses.dataclass(frozen=True)
class Method:
    """One RPC of a service: full name, request type, streaming kinds, deadline."""

    name: str
    request: type[Message]
    client_streaming: bool
    server_streaming: bool
    deadline_s: float
    long: bool = False  # DEADLINE_EXCEEDED is a legitimate outcome (not a hang)

    @property
    def short(self) -> str:
        return self.name.rpartition("/")[2]


@dataclasses.dataclass
class Request:
    """One hostile call: its body (bytes, or a list of messages' bytes for a client
    stream), the role whose token it presents ("none", "bogus" and "garbled:*"
    for broken authentication), and the codes the policy allows (None: any)."""

    method: Method
    category: str
    body: bytes | list[bytes]
    auth: str = "driver"
    expect: frozenset[str] | None = None


@dataclasses.dataclass
class Outcome:
    index: int
    method: str
    category: str
    auth: str
    code: str
    seconds: float
    details: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def methods_of(
    pb2: Any,
    service: str,
    *,
    deadline_s: float = 15.0,
    deadlines: dict[str, float] | None = None,
    long: Sequence[str] = (),
) -> list[Method]:
    """The methods of ``service`` in the generated module ``pb2``, from its descriptor."""
    sd = pb2.DESCRIPTOR.services_by_name[service]
    out = []
    for m in sd.methods:
        out.append(
            Method(
                name=f"/{sd.full_name}/{m.name}",
                request=message_factory.GetMessageClass(m.input_type),
                client_streaming=m.client_streaming,
                server_streaming=m.server_streaming,
                deadline_s=(deadlines or {}).get(m.name, deadline_s),
                long=m.name in long,
            )
        )
    return out


REQUEST_TYPES: tuple[type[Message], ...] = (
    *tuple(
        message_factory.GetMessageClass(m.input_type)
        for pb2 in (reward_pb2, rollout_pb2, scheduler_pb2, trainer_pb2, tools_pb2)
        for sd in pb2.DESCRIPTOR.services_by_name.values()
        for m in sd.methods
    ),
    common_pb2.TensorBatchChunk,
    common_pb2.TensorBatch,
    common_pb2.ErrorInfo,
)
"""Every request type of every service, plus a few common messages (wrong types)."""


# ------------------------------------------------------------- values from descriptors


def _is_repeated(f: FieldDescriptor) -> bool:
    return bool(f.is_repeated)


def _is_map(f: FieldDescriptor) -> bool:
    return f.message_type is not None and f.message_type.GetOptions().map_entry


MESSAGE_BUDGET = 6 << 20
"""Bytes of strings and lists one random message may hold (the rest of it stays small)."""


class Budget:
    """What is left of :data:`MESSAGE_BUDGET` while one random message is built."""

    def __init__(self, nbytes: int = MESSAGE_BUDGET) -> None:
        self.left = nbytes

    def take(self, nbytes: int) -> bool:
        """Spend ``nbytes`` if that many are left."""
        if nbytes > self.left:
            return False
        self.left -= nbytes
        return True


def random_string(rng: random.Random, name: str = "", budget: Budget | None = None) -> str:
    """A hostile string: empty, control characters, paths, unicode, numbers, huge
    (a thousand to over a million characters, when ``budget`` allows; None: a
    budget of its own)."""
    if name in _ADDRESS_FIELDS:
        return rng.choice(SAFE_ADDRESSES)
    budget = budget if budget is not None else Budget()
    kind = rng.randrange(12)
    if kind == 0:
        return ""
    if kind == 1:
        return "".join(chr(rng.randrange(32, 127)) for _ in range(rng.randrange(1, 40)))
    if kind == 2:
        return rng.choice(
            ["../../../etc/passwd", "/", "/dev/zero", "..", ".", "~", "/proc/self/mem", "a/../../b"]
        )
    if kind == 3:
        return rng.choice(["\x00", "a\x00b", "\n\r\t", "\u202e\u200b", "%s%n{0}{}", "\\", "\ufeff"])
    if kind == 4:
        return "".join(chr(rng.choice((rng.randrange(0x80, 0xD800), 0x1F600))) for _ in range(9))
    if kind == 5:
        return rng.choice(["-1", "0", "nan", "inf", "-inf", "1e999", "9" * 400, "0x10", "1_000"])
    if kind == 6:
        return rng.choice(["{", "[]", '{"a": NaN}', "null", '{"a":' * 200, "true"])
    if kind == 7:
        n = rng.choice((1000, 65_537, (1 << 20) + 1))
        if budget.take(n):
            return rng.choice("aZ9 é") * n
        return "z"
    if kind == 8:
        return rng.choice(["driver", "admin", "rollout-1", "trainer", "fsdp", "gsm8k", "math"])
    return "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(1, 200)))


def random_bytes(rng: random.Random, limit: int = 4096) -> bytes:
    n = rng.choice((0, 1, 2, 7, rng.randrange(limit + 1)))
    return rng.randbytes(n)


def random_scalar(f: FieldDescriptor, rng: random.Random, budget: Budget | None = None) -> Any:
    """An extreme or random value of a scalar field's type."""
    t = f.cpp_type
    if t == FieldDescriptor.CPPTYPE_BOOL:
        return rng.random() < 0.5
    if t == FieldDescriptor.CPPTYPE_STRING:
        if f.type == FieldDescriptor.TYPE_BYTES:
            data = random_bytes(rng)
            return data if budget is None or budget.take(len(data)) else b""
        return random_string(rng, f.name, budget)
    if t in (FieldDescriptor.CPPTYPE_DOUBLE, FieldDescriptor.CPPTYPE_FLOAT):
        big = 1.7e308 if t == FieldDescriptor.CPPTYPE_DOUBLE else 3.4e38
        return rng.choice(
            (
                0.0,
                -0.0,
                math.nan,
                math.inf,
                -math.inf,
                big,
                -big,
                5e-324,
                -1.0,
                1e-09,
                1000000000.0,
                rng.uniform(-10, 10),
            )
        )
    if t == FieldDescriptor.CPPTYPE_INT32 or t == FieldDescriptor.CPPTYPE_ENUM:
        lo, hi = _I32
        return rng.choice((0, 1, -1, lo, hi, 2, 64, rng.randint(lo, hi), rng.randint(-9, 9)))
    if t == FieldDescriptor.CPPTYPE_INT64:
        lo, hi = _I64
        return rng.choice((0, 1, -1, lo, hi, 2**31, 2**40, rng.randint(lo, hi)))
    if t == FieldDescriptor.CPPTYPE_UINT32:
        return rng.choice((0, 1, 2, _U32, 2**31, 1000, rng.randint(0, _U32)))
    if t == FieldDescriptor.CPPTYPE_UINT64:
        return rng.choice((0, 1, 2, _U64, 2**63, 2**32, rng.randint(0, _U64)))
    raise AssertionError(f"no values for field {f.full_name} of cpp type {t}")


def _repeat_count(rng: random.Random, f: FieldDescriptor, budget: Budget) -> int:
    """How many entries a repeated field gets: a few; now and then (budget allowing)
    a long list of numbers (token ids, shapes, crcs) or of anything else."""
    if rng.random() < 0.05:
        n = rng.choice((1000, 100_000)) if f.message_type is None else rng.choice((300, 3000))
        if budget.take(n * (10 if f.message_type is None else 200)):
            return n
    return rng.choice((0, 1, 1, 2, 3, 5, 17))


def random_message(
    cls: type[Message], rng: random.Random, depth: int = 0, budget: Budget | None = None
) -> Message:
    """A message of ``cls`` with random fields set to random or extreme values."""
    msg = cls()
    fill(msg, rng, depth, budget if budget is not None else Budget())
    return msg


def _message_class(desc: Descriptor) -> type[Message]:
    return message_factory.GetMessageClass(desc)


def fill(msg: Message, rng: random.Random, depth: int, budget: Budget) -> None:
    """Set random fields of ``msg`` (in place), recursing into messages to depth 4."""
    for f in msg.DESCRIPTOR.fields:
        if rng.random() < 0.35 or not budget.take(16):
            continue
        if f.message_type is not None and depth >= 4:
            continue
        if _is_map(f):
            key_f = f.message_type.fields_by_name["key"]
            val_f = f.message_type.fields_by_name["value"]
            m = getattr(msg, f.name)
            for _ in range(_repeat_count(rng, val_f, budget)):
                key = random_scalar(key_f, rng, budget)
                if val_f.message_type is not None:
                    sub = random_message(_message_class(val_f.message_type), rng, depth + 1, budget)
                    m[key].CopyFrom(sub)
                else:
                    m[key] = random_scalar(val_f, rng, budget)
        elif _is_repeated(f):
            values = getattr(msg, f.name)
            for _ in range(_repeat_count(rng, f, budget)):
                if f.message_type is not None:
                    sub = random_message(_message_class(f.message_type), rng, depth + 1, budget)
                    values.add().CopyFrom(sub)
                else:
                    values.append(random_scalar(f, rng, budget))
        elif f.message_type is not None:
            sub = random_message(_message_class(f.message_type), rng, depth + 1, budget)
            getattr(msg, f.name).CopyFrom(sub)
        else:
            setattr(msg, f.name, random_scalar(f, rng, budget))


def mutate(msg: Message, rng: random.Random) -> str:
    """Set one field somewhere in ``msg`` (in place) to an extreme value; returns its path."""
    path = msg.DESCRIPTOR.name
    target = msg
    for _ in range(4):  # descend into set submessages, a few levels
        subs = [
            f
            for f in target.DESCRIPTOR.fields
            if f.message_type is not None and not _is_map(f) and not _is_repeated(f)
            if target.HasField(f.name)
        ]
        lists = [
            f
            for f in target.DESCRIPTOR.fields
            if f.message_type is not None and _is_repeated(f) and not _is_map(f)
            if len(getattr(target, f.name))
        ]
        if not (subs or lists) or rng.random() < 0.3:
            break
        f = rng.choice(subs + lists)
        if _is_repeated(f):
            items = getattr(target, f.name)
            i = rng.randrange(len(items))
            target, path = items[i], f"{path}.{f.name}[{i}]"
        else:
            target, path = getattr(target, f.name), f"{path}.{f.name}"
    if not target.DESCRIPTOR.fields:
        return f"{path} (no fields)"
    f = rng.choice(target.DESCRIPTOR.fields)
    path = f"{path}.{f.name}"
    if _is_map(f) or (f.message_type is not None and _is_repeated(f)):
        fresh = random_message(type(target), rng, depth=2)
        target.ClearField(f.name)
        getattr(target, f.name).MergeFrom(getattr(fresh, f.name))
    elif _is_repeated(f):
        values = getattr(target, f.name)
        if len(values) and rng.random() < 0.5:
            values[rng.randrange(len(values))] = random_scalar(f, rng)
        else:
            budget = Budget()
            n = _repeat_count(rng, f, budget) or 1
            values.extend(random_scalar(f, rng, budget) for _ in range(n))
    elif f.message_type is not None:
        getattr(target, f.name).CopyFrom(random_message(_message_class(f.message_type), rng, 2))
    else:
        setattr(target, f.name, random_scalar(f, rng))
    return path


# ------------------------------------------------------------------ only 127.0.0.1


def _unsafe_address(value: str) -> bool:
    return value not in SAFE_ADDRESSES


def _make_safe(msg: Message, rng: random.Random) -> bool:
    """Replace every address-like string in ``msg`` that is not a safe one; True if any."""
    changed = False
    for f, value in msg.ListFields():
        if f.message_type is not None:
            if _is_map(f):
                if f.message_type.fields_by_name["value"].message_type is not None:
                    for v in value.values():
                        changed |= _make_safe(v, rng)
            elif _is_repeated(f):
                for v in value:
                    changed |= _make_safe(v, rng)
            else:
                changed |= _make_safe(value, rng)
        elif f.name in _ADDRESS_FIELDS and f.type == FieldDescriptor.TYPE_STRING:
            if _is_repeated(f):
                for i, v in enumerate(value):
                    if _unsafe_address(v):
                        value[i] = rng.choice(SAFE_ADDRESSES)
                        changed = True
            elif _unsafe_address(value):
                setattr(msg, f.name, rng.choice(SAFE_ADDRESSES))
                changed = True
    return changed


def loopback_only(method: Method, body: bytes, rng: random.Random) -> bytes:
    """``body`` as it is, unless it parses as ``method``'s request with an address field
    that is not a loopback literal: then that request with its addresses made safe."""
    try:
        msg = method.request.FromString(body)
    except (DecodeError, ValueError, RuntimeError):
        return body  # the server cannot parse it either
    if not _make_safe(msg, rng):
        return body
    return msg.SerializeToString()


# ------------------------------------------------------------------ generic generators

Generator = Callable[[random.Random, "Target"], Request]


def gen_random_bytes(rng: random.Random, target: Target) -> Request:
    """Random bytes as the request body (a few random chunks for a client stream)."""
    m = rng.choice(target.methods)
    if m.client_streaming:
        body: bytes | list[bytes] = [random_bytes(rng) for _ in range(rng.choice((0, 1, 2, 5)))]
    else:
        body = random_bytes(rng, limit=rng.choice((64, 4096, 1 << 16)))
    return Request(m, "random_bytes", body)


def gen_wrong_type(rng: random.Random, target: Target) -> Request:
    """A message of another type, serialized into a method."""
    m = rng.choice(target.methods)
    others = [t for t in REQUEST_TYPES if t is not m.request]
    cls = rng.choice(others)
    if m.client_streaming:
        body: bytes | list[bytes] = [
            random_message(cls, rng).SerializeToString() for _ in range(rng.choice((1, 2, 3)))
        ]
    else:
        body = random_message(cls, rng).SerializeToString()
    return Request(m, f"wrong_type:{cls.DESCRIPTOR.name}", body)


def gen_fuzzed_message(rng: random.Random, target: Target) -> Request:
    """A message of the right type, every field random or extreme."""
    m = rng.choice(target.methods)
    if m.client_streaming:
        body: bytes | list[bytes] = [
            random_message(m.request, rng).SerializeToString()
            for _ in range(rng.choice((0, 1, 2, 4)))
        ]
    else:
        body = random_message(m.request, rng).SerializeToString()
    return Request(m, "fuzzed", body)


def gen_mutated_valid(rng: random.Random, target: Target) -> Request:
    """A valid request of the target with one field set to an extreme value."""
    name = rng.choice(sorted(target.examples))
    m = target.method(name)
    msgs = target.examples[name](rng)
    if msgs:
        mutate(msgs[rng.randrange(len(msgs))], rng)
    body = [x.SerializeToString() for x in msgs]
    return Request(m, "mutated", body if m.client_streaming else body[0])


def _valid_body(rng: random.Random, target: Target) -> tuple[Method, bytes | list[bytes]]:
    """A valid request body of the target (or a random message where it has no example)."""
    name = rng.choice([m.short for m in target.methods])
    m = target.method(name)
    if name in target.examples:
        msgs = target.examples[name](rng)
    else:
        msgs = [random_message(m.request, rng)]
    body = [x.SerializeToString() for x in msgs]
    return m, body if m.client_streaming else body[0]


GARBLED_AUTH = {
    "garbled:scheme": "Basic {token}",
    "garbled:lowercase": "bearer {token}",
    "garbled:no-space": "Bearer{token}",
    "garbled:long": "Bearer " + "A" * 600,
    "garbled:empty": "Bearer ",
    "garbled:truncated": "Bearer {short}",
    "garbled:twice": "Bearer {token}",  # the header sent twice
}


def gen_auth(rng: random.Random, target: Target) -> Request:
    """A call without a token, with a bogus or garbled one, or with another role's token."""
    m, body = _valid_body(rng, target)
    auth = rng.choice(["none", "bogus", *GARBLED_AUTH, *PRINCIPALS])
    if auth in PRINCIPALS:
        expect = None if allowed(auth, m.name) else frozenset({"PERMISSION_DENIED"})
    else:
        expect = frozenset({"UNAUTHENTICATED"})
    return Request(m, f"auth:{auth}", body, auth=auth, expect=expect)


def gen_unknown_method(rng: random.Random, target: Target) -> Request:
    """A method the service does not have (no token: UNAUTHENTICATED)."""
    service = target.methods[0].name.rsplit("/", 1)[0]
    name = rng.choice(["Nope", "getStatus", "GetStatus/x", "", "Generate\x7f", "a" * 300])
    fake = dataclasses.replace(target.methods[0], name=f"{service}/{name}")
    fake = dataclasses.replace(fake, client_streaming=False, server_streaming=False)
    auth = rng.choice(["driver", "driver", "none", "observer"])
    # Methods outside the policy are refused to every role but admin, so a valid
    # token may get PERMISSION_DENIED as well as UNIMPLEMENTED.
    expect = frozenset(
        {"UNAUTHENTICATED"} if auth == "none" else {"PERMISSION_DENIED", "UNIMPLEMENTED"}
    )
    return Request(fake, "unknown_method", random_bytes(rng, 64), auth=auth, expect=expect)


GENERIC: tuple[tuple[Generator, float], ...] = (
    (gen_random_bytes, 3.0),
    (gen_wrong_type, 2.0),
    (gen_fuzzed_message, 4.0),
    (gen_mutated_valid, 4.0),
    (gen_auth, 2.0),
    (gen_unknown_method, 0.3),
)
"""The generators every target uses, with their weights."""


# ------------------------------------------------------------------ broken chunk streams


def broken_chunk_stream(
    chunks: list[common_pb2.TensorBatchChunk], rng: random.Random
) -> tuple[str, list[common_pb2.TensorBatchChunk]]:
    """A valid chunk stream (copied) broken one way: missing, duplicated, reordered or
    trailing chunks, a bad CRC, wrong declared sizes, shapes or dtypes, a changed stream
    id, a duplicated tensor name. Returns ``(what was done, chunks)``."""
    out = [type(c)() for c in chunks]
    for dst, src in zip(out, chunks, strict=True):
        dst.CopyFrom(src)
    n = len(out)
    i = rng.randrange(n)
    c = out[i]
    with_pieces = [x for x in out if len(x.pieces)]
    kind = rng.choice(
        [
            "drop",
            "drop_last",
            "duplicate",
            "after_last",
            "reorder",
            "bad_crc",
            "total_bytes",
            "num_chunks",
            "nbytes",
            "huge_shape",
            "negative_shape",
            "dtype",
            "offset",
            "truncate_data",
            "stream_id",
            "seq",
            "digest",
            "early_last",
            "duplicate_name",
            "empty",
            "huge_meta",
        ]
    )
    if kind == "drop" and n > 1:
        del out[i]
    elif kind == "drop_last":
        out = out[:-1]
    elif kind == "duplicate":
        out.insert(i, out[i])
    elif kind == "after_last":
        extra = type(c)()
        extra.CopyFrom(out[rng.randrange(n)])
        extra.seq = n
        out.append(extra)
    elif kind == "reorder" and n > 1:
        j = rng.randrange(n)
        out[i], out[j] = out[j], out[i]
    elif kind == "bad_crc":
        c.crc32c ^= 1 << rng.randrange(32)
    elif kind == "total_bytes":
        out[-1].total_bytes = rng.choice((0, out[-1].total_bytes + 1, _U64, 2**40))
        if rng.random() < 0.5:
            out[0].total_bytes = rng.choice((_U64, 2**40))
    elif kind == "num_chunks":
        out[-1].num_chunks = rng.choice((0, n + 1, _U32))
    elif kind == "early_last":
        c.last = True
        c.num_chunks = i + 1
    elif kind == "stream_id":
        c.stream_id = random_string(rng)
    elif kind == "seq":
        c.seq = rng.choice((_U32, i + 1, 0 if i else 1))
    elif kind == "digest":
        out[-1].digest = rng.choice(
            ("", "chunks:" + "0" * 64, "md5:x", "data:", random_string(rng))
        )
    elif kind == "empty":
        out = []
    elif kind == "huge_meta":
        key = rng.choice(("k", "rlfleet.weights.version", "rlfleet.weights.bucket", "metrics"))
        out[0].meta[key] = rng.choice(("x" * (1 << 20), "-1", "nan", str(_U64), "{"))
        for j in range(rng.choice((1, 1000))):
            out[0].meta[f"m{j}"] = "v"
    elif with_pieces:
        c = rng.choice(with_pieces)
        p = c.pieces[rng.randrange(len(c.pieces))]
        if kind == "nbytes":
            p.nbytes = rng.choice((0, p.nbytes + 1, p.nbytes - 1 if p.nbytes else 1, _U64))
        elif kind == "huge_shape":
            p.shape[:] = rng.choice(([2**62], [2**31, 2**31], [_I64[1]], [1 << 40, 8]))
            p.nbytes = min(math.prod(p.shape) * 4, _U64)
        elif kind == "negative_shape":
            p.shape[:] = rng.choice(([-1], [-(2**63)], [2, -2], [0, -5]))
        elif kind == "dtype":
            p.dtype = rng.choice((0, 99, -1, common_pb2.BOOL, common_pb2.COMPLEX128, 16))
        elif kind == "offset":
            p.offset = rng.choice((1, _U64, p.offset + len(p.data), 2**40))
        elif kind == "truncate_data":
            p.data = p.data[: len(p.data) // 2]
        elif kind == "duplicate_name":
            q = c.pieces.add()
            q.CopyFrom(p)
    return kind, out


# ------------------------------------------------------------------------------ target


@dataclasses.dataclass(frozen=True)
class KnownBug:
    """A crash found by fuzzing, not fixed yet: a short name, the method, which
    requests trigger it, and what happens (the reason of its ``xfail(strict=True)`` test)."""

    name: str
    method: str
    matches: Callable[[Request], bool]
    reason: str


def parsed(req: Request) -> list[Message]:
    """The request's messages as its method parses them (those that parse)."""
    bodies = req.body if isinstance(req.body, list) else [req.body]
    out = []
    for b in bodies:
        with contextlib.suppress(DecodeError, ValueError, RuntimeError):
            out.append(req.method.request.FromString(b))
    return out


@dataclasses.dataclass
class Target:
    """A service under fuzz: a real server, its methods and its attacks.

    Attributes:
        name: the service ("reward", "rollout", "trainer", "scheduler").
        address: its gRPC address on 127.0.0.1.
        tokens: role -> token of the credential set its server accepts.
        methods: every method of the service, with deadlines.
        examples: method short name -> a function making a valid request (a list
            of messages: one for unary, the stream for client streams).
        generators: ``(generator, weight)``: generic and the service's own.
        check: a normal call that must succeed (after the storm); raises otherwise.
        state: what the service's own generators need (current version, weights...).
        known_bugs: crashes already found and reported (each with an xfail test):
            still sent, but a crash they explain counts as ``known_crashes``.
    """

    name: str
    address: str
    tokens: dict[str, str]
    methods: list[Method]
    examples: dict[str, Callable[[random.Random], list[Message]]]
    generators: list[tuple[Generator, float]]
    check: Callable[[], None]
    state: dict[str, Any] = dataclasses.field(default_factory=dict)
    known_bugs: list[KnownBug] = dataclasses.field(default_factory=list)

    def known_bug(self, req: Request) -> KnownBug | None:
        for bug in self.known_bugs:
            if bug.method == req.method.short and bug.matches(req):
                return bug
        return None

    def method(self, short: str) -> Method:
        for m in self.methods:
            if m.short == short:
                return m
        raise KeyError(short)

    def metadata(self, auth: str) -> list[tuple[str, str]]:
        token = self.tokens["driver"]
        if auth == "none":
            return []
        if auth == "bogus":
            return [(AUTH_METADATA_KEY, "Bearer " + "x" * 43)]
        if auth in self.tokens:
            return [(AUTH_METADATA_KEY, f"Bearer {self.tokens[auth]}")]
        value = GARBLED_AUTH[auth].format(token=token, short=token[:-1])
        if auth == "garbled:twice":
            return [(AUTH_METADATA_KEY, value), (AUTH_METADATA_KEY, value)]
        return [(AUTH_METADATA_KEY, value)]

    def request(self, rng: random.Random) -> Request:
        gens, weights = zip(*self.generators, strict=True)
        gen = rng.choices(gens, weights=weights)[0]
        req = gen(rng, self)
        if isinstance(req.body, list):
            req.body = [loopback_only(req.method, b, rng) for b in req.body]
        else:
            req.body = loopback_only(req.method, req.body, rng)
        return req


def raw_channel(address: str) -> grpc.Channel:
    """A channel carrying no credentials of its own (requests carry their metadata),
    no retries (every call is one attempt within its deadline), 80 MiB messages."""
    return create_channel(
        address,
        security=Security(credentials=None, insecure=True),
        retry_unavailable=False,
        max_message_bytes=80 << 20,
    )


def call(channel: grpc.Channel, target: Target, req: Request) -> tuple[str, str]:
    """Send one request; ``(status code name, details)``."""
    m = req.method
    kwargs: dict[str, Any] = {"timeout": m.deadline_s, "metadata": target.metadata(req.auth)}
    try:
        if m.client_streaming:
            body = req.body if isinstance(req.body, list) else [req.body]
            if m.server_streaming:
                responses = channel.stream_stream(m.name)(iter(body), **kwargs)
            else:
                channel.stream_unary(m.name)(iter(body), **kwargs)
                return "OK", ""
        else:
            single = req.body if isinstance(req.body, bytes) else b"".join(req.body)
            if m.server_streaming:
                responses = channel.unary_stream(m.name)(single, **kwargs)
            else:
                channel.unary_unary(m.name)(single, **kwargs)
                return "OK", ""
        for n, _ in enumerate(responses):
            if n >= MAX_RESPONSES:
                responses.cancel()
                return "OK", f"cancelled after {MAX_RESPONSES} responses"
        return "OK", ""
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        details = (e.details() if hasattr(e, "details") else "") or ""
        return (code.name if code is not None else "UNKNOWN"), details[:300]


# ------------------------------------------------------------------------------- storm


def rss_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    import os

    return pages * os.sysconf("SC_PAGE_SIZE")


@dataclasses.dataclass
class Report:
    service: str
    seed: int
    requests: int = 0
    codes: Counter[str] = dataclasses.field(default_factory=Counter)
    categories: Counter[str] = dataclasses.field(default_factory=Counter)
    crashes: list[Outcome] = dataclasses.field(default_factory=list)
    known_crashes: Counter[str] = dataclasses.field(default_factory=Counter)
    hangs: list[Outcome] = dataclasses.field(default_factory=list)
    policy: list[Outcome] = dataclasses.field(default_factory=list)
    rss_growth_bytes: int = 0
    seconds: float = 0.0
    stopped_early: bool = False
    healthy_after: bool | None = None

    def summary(self) -> dict[str, Any]:
        """The JSON line of the runner: counts, and the first few failures in full."""
        return {
            "service": self.service,
            "seed": self.seed,
            "requests": self.requests,
            "codes": dict(sorted(self.codes.items())),
            "crashes": len(self.crashes),
            "known_crashes": dict(self.known_crashes),
            "hangs": len(self.hangs),
            "policy_violations": len(self.policy),
            "rss_growth_bytes": self.rss_growth_bytes,
            "seconds": round(self.seconds, 1),
            "stopped_early": self.stopped_early,
            "healthy_after": self.healthy_after,
            "failures": [o.as_dict() for o in (self.crashes + self.hangs + self.policy)[:10]],
        }

    def explain(self) -> str:
        return json.dumps(self.summary(), indent=1)


def classify(report: Report, req: Request, outcome: Outcome, known: KnownBug | None) -> None:
    report.requests += 1
    report.codes[outcome.code] += 1
    report.categories[req.category.split(":")[0]] += 1
    if outcome.code in CRASH_CODES:
        if known is not None:
            report.known_crashes[known.name] += 1
        else:
            report.crashes.append(outcome)
    late = outcome.seconds > req.method.deadline_s + SLACK_S
    if late or (outcome.code == "DEADLINE_EXCEEDED" and not req.method.long):
        report.hangs.append(outcome)
    if req.expect is not None and outcome.code not in req.expect:
        report.policy.append(outcome)


def storm(
    target: Target,
    *,
    seed: int,
    count: int,
    workers: int = 4,
    budget_s: float = 600.0,
    only: Sequence[int] = (),
) -> Report:
    """Send ``count`` hostile requests (or just the indices in ``only``) to ``target``
    from ``workers`` threads; stops sending new ones after ``budget_s`` seconds."""
    report = Report(target.name, seed)
    lock = threading.Lock()
    t0 = time.monotonic()
    indices = list(only) if only else list(range(count))
    channel = raw_channel(target.address)

    def one(i: int) -> None:
        if time.monotonic() - t0 > budget_s:
            with lock:
                report.stopped_early = True
            return
        rng = random.Random(f"{seed}:{target.name}:{i}")
        req = target.request(rng)
        start = time.monotonic()
        code, details = call(channel, target, req)
        outcome = Outcome(
            i,
            req.method.short,
            req.category,
            req.auth,
            code,
            round(time.monotonic() - start, 3),
            details,
        )
        with lock:
            classify(report, req, outcome, target.known_bug(req))

    gc.collect()
    before = rss_bytes()
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fuzz") as pool:
            for f in [pool.submit(one, i) for i in indices]:
                f.result()
    finally:
        channel.close()
    gc.collect()
    report.rss_growth_bytes = rss_bytes() - before
    report.seconds = time.monotonic() - t0
    return report


def healthy(address: str, timeout_s: float = 10.0) -> bool:
    """The server answers its health check SERVING (health needs no token)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with contextlib.closing(raw_channel(address)) as channel:
        try:
            r = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
    return bool(r.status == health_pb2.HealthCheckResponse.SERVING)


def storm_and_check(target: Target, **kwargs: Any) -> Report:
    """The target's normal request (it works, and warms the server up), :func:`storm`,
    then the health check and the normal request again."""
    target.check()
    report = storm(target, **kwargs)
    report.healthy_after = healthy(target.address)
    target.check()
    return report


# -------------------------------------------------------------- credentials & serving


@dataclasses.dataclass
class Credentials:
    tokens: dict[str, str]

    @classmethod
    def fresh(cls) -> Credentials:
        return cls(generate_tokens())

    def security(self, role: str = "driver") -> Security:
        return Security(credentials=credential_set(self.tokens)[role])

    def stub_kwargs(self, role: str = "driver", timeout_s: float = 60.0) -> dict[str, Any]:
        return {
            "metadata": [(AUTH_METADATA_KEY, f"Bearer {self.tokens[role]}")],
            "timeout": timeout_s,
        }


def serving(creds: Credentials) -> contextlib.AbstractContextManager[Security | None]:
    """Servers started inside require the set's tokens (clients present the driver's)."""
    return using_security(creds.security("driver"))


def model_dir_for(path: Path) -> Path:
    """The tiny model in ``path`` (built there once)."""
    from rlfleet.common.tiny_model import build_tiny_model

    if (path / "config.json").exists():
        return path
    return Path(build_tiny_model(path, preset="tiny", seed=0))
