"""`rlfleet serve trainer`: the TrainerService on one process or N ranks under torchrun.

::

    rlfleet serve trainer --config run.yaml --port 50051
    torchrun --nproc-per-node 2 -m rlfleet.trainer.server --config run.yaml --port 50051

Under torchrun (``WORLD_SIZE`` > 1) the process group is gloo on CPU, NCCL on GPU; rank 0
serves gRPC and drives, the other ranks follow its commands
(:mod:`rlfleet.trainer.dispatch`) until it stops. SIGTERM / SIGINT stop gracefully:
health goes NOT_SERVING, in-flight calls drain, then the followers are released.

``--address-file`` writes ``host:port`` once the server is up (atomically), which is how
a parent process that asked for port 0 learns the port.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from rlfleet.common import cli_args

__all__ = ["add_serve_arguments", "main", "serve_main"]

logger = logging.getLogger(__name__)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=False, default=None, help="run config (YAML)")
    parser.add_argument(
        "--port",
        type=cli_args.port,
        default=None,
        help="port to serve on; default: the port of services.trainer, else 0 (any free port)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0: all)")
    parser.add_argument("--address-file", default=None, help="write host:port here when ready")
    parser.add_argument(
        "--scheduler",
        default=None,
        help="scheduler host:port: PushWeights sends weights only to the rollout replicas "
        "registered there (default: only to services.rollout and loopback addresses)",
    )
    parser.add_argument(
        "--total-training-steps",
        type=cli_args.positive_int,
        default=None,
        help="for the lr schedules until a caller sends the run's own (the driver sends it "
        "with every TrainStep); default: trainer.total_training_steps",
    )
    parser.add_argument("overrides", nargs="*", help="dotted config overrides key.path=value")
    cli_args.add_override_argument(parser, "actor.lr=1e-6; joins the positional ones")
    from rlfleet.common.rpc import add_security_arguments

    add_security_arguments(parser)


def _port(args: argparse.Namespace, configured: str | None) -> int:
    if args.port is not None:
        return int(args.port)
    if configured and not configured.startswith("unix:"):
        return int(configured.rpartition(":")[2])
    return 0


def _registered_replicas(scheduler: str | None) -> Callable[[], set[str]] | None:
    """The addresses of the alive rollout replicas registered with ``scheduler``."""
    if not scheduler:
        return None
    from rlfleet.scheduler.client import RemoteSchedulerClient

    client = RemoteSchedulerClient(scheduler, timeout_s=10.0)

    def addresses() -> set[str]:
        return {e.spec.address for e in client.list_services("rollout", alive_only=True)}

    return addresses


def serve_main(args: argparse.Namespace) -> int:
    """Run the trainer service until stopped; returns the exit code."""
    from rlfleet.common.allocator import use_one_arena

    use_one_arena()  # before any thread starts (rlfleet.common.allocator)
    import torch.distributed as dist

    from rlfleet.common import tracing
    from rlfleet.common.auth import CredentialError
    from rlfleet.common.config import ConfigError, load_config
    from rlfleet.common.errors import load_failure
    from rlfleet.common.rpc import create_server, init_service_security, taken_ports
    from rlfleet.trainer.core import TrainerCore
    from rlfleet.trainer.dispatch import follow
    from rlfleet.trainer.servicer import TrainerServicer
    from rlfleet.trainer.servicer import add_to_server as trainer_add_to_server

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        init_service_security(args, what="rlfleet serve trainer", host=args.host)
    except CredentialError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config, [*args.overrides, *args.override])
    except ConfigError as e:
        print(e.lines("error: "), file=sys.stderr)
        return 2
    port = _port(args, config.services.trainer)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    tracing.configure(config, "trainer" if rank0 else f"trainer-rank{os.environ['RANK']}")
    taken = taken_ports(args.host, {"--port": port}) if rank0 else []
    if taken:  # before the model loads
        print("\n".join(f"error: {t}" for t in taken), file=sys.stderr)
        return 2
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if config.trainer.device == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        try:
            core = TrainerCore(config, total_training_steps=args.total_training_steps)
        except OSError as e:  # a model or tokenizer that is not there: one line, no trace
            keys = {
                "actor.model_path": config.actor.model_path,
                "actor.tokenizer_path": config.actor.tokenizer_path,
                "critic.model_path": config.critic.model_path,
                "ref.model_path": config.ref.model_path,
            }
            print(f"error: {load_failure(e, keys)}", file=sys.stderr, flush=True)
            return 2
        if rank != 0:
            # Followers leave when rank 0 says so (after draining its calls); a signal
            # sent to the whole group must not kill them under rank 0's feet.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            follow(core.ops)
            return 0
        server = create_server(
            [
                (
                    trainer_add_to_server,
                    TrainerServicer(core, push_targets=_registered_replicas(args.scheduler)),
                )
            ],
            host=args.host,
            port=port,
        )
        server.install_signal_handlers()
        if args.address_file:
            target = Path(args.address_file)
            tmp = target.with_suffix(target.suffix + ".tmp")
            tmp.write_text(server.address)
            tmp.replace(target)
        print(f"trainer serving on {server.address} (world size {world})", flush=True)
        server.wait()
        core.shutdown()
        return 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlfleet-trainer", description=__doc__)
    add_serve_arguments(parser)
    return serve_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
