"""PPO step time: synchronous vs pipelined, colocated vs disaggregated, and the
scheduler's own overhead. Prints one JSON object.

    .venv/bin/python bench/ppo_step.py [--gen-s 1.0] [--train-s 1.0] [--steps 6]

The driver (:class:`rlfleet.driver.loop.PPOTrainer`) runs unchanged: the real
dataset, tokenizer, sampler, batch assembly, reward manager (gsm8k rule), metrics and
pipeline thread. The rollout replica and the trainer are *timed stand-ins* that take
``--gen-s`` / ``--train-s`` seconds per step (split over the trainer's phases as
PPO's are) and return correctly shaped results, so the comparison isolates what the
scheduler controls -- overlap, ordering, its own work -- from model speed on a
shared 2-core machine.

Placements modelled:

* **disaggregated**: rollout and trainer on separate device sets; sync runs gen then
  train, pipelined overlaps gen of step k+1 with train of step k (``max_staleness 1``);
* **colocated**: one pool of twice the devices holds both, time-shared: each phase
  runs on all devices (half the time) but never concurrently, plus the engine's
  sleep / wake (``--swap-s``) each step.

Targets (issue 7): pipelined / sync <= 0.6 when gen and train take similar time;
scheduler share of step time <= 3%.

``--launcher local|ray`` instead times real services (tiny model, CPU) running the
same PPO steps, started as local processes by ``LocalCluster`` (the baseline, always
run) and, with ``ray``, as Ray actors by ``RayCluster`` on a Ray started for the bench
on this machine (loopback, its own temp directory): ``ray_over_local`` is the Ray
launcher's step time over the local launcher's, rounds alternating between them.

    .venv/bin/python bench/ppo_step.py --launcher ray [--service-steps 4] [--rounds 2]

``--service-overhead`` times a real ``rlfleet train`` step (GRPO, 64 prompts x 4
samples, responses up to 16 tokens, the tiny model) with the services as local
processes (disaggregated: trainer and rollout on ``--threads`` cores each, reward and
scheduler beside them) against the same step with every role in this process on
``--threads`` torch threads, runs alternating; ``service_overhead = (disaggregated -
in_process) / disaggregated`` step time (target <= 0.10). Per step the driver makes one
``TrainStep`` call and one weight push; ``train_hop_s`` is what that call cost beyond
the trainer's own phases.

    .venv/bin/python bench/ppo_step.py --service-overhead [--service-steps 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rlfleet.common.config import Config, config_from_dict
from rlfleet.driver.clients import Role, RolloutReplica
from rlfleet.driver.loop import PPOTrainer
from rlfleet.rollout.core import RolloutStatusInfo
from rlfleet.rollout.engine import FinishReason, SampleOutput, SamplingParams
from rlfleet.trainer.client import PushOutcome, TrainStepResult

# Share of the trainer's time per phase (old log-prob, ref, values, adv, critic, actor).
TRAIN_SPLIT = {"logp": 0.15, "ref": 0.1, "values": 0.1, "adv": 0.0, "critic": 0.3, "actor": 0.35}


class Device:
    """A set of devices: phases on the same Device never run at the same time."""

    def __init__(self, speedup: float = 1.0) -> None:
        self.lock = threading.Lock()
        self.speedup = speedup

    def busy(self, seconds: float) -> None:
        with self.lock:
            time.sleep(seconds / self.speedup)


class FakeRollout:
    def __init__(self, device: Device, gen_s: float, response_len: int, vocab: int) -> None:
        self.device = device
        self.gen_s = gen_s
        self.response_len = response_len
        self.vocab = vocab
        self.version = 0
        self.sleeping = False
        self.swap_s = 0.0
        self._lock = threading.Lock()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        min_weight_version: int = 0,
    ) -> Iterator[SampleOutput]:
        with self.device.lock:
            version = self.version
            time.sleep(self.gen_s / self.device.speedup)
        g = torch.Generator().manual_seed(params.seed or 0)
        lengths = torch.randint(4, self.response_len + 1, (len(prompts) * params.n,), generator=g)
        tokens = torch.randint(5, self.vocab, (int(lengths.sum()),), generator=g).tolist()
        pos = 0
        for i in range(len(prompts)):
            for j in range(params.n):
                n = int(lengths[i * params.n + j])
                yield SampleOutput(
                    i, j, tokens[pos : pos + n], [-1.0] * n, FinishReason.STOP, version
                )
                pos += n

    def update_weights(self, named: Mapping[str, Any], version: int, **_: Any) -> Any:
        self.version = version

    def status(self, *, probe: bool = False) -> RolloutStatusInfo:
        return RolloutStatusInfo(
            "fake", "fake", "fake", "float32", "cpu", self.version, 0, 0.0, self.sleeping, 0
        )

    def sleep(self, level: int = 1) -> int:
        time.sleep(self.swap_s / 2)
        self.sleeping = True
        return 0

    def wake_up(self) -> None:
        time.sleep(self.swap_s / 2)
        self.sleeping = False

    def close(self) -> None:
        pass


class FakeTrainer:
    def __init__(self, device: Device, train_s: float, rollouts: dict[str, FakeRollout]) -> None:
        self.device = device
        self.train_s = train_s
        self.rollouts = rollouts
        self.version = 0
        self.step = 0

    def _busy(self, key: str) -> None:
        self.device.busy(self.train_s * TRAIN_SPLIT[key])

    def train_step(
        self, batch: dict[str, Any], *, on_policy: bool = False, total_steps: int = 0
    ) -> TrainStepResult:
        """The one call per step: every phase's share of ``train_s``, timed as the
        trainer times them."""
        timing: dict[str, float] = {}
        for key, phase in (("logp", "old_log_prob"), ("ref", "ref"), ("values", "values"),
                           ("critic", "update_critic"), ("actor", "update_actor")):  # fmt: skip
            t0 = time.perf_counter()
            self._busy(key)
            timing[f"timing_s/{phase}"] = time.perf_counter() - t0
        self.step += 1
        self.version += 1
        return TrainStepResult(timing, self.step, self.version, True)

    def push_weights(
        self, targets: Sequence[tuple[str, str]], *, version: int = 0, **_: Any
    ) -> Any:
        for _rid, address in targets:
            self.rollouts[address].update_weights({}, version)
        return PushOutcome(version, 0, {rid: True for rid, _ in targets})

    def status(self) -> dict[str, Any]:
        return {"weight_version": self.version, "global_step": self.step}

    def close(self) -> None:
        pass


def _config(model: Path, data: Path, run_dir: Path, *, colocated: bool, pipelined: bool) -> Config:
    pools = {"global_pool": [2]} if colocated else {"train_pool": [1], "rollout_pool": [1]}
    tp, rp = ("global_pool", "global_pool") if colocated else ("train_pool", "rollout_pool")
    return config_from_dict(
        {
            "data": {
                "train_files": str(data / "train.parquet"),
                "val_files": [],
                "train_batch_size": 32,
                "max_prompt_length": 64,
                "max_response_length": 16,
            },
            "actor": {"model_path": str(model), "ppo_mini_batch_size": 8},
            "rollout": {"n": 4},
            "algorithm": {"adv_estimator": "gae"},
            "reward": {"num_workers": 1},
            "trainer": {
                "total_training_steps": 100,
                "default_local_dir": str(run_dir),
                "resume_mode": "disable",
                "logger": [],
                "val_before_train": False,
                "pipeline": {"enable": pipelined, "max_staleness": 1},
            },
            "resource_pools": pools,
            "mapping": {"actor": tp, "critic": tp, "rollout": rp},
        }
    )


def run_case(
    model: Path,
    data: Path,
    root: Path,
    *,
    colocated: bool,
    pipelined: bool,
    gen_s: float,
    train_s: float,
    swap_s: float,
    steps: int,
) -> dict[str, float]:
    cfg = _config(model, data, root / f"c{int(colocated)}p{int(pipelined)}", colocated=colocated,
                  pipelined=pipelined)  # fmt: skip
    if colocated:
        shared = Device(speedup=2.0)  # twice the devices, one phase at a time
        gen_dev = train_dev = shared
    else:
        gen_dev, train_dev = Device(), Device()
    rollout = FakeRollout(gen_dev, gen_s, 16, 2048)
    rollout.swap_s = swap_s if colocated else 0.0
    trainer_client = FakeTrainer(train_dev, train_s, {"fake-0": rollout})
    from rlfleet.reward.client import InProcessRewardClient
    from rlfleet.reward.core import RewardManager

    reward = InProcessRewardClient(RewardManager(cfg.reward, num_workers=0))
    mapping = {
        Role.ActorRolloutRef: trainer_client,
        Role.Rollout: [RolloutReplica("rollout-0", rollout, "fake-0")],  # type: ignore[arg-type]
        Role.RewardModel: reward,
    }
    cfg.trainer.total_training_steps = steps + 1
    with PPOTrainer(config=cfg, role_worker_mapping=mapping) as trainer:
        records = trainer.fit()
    warm = records[1:]  # step 1 has nothing to overlap with
    step = statistics.mean(r.metrics["timing_s/step"] for r in warm)
    sched = statistics.mean(r.metrics["timing_s/scheduler"] for r in warm)
    return {
        "step_s": round(step, 4),
        "scheduler_s": round(sched, 4),
        "scheduler_share": round(sched / step, 4),
        "staleness_mean": statistics.mean(r.metrics["staleness/mean"] for r in warm),
    }


def _service_config(model: Path, data: Path, run_dir: Path, launcher: str) -> Config:
    """Real services, one core each: trainer (actor + critic) and one rollout replica."""
    return config_from_dict(
        {
            "launcher": launcher,
            "data": {
                "train_files": str(data / "train.parquet"),
                "val_files": [],
                "train_batch_size": 8,
                "max_prompt_length": 64,
                "max_response_length": 16,
            },
            "actor": {"model_path": str(model), "ppo_mini_batch_size": 4},
            "critic": {"ppo_mini_batch_size": 4},
            "rollout": {"n": 4},
            "algorithm": {"adv_estimator": "gae"},
            "reward": {"num_workers": 1},
            "trainer": {
                "total_training_steps": 100,
                "default_local_dir": str(run_dir),
                "resume_mode": "disable",
                "logger": [],
                "val_before_train": False,
            },
            "resource_pools": {"train_pool": [1], "rollout_pool": [1]},
            "mapping": {"actor": "train_pool", "critic": "train_pool", "rollout": "rollout_pool"},
        }
    )


def run_services(
    model: Path, data: Path, run_dir: Path, launcher: str, steps: int
) -> dict[str, Any]:
    """Start the services with ``launcher``, run 1 + ``steps`` PPO steps, stop them."""
    from rlfleet.driver.clients import remote_workers

    cfg = _service_config(model, data, run_dir, launcher)
    cfg.trainer.total_training_steps = steps + 1
    cluster: Any
    if launcher == "ray":
        from rlfleet.launch.ray_cluster import RayCluster

        cluster = RayCluster(cfg, run_dir)
    else:
        from rlfleet.launch.cluster import LocalCluster

        cluster = LocalCluster(cfg, run_dir)
    t0 = time.perf_counter()
    with cluster:
        handle = cluster.start(timeout_s=300)
        start_s = time.perf_counter() - t0
        mapping = remote_workers(handle.trainer, handle.rollout, handle.reward)
        with PPOTrainer(config=cfg, role_worker_mapping=mapping, scheduler=handle.scheduler) as t:
            records = t.fit()
        t1 = time.perf_counter()
    stop_s = time.perf_counter() - t1
    warm = records[1:]  # step 1 loads and compiles
    return {
        "start_s": round(start_s, 2),
        "stop_s": round(stop_s, 2),
        "step_s": [round(r.metrics["timing_s/step"], 4) for r in warm],
        "weight_sync_s": statistics.mean(r.metrics["timing_s/weight_sync"] for r in warm),
        "weight_push_transports": push_transports([r.metrics for r in warm]),
    }


def push_transports(steps: list[dict[str, float]]) -> dict[str, int]:
    """How many replica pushes each transport carried over ``steps`` (the driver's
    ``weight_sync/transport/<name>`` metrics): which path a real run's pushes took."""
    prefix = "weight_sync/transport/"
    out: dict[str, int] = {}
    for m in steps:
        for key, count in m.items():
            if key.startswith(prefix):
                name = key[len(prefix) :]
                out[name] = out.get(name, 0) + int(count)
    return out


def launcher_cases(launcher: str, steps: int, rounds: int, root: Path, model: Path,
                   data: Path) -> dict[str, Any]:  # fmt: skip
    """Local (baseline) and, with ``launcher == "ray"``, Ray, alternating ``rounds`` times."""
    launchers = ["local", "ray"] if launcher == "ray" else ["local"]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in launchers}
    ray_mod: Any = None
    if launcher == "ray":
        import ray as ray_mod

        # This machine only: a fresh Ray (never one already running here), on loopback.
        ray_mod.init(namespace="rlfleet-bench", log_to_driver=False, include_dashboard=False)
    try:
        for i in range(rounds):
            for name in launchers:
                print(f"round {i + 1}/{rounds}: {name} launcher", file=sys.stderr)
                run_dir = root / f"{name}-{i}"
                runs[name].append(run_services(model, data, run_dir, name, steps))
    finally:
        if ray_mod is not None:
            ray_mod.shutdown()
    out: dict[str, Any] = {}
    for name, results in runs.items():
        steps_s = [s for r in results for s in r["step_s"]]
        out[name] = {
            "step_s_mean": round(statistics.mean(steps_s), 4),
            "step_s_median": round(statistics.median(steps_s), 4),
            "step_s": steps_s,
            "weight_sync_s_mean": round(statistics.mean(r["weight_sync_s"] for r in results), 4),
            "weight_push_transports": dict(
                sum((Counter(r["weight_push_transports"]) for r in results), Counter())
            ),
            "start_s": [r["start_s"] for r in results],
            "stop_s": [r["stop_s"] for r in results],
        }
    if "ray" in out:
        local, ray = out["local"], out["ray"]
        out["ray_over_local"] = round(ray["step_s_mean"] / local["step_s_mean"], 3)
        out["ray_over_local_median"] = round(ray["step_s_median"] / local["step_s_median"], 3)
        out["ray_overhead_per_step_s"] = round(ray["step_s_mean"] - local["step_s_mean"], 4)
    return out


# ------------------------------------------------------------------ service overhead

#: The trainer's phases, as it times them inside TrainStep.
TRAINER_PHASES = ("old_log_prob", "ref", "values", "adv", "update_critic", "update_actor")


def _overhead_config(model: Path, data: Path, run_dir: Path, threads: int, steps: int) -> Config:
    """``rlfleet train`` on the tiny model: GRPO (KL loss: a reference policy too), 64
    prompts x 4 samples, responses up to 16 tokens, one epoch over one mini-batch; the
    trainer and the rollout on ``threads`` cores each."""
    return config_from_dict(
        {
            "data": {
                "train_files": str(data / "train.parquet"),
                "val_files": [],
                "train_batch_size": 64,
                "max_prompt_length": 64,
                "max_response_length": 16,
            },
            "actor": {
                "model_path": str(model),
                "lr": 1e-4,
                "ppo_mini_batch_size": 64,
                "ppo_micro_batch_size": 64,
                "use_kl_loss": True,
            },
            "ref": {"log_prob_micro_batch_size": 64},
            "rollout": {"n": 4, "log_prob_micro_batch_size": 64},
            "algorithm": {"adv_estimator": "grpo"},
            "reward": {"num_workers": 1},
            "trainer": {
                "total_training_steps": steps,
                "test_freq": -1,
                "save_freq": -1,
                "default_local_dir": str(run_dir),
                "resume_mode": "disable",
                "logger": [],
                "val_before_train": False,
            },
            "resource_pools": {"train_pool": [threads], "rollout_pool": [threads]},
            "mapping": {"actor": "train_pool", "ref": "train_pool", "rollout": "rollout_pool"},
        }
    )


def run_train(cfg: Config, *, in_process: bool, threads: int) -> list[dict[str, float]]:
    """One ``rlfleet train`` run (:func:`rlfleet.launch.train.train`): the services as
    local processes with a scheduler (as ``rlfleet train`` starts them), or every role
    in this process on ``threads`` torch threads (the cores one service gets)."""
    from rlfleet.launch.train import train

    metrics: list[dict[str, float]] = []
    before = torch.get_num_threads()
    if in_process:
        torch.set_num_threads(threads)
    try:
        train(cfg, in_process=in_process, on_step=lambda r: metrics.append(dict(r.metrics)))
    finally:
        torch.set_num_threads(before)
    return metrics


def _summary(steps: list[dict[str, float]]) -> dict[str, Any]:
    def mean(key: str) -> float:
        return round(statistics.mean(m.get(key, 0.0) for m in steps), 4)

    phases = {p: mean(f"timing_s/{p}") for p in TRAINER_PHASES}
    trainer_s = statistics.mean(
        sum(m.get(f"timing_s/{p}", 0.0) for p in TRAINER_PHASES) for m in steps
    )
    train_s = statistics.mean(m["timing_s/train"] for m in steps)
    return {
        "step_s_mean": mean("timing_s/step"),
        "step_s_median": round(statistics.median(m["timing_s/step"] for m in steps), 4),
        "step_s": [round(m["timing_s/step"], 4) for m in steps],
        "gen_s": mean("timing_s/gen"),
        "reward_s": mean("timing_s/reward"),
        # The TrainStep call as the driver saw it, and what of it the trainer's phases
        # did not take: the batch's trip to the trainer and back (the hop).
        "train_call_s": round(train_s, 4),
        "trainer_phases_s": round(trainer_s, 4),
        "train_hop_s": round(train_s - trainer_s, 4),
        "weight_sync_s": mean("timing_s/weight_sync"),
        "weight_push_transports": push_transports(steps),
        "scheduler_s": mean("timing_s/scheduler"),
        "phases_s": phases,
        "old_log_prob_skipped": mean("actor/old_log_prob_skipped"),
    }


def overhead_cases(root: Path, model: Path, data: Path, *, steps: int, rounds: int,
                   threads: int) -> dict[str, Any]:  # fmt: skip
    """Disaggregated services vs every role in one process, alternating ``rounds`` times;
    each run is 1 + ``steps`` steps and its first step (start-up, first push) is left out."""
    runs: dict[str, list[dict[str, float]]] = {"disaggregated": [], "in_process": []}
    for i in range(rounds):
        for name in runs:
            print(f"round {i + 1}/{rounds}: {name}", file=sys.stderr)
            cfg = _overhead_config(model, data, root / f"{name}-{i}", threads, steps + 1)
            runs[name] += run_train(cfg, in_process=name == "in_process", threads=threads)[1:]
    dis, inp = _summary(runs["disaggregated"]), _summary(runs["in_process"])
    return {
        "disaggregated": dis,
        "in_process": inp,
        "service_overhead": round(
            (dis["step_s_mean"] - inp["step_s_mean"]) / dis["step_s_mean"], 4
        ),
        "service_overhead_median": round(
            (dis["step_s_median"] - inp["step_s_median"]) / dis["step_s_median"], 4
        ),
        "targets": {"service_overhead": 0.10},
    }


def main_overhead(args: argparse.Namespace) -> None:
    from rlfleet.common.tiny_model import build_tiny_model
    from rlfleet.driver.data.preprocess import preprocess

    with tempfile.TemporaryDirectory(prefix="rlb-") as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "tiny", preset="tiny", seed=0)
        with open(os.devnull, "w") as quiet:
            preprocess("arithmetic", None, root / "data", n=512, n_test=8, digits=2, seed=0,
                       stderr=quiet)  # fmt: skip
        cases = overhead_cases(root, model, root / "data", steps=args.service_steps,
                               rounds=args.rounds, threads=args.threads)  # fmt: skip
    out = {
        "bench": "ppo_step",
        "case": "service_overhead",
        "workers": "real `rlfleet train` (tiny model, CPU): local service processes with a "
        "scheduler, auth on, vs every role in one process",
        "batch": "GRPO (+ KL loss), 64 prompts x 4 samples, responses up to 16 tokens, "
        "one epoch over one mini-batch",
        "threads_per_role": args.threads,
        "steps_per_run": args.service_steps,
        "rounds": args.rounds,
        **cases,
    }
    print(json.dumps(out, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gen-s", type=float, default=1.0, help="generation seconds per step")
    parser.add_argument("--train-s", type=float, default=1.0, help="training seconds per step")
    parser.add_argument("--swap-s", type=float, default=0.1, help="colocated sleep+wake seconds")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per case")
    parser.add_argument(
        "--launcher",
        choices=("local", "ray"),
        default=None,
        help="time real services started by LocalCluster (and, with ray, RayCluster) "
        "instead of the stand-ins",
    )
    parser.add_argument(
        "--service-overhead",
        action="store_true",
        help="time a real `rlfleet train` step as services vs every role in one process",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="--service-overhead: cores per role (and pool)"
    )
    parser.add_argument("--service-steps", type=int, default=4, help="timed steps per launcher run")
    parser.add_argument("--rounds", type=int, default=2, help="runs per launcher, alternating")
    args = parser.parse_args()
    if args.service_overhead:
        main_overhead(args)
        return
    if args.launcher is not None:
        main_launcher(args)
        return
    from rlfleet.common.tiny_model import build_tiny_model
    from rlfleet.driver.data.preprocess import preprocess

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "tiny", preset="tiny", seed=0)
        with open(os.devnull, "w") as quiet:
            preprocess("arithmetic", None, root / "data", n=512, n_test=16, digits=2, seed=0,
                       stderr=quiet)  # fmt: skip
        kw = {"gen_s": args.gen_s, "train_s": args.train_s, "swap_s": args.swap_s,
              "steps": args.steps}  # fmt: skip
        sync = run_case(model, root / "data", root, colocated=False, pipelined=False, **kw)
        pipe = run_case(model, root / "data", root, colocated=False, pipelined=True, **kw)
        colo = run_case(model, root / "data", root, colocated=True, pipelined=False, **kw)
    out = {
        "bench": "ppo_step",
        "workers": "timed stand-ins (see docstring); driver, data, reward are real",
        "gen_s": args.gen_s,
        "train_s": args.train_s,
        "batch": "32 prompts x 4 samples, GAE",
        "disaggregated_sync": sync,
        "disaggregated_pipelined": pipe,
        "colocated_sync": colo,
        "pipelined_over_sync": round(pipe["step_s"] / sync["step_s"], 3),
        "colocated_over_disaggregated_sync": round(colo["step_s"] / sync["step_s"], 3),
        "colocated_over_disaggregated_pipelined": round(colo["step_s"] / pipe["step_s"], 3),
        "scheduler_share_max": max(c["scheduler_share"] for c in (sync, pipe, colo)),
        "targets": {"pipelined_over_sync": 0.6, "scheduler_share": 0.03},
    }
    print(json.dumps(out, indent=2))


def main_launcher(args: argparse.Namespace) -> None:
    from rlfleet.common.tiny_model import build_tiny_model
    from rlfleet.driver.data.preprocess import preprocess

    # A short temp dir: a Ray started here keeps its Unix sockets under it (RAY_TMPDIR).
    with tempfile.TemporaryDirectory(prefix="rlb-") as tmp:
        root = Path(tmp)
        if args.launcher == "ray":
            os.environ["RAY_TMPDIR"] = str(root / "ray")
            # Read at Ray's import: a node with no address given takes 127.0.0.1.
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
            os.environ.pop("RAY_ADDRESS", None)
        model = build_tiny_model(root / "tiny", preset="tiny", seed=0)
        with open(os.devnull, "w") as quiet:
            preprocess("arithmetic", None, root / "data", n=256, n_test=8, digits=2, seed=0,
                       stderr=quiet)  # fmt: skip
        cases = launcher_cases(args.launcher, args.service_steps, args.rounds, root, model,
                               root / "data")  # fmt: skip
    out = {
        "bench": "ppo_step",
        "launcher": args.launcher,
        "workers": "real services (tiny model, CPU, one core per pool), auth on",
        "batch": "8 prompts x 4 samples, GAE, 16 response tokens",
        "steps_per_run": args.service_steps,
        "rounds": args.rounds,
        **cases,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
