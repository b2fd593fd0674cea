"""RewardService over gRPC: validate, convert, delegate to :class:`RewardManager`.

Errors are raised as :mod:`rlfleet.common.errors` classes; the server's
error-mapping interceptor turns them into status codes with an ``ErrorInfo``
(field and sample index). Deadlines: each call gives the manager the time the
client has left, so work stops (and queued chunks are dropped) when it runs out.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc

from rlfleet.common import tracing
from rlfleet.common.errors import RlfleetError
from rlfleet.reward.core import RewardManager
from rlfleet.reward.metrics import RewardMetrics
from rlfleet.reward.serde import (
    info_to_proto,
    result_to_proto,
    results_to_proto,
    samples_from_request,
)
from rlfleet.reward.types import Sample, SampleLimits, ScoreResult
from rlfleet.v1 import reward_pb2, reward_pb2_grpc

__all__ = ["STREAM_REQUESTS_IN_FLIGHT", "RewardServicer"]

STREAM_REQUESTS_IN_FLIGHT = 4
"""Requests of one ScoreStream scored concurrently; reading pauses beyond this."""

STREAM_PACK = 256
"""Results in one ScoreStream message at most with ``pack_results``."""

_DONE = object()


def _time_left(context: grpc.ServicerContext) -> float | None:
    remaining: float | None = context.time_remaining()
    return remaining


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    """The RewardService RPCs over a :class:`RewardManager`.

    Args:
        manager: the core.
        metrics: default: the manager's.
        processes: reported by GetInfo: how many processes serve this port.
        limits: bounds on each sample's fields; samples per request are bounded by
            the manager's ``max_batch_size``, checked before any sample is converted.
    """

    def __init__(
        self,
        manager: RewardManager,
        metrics: RewardMetrics | None = None,
        *,
        processes: int = 1,
        limits: SampleLimits | None = None,
    ) -> None:
        self.manager = manager
        self.metrics = metrics or manager.metrics
        self.processes = processes
        self.limits = limits if limits is not None else SampleLimits()

    def _samples(self, request: reward_pb2.ScoreRequest, offset: int = 0) -> list[Sample]:
        return samples_from_request(
            request, offset, max_samples=self.manager.max_batch_size, limits=self.limits
        )

    def _record(self, method: str, started: float, code: str) -> None:
        self.metrics.request(method, code, time.perf_counter() - started)

    def Score(
        self, request: reward_pb2.ScoreRequest, context: grpc.ServicerContext
    ) -> reward_pb2.ScoreResponse:
        started = time.perf_counter()
        code = "INTERNAL"
        try:
            samples = self._samples(request)
            with tracing.span("reward.score", samples=len(samples)):
                results = self.manager.score(samples, timeout_s=_time_left(context))
            response = results_to_proto(results)
            code = "OK"
            return response
        except RlfleetError as exc:
            code = exc.status
            raise
        finally:
            self._record("Score", started, code)

    def ScoreStream(
        self, request_iterator: Iterator[reward_pb2.ScoreRequest], context: grpc.ServicerContext
    ) -> Iterator[reward_pb2.ScoreResult]:
        started = time.perf_counter()
        out: queue.Queue[Any] = queue.Queue()
        slots = threading.Semaphore(STREAM_REQUESTS_IN_FLIGHT)
        stop = threading.Event()
        executor = ThreadPoolExecutor(STREAM_REQUESTS_IN_FLIGHT, thread_name_prefix="reward-stream")

        def score_one(samples: Any, scorers: list[str], offset: int) -> None:
            try:
                self.manager.score(
                    samples,
                    timeout_s=_time_left(context),
                    on_result=out.put,
                    offset=offset,
                    scorers=scorers,
                )
            except Exception as exc:
                out.put(exc)
            finally:
                slots.release()

        pack = threading.Event()  # the first request's pack_results

        def read() -> None:
            offset = 0
            futures: list[Future[None]] = []
            try:
                for request in request_iterator:
                    if stop.is_set():
                        break
                    if offset == 0 and not futures and request.pack_results:
                        pack.set()
                    samples = self._samples(request, offset)
                    scorers = self.manager.validate(samples, offset)
                    slots.acquire()
                    futures.append(executor.submit(score_one, samples, scorers, offset))
                    offset += len(samples)
                for f in futures:
                    f.result()
            except Exception as exc:  # validation or a broken request stream
                out.put(exc)
            finally:
                out.put(_DONE)

        reader = threading.Thread(target=read, name="reward-stream-reader", daemon=True)
        reader.start()
        code = "INTERNAL"
        held: Any = None  # what ended a pack: the next message's first item
        try:
            while True:
                if held is not None:
                    item, held = held, None
                else:
                    try:
                        item = out.get(timeout=0.5)
                    except queue.Empty:
                        if not context.is_active():
                            code = "CANCELLED"
                            return
                        continue
                if item is _DONE:
                    code = "OK"
                    return
                if isinstance(item, Exception):
                    code = item.status if isinstance(item, RlfleetError) else "INTERNAL"
                    raise item
                assert isinstance(item, ScoreResult)
                msg = result_to_proto(item)
                if pack.is_set():  # whatever else is ready goes with it
                    add = msg.more.add
                    for _ in range(STREAM_PACK - 1):
                        try:
                            nxt = out.get_nowait()
                        except queue.Empty:
                            break
                        if not isinstance(nxt, ScoreResult):
                            held = nxt
                            break
                        result_to_proto(nxt, add())
                yield msg
        finally:
            stop.set()
            executor.shutdown(wait=False, cancel_futures=True)
            self._record("ScoreStream", started, code)

    def GetInfo(
        self, request: reward_pb2.GetRewardInfoRequest, context: grpc.ServicerContext
    ) -> reward_pb2.RewardInfo:
        started = time.perf_counter()
        info = info_to_proto(dataclasses.replace(self.manager.info(), processes=self.processes))
        self._record("GetInfo", started, "OK")
        return info
