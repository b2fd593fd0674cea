"""The errors rlfleet code raises, classed as recoverable or fatal.

Code inside a service lets these propagate; the gRPC boundary
(:mod:`rlfleet.common.rpc`) turns them into a status code plus a
``rlfleet.v1.ErrorInfo`` in the ``rlfleet-error-bin`` trailing metadata, and a
remote client turns them back into the same class, so in-process and remote
clients raise alike.

Messages state the actual values. ``field`` is prefixed to the message::

    raise InvalidArgument(
        f"unknown data source {source!r} and no default scorer",
        field=f"samples[{i}].data_source",
        value=source,
        sample_index=i,
    )
    # str(exc) == "samples[3].data_source: unknown data source 'foo' and no default scorer"

This module imports neither grpc nor torch.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "DeadlineExceeded",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "RlfleetError",
    "Unauthenticated",
    "Unavailable",
    "error_class_for_status",
]


class RlfleetError(Exception):
    """Base of every rlfleet error.

    Attributes:
        message: what went wrong, with the actual values (without the field prefix).
        code: a stable machine-readable name; defaults to the class's ``status``
            (e.g. ``"INVALID_ARGUMENT"``), may be more specific (``"UNKNOWN_DATA_SOURCE"``).
        field: the offending field, e.g. ``"samples[3].data_source"``; ``""`` if none.
        value: the offending value (any object; printed with :attr:`value_text`).
        sample_index: the sample of the batch it is about, or ``None``.
        recoverable: ``True`` when retrying the same call may succeed.

    Class attributes:
        status: name of the ``grpc.StatusCode`` this class maps to at the boundary.
        default_recoverable: ``recoverable`` when the constructor is not told.
    """

    status: ClassVar[str] = "INTERNAL"
    default_recoverable: ClassVar[bool] = False

    def __init__(
        self,
        message: str,
        *,
        field: str = "",
        value: object = None,
        sample_index: int | None = None,
        code: str | None = None,
        recoverable: bool | None = None,
    ) -> None:
        self.message = message
        self.field = field
        self.value = value
        self.sample_index = sample_index
        self.code = code or self.status
        self.recoverable = self.default_recoverable if recoverable is None else recoverable
        super().__init__(str(self))

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r}, code={self.code!r})"

    @property
    def value_text(self) -> str:
        """The value as ``ErrorInfo.value`` carries it: strings as-is, others ``repr``."""
        if self.value is None:
            return ""
        if isinstance(self.value, str):
            return self.value
        return repr(self.value)

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep the keyword fields through pickling (multiprocessing, Ray).
        return (_rebuild, (type(self), self.message, self._fields()))

    def _fields(self) -> dict[str, Any]:
        return {
            "field": self.field,
            "value": self.value,
            "sample_index": self.sample_index,
            "code": self.code,
            "recoverable": self.recoverable,
        }


def _rebuild(cls: type[RlfleetError], message: str, fields: dict[str, Any]) -> RlfleetError:
    return cls(message, **fields)


class InvalidArgument(RlfleetError):
    """The request is malformed or names something that cannot be valid. Fatal."""

    status = "INVALID_ARGUMENT"


class NotFound(RlfleetError):
    """A named thing (checkpoint, weight version, service, stream) does not exist. Fatal."""

    status = "NOT_FOUND"


class FailedPrecondition(RlfleetError):
    """The system is not in a state that allows the call (e.g. engine asleep). Fatal as sent."""

    status = "FAILED_PRECONDITION"


class Unavailable(RlfleetError):
    """Transiently unable to serve (starting, draining, upstream down). Recoverable.

    Raise it only before the call has had side effects: clients retry it.
    """

    status = "UNAVAILABLE"
    default_recoverable = True


class ResourceExhausted(RlfleetError):
    """Out of memory, a queue or a size limit. Fatal unless told ``recoverable=True``."""

    status = "RESOURCE_EXHAUSTED"


class DeadlineExceeded(RlfleetError):
    """A time limit ran out. Recoverable."""

    status = "DEADLINE_EXCEEDED"
    default_recoverable = True


class Unauthenticated(RlfleetError):
    """Missing or wrong credentials. Fatal."""

    status = "UNAUTHENTICATED"


class PermissionDenied(RlfleetError):
    """Authenticated, but the caller's role may not do this. Fatal."""

    status = "PERMISSION_DENIED"


class DataLoss(RlfleetError):
    """Bytes were lost or corrupted on the way (checksum, missing chunk). Recoverable:
    resending may succeed, and the receiver keeps its previous state."""

    status = "DATA_LOSS"
    default_recoverable = True


class Internal(RlfleetError):
    """A bug or an unexpected state inside the service. Fatal."""

    status = "INTERNAL"


_BY_STATUS: dict[str, type[RlfleetError]] = {
    cls.status: cls
    for cls in (
        InvalidArgument,
        PermissionDenied,
        NotFound,
        FailedPrecondition,
        Unavailable,
        ResourceExhausted,
        DeadlineExceeded,
        Unauthenticated,
        DataLoss,
        Internal,
    )
}


def error_class_for_status(status: str) -> type[RlfleetError]:
    """The class for a ``grpc.StatusCode`` name; :class:`Internal` for codes without one."""
    return _BY_STATUS.get(status, Internal)


def load_failure(error: BaseException, keys: dict[str, str | None]) -> str:
    """One line for a model that failed to load at a service's start: the config key
    whose value the error names (``keys``: key -> value; the first key otherwise), the
    value and the first line of the loader's message (transformers' run to many)."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    named = [(k, v) for k, v in keys.items() if v and v in text]
    key, value = named[0] if named else next(iter(keys.items()), ("model", None))
    return f"{key}: cannot load {value!r}: {first}"
