"""`rlfleet train --config FILE [key.path=value ...]`: one PPO run, start to finish.

1. Loads the config (YAML plus dotted overrides; every error reported at once) and
   saves the resolved config as ``<run dir>/config.yaml``.
2. Starts the services as local processes (:class:`rlfleet.launch.cluster.LocalCluster`:
   reward, trainer, one process per rollout replica, a scheduler for the registry;
   services named in ``services.*`` are used as they are), or with ``--in-process``
   builds every role inside this process instead. When every service is given
   (``services.trainer``, ``services.reward``, and ``services.rollout`` or
   ``services.scheduler``, whose registry then names the replicas) and the environment
   holds credentials (``RLFLEET_CREDENTIALS``, TLS from ``RLFLEET_TLS_*``), nothing is
   launched and the driver uses those credentials (docker compose, Kubernetes).
3. Runs :class:`rlfleet.driver.loop.PPOTrainer` ``init_workers()`` / ``fit()``.
4. Stops every service it started on exit, on an error and on Ctrl-C / SIGTERM.

Exit status: 0 done, 1 failed, 2 bad config, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from rlfleet.common import cli_args

__all__ = ["add_arguments", "run"]

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=None,
        help="run config (YAML), e.g. examples/*.yaml; none: the defaults, verl's when the "
        "overrides are verl's keys (as `python -m verl.trainer.main_ppo key=value ...`)",
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="key.path=value", help="dotted config overrides"
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run every role in this process (no services, no sockets)",
    )
    parser.add_argument(
        "--no-scheduler",
        action="store_true",
        help="do not start a scheduler (registry) process next to the services",
    )
    parser.add_argument(
        "--metrics-port",
        type=cli_args.port,
        default=None,
        help="serve the driver's Prometheus metrics on this port (0: a free port)",
    )
    parser.add_argument(
        "--start-timeout",
        type=cli_args.positive_float,
        default=300.0,
        help="seconds for the services to start",
    )
    parser.add_argument(
        "--torch-threads",
        type=cli_args.positive_int,
        default=None,
        help="--in-process: torch threads of this process (default: torch's choice)",
    )
    parser.add_argument(
        "--log-level", type=cli_args.log_level, default="WARNING", help="Python log level"
    )


def run(args: argparse.Namespace) -> int:
    from rlfleet.common.config import ConfigError, load_config, save_resolved

    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:  # one line per problem, as preflight's
        print(e.lines("rlfleet train: "), file=sys.stderr)
        return 2
    from rlfleet.launch.preflight import preflight

    problems = preflight(config, metrics_port=args.metrics_port, in_process=args.in_process)
    if problems:  # one line each, before any service starts or any model loads
        from rlfleet.common.config.verl import load_translation

        translation = load_translation(args.config, args.overrides)
        if translation is not None:  # named as the input names them: verl's keys
            problems = [translation.named_as_given(p) for p in problems]
        print("\n".join(f"rlfleet train: {p}" for p in problems), file=sys.stderr)
        return 2
    if (
        config.scheduler.autoscale.enable
        and (args.in_process or args.no_scheduler)
        and not config.services.scheduler
    ):
        how = "--in-process" if args.in_process else "--no-scheduler"
        print(f"rlfleet train: warning: scheduler.autoscale.enable does nothing with {how} "
              "(the autoscaler runs in the scheduler, and its count is followed by the "
              "launcher of service processes)", file=sys.stderr)  # fmt: skip
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    run_dir = config.run_dir()
    save_resolved(config, run_dir)
    _note_verl_translation(args.config, args.overrides, run_dir)
    written = ["config.yaml"]
    if "jsonl" in config.trainer.logger:
        written.append("metrics.jsonl")
    if "tensorboard" in config.trainer.logger:
        written.append("tensorboard/")
    print(f"run dir {run_dir} ({', '.join([*written, 'checkpoints/'])})", file=sys.stderr)
    try:
        summary = train(
            config,
            in_process=args.in_process,
            scheduler=not args.no_scheduler,
            metrics_port=args.metrics_port,
            start_timeout_s=args.start_timeout,
        )
    except KeyboardInterrupt:
        print("interrupted: services stopped", file=sys.stderr)
        return 130
    except Exception as e:  # the boundary: report, stop (done in train), exit non-zero
        logger.debug("training failed", exc_info=True)
        print(f"rlfleet train failed: {type(e).__name__}: {e}", file=sys.stderr)
        # A service that refused its input at start-up: a start-up error as preflight's.
        return 2 if getattr(e, "bad_input", False) else 1
    print(json.dumps(summary))
    return 0


def _note_verl_translation(path: str | None, overrides: list[str], run_dir: Any) -> None:
    """A verl-shaped config: list its ignored keys once and save how each key was read
    next to config.yaml (``verl_translation.yaml``)."""
    from rlfleet.common.config.verl import load_translation

    translation = load_translation(path, overrides)
    if translation is not None:
        print("\n".join(translation.startup_lines()), file=sys.stderr)
        translation.write(run_dir)


def train(
    config: Any,
    *,
    in_process: bool = False,
    scheduler: bool = True,
    metrics_port: int | None = None,
    start_timeout_s: float = 300.0,
    on_step: Any = None,
) -> dict[str, Any]:
    """Run one PPO job; returns a summary (steps, validation scores, run dir)."""
    from rlfleet.common.rpc import current_security, set_security
    from rlfleet.driver.clients import remote_workers
    from rlfleet.driver.loop import PPOTrainer

    previous_security = current_security()
    run_dir = config.run_dir()
    cluster: Any = None
    mapping: Any = None
    scheduler_address: str | None = None
    deployed = None if in_process else _deployed_security(config)
    try:
        if deployed is not None:
            # Every service runs already (docker compose, Kubernetes): nothing to launch,
            # and the driver speaks with the credentials its deployer gave this process.
            set_security(deployed)
            mapping, scheduler_address = _deployed_workers(config, start_timeout_s)
        elif not in_process:
            if config.launcher == "ray":
                from rlfleet.launch.ray_cluster import RayCluster

                cluster = RayCluster(config, run_dir, scheduler=scheduler)
            else:
                from rlfleet.launch.cluster import LocalCluster

                cluster = LocalCluster(config, run_dir, scheduler=scheduler)
            handle = cluster.start(timeout_s=start_timeout_s)
            print(
                f"services up ({handle.mode}): trainer {handle.trainer}, "
                f"rollout {', '.join(handle.rollout)}, reward {handle.reward}"
                + (f", scheduler {handle.scheduler} (rlfleet status --scheduler "
                   f"{handle.scheduler})" if handle.scheduler else ""),
                file=sys.stderr,
            )  # fmt: skip
            mapping = remote_workers(handle.trainer, handle.rollout, handle.reward)
            # Replicas that register later (`rlfleet serve rollout --scheduler ...`) join
            # the run at the next step, with the current weights.
            scheduler_address = handle.scheduler
        with PPOTrainer(
            config,
            role_worker_mapping=mapping,
            metrics_port=metrics_port,
            on_step=on_step,
            scheduler=scheduler_address,
            fleet_metrics=getattr(cluster, "fleet_metrics", None),
            kill_trainer=getattr(cluster, "kill_trainer", None),
        ) as trainer:
            if trainer.metrics_port:
                print(f"metrics on 127.0.0.1:{trainer.metrics_port}/metrics", file=sys.stderr)
            trainer.init_workers()
            trainer.fit()
            last = trainer.history[-1].metrics if trainer.history else {}
            return {
                "run_dir": str(run_dir),
                "global_steps": trainer.global_steps,
                "validation": [{"step": s, **v} for s, v in trainer.val_history],
                "last_step": {
                    k: v
                    for k, v in last.items()
                    if k.startswith(("critic/score", "timing_s/step", "staleness"))
                },
            }
    finally:
        if cluster is not None:
            cluster.stop()
        if deployed is not None:
            set_security(previous_security)


def _deployed_security(config: Any) -> Any:
    """The environment's security when every service is given by address and the
    environment holds credentials (``RLFLEET_CREDENTIALS``, ``RLFLEET_CREDENTIALS_JSON``
    or ``RLFLEET_AUTH_TOKEN``, TLS from ``RLFLEET_TLS_*``); else None (LocalCluster)."""
    from rlfleet.common.auth import credentials_in_env
    from rlfleet.common.rpc import Security

    s = config.services
    if s.trainer is None or s.reward is None or not (s.rollout or s.scheduler):
        return None
    if not credentials_in_env():
        return None
    return Security.from_env(what="rlfleet train")


def _deployed_workers(config: Any, timeout_s: float) -> tuple[Any, str | None]:
    """Workers of running services; rollout replicas from ``services.rollout``, else
    the scheduler's registry (waiting up to ``timeout_s`` for one to register)."""
    import time

    from rlfleet.common.errors import Unavailable
    from rlfleet.common.rpc import wait_for_ready
    from rlfleet.driver.clients import remote_workers
    from rlfleet.scheduler.client import RemoteSchedulerClient

    s = config.services
    deadline = time.monotonic() + timeout_s
    for address in (s.trainer, s.reward, *s.rollout, s.scheduler):
        if address:
            wait_for_ready(address, timeout_s=max(0.1, deadline - time.monotonic()))
    rollout = list(s.rollout)
    if not rollout:
        with RemoteSchedulerClient(s.scheduler) as client:
            while not rollout:
                entries = client.list_services("rollout", alive_only=True)
                rollout = sorted(e.spec.address for e in entries if e.spec.address)
                if not rollout and time.monotonic() > deadline:
                    raise Unavailable(
                        f"no rollout replica registered with {s.scheduler} within {timeout_s}s",
                        field="services.scheduler",
                        value=s.scheduler,
                    )
                if not rollout:
                    time.sleep(1.0)
    return remote_workers(s.trainer, rollout, s.reward), s.scheduler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlfleet train", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
