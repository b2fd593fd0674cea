"""Versioned, atomic weight updates: stage, verify, check against the model, swap.

Every transport (the gRPC chunk stream here, the bulk TCP / shared-memory data
plane in :mod:`rlfleet.rollout.transport`) ends in :meth:`WeightReceiver.apply`:

1. **stage**: the bytes land in buffers owned by the receiver, never in the model;
2. **verify**: the codec's checks (per-chunk crc32, per-tensor byte ranges, counts,
   the stream's sha256), or the bulk plane's sha256 of all bytes; a failure raises
   :class:`DataLoss` (gRPC ``DATA_LOSS``) naming the chunk / tensor;
3. **check**: every name, dtype and shape against the model, and that every
   parameter is covered (``InvalidArgument`` naming the tensor);
4. **swap**: copy into the parameters under the engine's lock, between two
   generation batches, and bump the version.

Until step 4 the old weights keep serving; a failed update leaves no trace.
Versions may repeat (a re-sync) but never go back: an older version is refused
with ``FailedPrecondition`` (code ``STALE_VERSION``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rlfleet.common.codec import ChunkAssembler, ChunkLike, CodecError
from rlfleet.common.errors import DataLoss, FailedPrecondition, InvalidArgument
from rlfleet.rollout.engine import Engine

__all__ = ["DataLoss", "UpdateResult", "WeightReceiver"]


@dataclass(frozen=True, slots=True)
class UpdateResult:
    """What an applied update did."""

    version: int  # now serving
    bytes: int
    tensors: int
    seconds: float  # from the first byte staged to the swap done
    transport: str = "grpc"


class WeightReceiver:
    """Applies weight updates to one engine, one update at a time."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self.updates = 0
        self.last: UpdateResult | None = None

    @property
    def version(self) -> int:
        return self._engine.info().weight_version

    def check_version(self, version: int) -> None:
        current = self.version
        if version < current:
            raise FailedPrecondition(
                f"weight version {version} is older than the version serving ({current})",
                field="version",
                value=version,
                code="STALE_VERSION",
            )

    def receive_chunks(self, stream: Iterable[tuple[int, ChunkLike]]) -> UpdateResult:
        """Stage a ``(version, TensorBatchChunk)`` stream (the ``UpdateWeights`` RPC),
        verify it and apply it. Every chunk must carry the same version."""
        asm = ChunkAssembler()
        version: int | None = None
        start = time.perf_counter()
        count = 0
        for v, chunk in stream:
            if version is None:
                version = v
                self.check_version(v)
            elif v != version:
                raise InvalidArgument(
                    f"chunk {count} has version {v}, the stream began with {version}",
                    field="version",
                    value=v,
                )
            try:
                asm.add(chunk)
            except CodecError as e:
                raise DataLoss(
                    f"weight update {version} rejected: {e}", code="CORRUPT_CHUNK"
                ) from e
            count += 1
        if version is None:
            raise InvalidArgument("empty weight update: no chunks", field="chunks")
        if not asm.complete:
            raise DataLoss(
                f"weight update {version} ended after {count} chunks without its last chunk; "
                "nothing applied",
                code="INCOMPLETE_UPDATE",
            )
        tensors, _meta = asm.result(to="torch")
        return self.apply(tensors, version, start=start, transport="grpc")

    def apply(
        self,
        tensors: Mapping[str, Any],
        version: int,
        *,
        start: float | None = None,
        transport: str = "grpc",
    ) -> UpdateResult:
        """Check verified tensors against the model and swap them in (all or nothing)."""
        start = time.perf_counter() if start is None else start
        with self._lock:
            self.check_version(version)
            self._engine.update_weights(tensors, version)
            nbytes = sum(int(t.numel()) * int(t.element_size()) for t in tensors.values())
            result = UpdateResult(
                version=version,
                bytes=nbytes,
                tensors=len(tensors),
                seconds=time.perf_counter() - start,
                transport=transport,
            )
            self.updates += 1
            self.last = result
            return result
