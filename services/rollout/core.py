"""RolloutCore: one engine, many callers. No sockets, no protobuf.

* **Request batching**: callers submit requests; one batching thread takes every
  request waiting (up to ``max_batch_samples`` rows) and runs them as one engine
  batch, so concurrent callers share the forward passes. Samples are handed to
  their caller as soon as they finish.
* **Weights**: the gRPC chunk stream, the bulk data plane and in-process tensors
  all go through one :class:`~rlfleet.weightsync.receiver.WeightReceiver`; the swap
  waits for the running batch (the engine's lock), so every sample is generated
  with exactly one weight version, which it carries. With an HF engine built with
  ``partial_rollout=True`` the swap happens between two decode steps of the running
  batch instead, and each sample lists the version of each of its tokens
  (``SampleOutput.token_weight_versions``).
* **Limits and cancellation**: a request is checked against the replica's
  :class:`~rlfleet.rollout.engine.GenerateLimits` before it queues; one whose caller
  gave up (``GenerationHandle.cancel``: the servicer calls it when the RPC ends,
  deadline or cancel) is dropped if it has not started and stopped between two
  decode steps if it has, so it does not hold the engine for the others.
* **Status**: weight version, queue depth (samples waiting or running), recent
  tokens/s, totals, bytes of bulk staging held; the same values feed the
  Prometheus metrics.
* **Multi-turn** (a :class:`~rlfleet.rollout.multiturn.MultiTurn` given): every
  request is run as conversations with tool calls, one engine batch per round of
  turns (:meth:`RolloutCore.submit_requests` queues a round at once, so the batching
  thread takes it whole); ``submit(..., multi_turn=False)`` still generates one turn.
"""

from __future__ import annotations

import collections
import logging
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlfleet.common.codec.wire import ChunkLike
from rlfleet.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from rlfleet.rollout.engine import (
    Engine,
    EngineInfo,
    GenerateLimits,
    GenerationRequest,
    SampleOutput,
    SamplingParams,
)
from rlfleet.rollout.handle import DONE, SampleStream
from rlfleet.rollout.metrics import RolloutMetrics
from rlfleet.rollout.multiturn import ConversationHandle, MultiTurn
from rlfleet.weightsync.receiver import BulkReceiver, WeightReceiver
from rlfleet.weightsync.tcp import TOKEN_TIMEOUT_S
from rlfleet.weightsync.wire import AbortResult, TransferOffer, TransferPlan, UpdateResult

__all__ = ["GenerationHandle", "RolloutCore", "RolloutStatusInfo"]

logger = logging.getLogger(__name__)

_RATE_WINDOW_S = 30.0


@dataclass(frozen=True, slots=True)
class RolloutStatusInfo:
    """A replica's state (``RolloutStatus``)."""

    replica_id: str
    model: str
    engine: str
    dtype: str
    device: str
    weight_version: int
    queue_depth: int
    tokens_per_second: float
    sleeping: bool
    generated_tokens_total: int
    # Bulk plane: staging bytes held by updates not applied yet, and spare buffers.
    weight_staged_bytes: int = 0
    weight_spare_bytes: int = 0
    # Requests whose caller gave up before they finished (in-process only: not in
    # the RolloutStatus message).
    requests_cancelled: int = 0


class GenerationHandle(SampleStream):
    """A submitted request: iterate it for its samples as they finish
    (:class:`~rlfleet.rollout.handle.SampleStream`). Cancelling drops the request if
    it has not started yet and stops it between two decode steps if it has."""

    def __init__(self, request: GenerationRequest, min_weight_version: int) -> None:
        super().__init__()
        self.request = request
        self.min_weight_version = min_weight_version
        self.samples = len(request.prompts) * request.params.n
        self.submitted = time.perf_counter()
        self.first_sample: float | None = None


class RolloutCore:
    """Batches generation requests onto one engine and manages its weights.

    Args:
        engine: the backend.
        replica_id: tags every sample and the status.
        max_batch_samples: rows (prompts x n) per engine batch at most; a larger
            request runs alone.
        bulk_host: interface the bulk TCP transport listens on.
        bulk_tls: server context of the bulk TCP transport (None: plain TCP).
        transfer_timeout_s: an open bulk transfer not committed within this expires.
        limits: what one request may ask for (``GenerateLimits()``: the defaults).
        max_version_step: a weight update may raise the version by this much at
            most (``WeightReceiver``).
        bulk_token_timeout_s: a bulk TCP connection must present its transfer's
            token within this (``BulkReceiver``).
        multi_turn: run requests as conversations with tools (None: one turn each).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        replica_id: str = "rollout-0",
        max_batch_samples: int = 256,
        bulk_host: str = "127.0.0.1",
        bulk_tls: ssl.SSLContext | None = None,
        transfer_timeout_s: float = 300.0,
        metrics: RolloutMetrics | None = None,
        limits: GenerateLimits | None = None,
        max_version_step: int | None = None,
        bulk_token_timeout_s: float = TOKEN_TIMEOUT_S,
        multi_turn: MultiTurn | None = None,
    ) -> None:
        if max_batch_samples < 1:
            raise ValueError(f"max_batch_samples must be >= 1, got {max_batch_samples}")
        self.engine = engine
        self.replica_id = replica_id
        self.metrics = metrics or RolloutMetrics(replica_id)
        self._max_rows = max_batch_samples
        self.limits = limits or GenerateLimits()
        self.multi_turn = multi_turn
        self._weights = (
            WeightReceiver(engine)
            if max_version_step is None
            else WeightReceiver(engine, max_version_step=max_version_step)
        )
        self._bulk = BulkReceiver(
            self._weights,
            engine,
            host=bulk_host,
            tls=bulk_tls,
            timeout_s=transfer_timeout_s,
            token_timeout_s=bulk_token_timeout_s,
        )
        self._cond = threading.Condition()
        self._pending: collections.deque[GenerationHandle] = collections.deque()
        self._queued = 0  # samples waiting or running
        self._closed = False
        self._draining = False
        self._drain_abort = threading.Event()
        self._sleeping = False
        self._tokens_total = 0
        self._cancelled_total = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._started = time.monotonic()
        self.metrics.weight_version.set(engine.info().weight_version)
        self.metrics.weight_staged_bytes.set_function(self._bulk.staged_bytes)
        self.metrics.weight_spare_bytes.set_function(self._bulk.spare_bytes)
        self._thread = threading.Thread(target=self._loop, name="rlfleet-batcher", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ generation

    def submit(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        min_weight_version: int = 0,
        multi_turn: bool | None = None,
        seed_indices: Sequence[int] | None = None,
    ) -> GenerationHandle | ConversationHandle:
        """Queue a request; validated now (limits, then the engine's checks), so a bad
        one fails alone. With a multi-turn replica (and ``multi_turn`` not False) the
        request runs as conversations: ``max_tokens`` is each sample's whole response
        budget, tool turns included. ``seed_indices``: see
        :class:`~rlfleet.rollout.engine.GenerationRequest`."""
        if seed_indices is not None:
            seed_indices = [int(i) for i in seed_indices]
            if len(seed_indices) != len(prompts):
                raise InvalidArgument(
                    f"{len(seed_indices)} seed indices for {len(prompts)} prompts",
                    field="prompts.seed_index",
                    value=len(seed_indices),
                )
        request = GenerationRequest([list(p) for p in prompts], params, seed_indices)
        if not request.prompts:
            raise InvalidArgument("no prompts", field="prompts")
        self.limits.check(request)
        self.engine.validate([request])
        with self._cond:
            self._check_open()
        if self.multi_turn is not None and multi_turn is not False:
            return self.multi_turn.submit(self, request, min_weight_version=min_weight_version)
        return self._queue([request], min_weight_version)[0]

    def submit_requests(
        self, requests: Sequence[GenerationRequest], *, min_weight_version: int = 0
    ) -> list[GenerationHandle]:
        """Queue several single-turn requests at once: the batching thread sees them
        together, so they share one engine batch (up to ``max_batch_samples`` rows).
        Each is checked like :meth:`submit`'s; none is queued if one fails."""
        for r in requests:
            if not r.prompts:
                raise InvalidArgument("no prompts", field="prompts")
            self.limits.check(r)
        self.engine.validate(requests)
        return self._queue(requests, min_weight_version)

    def _queue(
        self, requests: Sequence[GenerationRequest], min_weight_version: int
    ) -> list[GenerationHandle]:
        handles = [GenerationHandle(r, min_weight_version) for r in requests]
        with self._cond:
            if self._closed:  # draining: a conversation's later rounds still queue
                raise Unavailable("the rollout core is shut down")
            self._pending.extend(handles)
            self._queued += sum(h.samples for h in handles)
            self.metrics.queue_depth.set(self._queued)
            self._cond.notify()
        return handles

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        min_weight_version: int = 0,
        seed_indices: Sequence[int] | None = None,
    ) -> Iterator[SampleOutput]:
        """Samples as they finish (any order; each carries its indices)."""
        handle = self.submit(
            prompts, params, min_weight_version=min_weight_version, seed_indices=seed_indices
        )
        return iter(handle)

    def _take_batch(self) -> list[GenerationHandle] | None:
        with self._cond:
            while not self._pending and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            batch: list[GenerationHandle] = []
            rows = 0
            while self._pending:
                h = self._pending[0]
                if batch and rows + h.samples > self._max_rows:
                    break
                self._pending.popleft()
                if h.cancelled:
                    self._queued -= h.samples
                    self._cancelled_total += 1
                    self.metrics.requests.labels("cancelled").inc()
                    h._put(DONE)
                    continue
                batch.append(h)
                rows += h.samples
            self.metrics.queue_depth.set(self._queued)
            return batch

    def _loop(self) -> None:
        while (batch := self._take_batch()) is not None:
            if batch:
                self._run(batch)

    def _run(self, batch: list[GenerationHandle]) -> None:
        version = self.engine.info().weight_version
        runnable: list[GenerationHandle] = []
        for h in batch:
            if version < h.min_weight_version:
                self._fail(
                    h,
                    FailedPrecondition(
                        f"serving weight version {version}, the request needs at least "
                        f"{h.min_weight_version}",
                        field="min_weight_version",
                        value=h.min_weight_version,
                        code="STALE_WEIGHTS",
                        recoverable=True,
                    ),
                )
            else:
                runnable.append(h)
        if not runnable:
            return
        emitted = [0] * len(runnable)

        def on_sample(r: int, sample: SampleOutput) -> None:
            h = runnable[r]
            now = time.perf_counter()
            if h.first_sample is None:
                h.first_sample = now
                self.metrics.time_to_first_sample.observe(now - h.submitted)
            emitted[r] += 1
            n = len(sample.token_ids)
            with self._cond:
                self._queued -= 1
                self._tokens_total += n
                self._recent.append((time.monotonic(), n))
            self.metrics.generated_tokens.inc(n)
            self.metrics.samples.labels(sample.finish_reason.name.lower()).inc()
            self.metrics.queue_depth.set(self._queued)
            h._put(sample)

        try:
            self.engine.generate(
                [h.request for h in runnable],
                on_sample=on_sample,
                cancelled=lambda r: runnable[r].cancelled,
            )
        except Exception as e:  # handed to every caller of the batch
            if not isinstance(e, FailedPrecondition | InvalidArgument):
                logger.exception("generation batch of %d requests failed", len(runnable))
            for r, h in enumerate(runnable):
                self._fail(h, e, already=emitted[r])
            return
        for r, h in enumerate(runnable):
            if emitted[r] < h.samples:  # stopped early: its caller gave up
                with self._cond:
                    self._queued -= h.samples - emitted[r]
                    self._cancelled_total += 1
                self.metrics.queue_depth.set(self._queued)
                self.metrics.requests.labels("cancelled").inc()
            else:
                self.metrics.request_latency.observe(time.perf_counter() - h.submitted)
                self.metrics.requests.labels("ok").inc()
            h._put(DONE)

    def _fail(self, h: GenerationHandle, error: BaseException, already: int = 0) -> None:
        with self._cond:
            self._queued -= h.samples - already
        self.metrics.queue_depth.set(self._queued)
        self.metrics.requests.labels("error").inc()
        h._put(error)

    # ------------------------------------------------------------------ weights

    def _record(self, result: UpdateResult) -> UpdateResult:
        if result.staged:  # a bucket of a bucketed update: counted once, when it applies
            return result
        self.metrics.weight_version.set(result.version)
        self.metrics.weight_update_seconds.labels(result.transport).observe(result.seconds)
        self.metrics.weight_update_bytes.labels(result.transport).inc(result.bytes)
        return result

    def update_weights_from_chunks(self, stream: Iterable[tuple[int, ChunkLike]]) -> UpdateResult:
        """Apply a ``(version, TensorBatchChunk)`` stream (see ``WeightReceiver``)."""
        return self._record(self._weights.receive_chunks(stream))

    def update_weights(self, named_tensors: Mapping[str, Any], version: int) -> UpdateResult:
        """Apply tensors handed over in-process (colocated trainer, tests)."""
        return self._record(self._weights.apply(named_tensors, version, transport="inprocess"))

    def open_transfer(self, offer: TransferOffer) -> TransferPlan:
        return self._bulk.open(offer)

    def commit_transfer(
        self,
        transfer_id: str,
        crc32c: Sequence[int],
        *,
        timeout_s: float | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> UpdateResult:
        """Verify a bulk transfer against the sender's per-tensor CRC-32Cs and apply it
        (a bucket that is not its update's last is staged instead); waiting for its
        bytes ends at ``timeout_s`` too (the caller's deadline), or when ``cancelled()``
        (the caller went away)."""
        return self._record(
            self._bulk.commit(transfer_id, crc32c, timeout_s=timeout_s, cancelled=cancelled)
        )

    def abort_transfer(self, update_id: str, reason: str = "") -> AbortResult:
        """Drop a bucketed update its sender gave up (staged buckets freed at once);
        an unknown or finished ``update_id`` is a no-op (``aborted`` False)."""
        result = self._bulk.abort(update_id, reason)
        if result.aborted:
            self.metrics.weight_updates_aborted.inc()
        return result

    # ------------------------------------------------------------------ sleep / status

    def sleep(self, level: int = 1) -> int:
        freed = self.engine.sleep(level)
        self._sleeping = True
        return freed

    def wake_up(self) -> None:
        self.engine.wake_up()
        self._sleeping = False

    def info(self) -> EngineInfo:
        return self.engine.info()

    def status(self) -> RolloutStatusInfo:
        info = self.engine.info()
        now = time.monotonic()
        with self._cond:
            while self._recent and now - self._recent[0][0] > _RATE_WINDOW_S:
                self._recent.popleft()
            window = max(1e-3, min(_RATE_WINDOW_S, now - self._started))
            rate = sum(n for _, n in self._recent) / window
            queued = self._queued
            total = self._tokens_total
            cancelled = self._cancelled_total
        return RolloutStatusInfo(
            replica_id=self.replica_id,
            model=info.model,
            engine=info.engine,
            dtype=info.dtype,
            device=info.device,
            weight_version=info.weight_version,
            queue_depth=queued,
            tokens_per_second=rate,
            sleeping=self._sleeping,
            generated_tokens_total=total,
            weight_staged_bytes=self._bulk.staged_bytes(),
            weight_spare_bytes=self._bulk.spare_bytes(),
            requests_cancelled=cancelled,
        )

    def _check_open(self) -> None:
        """Unavailable once the core is closed or draining (for new requests)."""
        if self._closed:
            raise Unavailable("the rollout core is shut down")
        if self._draining:
            raise Unavailable(
                f"rollout replica {self.replica_id} is draining (scaled down or stopping): "
                "send the work to another replica"
            )

    def drain(self, timeout_s: float) -> bool:
        """Refuse new requests (``Unavailable``) and wait up to ``timeout_s`` until
        every queued and running sample is out; True when it emptied in time.

        The server keeps answering meanwhile (``GetStatus`` included), so a caller's
        liveness probe does not take a draining replica for a dead one; only then
        does the gRPC server stop. :meth:`abort_drain` ends the wait early.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._draining = True
            while self._queued > 0 and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0 or self._drain_abort.is_set():
                    return False
                self._cond.wait(min(left, 0.1))
            return True

    def abort_drain(self) -> None:
        self._drain_abort.set()

    def close(self) -> None:
        """Stop the batching thread; waiting requests fail with ``Unavailable``."""
        with self._cond:
            self._closed = True
            pending, self._pending = list(self._pending), collections.deque()
            self._cond.notify_all()
        for h in pending:
            self._fail(h, Unavailable("the rollout core shut down before the request ran"))
        self._thread.join(timeout=60)
        self._bulk.close()
        if self.multi_turn is not None:
            self.multi_turn.close()
