"""The PPO driver: ``PPOTrainer.init_workers()`` then ``PPOTrainer.fit()`` (verl's shape).

One step (``global_steps`` counts from 1, as in verl)::

    prompts (train_batch_size, from the resumable loader)
      -> generate: the prompts sharded over the rollout replicas, the least loaded
         replica first, rollout.n samples each; samples stream back as they finish
      -> reward: finished samples are decoded and scored in chunks while the rest
         are still generating (the reward service is text in, scores out)
      -> trainer: one TrainStep call with the scored batch (sent once, kept there):
         old log-probs (skipped when provably equal to the actor's own: on-policy, one
         epoch, one mini-batch), ref log-probs, values, advantages, critic update,
         actor update, each timed on the trainer (timing_s/<phase>)
      -> weight sync: trainer -> every rollout replica, versioned
      -> metrics; validation every trainer.test_freq; checkpoint every save_freq

**Dynamic sampling** (DAPO, ``algorithm.filter_groups.enable``): a generation round
draws the next loader batch (``data.gen_batch_size`` prompts, default
``train_batch_size``), generates and scores it, and drops the prompt groups whose
samples all have the same ``filter_groups.metric`` (all right or all wrong: zero
group-relative advantage); rounds go on until ``train_batch_size`` prompts are kept
(the surplus of the last round is cut, as in verl). After ``max_num_gen_batches``
rounds a batch still short fails the step with a message that says so (verl's
behaviour; training on a smaller batch would change the mini-batch split). This runs
inside the batch producer, so it works the same in sync and pipelined mode; metrics:
``train/num_gen_batches`` (verl's name) and ``dynamic_sampling/*``.

**Overlong shaping** (DAPO, ``reward.overlong_buffer``): each training sample's score
gets :func:`~rlfleet.trainer.ppo.core_algos.compute_overlong_penalty` of its length
before the filter and the trainer see it (``reward/overlong_reward/mean``,
``reward/overlong/mean``); validation scores are left unshaped, so
``val/test_score`` stays the scorer's accuracy.

**Pipelined mode** (``trainer.pipeline.enable``): a background thread produces the
generated and scored batches in step order while the main thread trains. The batch
of step ``s`` may start generating once the weights after step ``s - 1 - k`` are on
the replicas (``k = max_staleness``; ``k = 0`` is synchronous), so with ``k = 1``
generation of step ``s + 1`` overlaps training on step ``s``, with weights one
version old. Every sample carries the weight version it was generated with;
``staleness/mean`` and ``staleness/max`` report ``policy version - sample version``
at training time. Replicas are also asked for ``min_weight_version``, so a replica
never serves older weights than the bound allows. With
``trainer.pipeline.partial_rollout`` a push that lands while a replica generates is
applied between two decode steps (the samples go on under the new weights, each token
tagged with its version), and ``rollout/stale_token_frac`` and
``rollout/token_staleness_*`` count staleness per token
(:func:`~rlfleet.driver.batch.token_staleness_metrics`).

**Checkpoints** hold the trainer state and, as extra state, the step count and the
loader position *after the batch that step trained on*; batches prefetched by the
pipeline are not counted, so a resumed run (``trainer.resume_mode: auto``) sees the
same prompts in the same order at the same step numbers.

Generation seeds are ``trainer.seed`` mixed with the step, and each prompt's sampling
noise is keyed by its place in the step's batch (its seed index), so a resumed run
samples the same responses, whatever the replica count and whichever replica (a
re-queue after a failure included) generates a prompt.

**Rollout membership.** With a scheduler (``services.scheduler`` or the ``scheduler``
argument) the driver refreshes its rollout replicas from the registry (alive ROLLOUT
services) before every step: a newcomer first gets the current weights, at the
current version, and only then takes work; a replica the registry lists no longer is
dropped. Without a scheduler the replica set is the configured one. Either way, a
replica that fails mid-generation (a recoverable error: UNAVAILABLE, a deadline) is
dropped for the step and the prompts it had not finished are re-queued onto the
others, so the step still trains on the full batch (``rollout/requeued_samples``).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import dataclasses
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rlfleet.common import tracing
from rlfleet.common.config import Config, run_warnings, save_resolved
from rlfleet.common.errors import (
    DeadlineExceeded,
    NotFound,
    PermissionDenied,
    RlfleetError,
    Unavailable,
)
from rlfleet.driver.batch import (
    Batch,
    GeneratedBatch,
    concat_prompts,
    prompt_ids,
    rollout_metrics,
    select_prompts,
    trainer_batch,
)
from rlfleet.driver.clients import (
    ResourcePoolManager,
    Role,
    RolloutReplica,
    Workers,
    in_process_workers,
    resolve_workers,
)
from rlfleet.driver.external import ExternalRollouts, TrajectorySource, sources_for
from rlfleet.driver.fleet import RolloutFleet
from rlfleet.driver.health import Guard, GuardAction, HealthMonitor, sampled_entropy
from rlfleet.driver.reward import (
    RewardAdapter,
    RewardFn,
    reward_error_fractions,
    reward_error_metrics,
)
from rlfleet.driver.tracking import SchedulerMetrics, Tracking, start_metrics_server
from rlfleet.rollout.engine import GenerateLimits, SampleOutput, SamplingParams
from rlfleet.trainer.ppo import core_algos
from rlfleet.trainer.push import PushOutcome

if TYPE_CHECKING:
    from rlfleet.driver.data.dataset import RLHFDataset
    from rlfleet.driver.data.sampler import PromptLoader
    from rlfleet.scheduler.client import SchedulerClient
    from rlfleet.scheduler.registry import TrainingState

__all__ = ["GeneratedBatch", "PPOTrainer", "Role", "StepRecord"]

logger = logging.getLogger(__name__)

_SEED_MIX = 1_000_003
_ROUND_SEED_MIX = 104_729  # dynamic sampling: each generation round samples anew


class TrainerRestarted(Unavailable):
    """The trainer answered, but as a fresh process: its state (weights, optimizer,
    step) is not the run's any more."""


@dataclass
class StepRecord:
    """What one step trained on (kept in ``PPOTrainer.history`` and the JSONL file)."""

    step: int
    indices: list[int]
    metrics: dict[str, float] = field(default_factory=dict)


def keep_after_restore(
    batches: Sequence[GeneratedBatch], restored_step: int, restored_version: int
) -> list[GeneratedBatch]:
    """Which pipelined batches, generated before the trainer's restart, a recovery keeps.

    The restore takes the weights back to ``restored_version`` (the checkpoint's, in
    the driver's numbering); weights newer than it are gone. A batch whose every token
    came from that version or an older one was generated by an ancestor of the weights
    training goes on from, exactly as if the fault had not happened: its staleness at
    its step is what it was before, within ``max_staleness`` by construction. One with
    a newer token came from the discarded weights and is dropped, with every batch
    after it (the data order must stay the steps' order). Kept: the steps right after
    the ones the recovery redoes, ``restored_step + 1`` onwards, without a gap.
    """
    steps = sorted(batches, key=lambda gb: gb.step)
    # The steps the recovery redoes (restored_step + 1 .. the first kept one - 1) are
    # generated again; what comes after them must follow on without a gap.
    kept: list[GeneratedBatch] = []
    for gb in steps:
        if gb.step <= restored_step or (kept and gb.step != kept[-1].step + 1):
            break
        if any(_newest_version(s) > restored_version for s in gb.samples):
            break
        kept.append(gb)
    return kept


def _renumbered(gb: GeneratedBatch, delta: int) -> GeneratedBatch:
    """``gb`` with every weight version it carries moved by ``delta``."""
    if delta == 0:
        return gb
    samples = [
        dataclasses.replace(
            s,
            weight_version=s.weight_version + delta,
            token_weight_versions=[v + delta for v in s.token_weight_versions],
        )
        for s in gb.samples
    ]
    return dataclasses.replace(
        gb, samples=samples, min_weight_version=gb.min_weight_version + delta
    )


def _newest_version(sample: SampleOutput) -> int:
    """The newest weight version among the tokens of ``sample``."""
    versions = sample.token_weight_versions
    return max(versions) if len(versions) else sample.weight_version


class PPOTrainer:
    """PPO over rlfleet services (see the module docstring).

    Args:
        config: the run config.
        tokenizer: the policy's tokenizer; None: loaded from ``actor.tokenizer_path``.
        role_worker_mapping: role -> worker spec (address, client or factory; see
            :mod:`rlfleet.driver.clients`); None: every role in this process.
        resource_pool_manager: pools and mapping; None: from the config.
        reward_fn: scores training samples: a reward client (``score(samples)``) or
            a callable ``fn(list[Sample]) -> list[float | ScoreResult]``; None: the
            ``Role.RewardModel`` worker.
        val_reward_fn: the same for validation; None: ``reward_fn``.
        train_dataset, val_dataset: ready datasets; None: from ``data.*``.
        metrics_port: serve the Prometheus metrics on this port (0: a free one;
            None: not served).
        on_step: called after every step with its :class:`StepRecord` (tests use it
            to stop a run; an exception raised there ends ``fit``).
        scheduler: the scheduler's address or a client (``list_services``) to take
            rollout membership from; None: ``services.scheduler``, else fixed replicas.
        fleet_metrics: what the launcher did (restarts, replacements, replicas), merged
            into every step's metrics (``fleet/...``); None: nothing.
        trajectory_sources: with ``trainer.rollout_source: external``, where finished
            agent sessions come from; None: every rollout replica's ``PopTrajectories``
            (:mod:`rlfleet.driver.external`).
        kill_trainer: ends the trainer's processes so its launcher restarts them (the
            local and Ray launchers' ``kill_trainer``); with ``trainer.recovery``, called
            once a lost trainer has not answered for ``trainer.recovery.kill_after_s``:
            one that is alive but frozen is never restarted otherwise. None: the driver
            only waits.
        processor, ray_worker_group_cls, collate_fn, train_sampler, device_name: verl's
            ``RayPPOTrainer`` arguments, taken so its callers run unchanged:
            ``ray_worker_group_cls`` is not used (the launchers place the workers);
            ``device_name`` must agree with ``trainer.device``; a ``processor``
            (multimodal inputs) is refused; ``collate_fn`` and ``train_sampler`` are not
            used (batches are the datasets' own, in the order of ``data.shuffle`` and
            ``data.seed``), with a warning when given.
    """

    def __init__(
        self,
        config: Config,
        tokenizer: Any = None,
        role_worker_mapping: Mapping[Any, Any] | None = None,
        resource_pool_manager: ResourcePoolManager | None = None,
        reward_fn: RewardFn = None,
        val_reward_fn: RewardFn = None,
        *,
        train_dataset: RLHFDataset | None = None,
        val_dataset: RLHFDataset | None = None,
        metrics_port: int | None = None,
        on_step: Callable[[StepRecord], None] | None = None,
        scheduler: str | SchedulerClient | None = None,
        fleet_metrics: Callable[[], Mapping[str, float]] | None = None,
        trajectory_sources: Sequence[TrajectorySource] | None = None,
        kill_trainer: Callable[[], None] | None = None,
        processor: Any = None,
        ray_worker_group_cls: Any = None,
        collate_fn: Any = None,
        train_sampler: Any = None,
        device_name: str | None = None,
    ) -> None:
        if processor is not None:
            raise ValueError("processor: multimodal inputs are not supported (text only)")
        if device_name is not None and str(device_name) != config.trainer.device:
            raise ValueError(
                f"device_name {device_name!r} disagrees with trainer.device "
                f"{config.trainer.device!r}: set trainer.device"
            )
        if collate_fn is not None or train_sampler is not None:
            logger.warning(
                "PPOTrainer: collate_fn / train_sampler are not used: batches are the "
                "datasets' own, in the order of data.shuffle and data.seed"
            )
        del ray_worker_group_cls  # the launchers place the workers
        self.config = config
        self.kill_trainer = kill_trainer
        self.external_rollouts = config.trainer.rollout_source == "external"
        self._trajectory_sources = trajectory_sources
        self._external: ExternalRollouts | None = None
        self.fleet_metrics = fleet_metrics
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(
                config.actor.tokenizer_path or config.actor.model_path,
                trust_remote_code=config.actor.trust_remote_code,
            )
        self.tokenizer = tokenizer
        self.role_worker_mapping = (
            dict(role_worker_mapping) if role_worker_mapping is not None else None
        )
        self.resource_pool_manager = resource_pool_manager or ResourcePoolManager.from_config(
            config
        )
        self.reward_fn = reward_fn
        self.val_reward_fn = val_reward_fn
        self.on_step = on_step
        self._replica_wait_s = 0.0  # the last step's membership refresh (see _step_metrics)
        self.metrics = SchedulerMetrics()
        self.metrics_port: int | None = None
        if metrics_port is not None:
            self.metrics_port = start_metrics_server(self.metrics, metrics_port)
        self.run_dir = config.run_dir()
        self.history: list[StepRecord] = []
        self.val_history: list[tuple[int, dict[str, float]]] = []
        self.workers: Workers | None = None
        self.global_steps = 0
        self._version_offset = 0
        self._policy_version = 0
        # The policy version of the weights the trainer holds, once this driver pushed
        # them (None before: it cannot know what the replicas were started with).
        self._trainer_weights: int | None = None
        # The last push's step metrics (``weight_sync/...``; see ``_push_weights``).
        self.weight_sync_metrics: dict[str, float] = {}
        self._loader_iter: Iterator[Batch] | None = None
        self._scheduler_spec = scheduler if scheduler is not None else config.services.scheduler
        self._scheduler: SchedulerClient | None = None
        self.fleet: RolloutFleet | None = None
        self._headline: dict[str, float] = {}  # published with the training status
        # Trainer recovery (trainer.recovery): where the run started, and what happened.
        # The trainer's step counter after the last TrainStep (None: not known since the
        # last restore): a counter that does not move by one says the trainer restarted.
        self._trainer_step: int | None = None
        self._producer: threading.Thread | None = None  # pipelined: the generating thread
        # Pipelined: the batches generated and not trained yet (the one being trained
        # first); what a trainer recovery may keep.
        self._pipeline_out: queue.Queue[GeneratedBatch | BaseException] | None = None
        self._in_hand: GeneratedBatch | None = None
        # The driver-side weight version of the weights the last restore went back to.
        self._restored_version: int | None = None
        self._start_state: dict[str, Any] | None = None
        self.recoveries = 0
        self._recovery_metrics: dict[str, float] = {}
        self.health = HealthMonitor(config.trainer.health)
        self.guard = Guard(config.trainer.health)

        self._build_data(train_dataset, val_dataset)
        t = config.trainer
        if self.external_rollouts:  # no dataset to count over (the config check asks for it)
            if t.total_training_steps is None:
                raise ValueError(
                    "trainer.rollout_source external needs trainer.total_training_steps"
                )
            self.total_training_steps = t.total_training_steps
        else:
            self.total_training_steps = t.total_training_steps or len(self.loader) * t.total_epochs
        self.colocated = self.resource_pool_manager.placement == "colocated"
        self.pipelined = t.pipeline.enable and t.pipeline.max_staleness > 0
        if self.pipelined and self.colocated:
            logger.warning(
                "trainer.pipeline.enable with colocated placement: the rollout engine sleeps "
                "while the trainer works, so generation cannot overlap training; running "
                "synchronously"
            )
            self.pipelined = False

    # ------------------------------------------------------------------ set-up

    def _build_data(self, train: RLHFDataset | None, val: RLHFDataset | None) -> None:
        from rlfleet.driver.data.dataset import RLHFDataset
        from rlfleet.driver.data.sampler import PromptLoader

        d = self.config.data
        # A reward model reads the prompt's chat turns: keep them in the batches.
        chats = self.config.reward.reward_model.enable
        if val is None and d.val_files:
            val = RLHFDataset.from_config(
                d.val_files, self.tokenizer, d, tensor_type="torch", return_raw_chat=chats
            )
        self.val_dataset = val
        if self.external_rollouts and train is None:
            return  # the prompts come from the agents: no training set, no loader
        self.train_dataset = train or RLHFDataset.from_config(
            d.train_files, self.tokenizer, d, tensor_type="torch", return_raw_chat=chats
        )
        if len(self.train_dataset) < d.train_batch_size:
            raise ValueError(
                f"data.train_batch_size {d.train_batch_size} is larger than the training set "
                f"({len(self.train_dataset)} prompts)"
            )
        # Dynamic sampling draws generation rounds of gen_batch_size prompts.
        size = d.gen_batch_size or d.train_batch_size
        if len(self.train_dataset) < size:
            raise ValueError(
                f"data.gen_batch_size {size} is larger than the training set "
                f"({len(self.train_dataset)} prompts)"
            )
        self.loader: PromptLoader = PromptLoader(
            self.train_dataset, size, shuffle=d.shuffle, seed=d.seed, drop_last=True
        )

    def init_workers(self) -> None:
        """Build or connect the clients of every role and check the rollout replicas."""
        if self.workers is not None:
            return
        mapping = self.role_worker_mapping
        if mapping is None:
            mapping = in_process_workers(self.config)
        workers = resolve_workers(mapping, self.config)
        self.workers = workers
        if self.reward_fn is None:
            if workers.reward is None and not self.external_rollouts:
                workers.close()
                self.workers = None
                raise ValueError("no reward_fn and no Role.RewardModel worker")
            self.reward_fn = workers.reward
        if self.val_reward_fn is None:
            self.val_reward_fn = self.reward_fn
        if not self._in_process_weights() and any(r.address is None for r in workers.rollouts):
            workers.close()
            self.workers = None
            raise ValueError(
                "a remote trainer pushes weights to rollout addresses, but a rollout replica "
                "has none: give the rollout replicas as addresses or RolloutReplica(address=...)"
            )
        if isinstance(self._scheduler_spec, str):
            from rlfleet.scheduler.client import RemoteSchedulerClient

            client = RemoteSchedulerClient(self._scheduler_spec)
            workers.owned.append(client)
            self._scheduler = client
        elif self._scheduler_spec is not None:
            self._scheduler = self._scheduler_spec
        key = self.config.data.reward_fn_key
        # External rollouts may run without one: the agents post their rewards.
        self._reward = (
            RewardAdapter(self.reward_fn, self.tokenizer, key, retry_s=self.config.reward.retry_s)
            if self.reward_fn is not None
            else None
        )
        self._val_reward = (
            RewardAdapter(
                self.val_reward_fn, self.tokenizer, key, retry_s=self.config.reward.retry_s
            )
            if self.val_reward_fn is not None
            else None
        )
        self.fleet = RolloutFleet(
            workers,
            push=self._push_weights,
            version=lambda: self._policy_version,
            scheduler=self._scheduler,
            # Synchronous runs generate on the thread that pushes weights, so a replica
            # that comes back mid-generation is given them there; pipelined runs have
            # the main thread adopt it while the producer waits (_pipeline).
            heal_wait_s=self.config.rollout.replica_wait_s,
            adopt_here=not self.pipelined,
        )
        if self.external_rollouts:
            sources = self._trajectory_sources
            if sources is None:
                sources = sources_for(workers.rollouts)
                workers.owned.extend(sources)
            pad = self.tokenizer.pad_token_id
            self._external = ExternalRollouts(
                sources, self.config, 0 if pad is None else int(pad), self._reward
            )
        versions = [r.client.status().weight_version for r in workers.rollouts]
        self._policy_version = max(versions)
        logger.info(
            "workers ready: %d rollout replica(s) at weight versions %s, placement %s%s",
            len(workers.rollouts),
            versions,
            "colocated" if self.colocated else "disaggregated",
            ", pipelined" if self.pipelined else "",
        )

    def close(self) -> None:
        """Close the clients this trainer built (services it did not start keep running)."""
        if self.workers is not None:
            self.workers.close()
            self.workers = None
            self.fleet = None

    def __enter__(self) -> PPOTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def _w(self) -> Workers:
        if self.workers is None:
            raise RuntimeError("call init_workers() first")
        return self.workers

    @property
    def _fleet(self) -> RolloutFleet:
        if self.fleet is None:
            raise RuntimeError("call init_workers() first")
        return self.fleet

    # ------------------------------------------------------------------ data

    def _next_prompts(self) -> tuple[Batch, dict[str, Any], int]:
        """The next batch, the loader position after it, and its epoch."""
        for _ in range(2):
            if self._loader_iter is None:
                self._loader_iter = iter(self.loader)
            epoch = self.loader.epoch
            try:
                batch = next(self._loader_iter)
            except StopIteration:
                self._loader_iter = None
                continue
            return batch, self.loader.state_dict(), epoch
        raise RuntimeError("the training loader yields no batch (fewer prompts than a batch?)")

    # ------------------------------------------------------------------ generation

    def _sampling(self, *, validate: bool, step: int) -> SamplingParams:
        r = self.config.rollout
        max_tokens = r.response_length or self.config.data.max_response_length
        if validate:
            v = r.val_kwargs
            temperature = v.temperature if v.do_sample else 0.0
            return SamplingParams(
                n=v.n, temperature=temperature, top_p=v.top_p, top_k=v.top_k,
                max_tokens=max_tokens, seed=self.config.trainer.seed,
            )  # fmt: skip
        temperature = r.temperature if r.do_sample else 0.0
        return SamplingParams(
            n=r.n, temperature=temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=max_tokens,
            seed=(self.config.trainer.seed * _SEED_MIX + step) % (2**63),
        )  # fmt: skip

    def _rollout_and_score(
        self,
        batch: Batch,
        params: SamplingParams,
        reward: RewardAdapter,
        *,
        min_version: int = 0,
        stats: dict[str, int] | None = None,
    ) -> tuple[list[SampleOutput], list[float], list[dict[str, Any]], dict[str, float]]:
        """Generate and score; scoring of finished samples overlaps generation.

        Returns samples ordered by (prompt, sample), their scores, the scorers' details,
        and timings: ``gen`` (generation wall time) and ``reward`` (scoring time left
        after the last sample finished).
        """
        prompts = prompt_ids(batch)
        total = len(prompts) * params.n
        chunk = max(8, -(-total // 4))
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="reward")
        futures: list[tuple[list[SampleOutput], concurrent.futures.Future[Any]]] = []
        pending: list[SampleOutput] = []

        def flush() -> None:
            if pending:
                group = list(pending)
                pending.clear()
                score = contextvars.copy_context().run  # the reward call joins the trace
                futures.append((group, pool.submit(score, self._score, reward, batch, group)))

        t0 = time.perf_counter()
        try:
            # The call's prompts by dataset index (a shard's and a reward call's
            # ``prompt_indices`` are places in this list): `rlfleet trace --prompt`.
            index = batch.get("index")
            ids = [int(i) for i in index] if index is not None else list(range(len(prompts)))
            with tracing.span("generate", prompts=ids, n=params.n) as attrs:
                for s in self._fleet.generate(prompts, params, min_version, stats):
                    pending.append(s)
                    if len(pending) >= chunk:
                        flush()
                flush()
                attrs["requeued_samples"] = (stats or {}).get("requeued_samples", 0)
            t_gen = time.perf_counter() - t0
            with tracing.span("reward.wait", groups=len(futures)):
                results = [(g, f.result()) for g, f in futures]
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        t_reward = time.perf_counter() - t0 - t_gen
        scored = [
            (s, score, detail)
            for group, (scores, details) in results
            for s, score, detail in zip(group, scores, details, strict=True)
        ]
        scored.sort(key=lambda x: (x[0].prompt_index, x[0].sample_index))
        if len(scored) != total:
            raise RuntimeError(f"expected {total} samples from the rollout, got {len(scored)}")
        return (
            [x[0] for x in scored],
            [x[1] for x in scored],
            [x[2] for x in scored],
            {"gen": t_gen, "reward": t_reward},
        )

    @staticmethod
    def _score(reward: RewardAdapter, batch: Batch, group: list[SampleOutput]) -> Any:
        places = sorted({s.prompt_index for s in group})
        with tracing.span("reward", samples=len(group), prompt_indices=places):
            return reward.score(batch, group)

    def _produce(self, step: int, min_version: int) -> GeneratedBatch:
        """One step's generated and scored batch (several rounds with dynamic sampling)."""
        if self._external is not None:  # trainer.rollout_source: external
            return self._external.next_batch(step, self._policy_version)
        params = self._sampling(validate=False, step=step)
        if self.config.algorithm.filter_groups.enable:
            return self._produce_filtered(step, min_version, params)
        prompts, state, epoch = self._next_prompts()
        stats: dict[str, int] = {}
        if self._reward is None:
            raise RuntimeError("call init_workers() first (no reward adapter)")
        samples, raw, details, timing = self._rollout_and_score(
            prompts, params, self._reward, min_version=min_version, stats=stats
        )
        errors = reward_error_metrics(details, self.config.reward.max_error_fraction)
        penalty = self._overlong_penalty(samples)
        scores = _add(raw, penalty)
        requeued = stats.get("requeued_samples", 0)
        return GeneratedBatch(
            step, prompts, state, epoch, samples, scores, timing, min_version, requeued,
            sampling={**self._overlong_metrics(penalty), **errors},
        )  # fmt: skip

    def _produce_filtered(
        self, step: int, min_version: int, params: SamplingParams
    ) -> GeneratedBatch:
        """DAPO's dynamic sampling (see the module docstring)."""
        fg = self.config.algorithm.filter_groups
        want = self.config.data.train_batch_size
        n = params.n
        kept: list[tuple[Batch, list[SampleOutput], list[float], list[float]]] = []
        have = drawn = dropped = surplus = requeued = 0
        generated: list[float] = []  # every sample's score, kept or not
        all_details: list[Mapping[str, Any]] = []  # and its scorer's details
        timing = {"gen": 0.0, "reward": 0.0}
        first_epoch: int | None = None
        for round_ in range(fg.max_num_gen_batches):
            prompts, state, epoch = self._next_prompts()
            first_epoch = epoch if first_epoch is None else first_epoch
            p = params
            if p.seed is not None:
                p = dataclasses.replace(p, seed=(p.seed + round_ * _ROUND_SEED_MIX) % (2**63))
            stats: dict[str, int] = {}
            samples, raw, details, t = self._rollout_and_score(
                prompts, p, self._reward, min_version=min_version, stats=stats
            )
            requeued += stats.get("requeued_samples", 0)
            reward_error_metrics(details, self.config.reward.max_error_fraction)
            all_details.extend(details)
            timing["gen"] += t["gen"]
            timing["reward"] += t["reward"]
            penalty = self._overlong_penalty(samples)
            scores = _add(raw, penalty)
            generated.extend(scores)
            values = self._filter_values(fg.metric, scores, raw, details)
            keep = core_algos.compute_group_filter_mask(
                torch.tensor(values, dtype=torch.float64), [s.prompt_index for s in samples]
            ).tolist()
            rows = sorted({s.prompt_index for s, k in zip(samples, keep, strict=True) if k})
            n_prompts = len(prompt_ids(prompts))
            drawn += n_prompts
            dropped += n_prompts - len(rows)
            take = rows[: want - have]
            surplus += len(rows) - len(take)
            if take:
                where = {row: j for j, row in enumerate(take)}
                picked = [i for i, s in enumerate(samples) if s.prompt_index in where]
                chosen = [samples[i] for i in picked]
                for s in chosen:  # indices into the joined prompt batch
                    s.prompt_index = have + where[s.prompt_index]
                kept.append(
                    (
                        select_prompts(prompts, take),
                        chosen,
                        [scores[i] for i in picked],
                        [penalty[i] for i in picked] if penalty else [],
                    )
                )
                have += len(take)
            if have == want:
                break
        else:
            raise RuntimeError(
                f"dynamic sampling (algorithm.filter_groups): {fg.max_num_gen_batches} "
                f"generation rounds (max_num_gen_batches) drew {drawn} prompts and kept {have} "
                f"whose {n} samples differ in {fg.metric}; data.train_batch_size needs {want}. "
                "The other groups scored the same on every sample (all right or all wrong), "
                "so the data may be too easy or too hard for the model: raise "
                "algorithm.filter_groups.max_num_gen_batches or data.gen_batch_size"
            )
        trained_penalty = [x for _, _, _, pen in kept for x in pen]
        sampling = self._overlong_metrics(trained_penalty)
        sampling.update(reward_error_fractions(all_details))
        sampling.update(
            {
                "train/num_gen_batches": float(round_ + 1),
                "dynamic_sampling/prompts_drawn": float(drawn),
                "dynamic_sampling/prompts_dropped": float(dropped),
                "dynamic_sampling/prompts_surplus": float(surplus),
                "dynamic_sampling/drop_fraction": dropped / drawn,
                "dynamic_sampling/samples_generated": float(drawn * n),
                # the policy's reward before the filter (critic/score/mean is after it)
                "dynamic_sampling/score_mean": float(np.mean(generated)),
            }
        )
        return GeneratedBatch(
            step,
            concat_prompts([k[0] for k in kept]),
            state,
            first_epoch if first_epoch is not None else 0,
            [s for k in kept for s in k[1]],
            [x for k in kept for x in k[2]],
            timing,
            min_version,
            requeued,
            sampling=sampling,
        )

    def _filter_values(
        self,
        metric: str,
        scores: Sequence[float],
        raw: Sequence[float],
        details: Sequence[Mapping[str, Any]],
    ) -> list[float]:
        """Each sample's value of ``filter_groups.metric``."""
        if metric in ("seq_reward", "seq_final_reward"):  # no in-reward KL (a config check)
            return list(scores)
        if metric == "score":
            return list(raw)
        missing = [i for i, d in enumerate(details) if "acc" not in d]
        if missing:
            raise RuntimeError(
                "algorithm.filter_groups.metric acc: the scorer returned no 'acc' for "
                f"{len(missing)} of {len(details)} samples (a verl-style compute_score returns "
                "{'score': ..., 'acc': ...}; the reward service returns a score only): use "
                "metric score or seq_reward"
            )
        return [float(d["acc"]) for d in details]

    def _overlong_penalty(self, samples: Sequence[SampleOutput]) -> list[float]:
        """DAPO's overlong penalty of each sample (empty when reward.overlong_buffer is off)."""
        ob = self.config.reward.overlong_buffer
        if not ob.enable:
            return []
        r = self.config.rollout
        limit = ob.max_resp_len or r.response_length or self.config.data.max_response_length
        lengths = torch.tensor([len(s.token_ids) for s in samples], dtype=torch.long)
        penalty = core_algos.compute_overlong_penalty(lengths, limit, ob.len, ob.penalty_factor)
        return [float(x) for x in penalty.tolist()]

    @staticmethod
    def _overlong_metrics(penalty: Sequence[float]) -> dict[str, float]:
        if not penalty:
            return {}
        return {
            "reward/overlong_reward/mean": float(np.mean(penalty)),
            "reward/overlong/mean": float(np.mean([p < 0 for p in penalty])),
        }

    # ------------------------------------------------------------------ weights

    def _in_process_weights(self) -> bool:
        return hasattr(self._w.trainer, "core")

    def _sync_weights(self, trainer_version: int) -> float:
        """Send the actor's weights to every rollout replica; returns seconds."""
        t0 = time.perf_counter()
        version = trainer_version + self._version_offset
        if version < self._policy_version:  # replicas never go back: renumber
            self._version_offset += self._policy_version - version
            version = self._policy_version
        self._fleet.prune()  # no waiting on a replica the scheduler gave up
        replicas = self._fleet.replicas
        with tracing.span("weight_sync", version=version, replicas=len(replicas)):
            self._push_weights(replicas, version)
        self._policy_version = version
        self._trainer_weights = version
        return time.perf_counter() - t0

    def _push_weights(self, replicas: Sequence[RolloutReplica], version: int) -> None:
        """The trainer's current weights to ``replicas``, labelled ``version``.

        Replicas that are services (they have an address) get the trainer's push,
        each over the best transport it can take under ``rollout.weight_transport``
        (``auto``: shared memory on the trainer's host, else TCP, else the gRPC
        stream); in-process replicas of an in-process trainer get the tensors. Each
        replica's push is one log line (version, replica, transport, bytes, seconds,
        GB/s), counted in ``rlfleet_scheduler_weight_pushes_total{transport}`` /
        ``..._weight_push_bytes_total{transport}``, and summed up in the step metrics
        ``weight_sync/transport/<name>`` (replicas pushed over it), ``weight_sync/bytes``
        (per replica) and ``weight_sync/GBps`` (the slowest replica's)."""
        from rlfleet.weightsync.wire import transports_for

        pushed: list[tuple[RolloutReplica, str, int, float]] = []  # replica, transport, B, s
        local = [r for r in replicas if not r.address]
        remote = [r for r in replicas if r.address]
        if local:
            if not self._in_process_weights():
                raise RuntimeError(
                    f"rollout replicas {[r.replica_id for r in local]} have no address: a "
                    "remote trainer can only push to replicas that are services"
                )
            trainer: Any = self._w.trainer
            dtype = getattr(torch, self.config.rollout.dtype)
            weights = {k: v.clone() for k, v in trainer.core.iter_weights(dtype)}
            nbytes = sum(t.numel() * t.element_size() for t in weights.values())

            def hand_over(r: RolloutReplica) -> tuple[RolloutReplica, str, int, float]:
                t0 = time.perf_counter()
                r.client.update_weights(weights, version)
                return r, "inprocess", nbytes, time.perf_counter() - t0

            with concurrent.futures.ThreadPoolExecutor(len(local)) as ex:
                pushed += list(ex.map(hand_over, local))
        if remote:
            # A replica that froze since it last answered (SIGSTOP, a stuck device)
            # would hold the whole push (every replica's buckets move together): it
            # must answer a liveness probe first, or it fails this push alone.
            frozen = _unresponsive(remote)
            targets = [
                (r.replica_id, r.address or "") for r in remote if r.replica_id not in frozen
            ]
            started = time.time_ns()
            try:
                outcome = (
                    self._w.trainer.push_weights(
                        targets,
                        version=version,
                        transports=transports_for(self.config.rollout.weight_transport),
                    )
                    if targets
                    else PushOutcome(version, 0)
                )
            except PermissionDenied as e:
                if not self._fleet.can_heal:
                    raise
                # The trainer checks targets against the scheduler's registry: a
                # scheduler that just restarted lists none until the replicas'
                # next heartbeats. Every target failed; replacements are waited for.
                outcome = PushOutcome(version, 0, errors={rid: e.message for rid, _ in targets})
            for rid, why in frozen.items():
                outcome.ok[rid] = False
                outcome.errors[rid] = why
            pushed += [
                (r, outcome.transports[r.replica_id], outcome.bytes, outcome.seconds[r.replica_id])
                for r in remote
                if outcome.ok.get(r.replica_id) and r.replica_id in outcome.transports
            ]
            _trace_pushes(remote, outcome, started)
            if outcome.errors:
                self.metrics.weight_sync_failures.inc()
                failed = [r for r in remote if r.replica_id in outcome.errors]
                if len(failed) == len(replicas):
                    if not self._fleet.can_heal:
                        raise RuntimeError(
                            f"weight push of version {version} failed: {outcome.errors}"
                        )
                    # Every replica gone: none serves stale weights; the next generation
                    # waits for replacements (rollout.replica_wait_s), adopted at this
                    # version.
                    logger.warning("weight push of version %d reached no replica (%s): "
                                   "waiting for replacements", version, outcome.errors)  # fmt: skip
                    self._fleet.remove(failed)
                    failed = []
                # Those replicas would serve stale weights: out of the fleet (a
                # replacement that registers is adopted with the current weights).
                for r in failed:
                    logger.warning("weight push to rollout replica %s (%s) failed (%s): "
                                   "dropping it", r.replica_id, r.address,
                                   outcome.errors[r.replica_id])  # fmt: skip
                    self._fleet.drop(r)
        summary: dict[str, float] = {}
        slowest = 0.0
        for r, transport, nbytes, seconds in pushed:
            logger.info(
                "weight push v%d -> rollout replica %s (%s): %s, %d bytes, %.3f s, %.2f GB/s",
                version, r.replica_id, r.address or "in-process", transport, nbytes, seconds,
                nbytes / 1e9 / max(seconds, 1e-9),
            )  # fmt: skip
            self.metrics.weight_pushes.labels(transport).inc()
            self.metrics.weight_push_bytes.labels(transport).inc(nbytes)
            key = f"weight_sync/transport/{transport}"
            summary[key] = summary.get(key, 0.0) + 1.0
            summary["weight_sync/bytes"] = float(nbytes)
            slowest = max(slowest, seconds)
        if pushed:
            summary["weight_sync/GBps"] = summary["weight_sync/bytes"] / 1e9 / max(slowest, 1e-9)
        self.weight_sync_metrics = summary

    def _swaps(self) -> bool:
        """Colocated replicas free their memory while the trainer works."""
        return self.colocated and self.config.rollout.free_cache_engine

    # ------------------------------------------------------------------ one step

    def _train(self, gb: GeneratedBatch) -> tuple[dict[str, float], int | None]:
        """One ``TrainStep`` call on the scored batch (the batch goes up once and stays
        on the trainer); returns the trainer's metrics (its phases timed there) and the
        new weight version (None when the actor did not update)."""
        batch = gb.trainer_batch
        if batch is None:
            batch = trainer_batch(gb, self.config.rollout.n, self.train_dataset.pad_token_id)
        on_policy = self._on_policy(gb)
        t0 = time.perf_counter()
        with tracing.span("train", rows=len(gb.samples), on_policy=on_policy):
            result = self._w.trainer.train_step(
                batch, on_policy=on_policy, total_steps=self.total_training_steps
            )
        expected, self._trainer_step = self._trainer_step, result.global_step
        if expected is not None and result.global_step != expected + 1:
            self._trainer_step = None
            raise TrainerRestarted(
                f"the trainer's step counter went from {expected} to {result.global_step}: it "
                "restarted and lost its state (trainer.recovery restores the last checkpoint)",
                field="trainer",
                value=result.global_step,
            )
        metrics = dict(result.metrics)
        metrics["timing_s/train"] = time.perf_counter() - t0
        # Against the policy the batch trains (before this step's push).
        metrics.update(rollout_metrics(gb, self._policy_version))
        metrics["rollout/on_policy"] = 1.0 if on_policy else 0.0
        return metrics, result.new_weight_version

    def _on_policy(self, gb: GeneratedBatch) -> bool:
        """Every sample was generated with the weights the trainer holds now: the
        driver pushed those weights itself (as ``_trainer_weights``), and no sample
        carries another version. Before the first push of this run it cannot know."""
        current = self._trainer_weights
        return current is not None and all(s.weight_version == current for s in gb.samples)

    def _step_metrics(
        self, gb: GeneratedBatch, metrics: dict[str, float], wait_s: float
    ) -> dict[str, float]:
        tokens = sum(len(s.token_ids) for s in gb.samples)
        gen = gb.timing["gen"]
        metrics["timing_s/gen"] = gen
        metrics["timing_s/reward"] = gb.timing["reward"]
        metrics["timing_s/wait_batch"] = wait_s
        # Membership before the step: the registry read, newcomers brought to the
        # current weights, and (none left) the wait for a replica to come back.
        metrics["timing_s/wait_replicas"] = self._replica_wait_s
        metrics["perf/total_gen_tokens"] = float(tokens)
        metrics["perf/tokens_per_second"] = tokens / gen if gen > 0 else 0.0
        metrics["training/global_step"] = float(self.global_steps)
        metrics["training/epoch"] = float(gb.epoch)
        metrics["rollout/requeued_samples"] = float(gb.requeued_samples)
        metrics["rollout/samples"] = float(len(gb.samples))  # the batch the step trained
        metrics["rollout/replicas"] = float(len(self._fleet))
        metrics.update(gb.sampling)
        metrics.update(gb.extra_metrics)
        return metrics

    # ------------------------------------------------------------------ validation

    def validate(self) -> dict[str, float]:
        """Greedy (``rollout.val_kwargs``) responses to the whole validation set; mean
        score per data_source (``val/test_score/<data_source>``) and overall, and the
        mean of each numeric extra a scorer returns (a verl ``compute_score``'s dict
        keys beside ``score``, e.g. ``acc``) per data_source (``val/<key>/<data_source>``)."""
        if self.val_dataset is None or len(self.val_dataset) == 0:
            return {}
        if self._val_reward is None:
            logger.warning("validation skipped: no reward function to score it with")
            return {}
        ds = self.val_dataset
        params = self._sampling(validate=True, step=0)
        # The whole set by default, in requests a replica's default limits take.
        size = self.config.data.val_batch_size or min(
            len(ds), max(1, GenerateLimits().max_samples // params.n)
        )
        key = self.config.data.reward_fn_key
        per_source: dict[str, list[float]] = {}
        extras: dict[str, list[float]] = {}  # "<key>/<source>": a scorer's numeric extras
        lengths: list[int] = []
        shown: list[dict[str, Any]] = []
        for lo in range(0, len(ds), size):
            batch = ds.collate(np.arange(lo, min(lo + size, len(ds))))
            samples, scores, details, _t = self._rollout_and_score(
                batch, params, self._val_reward, min_version=self._policy_version
            )
            for s, sc, detail in zip(samples, scores, details, strict=True):
                source = str(batch[key][s.prompt_index])
                per_source.setdefault(source, []).append(sc)
                lengths.append(len(s.token_ids))
                for name, value in detail.items():  # e.g. a compute_score's "acc"
                    if name not in ("error", "timed_out") and isinstance(value, int | float):
                        extras.setdefault(f"{name}/{source}", []).append(float(value))
            want = self.config.trainer.log_val_generations - len(shown)
            if want > 0:
                texts = self.tokenizer.batch_decode(
                    [s.token_ids for s in samples[:want]], skip_special_tokens=True
                )
                shown += [
                    {"prompt_index": lo + s.prompt_index, "response": t, "score": sc}
                    for s, t, sc in zip(samples[:want], texts, scores[:want], strict=True)
                ]
        out = {f"val/test_score/{k}": float(np.mean(v)) for k, v in per_source.items()}
        every = [x for v in per_source.values() for x in v]
        out["val/test_score/mean"] = float(np.mean(every))
        out["val/response_length/mean"] = float(np.mean(lengths))
        out |= {f"val/{k}": float(np.mean(v)) for k, v in sorted(extras.items())}
        self.metrics.record_validation(
            {k: float(np.mean(v)) for k, v in per_source.items()} | {"all": float(np.mean(every))}
        )
        self.last_val_generations = shown
        return out

    # ------------------------------------------------------------------ checkpoints

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    def save_checkpoint(self, loader_state: dict[str, Any]) -> float:
        t0 = time.perf_counter()
        extra = {
            "global_steps": self.global_steps,
            "dataloader": loader_state,
            "policy_version": self._policy_version,
            "health": {"monitor": self.health.state_dict(), "guard": self.guard.state_dict()},
        }
        # Relative to the trainer's run directory, where it confines checkpoints (the
        # same folder as checkpoint_dir when the trainer reads this run's config). The
        # huggingface/ folder is asked for even of a trainer started with another config.
        self._w.trainer.save_checkpoint(
            _CHECKPOINTS,
            step=self.global_steps,
            extra_state_json=json.dumps(extra),
            export_hf=self.config.trainer.save_hf,
        )
        return time.perf_counter() - t0

    def _load_checkpoint(self) -> bool:
        t = self.config.trainer
        if t.resume_mode == "disable":
            return False
        path = _CHECKPOINTS
        if t.resume_mode == "resume_path":
            if not t.resume_from_path:
                raise ValueError("trainer.resume_mode is resume_path but resume_from_path is unset")
            path = t.resume_from_path
        try:
            path = self._restore(path)
        except NotFound:
            if t.resume_mode == "resume_path":
                raise
            logger.info("no checkpoint under %s: starting from scratch", path)
            return False
        logger.info("resumed from %s at step %d", path, self.global_steps)
        return True

    def _restore(self, path: str) -> str:
        """Load the checkpoint at ``path`` (a run's checkpoints folder: its latest) into
        the trainer and this driver (step, data order, health state), push its weights.
        Returns the folder loaded; raises NotFound when there is none."""
        info = self._w.trainer.load_checkpoint(path)
        self._trainer_step = None
        extra = json.loads(info.extra_state_json or "{}")
        if "dataloader" in extra and not self.external_rollouts:
            self.loader.load_state_dict(extra["dataloader"])
            self._loader_iter = None  # the next batch comes from the restored position
        self.global_steps = int(extra.get("global_steps", info.step))
        if "health" in extra:
            self.health.load_state_dict(extra["health"].get("monitor", {}))
            self.guard.load_state_dict(extra["health"].get("guard", {}))
        self._push_restored()
        return info.path

    # ------------------------------------------------------------------ trainer recovery

    def _trainer_lost(self, error: RlfleetError) -> bool:
        """After a step failed with ``error``: is the trainer gone (dead, or restarted
        with a fresh state) rather than refusing the request? Only with
        ``trainer.recovery``."""
        address = getattr(self._w.trainer, "address", None)
        if not self.config.trainer.recovery.enable or not address:
            return False
        if isinstance(error, TrainerRestarted):
            return True
        from rlfleet.common.rpc import wait_for_ready

        try:
            wait_for_ready(address, timeout_s=2.0)
            status = self._w.trainer.status()
        except RlfleetError:
            return True
        # Serving again already: a restarted trainer has lost every step.
        step = int(status["global_step"])
        known = self._trainer_step
        return (self.global_steps > 0 and step == 0) or (known is not None and step < known)

    def _recover_trainer(self, error: RlfleetError, tracking: Tracking) -> None:
        """Wait for the restarted trainer, restore the last checkpoint (none: the run's
        start) into it and into this driver, push its weights; the steps since are
        redone in the same data order."""
        from rlfleet.common.rpc import wait_for_ready

        r = self.config.trainer.recovery
        address = getattr(self._w.trainer, "address", "")
        failed_at = self.global_steps + 1
        if self.recoveries >= r.max_recoveries:
            tracking.warn(f"trainer {address} lost at step {failed_at} after "
                          f"{self.recoveries} recoveries (trainer.recovery.max_recoveries)")  # fmt: skip
            raise error
        self.recoveries += 1
        tracking.warn(
            f"trainer {address} lost at step {failed_at} ({error}); waiting up to "
            f"{r.wait_s:g}s for it to serve again (recovery {self.recoveries} of "
            f"{r.max_recoveries})"
        )
        t0 = time.perf_counter()
        deadline = time.monotonic() + r.wait_s
        kill_at = time.monotonic() + r.kill_after_s if self.kill_trainer is not None else None
        while True:  # back on its address, or registered at a new one
            try:
                wait_for_ready(address, timeout_s=min(2.0, max(0.1, deadline - time.monotonic())))
                break
            except Unavailable as e:
                moved = self._moved_trainer(address)
                if moved is not None:
                    tracking.warn(f"trainer moved: {address} -> {moved} (registered anew)")
                    self._rebind_trainer(moved)
                    address = moved
                    continue
                if kill_at is not None and time.monotonic() >= kill_at:
                    kill_at = None  # once: a restart that is slow is not killed again
                    tracking.warn(
                        f"trainer {address} has not answered for trainer.recovery."
                        f"kill_after_s={r.kill_after_s:g}s: killing it, so that its "
                        "launcher restarts it (frozen, or stuck)"
                    )
                    assert self.kill_trainer is not None
                    try:
                        self.kill_trainer()
                    except Exception as kill_error:  # the wait goes on; it may come back
                        tracking.warn(f"killing trainer {address} failed: {kill_error}")
                if time.monotonic() >= deadline:
                    raise Unavailable(
                        f"trainer {address} did not serve again within trainer.recovery."
                        f"wait_s={r.wait_s:g}s after it failed at step {failed_at}: {error}",
                        field="trainer.recovery.wait_s",
                        value=r.wait_s,
                    ) from e
        waited = time.perf_counter() - t0
        try:
            source = self._restore(_CHECKPOINTS)
        except NotFound:
            source = self._rewind()
        self.history = [h for h in self.history if h.step <= self.global_steps]
        tracking.rewind(self.global_steps)  # the redone steps are recorded once
        seconds = time.perf_counter() - t0
        redone = failed_at - 1 - self.global_steps  # steps trained and lost with the trainer
        self._recovery_metrics = {
            "fault/trainer_recoveries": float(self.recoveries),
            "fault/trainer_recovery_s": seconds,
            "fault/redone_steps": float(max(0, redone)),
        }
        again = (
            f"steps {self.global_steps + 1}..{failed_at - 1} are redone, then step {failed_at}"
            if redone > 0
            else f"step {failed_at} runs again"
        )
        tracking.warn(
            f"trainer back after {waited:.1f}s; restored {source} in {seconds - waited:.1f}s: "
            f"continuing from step {self.global_steps} ({again}, with the same prompts)"
        )
        self._publish_status("running")

    def _moved_trainer(self, address: str) -> str | None:
        """The address of a trainer the scheduler lists alive other than ``address``
        (a launcher placed it anew, on another node: its old node is gone), if any."""
        if self._scheduler is None or not address:
            return None
        try:
            entries = self._scheduler.list_services("trainer", alive_only=True)
        except RlfleetError as e:
            logger.warning("scheduler: looking for a moved trainer failed (%s)", e)
            return None
        others = sorted((e.registered_unix, e.spec.address) for e in entries
                        if e.spec.address and e.spec.address != address)  # fmt: skip
        return others[-1][1] if others else None

    def _rebind_trainer(self, address: str) -> None:
        """Talk to the trainer at ``address`` from now on."""
        from rlfleet.trainer.client import RemoteTrainerClient

        old = self._w.trainer
        client = RemoteTrainerClient(address)
        self._w.trainer = client
        self._w.owned.append(client)
        if old in self._w.owned:
            self._w.owned.remove(old)
            close = getattr(old, "close", None)
            if close is not None:
                close()

    def _rewind(self) -> str:
        """No checkpoint yet: back to where this run started (the restarted trainer
        holds the initial model); push its weights."""
        start = self._start_state
        assert start is not None
        self._trainer_step = None
        if not self.external_rollouts:
            self.loader.load_state_dict(start["loader"])
            self._loader_iter = None
        self.global_steps = start["global_steps"]
        self.health.load_state_dict(start["health"])
        self.guard.load_state_dict(start["guard"])
        self._push_restored()
        return "the initial model (no checkpoint yet)"

    def _push_restored(self) -> None:
        """Push the weights a restore put on the trainer; note their version in this
        driver's numbering before the push renumbers it (``keep_after_restore``)."""
        version = int(self._w.trainer.status()["weight_version"])
        self._restored_version = version + self._version_offset
        self._sync_weights(version)

    # ------------------------------------------------------------------ the loop

    def fit(self) -> list[StepRecord]:
        """Train until ``total_training_steps``; returns the records of this call's steps."""
        self.init_workers()
        cfg = self.config
        t = cfg.trainer
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_resolved(cfg, self.run_dir)
        previous_tracer = None
        if t.trace:
            path = tracing.service_trace_path(self.run_dir, "driver")
            previous_tracer = tracing.set_tracer(
                tracing.Tracer(path, "driver", otlp_endpoint=t.trace_otlp_endpoint)
            )
        resumed = self._load_checkpoint()
        self._start_state = {
            "loader": None if self.external_rollouts else self.loader.state_dict(),
            "global_steps": self.global_steps,
            "health": self.health.state_dict(),
            "guard": self.guard.state_dict(),
        }
        tracking = Tracking(
            t.logger, self.run_dir, project=t.project_name, experiment=t.experiment_name,
            config=cfg.model_dump(mode="json"), total_steps=self.total_training_steps,
            initial_step=self.global_steps, resume_step=self.global_steps if resumed else None,
        )  # fmt: skip
        if resumed:
            tracking.note(f"resumed at step {self.global_steps}")
        for text in run_warnings(cfg):
            tracking.warn(text)
        records: list[StepRecord] = []
        self._publish_status("running")
        state: TrainingState = "failed"
        try:
            if t.val_before_train and self.val_dataset is not None and not resumed:
                val = self.validate()
                self.val_history.append((self.global_steps, val))
                tracking.note(_val_line(self.global_steps, val))
                tracking.log(val, self.global_steps, kind="validation")
                if "val/test_score/mean" in val:
                    self.health.note_validation(self.global_steps, val["val/test_score/mean"])
            run = self._fit_pipelined if self.pipelined else self._fit_sync
            records = run(tracking)
            state = "done" if self.global_steps >= self.total_training_steps else "running"
        finally:
            tracking.close()
            self._publish_status(state)
            if previous_tracer is not None:
                tracing.set_tracer(previous_tracer).close()
        return records

    def _publish_status(
        self, state: TrainingState, metrics: Mapping[str, float] | None = None
    ) -> None:
        """The run's progress to the scheduler (``rlfleet status`` shows it): step,
        weight version, state and a few headline metrics. A scheduler that does not
        answer costs a warning, never the run."""
        if self._scheduler is None:
            return
        from rlfleet.scheduler.registry import TrainingStatus

        if metrics is not None:  # else the last step's
            self._headline = {k: float(v) for k, v in metrics.items() if k in STATUS_METRICS}
        status = TrainingStatus(
            global_step=self.global_steps,
            total_steps=self.total_training_steps,
            weight_version=self._policy_version,
            metrics=self._headline,
            state=state,
        )
        try:
            self._scheduler.set_training_status(status)
        except RlfleetError as e:
            logger.warning("scheduler: publishing the training status failed (%s)", e)

    def _fit_sync(self, tracking: Tracking) -> list[StepRecord]:
        records = []
        while self.global_steps < self.total_training_steps:
            t0 = time.perf_counter()
            self._fleet.refresh_waiting()  # none left: wait for rollout.replica_wait_s
            self._replica_wait_s = time.perf_counter() - t0
            step = self.global_steps + 1
            try:
                with tracing.span("step", root=True, step=step) as attrs:
                    gb = self._produce(step, self._policy_version)
                    attrs["prompts"] = [int(i) for i in gb.prompts["index"]]
                    attrs["samples"] = len(gb.samples)
                    records.append(self._finish_step(gb, tracking, t0, wait_s=0.0))
            except RlfleetError as e:
                if not self._trainer_lost(e):
                    raise
                self._recover_trainer(e, tracking)
                records = [r for r in records if r.step <= self.global_steps]
        return records

    def _fit_pipelined(self, tracking: Tracking) -> list[StepRecord]:
        records: list[StepRecord] = []
        kept: list[GeneratedBatch] = []
        while True:
            try:
                self._pipeline(tracking, records, kept)
                return records
            except RlfleetError as e:
                if not self._trainer_lost(e):
                    raise
                # The generation in flight ends (the replicas are up); then the batches
                # generated and not trained are kept where the restore keeps the
                # weights that generated them (see keep_after_restore).
                producer = self._producer
                if producer is not None:
                    producer.join(timeout=self.config.trainer.recovery.wait_s)
                    if producer.is_alive():
                        raise
                ahead = self._untrained_batches()
                self._recover_trainer(e, tracking)
                kept = []
                if not self.external_rollouts and self._restored_version is not None:
                    kept = keep_after_restore(ahead, self.global_steps, self._restored_version)
                    # The restored weights went out under a new number: the kept
                    # samples' versions follow, so staleness stays what it is.
                    delta = self._policy_version - self._restored_version
                    kept = [_renumbered(gb, delta) for gb in kept]
                self._recovery_metrics["fault/kept_batches"] = float(len(kept))
                self._recovery_metrics["fault/dropped_batches"] = float(len(ahead) - len(kept))
                if ahead:
                    tracking.note(
                        f"kept {len(kept)} of the {len(ahead)} batch(es) generated ahead "
                        f"(steps {[gb.step for gb in kept]}: generated with weights up to "
                        f"version {self._restored_version}, the restored one)"
                    )
                records[:] = [r for r in records if r.step <= self.global_steps]

    def _untrained_batches(self) -> list[GeneratedBatch]:
        """The pipeline's batches generated and not trained: the one whose step failed
        and those queued behind it, in step order."""
        out: list[GeneratedBatch] = [] if self._in_hand is None else [self._in_hand]
        self._in_hand = None
        q = self._pipeline_out
        while q is not None:
            try:
                item = q.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, GeneratedBatch):
                out.append(item)
        return sorted(out, key=lambda gb: gb.step)

    def _pipeline(
        self, tracking: Tracking, records: list[StepRecord], kept: list[GeneratedBatch]
    ) -> None:
        """Pipelined steps from the current one to the last, appended to ``records``;
        ``kept``: batches a trainer recovery kept, used for their steps as they come."""
        k = self.config.trainer.pipeline.max_staleness
        cond = threading.Condition()
        synced = {"step": self.global_steps, "versions": {self.global_steps: self._policy_version}}
        out: queue.Queue[GeneratedBatch | BaseException] = queue.Queue()
        self._pipeline_out = out
        stop = threading.Event()
        first = self.global_steps + 1
        last = self.total_training_steps
        ready = {gb.step: gb for gb in kept}

        def producer() -> None:
            try:
                for step in range(first, last + 1):
                    if step in ready:  # generated before the trainer's restart
                        gb = ready.pop(step)
                        self.loader.load_state_dict(gb.loader_state)
                        self._loader_iter = None  # the next draw is the next step's
                        out.put(gb)
                        continue
                    need = step - 1 - k  # weights after this step must be on the replicas
                    with cond:
                        while synced["step"] < need and not stop.is_set():
                            cond.wait(0.5)
                        if stop.is_set():
                            return
                        versions: dict[int, int] = synced["versions"]  # type: ignore[assignment]
                        min_version = versions.get(max(need, first - 1), 0)
                    with tracing.span("produce", root=True, step=step) as attrs:
                        gb = self._produce(step, min_version)
                        attrs["prompts"] = [int(i) for i in gb.prompts["index"]]
                        attrs["samples"] = len(gb.samples)
                    out.put(gb)
            except BaseException as e:
                out.put(e)

        # Membership is refreshed on this thread, between trainer calls, so that a
        # newcomer gets weights that match the version it is told.
        self._fleet.refresh()
        thread = threading.Thread(target=producer, name="rlfleet-pipeline", daemon=True)
        self._producer = thread
        thread.start()
        try:
            while self.global_steps < last:
                t0 = time.perf_counter()
                if self.global_steps >= first:
                    self._fleet.refresh_waiting()  # none left: rollout.replica_wait_s
                self._replica_wait_s = time.perf_counter() - t0
                while True:
                    try:
                        item = out.get(timeout=0.5)
                        break
                    except queue.Empty:  # the producer may wait for replicas to adopt
                        self._fleet.feed_if_starved()
                if isinstance(item, BaseException):
                    raise item
                wait = time.perf_counter() - t0 - self._replica_wait_s

                def synced_cb(step: int, version: int) -> None:
                    with cond:
                        synced["step"] = step
                        synced["versions"][step] = version  # type: ignore[index]
                        cond.notify_all()

                self._in_hand = item
                with tracing.span("step", root=True, step=item.step) as attrs:
                    attrs["prompts"] = [int(i) for i in item.prompts["index"]]
                    attrs["samples"] = len(item.samples)
                    record = self._finish_step(item, tracking, t0, wait, on_synced=synced_cb)
                self._in_hand = None
                records.append(record)
        finally:
            stop.set()
            with cond:
                cond.notify_all()
            thread.join(timeout=1.0)

    def _finish_step(
        self,
        gb: GeneratedBatch,
        tracking: Tracking,
        t0: float,
        wait_s: float,
        on_synced: Callable[[int, int], None] | None = None,
    ) -> StepRecord:
        cfg = self.config
        t = cfg.trainer
        t_swap = time.perf_counter()
        if self._swaps():
            self._fleet.sleep()
        swap_s = time.perf_counter() - t_swap
        metrics, version = self._train(gb)
        t_swap = time.perf_counter()
        if self._swaps():
            self._fleet.wake()
        swap_s += time.perf_counter() - t_swap
        if self.colocated:
            metrics["timing_s/rollout_swap"] = swap_s
        self.global_steps = gb.step
        sync_s = 0.0
        if version is not None:
            sync_s = self._sync_weights(version)
            metrics.update(self.weight_sync_metrics)
        if on_synced is not None:
            on_synced(gb.step, self._policy_version)
        metrics["timing_s/weight_sync"] = sync_s
        metrics = self._step_metrics(gb, metrics, wait_s)
        is_last = self.global_steps >= self.total_training_steps
        if t.test_freq > 0 and (is_last or self.global_steps % t.test_freq == 0):
            tv = time.perf_counter()
            with tracing.span("validation"):
                val = self.validate()
            metrics["timing_s/validation"] = time.perf_counter() - tv
            metrics.update(val)
            self.val_history.append((self.global_steps, val))
            tracking.note(_val_line(self.global_steps, val))
        save = t.save_freq > 0 and (is_last or self.global_steps % t.save_freq == 0)
        if self.fleet_metrics is not None:
            metrics.update(self.fleet_metrics())
        metrics.update(self._recovery_metrics)
        self._check_health(gb, metrics, tracking)
        step_s = time.perf_counter() - t0
        metrics["timing_s/step"] = step_s
        # The trainer's phases and the batch's trip there: the TrainStep call as a whole.
        busy = metrics["timing_s/train"]
        busy += wait_s + sync_s + swap_s + metrics.get("timing_s/validation", 0.0)
        busy += metrics.get("timing_s/guard", 0.0) + metrics["timing_s/wait_replicas"]
        if not self.pipelined:
            busy += gb.timing["gen"] + gb.timing["reward"]
        metrics["timing_s/scheduler"] = max(0.0, step_s - busy)
        metrics["perf/scheduler_share"] = metrics["timing_s/scheduler"] / step_s
        indices = [int(i) for i in gb.prompts["index"]]
        record = StepRecord(gb.step, indices, metrics)
        self.history.append(record)
        self.metrics.record_step(metrics, self.global_steps, len(gb.samples))
        tracking.log(metrics, self.global_steps, kind="train", indices=indices)
        # The step's line is written before its checkpoint: a run killed right after
        # saving never resumes past a step that metrics.jsonl lacks. The checkpoint's
        # time is therefore kept in the step record only, outside timing_s/step.
        if save:
            with tracing.span("checkpoint"):
                metrics["timing_s/checkpoint"] = self.save_checkpoint(gb.loader_state)
            self.guard.checkpoint_saved(self.global_steps, healthy=self.health.healthy)
        self._publish_status("running", metrics)
        if self.on_step is not None:
            self.on_step(record)
        return record

    # ------------------------------------------------------------------ health

    def _check_health(
        self, gb: GeneratedBatch, metrics: dict[str, float], tracking: Tracking
    ) -> None:
        """The step's health checks (``trainer.health``): new warnings on the console,
        ``health/...`` in the metrics, and the guard's intervention if it is on."""
        entropy = sampled_entropy([s.logprobs for s in gb.samples])
        if entropy is not None:
            metrics["rollout/neg_log_prob_mean"] = entropy
        warnings = self.health.observe(self.global_steps, metrics)
        for w in warnings:
            tracking.warn(w.message)
        action = self.guard.decide(warnings)
        actions: list[str] = []
        if action is not None:
            t0 = time.perf_counter()
            actions = self._intervene(action, tracking)
            metrics["timing_s/guard"] = time.perf_counter() - t0
        elif warnings and self.guard.enabled and not self.guard.spent_noted:
            self.guard.spent_noted = True
            tracking.warn(
                f"health guard: all {self.guard.config.max_interventions} interventions "
                "(trainer.health.guard.max_interventions) are spent; warnings only from now on"
            )
        metrics.update(self.health.metrics())
        metrics.update(self.guard.metrics())
        self.metrics.record_health(
            self.health.active, [w.check for w in warnings], actions, self.guard.lr_scale
        )

    def _intervene(self, action: GuardAction, tracking: Tracking) -> list[str]:
        """Roll the trainer back to the last good checkpoint (when there is one and
        ``rollback`` is on) and push its weights, then set the actor's lr scale;
        returns what was done (``rollback``, ``lr_cut``)."""
        g = self.guard.config
        done = []
        actions = []
        if action.rollback_step is not None:
            path = f"{_CHECKPOINTS}/global_step_{action.rollback_step}"
            try:
                self._w.trainer.load_checkpoint(path)
                self._trainer_step = None
            except NotFound:
                done.append(f"no rollback: the checkpoint of step {action.rollback_step} is "
                            "gone (trainer.max_actor_ckpt_to_keep)")  # fmt: skip
            else:
                self._sync_weights(int(self._w.trainer.status()["weight_version"]))
                self.guard.rolled_back()
                actions.append("rollback")
                done.append(f"rolled back to the checkpoint of step {action.rollback_step}")
        elif g.rollback:
            why = "trainer.save_freq is -1" if self.config.trainer.save_freq <= 0 else (
                "none was saved while healthy yet")  # fmt: skip
            done.append(f"no checkpoint to roll back to ({why})")
        lr = self._w.trainer.set_lr_scale("actor", action.lr_scale)
        actions.append("lr_cut")
        done.append(f"actor lr now {lr:.3g} ({action.lr_scale:g} x actor.lr)")
        self.health.restart(self.global_steps, g.cooldown_steps)
        tracking.warn(
            f"health guard: step {self.global_steps}: intervention {action.number} of "
            f"{g.max_interventions} on {action.reason}: " + "; ".join(done)
        )
        return actions


def _add(scores: Sequence[float], penalty: Sequence[float]) -> list[float]:
    """``scores`` plus ``penalty`` (empty: no penalty)."""
    if not penalty:
        return list(scores)
    return [s + p for s, p in zip(scores, penalty, strict=True)]


_CHECKPOINTS = "checkpoints"
#: The step metrics the driver publishes with its training status.
STATUS_METRICS = frozenset(
    {
        "critic/score/mean",
        "response_length/mean",
        "actor/pg_loss",
        "actor/entropy",
        "timing_s/step",
        "timing_s/gen",
        "timing_s/wait_replicas",
        "staleness/mean",
        "rollout/replicas",
        "val/test_score/mean",
        "health/warnings",
    }
)


def _val_line(step: int, val: Mapping[str, float]) -> str:
    parts = [f"{k.removeprefix('val/test_score/')} {v:.3f}" for k, v in val.items() if "score" in k]
    return f"validation at step {step}: " + ", ".join(parts)


def _unresponsive(replicas: Sequence[RolloutReplica]) -> dict[str, str]:
    """The replicas (by id) that do not answer a liveness probe (``GetStatus`` within
    :data:`~rlfleet.rollout.client.PROBE_TIMEOUT_S`, a second try after a deadline; all
    probed at once), and why."""
    from rlfleet.rollout.client import PROBE_TIMEOUT_S

    def probe(r: RolloutReplica) -> str | None:
        for attempt in range(2):  # a busy host may answer late once; frozen never does
            try:
                r.client.status(probe=True)
                return None
            except DeadlineExceeded as e:
                if attempt:
                    return f"it did not answer two liveness probes of {PROBE_TIMEOUT_S:g}s ({e})"
            except RlfleetError as e:
                return f"it did not answer a liveness probe ({e.message})"
        return None

    if len(replicas) == 1:
        answers = [probe(replicas[0])]
    else:
        with concurrent.futures.ThreadPoolExecutor(len(replicas)) as ex:
            answers = list(ex.map(probe, replicas))
    return {r.replica_id: why for r, why in zip(replicas, answers, strict=True) if why is not None}


def _trace_pushes(replicas: Sequence[RolloutReplica], outcome: Any, started: int) -> None:
    """One ``weight_push`` span per replica under the current ``weight_sync`` one,
    laid out from the trainer's per-replica seconds (the replicas' transfers start
    together, when the push does; a failed one spans the whole push), so that a trace
    shows which replica a slow push waited on."""
    end = time.time_ns()
    for r in replicas:
        seconds = outcome.seconds.get(r.replica_id)
        if seconds is None or r.replica_id in outcome.errors:
            seconds = (end - started) / 1e9
        attrs: dict[str, Any] = {"replica": r.replica_id, "address": r.address or ""}
        if r.replica_id in outcome.transports:
            attrs["transport"] = outcome.transports[r.replica_id]
        if r.replica_id in outcome.errors:
            attrs["error"] = str(outcome.errors[r.replica_id])[:500]
        stop = min(end, started + int(float(seconds) * 1e9))
        tracing.record_child("weight_push", stop - int(float(seconds) * 1e9), stop, **attrs)
