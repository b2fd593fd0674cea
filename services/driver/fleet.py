"""The rollout fleet: which replicas take work, how a batch is sharded over them, and
what happens when one fails or joins.

* **Sharding**: contiguous prompt ranges, the least loaded replica (by queue depth)
  first; samples stream back as they finish, a prompt's ``n`` samples together.
* **Failure**: a replica that fails mid-generation with a recoverable error
  (UNAVAILABLE, a deadline) is dropped for the run, and the prompts it had not
  finished are re-queued over the others, so the step still gets the full batch
  (``requeued_samples``).
* **Membership**: with a scheduler, the replicas are the registry's alive rollout
  services: a newcomer gets the current weights at the current version before it
  takes work; one the registry lists no longer is dropped. Without one, the set is
  the configured one.

The replica list lives in the run's :class:`~rlfleet.driver.clients.Workers`
(``workers.rollouts``); every change to it goes through this class's lock.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from rlfleet.common import tracing
from rlfleet.common.errors import RlfleetError
from rlfleet.driver.clients import RolloutReplica, Workers
from rlfleet.rollout.engine import SampleOutput, SamplingParams

if TYPE_CHECKING:
    from rlfleet.scheduler.client import SchedulerClient
    from rlfleet.scheduler.registry import ServiceEntry

__all__ = ["RolloutFleet"]

logger = logging.getLogger(__name__)


PushFn = Callable[[Sequence[RolloutReplica], int], None]
"""``push(replicas, version)``: the trainer's current weights to ``replicas``."""


class RolloutFleet:
    """The replicas of a run (see the module docstring).

    Args:
        workers: the run's clients; ``workers.rollouts`` is the replica list.
        push: brings replicas to a weight version (used to adopt newcomers).
        version: the policy's current weight version.
        scheduler: the registry to take membership from; None: fixed replicas.
        heal_wait_s: when every replica has failed mid-generation, how long
            :meth:`generate` waits for one to register again (0: it fails at once).
        adopt_here: whether :meth:`generate` may adopt a newcomer itself (it runs on
            the thread that pushes weights: synchronous runs). False (pipelined): it
            sets :attr:`starved` and waits for the thread that pushes weights to call
            :meth:`refresh` (:meth:`feed_if_starved`).
    """

    def __init__(
        self,
        workers: Workers,
        *,
        push: PushFn,
        version: Callable[[], int],
        scheduler: SchedulerClient | None = None,
        heal_wait_s: float = 0.0,
        adopt_here: bool = True,
    ) -> None:
        self.workers = workers
        self.push = push
        self.version = version
        self.scheduler = scheduler
        self.heal_wait_s = heal_wait_s
        self.adopt_here = adopt_here
        self.starved = False  # generate() waits for replicas (adopt_here False)
        self._lock = threading.Lock()
        self._registered: set[str] = set()  # addresses the registry has listed

    @property
    def replicas(self) -> list[RolloutReplica]:
        """A snapshot of the replicas taking work."""
        with self._lock:
            return list(self.workers.rollouts)

    def __len__(self) -> int:
        return len(self.workers.rollouts)

    # ------------------------------------------------------------------ generation

    def shards(self, n_prompts: int) -> list[tuple[RolloutReplica, int, int]]:
        """Contiguous prompt ranges per replica; the least loaded replica gets the first
        (and, when the split is uneven, a larger) share."""
        replicas = self.replicas
        if len(replicas) == 1:
            return [(replicas[0], 0, n_prompts)]
        depth = []
        for i, r in enumerate(replicas):
            try:
                depth.append((r.client.status(probe=True).queue_depth, i))
            except Exception as e:  # an unreachable replica: last in line, generate() will tell
                logger.warning("rollout replica %s: status failed (%s)", r.replica_id, e)
                depth.append((1 << 30, i))
        order = [i for _, i in sorted(depth)]
        k = len(order)
        sizes = [n_prompts // k + (1 if j < n_prompts % k else 0) for j in range(k)]
        out, start = [], 0
        for j, i in enumerate(order):
            if sizes[j]:
                out.append((replicas[i], start, start + sizes[j]))
                start += sizes[j]
        return out

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        min_version: int,
        stats: dict[str, int] | None = None,
    ) -> Iterator[SampleOutput]:
        """Samples of all shards, a prompt's ``n`` samples together once all have finished;
        ``prompt_index`` is global.

        A shard whose replica fails with a recoverable error drops that replica, and the
        prompts it had not finished (partial samples discarded) are re-queued over the
        remaining replicas; ``stats["requeued_samples"]`` counts them. Other errors
        propagate.
        """
        n = params.n
        out: queue.SimpleQueue[tuple[int, SampleOutput | BaseException | None]] = (
            queue.SimpleQueue()
        )
        jobs: list[tuple[RolloutReplica, list[int]]] = []
        got: dict[int, list[SampleOutput]] = {}  # prompt -> its samples so far
        failed: set[int] = set()  # id() of the replicas dropped in this call

        def run(job: int, replica: RolloutReplica, indices: list[int]) -> None:
            with tracing.span(
                "generate.shard", replica=replica.replica_id, address=replica.address, job=job
            ) as attrs:
                attrs["prompt_indices"] = indices
                attrs["samples"] = 0
                versions: set[int] = set()
                try:
                    # One seed for every shard, and each prompt its index in the whole
                    # batch as its seed index: a prompt's samples are the same on any
                    # replica, in any shard, re-queued or not.
                    batch = [prompts[i] for i in indices]
                    for s in replica.client.generate(
                        batch, params, min_weight_version=min_version, seed_indices=indices
                    ):
                        s.prompt_index = indices[s.prompt_index]
                        attrs["samples"] += 1
                        versions.add(s.weight_version)
                        out.put((job, s))
                except BaseException as e:
                    attrs["error"] = f"{type(e).__name__}: {e}"[:500]
                    out.put((job, e))
                finally:
                    attrs["versions"] = sorted(versions)
                    out.put((job, None))

        def launch(replica: RolloutReplica, indices: list[int]) -> None:
            job = len(jobs)
            jobs.append((replica, indices))
            ctx = contextvars.copy_context()  # the shard's span joins the caller's trace
            threading.Thread(
                target=ctx.run, args=(run, job, replica, indices), daemon=True, name=f"gen-{job}"
            ).start()

        if not self.replicas and not self._heal(set()):  # emptied by a failed push
            raise RuntimeError("no rollout replica left to generate with")
        for replica, lo, hi in self.shards(len(prompts)):
            launch(replica, list(range(lo, hi)))
        running = len(jobs)
        errors: dict[int, BaseException] = {}
        error: BaseException | None = None
        requeued = 0
        while running:
            job, item = out.get()
            if isinstance(item, SampleOutput):
                if error is None and job not in errors:
                    group = got.setdefault(item.prompt_index, [])
                    group.append(item)
                    if len(group) == n:
                        yield from group
                continue
            if isinstance(item, BaseException):
                errors[job] = item
                continue
            running -= 1  # the job ended
            e = errors.pop(job, None)
            if e is None or error is not None:
                continue
            if not (isinstance(e, RlfleetError) and e.recoverable):
                error = e
                continue
            replica, indices = jobs[job]
            failed.add(id(replica))
            others = [r for r in self.drop(replica) if id(r) not in failed]
            if not others:
                others = self._heal(failed)
            if not others:
                error = e
                continue
            unfinished = [i for i in indices if len(got.get(i, ())) < n]
            for i in unfinished:
                got.pop(i, None)
            logger.warning(
                "rollout replica %s (%s) failed mid-generation (%s): re-queuing %d unfinished "
                "prompt(s) x %d samples onto %d other replica(s)",
                replica.replica_id, replica.address, e, len(unfinished), n, len(others),
            )  # fmt: skip
            k = len(others)
            for j, r in enumerate(others):
                share = unfinished[j::k]
                if share:
                    launch(r, share)
                    running += 1
            requeued += len(unfinished) * n
        if stats is not None:
            stats["requeued_samples"] = stats.get("requeued_samples", 0) + requeued
        if error is not None:
            raise error

    # ------------------------------------------------------------------ membership

    @property
    def can_heal(self) -> bool:
        """Whether the fleet may be left empty for a while: replacements are waited
        for (``heal_wait_s``) and found in the registry."""
        return self.heal_wait_s > 0 and self.scheduler is not None

    def remove(self, replicas: Sequence[RolloutReplica]) -> None:
        """Take ``replicas`` out of the fleet, even if that empties it (only where it
        :attr:`can_heal`: generation then waits for replacements)."""
        gone = {id(r) for r in replicas}
        with self._lock:
            self.workers.rollouts = [r for r in self.workers.rollouts if id(r) not in gone]

    def _heal(self, failed: set[int]) -> list[RolloutReplica]:
        """Every replica failed: wait up to ``heal_wait_s`` for the registry to list one
        again (a launcher restarting them, or a replacement), adopt it with the current
        weights and return the replicas then; [] when none came."""
        if not self.can_heal:
            return []
        self.remove([r for r in self.replicas if id(r) in failed])
        logger.warning(
            "every rollout replica failed: waiting up to %.0fs for one to register again",
            self.heal_wait_s,
        )
        if self.adopt_here:
            try:
                self.refresh_waiting()
            except RuntimeError:
                return []
        else:
            self.starved = True  # the weight-pushing thread adopts (feed_if_starved)
            deadline = time.monotonic() + self.heal_wait_s
            try:
                while not self.replicas and time.monotonic() < deadline:
                    time.sleep(0.5)
                    if not self.replicas and self._registered_alive():
                        # One is back and waits for the main thread, which may be in a
                        # long training call: the wait is for replicas, not for it.
                        deadline = max(deadline, time.monotonic() + 1.0)
            finally:
                self.starved = False
        replicas = [r for r in self.replicas if id(r) not in failed]
        if replicas:
            logger.warning("rollout replicas back: %s", [r.replica_id for r in replicas])
        return replicas

    def _registered_alive(self) -> bool:
        """Whether the registry lists a rollout replica alive (a read: any thread)."""
        assert self.scheduler is not None
        try:
            return bool(self.scheduler.list_services("rollout", alive_only=True))
        except RlfleetError:
            return False

    def feed_if_starved(self) -> None:
        """On the thread that pushes weights, while :meth:`generate` waits for replicas
        on another (pipelined runs): adopt what the registry lists now."""
        if self.starved:
            with contextlib.suppress(RuntimeError):  # none yet: asked again
                self.refresh()

    def refresh_waiting(self) -> None:
        """:meth:`refresh`; while no replica is left, again every half second for up to
        ``heal_wait_s`` (a launcher restarting them), then its error."""
        deadline = time.monotonic() + self.heal_wait_s
        while True:
            try:
                self.refresh()
                return
            except RuntimeError:
                if time.monotonic() >= deadline:
                    raise
            time.sleep(0.5)

    def drop(self, replica: RolloutReplica) -> list[RolloutReplica]:
        """Stop sending work to ``replica``; returns the replicas left."""
        with self._lock:
            left = [r for r in self.workers.rollouts if r is not replica]
            if len(left) < len(self.workers.rollouts):
                logger.warning(
                    "dropping rollout replica %s (%s)", replica.replica_id, replica.address
                )
            if left:  # never empty the set: the caller reports the failure
                self.workers.rollouts = left
            return left

    def refresh(self) -> None:
        """Take the replicas from the scheduler's registry (no scheduler: no-op).

        A replica the registry listed before and lists no longer (dead, deregistered)
        is dropped; configured replicas it never listed are kept. A newcomer gets the
        current weights at the current version before it is added.
        """
        if self.scheduler is None:
            return
        try:
            entries = self.scheduler.list_services("rollout", alive_only=True)
        except RlfleetError as e:  # keep the replicas we have; try again next step
            logger.warning("scheduler: listing rollout replicas failed (%s); keeping %d", e,
                           len(self))  # fmt: skip
            return
        alive = {e.spec.address: e for e in entries if e.spec.address}
        self._registered |= alive.keys()
        current = self.replicas
        keep = [r for r in current if r.address not in self._registered or r.address in alive]
        for r in current:
            if r not in keep:
                logger.info("rollout replica %s (%s) left the registry: dropped",
                            r.replica_id, r.address)  # fmt: skip
        known = {r.address for r in keep}
        joined = [
            r for e in alive.values() if e.spec.address not in known
            if (r := self.adopt(e)) is not None
        ]  # fmt: skip
        if not keep and not joined:
            raise RuntimeError(
                f"no rollout replica left: the registry lists {sorted(alive)} alive, and "
                f"{[r.address for r in current]} are gone"
            )
        with self._lock:
            self.workers.rollouts = keep + joined

    def prune(self) -> None:
        """Drop the replicas the registry listed and lists alive no longer (frozen and
        declared dead, scaled down, lost with their node), adopting no newcomer: what a
        weight push does first, so that it does not wait on a replica the scheduler
        already gave up. One that comes back is adopted again by :meth:`refresh`, with
        the weights of then. No scheduler, a failed listing or none left alive: no-op."""
        if self.scheduler is None:
            return
        try:
            entries = self.scheduler.list_services("rollout", alive_only=True)
        except RlfleetError:
            return
        alive = {e.spec.address for e in entries if e.spec.address}
        self._registered |= alive
        current = self.replicas
        keep = [r for r in current if r.address not in self._registered or r.address in alive]
        if not keep or len(keep) == len(current):
            return
        for r in current:
            if r not in keep:
                logger.info("rollout replica %s (%s) is not alive in the registry: not "
                            "pushed to, dropped", r.replica_id, r.address)  # fmt: skip
        with self._lock:
            self.workers.rollouts = keep

    def adopt(self, entry: ServiceEntry) -> RolloutReplica | None:
        """A replica for a newly registered rollout service, at the current weight
        version; None (logged, retried next step) when it cannot be brought there."""
        from rlfleet.rollout.client import RemoteRolloutClient

        address = entry.spec.address
        client = RemoteRolloutClient(address)
        replica = RolloutReplica(entry.service_id or address, client, address)
        want = self.version()
        try:
            if client.status().weight_version != want:
                self.push([replica], want)
            version = client.status().weight_version
        except (RlfleetError, RuntimeError) as e:
            logger.warning("rollout replica %s (%s) not adopted: %s", replica.replica_id,
                           address, e)  # fmt: skip
            client.close()
            return None
        if version != want:
            logger.warning(
                "rollout replica %s (%s) not adopted: at weight version %d after the push, "
                "not %d", replica.replica_id, address, version, want,
            )  # fmt: skip
            client.close()
            return None
        self.workers.owned.append(client)
        logger.info("rollout replica %s (%s) joined at weight version %d",
                    replica.replica_id, address, version)  # fmt: skip
        return replica

    # ------------------------------------------------------------------ colocation

    def sleep(self) -> None:
        """Free the engines' memory while the trainer works (colocated placement)."""
        for r in self.replicas:
            r.client.sleep(1)

    def wake(self) -> None:
        for r in self.replicas:
            r.client.wake_up()
