"""Rollout benchmark: prints one JSON object on stdout (progress goes to stderr).

(a) **Generation**: tokens/s of the HF engine called in this process
    (``HFEngine.generate``: per-row seeded sampling, log-probs) against
    ``model.generate`` of transformers (the model loaded as it comes, sdpa
    attention) on the same weights and the same left-padded
    batch (sampling at temperature 1, no top-k / top-p, exactly ``--max-tokens``
    new tokens, no log-probs: the plain library loop), and the rollout gRPC service
    (``python -m rlfleet.rollout.server --engine hf --port 0``, a separate process,
    called through ``RemoteRolloutClient``) and the in-process core
    (``RolloutCore`` + ``InProcessRolloutClient``) against the engine: same model
    folder, prompts and sampling parameters (seeded, temperature 1, exactly
    ``--max-tokens`` tokens: ``ignore_eos``), one request of ``--prompts`` x ``--n``
    rows. Models are built by ``rlfleet.common.tiny_model.build_tiny_model``
    (``--presets``). ``--max-num-batched-tokens N`` adds the engine with that token
    budget (``engine_token_budget``: rows grouped by prompt length; use it with
    ``--prompt-len-min`` for varied lengths). Targets (issue 14):
    ``engine_vs_generate`` >= 0.95, ``service_vs_engine`` >= 0.95.
(b) **Weight update**: ``--params`` bf16 parameters of random values (1 GiB by
    default: 32 matrices of 4096 x 4096) pushed with ``rlfleet.weightsync.sender.send_update``
    over each transport (gRPC chunks, raw TCP, shared memory) into a ``RolloutCore``
    served over gRPC in a separate process, whose engine holds a state of the same
    names, shapes and dtype; against a raw TCP socket moving the same bytes into the
    same process, and a memcpy of the same bytes in this process.
    ``--bucket-bytes N`` (default 0: off) adds a second phase: the same bytes pushed
    as buckets of at most N bytes over each transport with the trainer's bucketed
    push (``rlfleet.weightsync.sender.push_weights``: one bulk transfer per bucket,
    staged by the replica, applied once; gRPC: the bucketed chunk stream),
    interleaved with the raw TCP baseline again (same receiver, same run).
(c) **The weight push of a real run**: a trainer service (``python -m
    rlfleet.trainer.server``, its own process) holding a Llama of ``--push-params``
    float32 parameters (2**27 by default: 537 MB) pushes it, on the driver's
    ``PushWeights`` call, through its real push path
    (``rlfleet.weightsync.sender.push_weights``) into a real rollout replica
    (``python -m rlfleet.rollout.server``, HF engine, the same model) for each
    ``rollout.weight_transport`` (auto, shm, tcp, grpc); against raw TCP moving the
    same number of bytes between two processes, interleaved in the same run (``auto``
    in a phase of its own, as a run pushes with one transport). Auth on.

    python bench/rollout.py                                  # tiny + small, 1 GiB update
    python bench/rollout.py --presets tiny --params 64e6 --repeats 3     # quick
    # generation only, the issue's batch (64 prompts x 4 samples, 16 new tokens):
    python bench/rollout.py --presets tiny --params 0 --prompts 64 --n 4 --max-tokens 16
    python bench/rollout.py --presets '' --params 0 --push-params 134217728  # (c) only

``tokens_per_s`` / ``GBps`` are medians of ``--repeats`` timed runs after one warm-up
(``best_*`` the fastest); methods are interleaved run by run, so background load hits
them alike. Ratios use the medians. GB is 10**9 bytes. ``--threads`` (default 1) sets
torch's intra-op threads in this process and in the service process alike: on a small
shared CPU host, two OpenMP threads per process make generation times swing tenfold.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

from rlfleet.common.auth import load_credentials, write_credential_set
from rlfleet.common.errors import FailedPrecondition, InvalidArgument
from rlfleet.common.rpc import Security, create_channel, set_security
from rlfleet.rollout.engine import EngineInfo, GenerationRequest, SampleOutput, SamplingParams
from rlfleet.weightsync import sender as weight_sender

TIMEOUT_S = 600.0
_MATRIX = 4096  # columns of every weight matrix in (b)


def log(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


def interleaved(
    methods: Mapping[str, Callable[[], Any]], repeats: int
) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Seconds of each run per method (one warm-up each first, not counted), and the
    last value each method returned."""
    last: dict[str, Any] = {}
    for name, fn in methods.items():
        last[name] = fn()
    times: dict[str, list[float]] = {k: [] for k in methods}
    for r in range(repeats):
        for name, fn in methods.items():
            start = time.perf_counter()
            last[name] = fn()
            times[name].append(time.perf_counter() - start)
        log(
            f"  round {r + 1}/{repeats}: "
            + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items())
        )
    return times, last


# --------------------------------------------------------------------------- (a)


def _start_service(
    model_dir: Path, threads: int, device: str = "cpu"
) -> tuple[subprocess.Popen[str], str]:
    """``python -m rlfleet.rollout.server`` on port 0 with ``--torch-threads threads``
    on ``device``; returns it and its address."""
    cmd = [sys.executable, "-m", "rlfleet.rollout.server", "--model", str(model_dir)]
    cmd += ["--engine", "hf", "--port", "0", "--metrics-port", "-1", "--log-level", "WARNING"]
    cmd += ["--torch-threads", str(threads), "--device", device]
    # Auth on, as deployed: the replica has the rollout role, this process the driver's.
    secrets = write_credential_set(Path(tempfile.mkdtemp(prefix="rlfleet-bench-")) / "s")
    set_security(
        Security(
            credentials=load_credentials({"RLFLEET_CREDENTIALS": str(secrets / "driver.json")})
        )
    )
    env = {**os.environ, "RLFLEET_CREDENTIALS": str(secrets / "rollout.json")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"rollout server exited with {proc.wait()} before serving")
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") == "serving":
            return proc, str(event["address"])
    proc.terminate()
    raise TimeoutError("rollout server did not print its address within 120 s")


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()  # SIGTERM: graceful stop
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _tokens(samples: list[SampleOutput]) -> int:
    return sum(len(s.token_ids) for s in samples)


def _key(samples: list[SampleOutput]) -> list[tuple[int, int, tuple[int, ...]]]:
    return sorted((s.prompt_index, s.sample_index, tuple(s.token_ids)) for s in samples)


def bench_generation(preset: str, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from rlfleet.common.tiny_model import build_tiny_model
    from rlfleet.rollout.client import InProcessRolloutClient, RemoteRolloutClient
    from rlfleet.rollout.core import RolloutCore
    from rlfleet.rollout.hf_engine import HFEngine

    model_dir = build_tiny_model(workdir / preset, preset=preset, seed=0)
    engine = HFEngine(model_dir, device=args.device)
    vocab = int(engine.model.get_output_embeddings().weight.shape[0])
    n_params = sum(p.numel() for p in engine.model.parameters())
    gen = torch.Generator().manual_seed(0)
    shortest = min(args.prompt_len_min or args.prompt_len, args.prompt_len)
    lens = torch.randint(shortest, args.prompt_len + 1, (args.prompts,), generator=gen).tolist()
    prompts = [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in lens]
    # ignore_eos: every path generates exactly max_tokens per row, the same work.
    params = SamplingParams(
        n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=1234, ignore_eos=True
    )
    # The same rows for model.generate: each prompt n times, left-padded, sampling as
    # the engine does.
    pad = int(engine.model.config.pad_token_id or 0)
    width = max(lens)
    padded = torch.full((args.prompts, width), pad, dtype=torch.long)
    attention = torch.zeros_like(padded)
    for i, p in enumerate(prompts):
        padded[i, width - len(p) :] = torch.tensor(p)
        attention[i, width - len(p) :] = 1
    rows = padded.repeat_interleave(args.n, dim=0).to(args.device)
    attention = attention.repeat_interleave(args.n, dim=0).to(args.device)

    # transformers as it comes (sdpa attention), not the engine's model, whose decode
    # attention the engine changed.
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True)
    plain = plain.to(args.device).eval()

    def hf_generate() -> torch.Tensor:
        with torch.inference_mode():
            out = plain.generate(
                input_ids=rows,
                attention_mask=attention,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.max_tokens,
                min_new_tokens=args.max_tokens,
                eos_token_id=None,
                pad_token_id=pad,
            )
        return out[:, rows.shape[1] :]

    core = RolloutCore(engine, replica_id="bench-inprocess")
    local = InProcessRolloutClient(core)
    proc, address = _start_service(model_dir, args.threads, args.device)
    remote = RemoteRolloutClient(address, generate_timeout_s=TIMEOUT_S)
    try:
        methods: dict[str, Callable[[], Any]] = {
            "hf_generate": hf_generate,
            "engine_inprocess": lambda: engine.generate([GenerationRequest(prompts, params)])[0],
            "core_inprocess": lambda: list(local.generate(prompts, params)),
            "service_grpc": lambda: list(remote.generate(prompts, params)),
        }
        if args.max_num_batched_tokens:
            budget = HFEngine(
                model_dir, device=args.device, max_num_batched_tokens=args.max_num_batched_tokens
            )
            methods["engine_token_budget"] = lambda: budget.generate(
                [GenerationRequest(prompts, params)]
            )[0]
        times, last = interleaved(methods, args.repeats)
    finally:
        remote.close()
        _stop(proc)
        core.close()
    tokens = {k: int(v.numel()) if k == "hf_generate" else _tokens(v) for k, v in last.items()}
    tps = {k: tokens[k] / statistics.median(v) for k, v in times.items()}
    base = tps["engine_inprocess"]
    ratios = {
        "engine_vs_generate": round(base / tps["hf_generate"], 3),
        "service_vs_engine": round(tps["service_grpc"] / base, 3),
        "core_vs_engine": round(tps["core_inprocess"] / base, 3),
    }
    if "engine_token_budget" in tps:
        ratios["token_budget_vs_engine"] = round(tps["engine_token_budget"] / base, 3)
    return {
        "preset": preset,
        "device": str(engine.info().device),
        "parameters": n_params,
        "rows": args.prompts * args.n,
        "prompt_tokens": [min(lens), max(lens)],
        "max_tokens": args.max_tokens,
        "tokens_per_run": tokens,
        # Seeded sampling, the same batch: the service should give the same tokens.
        "service_tokens_equal_inprocess": _key(last["service_grpc"])
        == _key(last["engine_inprocess"]),
        "median_s": {k: round(statistics.median(v), 4) for k, v in times.items()},
        "tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
        "best_tokens_per_s": {k: round(tokens[k] / min(v), 1) for k, v in times.items()},
        **ratios,
        "targets": {"engine_vs_generate": ">= 0.95", "service_vs_engine": ">= 0.95"},
        "met": {
            "engine_vs_generate": ratios["engine_vs_generate"] >= 0.95,
            "service_vs_engine": ratios["service_vs_engine"] >= 0.95,
        },
    }


# --------------------------------------------------------------------------- (b)


def weight_shapes(n_params: int) -> dict[str, tuple[int, int]]:
    """Names and shapes of bf16 matrices of ``_MATRIX`` columns, ``n_params`` in all
    (rounded up to whole rows)."""
    rows_total = max(1, math.ceil(n_params / _MATRIX))
    shapes: dict[str, tuple[int, int]] = {}
    i = 0
    while rows_total > 0:
        rows = min(_MATRIX, rows_total)
        shapes[f"model.layers.{i // 4}.w{i % 4}.weight"] = (rows, _MATRIX)
        rows_total -= rows
        i += 1
    return shapes


class StateEngine:
    """The rollout ``Engine`` protocol's weight side on a plain state of bf16 tensors:
    checks and applies updates as ``HFEngine`` does (validate everything, then
    ``copy_`` into the held tensors under a lock), and cannot generate."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], *, adopt: bool = True) -> None:
        self.state = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}
        self.version = 0
        self.apply_s: dict[int, float] = {}  # version -> seconds of the copy into the state
        self._lock = threading.Lock()
        self.adopt = adopt
        self._release: Callable[[], None] | None = None

    def validate(self, requests: Any) -> None:
        raise FailedPrecondition("the benchmark engine does not generate")

    def generate(self, requests: Any, on_sample: Any = None) -> list[list[SampleOutput]]:
        raise FailedPrecondition("the benchmark engine does not generate")

    def check_weights(
        self, specs: Mapping[str, tuple[str, tuple[int, ...]]], *, complete: bool = True
    ) -> None:
        for name, (dtype, shape) in specs.items():
            held = self.state.get(name)
            if held is None:
                raise InvalidArgument(f"unknown tensor {name!r}", field=name)
            if dtype != "bfloat16" or tuple(shape) != tuple(held.shape):
                raise InvalidArgument(
                    f"tensor {name!r}: {dtype} {list(shape)}, held bfloat16 {list(held.shape)}",
                    field=name,
                )
        missing = set(self.state) - set(specs)
        if missing and complete:
            raise InvalidArgument(f"missing {len(missing)} tensors", field="weights")

    def update_weights(
        self,
        named_tensors: Mapping[str, Any],
        version: int,
        *,
        on_release: Callable[[], None] | None = None,
    ) -> bool:
        self.check_weights(
            {
                n: (str(t.dtype).removeprefix("torch."), tuple(t.shape))
                for n, t in named_tensors.items()
            }
        )
        # As HFEngine on CPU: with ``on_release`` (bulk TCP) the staged tensors become
        # the state (no copy) and the previously adopted ones are released; else copy.
        adopt = on_release is not None and (
            self.adopt
            and all(
                t.is_contiguous() and t.data_ptr() % t.element_size() == 0
                for t in named_tensors.values()
            )
        )
        released = None
        start = time.perf_counter()
        with self._lock, torch.no_grad():
            for name, t in named_tensors.items():
                if adopt:
                    self.state[name] = t
                else:
                    self.state[name].copy_(t)
            if adopt:
                released, self._release = self._release, on_release
            self.version = version
        if released is not None:
            released()
        self.apply_s[version] = time.perf_counter() - start
        return adopt

    def sleep(self, level: int = 1) -> int:
        return 0

    def wake_up(self) -> None:
        pass

    def info(self) -> EngineInfo:
        return EngineInfo(
            engine="bench",
            model="random-bf16",
            dtype="bfloat16",
            device="cpu",
            weight_version=self.version,
            max_model_len=0,
        )


def _raw_tcp_receiver(listener: socket.socket, total: int, runs: int) -> None:
    """Accept ``runs`` connections; each sends an 8-byte length then the bytes, which
    land by ``recv_into`` in one buffer allocated and touched once (the best case for
    a bulk transport: no page faults); ack each with one byte."""
    buf = np.ones(total, dtype=np.uint8).data
    head = bytearray(8)
    with listener:
        for _ in range(runs):
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(TIMEOUT_S)
                conn.recv_into(head, 8, socket.MSG_WAITALL)
                (size,) = struct.unpack("<Q", head)
                if size != total:
                    raise ConnectionError(f"announced {size} bytes, expected {total}")
                got = 0
                while got < size:
                    n = conn.recv_into(buf[got:])
                    if n == 0:
                        raise ConnectionError(f"peer closed after {got} of {size} bytes")
                    got += n
                conn.sendall(b"k")


def _receiver_process(
    conn: Connection, shapes: dict[str, tuple[int, ...]], adopt: bool = True
) -> None:
    """A rollout replica of its own (core + gRPC server) holding a ``StateEngine``, plus
    a raw TCP receiver; driven by commands over ``conn``."""
    from rlfleet.rollout.core import RolloutCore
    from rlfleet.rollout.server import start_rollout_server

    engine = StateEngine(shapes, adopt=adopt)
    core = RolloutCore(engine, replica_id="bench-receiver", transfer_timeout_s=TIMEOUT_S)
    server = start_rollout_server(core, host="127.0.0.1", port=0)
    conn.send(server.address)
    threads: list[threading.Thread] = []
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            break
        if cmd == "tcp":
            listener = socket.create_server(("127.0.0.1", 0))
            listener.settimeout(TIMEOUT_S)
            t = threading.Thread(target=_raw_tcp_receiver, args=(listener, *arg), daemon=True)
            t.start()
            threads.append(t)
            conn.send(listener.getsockname()[1])
        elif cmd == "apply_s":
            conn.send(dict(engine.apply_s))
    server.stop(1.0)
    core.close()


def _raw_tcp_send(views: list[memoryview], port: int) -> None:
    total = sum(len(v) for v in views)
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
        sock.sendall(struct.pack("<Q", total))
        for v in views:
            sock.sendall(v)
        if sock.recv(1) != b"k":
            raise ConnectionError("no ack from the TCP receiver")


class PhaseTimer:
    """Times the sender's phases inside the real ``push_weights``: wraps the functions
    ``rlfleet.weightsync.sender`` calls (``make_offer``: the layout, no pass over the
    bytes; ``send_tcp`` / ``send_shm``: moving the bytes and checksumming each block
    as it goes) and records their seconds under the current method's name."""

    def __init__(self) -> None:
        self.method = ""
        self.seconds: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))

    def _wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds[self.method][phase].append(time.perf_counter() - start)

        return timed

    def install(self) -> None:
        weight_sender.make_offer = self._wrap("offer", weight_sender.make_offer)
        weight_sender.send_tcp = self._wrap("move", weight_sender.send_tcp)
        weight_sender.send_shm = self._wrap("move", weight_sender.send_shm)


def bench_weights(
    n_params: int, repeats: int, adopt: bool = True, bucket_bytes: int = 0
) -> dict[str, Any]:
    shapes = weight_shapes(n_params)
    log(f"(b) building {sum(r * c for r, c in shapes.values()) / 1e6:.0f}M bf16 parameters")
    gen = torch.Generator().manual_seed(0)
    state = {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in shapes.items()}
    size = sum(t.numel() * t.element_size() for t in state.values())
    views = [t.view(-1).view(torch.uint8).numpy().data for t in state.values()]
    warm = np.ones(size, dtype=np.uint8)  # memcpy target, touched once

    def memcpy(dst: np.ndarray) -> None:
        offset = 0
        for v in views:
            dst[offset : offset + len(v)] = np.frombuffer(v, dtype=np.uint8)
            offset += len(v)

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(
        target=_receiver_process, args=(child_conn, dict(shapes), adopt), daemon=True
    )
    proc.start()
    timer = PhaseTimer()
    timer.install()
    version = 0
    versions: dict[int, str] = {}
    results: dict[str, Any] = {}
    try:
        if not conn.poll(120):
            raise TimeoutError("receiver process did not start within 120 s")
        address = conn.recv()
        # Raw TCP runs: one warm-up + the timed ones per phase (two warm-ups in the
        # bucketed phase).
        raw_runs = repeats + 1 + (repeats + 2 if bucket_bytes > 0 else 0)
        conn.send(("tcp", (size, raw_runs)))
        if not conn.poll(60):
            raise TimeoutError("raw TCP receiver did not start within 60 s")
        tcp_port = conn.recv()
        channel = create_channel(address)

        def push(transport: str) -> Callable[[], Any]:
            def run() -> Any:
                nonlocal version
                version += 1
                versions[version] = transport
                timer.method = transport
                result = weight_sender.send_update(
                    channel, state, version, transports=(transport,), timeout_s=TIMEOUT_S
                )
                if result.transport != transport or result.version != version:
                    raise RuntimeError(f"asked for {transport} v{version}, got {result}")
                return result

            return run

        methods: dict[str, Callable[[], Any]] = {
            "tcp_raw": lambda: _raw_tcp_send(views, tcp_port),
            "grpc": push("grpc"),
            "tcp": push("tcp"),
            "shm": push("shm"),
            "memcpy_warm": lambda: memcpy(warm),
            "memcpy_fresh": lambda: memcpy(np.empty(size, dtype=np.uint8)),
        }
        times, last = interleaved(methods, repeats)
        bucketed_times: dict[str, list[float]] = {}
        n_buckets = 0
        if bucket_bytes > 0:

            def push_bucketed(transport: str) -> Callable[[], Any]:
                def run() -> Any:
                    nonlocal version
                    version += 1
                    name = f"{transport}_bucketed"
                    versions[version] = name
                    timer.method = name
                    summary = weight_sender.push_weights(
                        state.items(),
                        [("bench-receiver", address)],
                        version,
                        bucket_bytes=bucket_bytes,
                        timeout_s=TIMEOUT_S,
                        transports=(transport,),
                    )
                    r = summary.results[0]
                    if not r.ok or r.transport != transport:
                        raise RuntimeError(f"bucketed {transport} v{version}: {r}")
                    return summary

                return run

            bucketed: dict[str, Callable[[], Any]] = {
                "tcp_raw": lambda: _raw_tcp_send(views, tcp_port),
                "grpc_bucketed": push_bucketed("grpc"),
                "tcp_bucketed": push_bucketed("tcp"),
                "shm_bucketed": push_bucketed("shm"),
            }
            log(f"(b) bucketed phase: buckets of at most {bucket_bytes} bytes")
            # An extra warm-up: the replica's spare buffers change shape (one per
            # bucket) and, over TCP, the adopted ones ping-pong; neither is timed.
            for fn in bucketed.values():
                fn()
            bucketed_times, bucketed_last = interleaved(bucketed, repeats)
            n_buckets = bucketed_last["tcp_bucketed"].buckets
        conn.send(("apply_s", None))
        apply_by_version: dict[int, float] = conn.recv()
        channel.close()
        conn.send(("stop", None))
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.terminate()
            proc.join(10)
    med = {k: statistics.median(v) for k, v in times.items()}
    gbps = {k: size / 1e9 / v for k, v in med.items()}
    apply_s: dict[str, list[float]] = defaultdict(list)
    for v in sorted(apply_by_version):
        apply_s[versions[v]].append(apply_by_version[v])
    phases: dict[str, dict[str, float]] = {}
    for transport in ("grpc", "tcp", "shm"):
        # Per timed run (the warm-up, first, is dropped as in ``times``): every phase
        # and ``other`` = total - phases, then the median of each over the runs.
        runs = [
            {name: xs[1 + r] for name, xs in timer.seconds[transport].items()}
            | {"apply_copy": apply_s[transport][1 + r], "total": times[transport][r]}
            for r in range(len(times[transport]))
        ]
        for run in runs:
            run["other"] = run["total"] - sum(v for k, v in run.items() if k != "total")
        phases[transport] = {
            k: round(statistics.median(run[k] for run in runs), 4) for k in runs[0]
        }
    move_gbps = {t: size / 1e9 / phases[t]["move"] for t in ("tcp", "shm")}
    results = {
        "parameters": size // 2,
        "bytes": size,
        "tensors": len(state),
        "dtype": "bfloat16",
        "receiver": "RolloutCore + gRPC server in a separate process, StateEngine",
        "apply": "adopts the staged tensors (TCP)" if adopt else "copies (--copy-apply)",
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "GBps": {k: round(v, 3) for k, v in gbps.items()},
        "best_GBps": {k: round(size / 1e9 / min(v), 3) for k, v in times.items()},
        "phases_median_s": phases,
        "receiver_reported_s": {k: round(v.seconds, 4) for k, v in last.items() if v is not None},
        "data_plane_move_GBps": {k: round(v, 3) for k, v in move_gbps.items()},
        "tcp_vs_raw_tcp": round(gbps["tcp"] / gbps["tcp_raw"], 3),
        "tcp_move_vs_raw_tcp": round(move_gbps["tcp"] / gbps["tcp_raw"], 3),
        "grpc_vs_raw_tcp": round(gbps["grpc"] / gbps["tcp_raw"], 3),
        "shm_vs_raw_tcp": round(gbps["shm"] / gbps["tcp_raw"], 3),
        "shm_vs_memcpy_warm": round(gbps["shm"] / gbps["memcpy_warm"], 3),
        "shm_move_vs_memcpy_fresh": round(move_gbps["shm"] / gbps["memcpy_fresh"], 3),
        "target": "bulk data plane (tcp) >= 0.8 x raw TCP",
        "met_end_to_end": gbps["tcp"] / gbps["tcp_raw"] >= 0.8,
        "met_move_only": move_gbps["tcp"] / gbps["tcp_raw"] >= 0.8,
    }
    if bucket_bytes > 0:
        results["bucketed"] = _bucketed_results(
            size, bucket_bytes, n_buckets, bucketed_times, timer, apply_s, gbps
        )
    return results


def _bucketed_results(
    size: int,
    bucket_bytes: int,
    n_buckets: int,
    times: dict[str, list[float]],
    timer: PhaseTimer,
    apply_s: Mapping[str, list[float]],
    one_bucket_gbps: Mapping[str, float],
) -> dict[str, Any]:
    """(b)'s bucketed phase: GB/s per transport, each against the raw TCP runs of the
    same phase, and the sender's move (summed over the buckets of a push) and the
    replica's one apply, medians over the timed pushes (two warm-ups dropped)."""
    med = {k: statistics.median(v) for k, v in times.items()}
    gbps = {k: size / 1e9 / v for k, v in med.items()}
    raw = gbps["tcp_raw"]
    move: dict[str, float] = {}
    for t in ("tcp", "shm"):
        xs = timer.seconds[f"{t}_bucketed"]["move"][2 * n_buckets :]
        per_push = [sum(xs[i : i + n_buckets]) for i in range(0, len(xs), n_buckets)]
        move[t] = statistics.median(per_push)
    return {
        "bucket_bytes": bucket_bytes,
        "buckets": n_buckets,
        "pushed_with": "rlfleet.weightsync.sender.push_weights (one bulk transfer per bucket)",
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "GBps": {k: round(v, 3) for k, v in gbps.items()},
        "best_GBps": {k: round(size / 1e9 / min(v), 3) for k, v in times.items()},
        "vs_raw_tcp": {t: round(gbps[f"{t}_bucketed"] / raw, 3) for t in ("grpc", "tcp", "shm")},
        "vs_one_bucket": {
            t: round(gbps[f"{t}_bucketed"] / one_bucket_gbps[t], 3) for t in ("grpc", "tcp", "shm")
        },
        "move_sum_median_s": {k: round(v, 4) for k, v in move.items()},
        "apply_median_s": {
            t: round(statistics.median(apply_s[f"{t}_bucketed"][2:]), 4)
            for t in ("grpc", "tcp", "shm")
        },
        "raw_tcp_GBps_this_phase_vs_first": round(raw / one_bucket_gbps["tcp_raw"], 3),
    }


# --------------------------------------------------------------------------- (c)


def _push_model(out: Path, n_params: int) -> Path:
    """A Llama of about ``n_params`` parameters (float32, tied embeddings; hidden 1024,
    MLP 4096, as many layers as it takes) with the tiny model's tokenizer."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from rlfleet.common.tiny_model import train_tokenizer

    tokenizer = train_tokenizer(2048)
    hidden, mlp, vocab = 1024, 4096, len(tokenizer)
    per_layer = 4 * hidden * hidden + 3 * hidden * mlp + 2 * hidden
    layers = max(1, round((n_params - vocab * hidden) / per_layer))
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=256,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def _start_trainer(config: Path, env: dict[str, str], workdir: Path) -> tuple[Any, str]:
    """``python -m rlfleet.trainer.server`` on port 0 (its own process, as deployed)."""
    address_file = workdir / "trainer.address"
    cmd = [sys.executable, "-m", "rlfleet.trainer.server", "--config", str(config)]
    cmd += ["--host", "127.0.0.1", "--port", "0", "--address-file", str(address_file)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if address_file.exists():
            return proc, address_file.read_text().strip()
        if proc.poll() is not None:
            raise RuntimeError(f"trainer server exited with {proc.returncode} before serving")
        time.sleep(0.2)
    proc.terminate()
    raise TimeoutError("trainer server did not write its address within 300 s")


def _raw_tcp_process(conn: Connection, total: int, runs: int) -> None:
    """The raw TCP baseline's receiver in a process of its own (as a replica is)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(TIMEOUT_S)
    conn.send(listener.getsockname()[1])
    _raw_tcp_receiver(listener, total, runs)


def bench_trainer_push(n_params: int, repeats: int, threads: int) -> dict[str, Any]:
    """(c) The weight push of a real run: the driver's ``PushWeights`` call to a real
    trainer service (its own process, holding a model of ``n_params`` float32
    parameters), which pushes the model through its real push path
    (``rlfleet.weightsync.sender.push_weights``: gather, buckets, negotiate, move,
    commit) to a real rollout replica (``python -m rlfleet.rollout.server``, HF
    engine, the same model), for each ``rollout.weight_transport`` (auto, shm, tcp,
    grpc); against raw TCP moving the same number of bytes between two processes,
    interleaved run by run. Auth on everywhere, as deployed."""
    workdir = Path(tempfile.mkdtemp(prefix="rlfleet-bench-push-"))
    try:
        return _trainer_push(workdir, n_params, repeats, threads)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _trainer_push(workdir: Path, n_params: int, repeats: int, threads: int) -> dict[str, Any]:
    from rlfleet.trainer.client import RemoteTrainerClient
    from rlfleet.weightsync.wire import transports_for

    log(f"(c) building a {n_params / 1e6:.0f}M-parameter model")
    model = _push_model(workdir / "model", n_params)
    secrets = write_credential_set(workdir / "secrets")
    set_security(
        Security(
            credentials=load_credentials({"RLFLEET_CREDENTIALS": str(secrets / "driver.json")})
        )
    )
    config = workdir / "run.yaml"
    config.write_text(
        json.dumps(
            {
                "actor": {"model_path": str(model), "dtype": "float32"},
                "algorithm": {"adv_estimator": "grpo"},  # no critic: only the actor pushes
                "rollout": {"dtype": "float32", "n": 2},
                "trainer": {"device": "cpu", "default_local_dir": str(workdir / "run")},
            }
        )
    )
    base = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "rlfleet.rollout.server", "--model", str(model), "--engine"]
    cmd += ["hf", "--port", "0", "--metrics-port", "-1", "--log-level", "WARNING"]
    cmd += ["--torch-threads", str(threads)]
    rollout = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        text=True,
        env={**base, "RLFLEET_CREDENTIALS": str(secrets / "rollout.json")},
    )
    trainer = None
    ctx = mp.get_context("spawn")
    raw_conn, child = ctx.Pipe()
    raw_proc = None
    try:
        trainer, trainer_address = _start_trainer(
            config, {**base, "RLFLEET_CREDENTIALS": str(secrets / "trainer.json")}, workdir
        )
        rollout_address = _serving_address(rollout)
        client = RemoteTrainerClient(trainer_address, timeout_s=TIMEOUT_S)
        target = [("r0", rollout_address)]
        probe = client.push_weights(target, version=1, transports=("grpc",))
        size = probe.bytes
        data = np.ones(size, dtype=np.uint8)
        raw_proc = ctx.Process(target=_raw_tcp_process, args=(child, size, 2 * (repeats + 2)))
        raw_proc.start()
        if not raw_conn.poll(60):
            raise TimeoutError("raw TCP receiver did not start within 60 s")
        port = raw_conn.recv()
        version = 1
        used: dict[str, list[str]] = defaultdict(list)
        replica_s: dict[str, list[float]] = defaultdict(list)

        def push(mode: str) -> Callable[[], Any]:
            def run() -> Any:
                nonlocal version
                version += 1
                out = client.push_weights(target, version=version, transports=transports_for(mode))
                if not out.ok.get("r0"):
                    raise RuntimeError(f"{mode} push v{version} failed: {out.errors}")
                used[mode].append(out.transports["r0"])
                replica_s[mode].append(out.seconds["r0"])
                return out

            return run

        def raw() -> Any:
            return _raw_tcp_send([data.data], port)

        # Two phases, each against raw TCP: a real run pushes with one transport, so
        # the target's phase pushes with ``auto`` alone (a push over another
        # transport in between would leave the replica's staging buffers to that
        # one and make the next ``auto`` push fault in fresh pages); then every
        # forced transport, interleaved. Two warm-ups each: the replica's staging
        # buffers ping-pong (adopted as its weights), so the second push of a
        # transport touches fresh memory.
        times: dict[str, list[float]] = {}
        raw_of: dict[str, str] = {}  # transport -> the raw TCP runs of its phase
        for n, phase in enumerate((("auto",), ("shm", "tcp", "grpc"))):
            methods: dict[str, Callable[[], Any]] = {f"tcp_raw_{n}": raw}
            methods |= {mode: push(mode) for mode in phase}
            raw_of |= {mode: f"tcp_raw_{n}" for mode in phase}
            for fn in methods.values():
                fn()
            got, _ = interleaved(methods, repeats)
            times |= got
        client.close()
    finally:
        for p in (trainer, rollout):
            if p is not None:
                _stop(p)
        if raw_proc is not None:
            raw_proc.join(10)
            if raw_proc.is_alive():
                raw_proc.terminate()
    med = {k: statistics.median(v) for k, v in times.items()}
    gbps = {k: size / 1e9 / v for k, v in med.items()}
    return {
        "parameters": size // 4,
        "bytes": size,
        "dtype": "float32",
        "path": "driver PushWeights -> trainer service (own process) -> "
        "rlfleet.weightsync.sender.push_weights -> rollout service (own process, HF engine)",
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "GBps": {k: round(v, 3) for k, v in gbps.items()},
        "transport_used": {k: sorted(set(v)) for k, v in used.items()},
        # The trainer's own time of each timed push (two warm-ups left out).
        "trainer_reported_s": {k: round(statistics.median(v[2:]), 4) for k, v in replica_s.items()},
        # Each transport against the raw TCP runs of its own phase.
        "vs_raw_tcp": {k: round(gbps[k] / gbps[raw], 3) for k, raw in raw_of.items()},
        "target": "weight push inside a real run (auto) >= 0.8 x raw TCP of the same bytes",
        "met": gbps["auto"] / gbps[raw_of["auto"]] >= 0.8,
    }


def _serving_address(proc: Any) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"rollout server exited with {proc.wait()} before serving")
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") == "serving":
            return str(event["address"])
    raise TimeoutError("rollout server did not print its address within 300 s")


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--presets", default="tiny,small", help="comma list; '' skips (a)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--device", default="cpu", help="(a): the HF engine's device (cpu, cuda)")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=32, help="(a): tokens per prompt (most)")
    ap.add_argument(
        "--prompt-len-min",
        type=int,
        default=0,
        help="(a): prompt lengths drawn from [this, --prompt-len]; 0: all --prompt-len",
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=0,
        help="(a): also time the engine with this token budget per generation batch "
        "(rows grouped by prompt length); 0: off",
    )
    ap.add_argument(
        "--params", type=float, default=float(2**29), help="bf16 parameters in (b); 0 skips"
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--weight-repeats", type=int, default=3)
    ap.add_argument(
        "--bucket-bytes",
        type=float,
        default=0,
        help="(b): also push the same bytes as buckets of at most this many bytes over "
        "each transport (the trainer's bucketed push); 0: one bucket only",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads, here and in the service process (see BENCHMARKS.md)",
    )
    ap.add_argument(
        "--push-params",
        type=float,
        default=float(2**27),
        help="(c): float32 parameters of the model the trainer service pushes (0 skips)",
    )
    ap.add_argument(
        "--copy-apply",
        action="store_true",
        help="(b): the engine copies every update into its state, as before it adopted "
        "the staged tensors of a TCP transfer (an A/B baseline in the same code)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    out: dict[str, Any] = {
        "benchmark": "rollout",
        "date": time.strftime("%Y-%m-%d"),
        "host": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "loadavg_start": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(),
            "torch": torch.__version__,
            "grpcio": grpc.__version__,
        },
    }
    presets = [p for p in args.presets.split(",") if p]
    if presets:
        out["generation"] = []
        with tempfile.TemporaryDirectory(prefix="rlfleet-bench-") as tmp:
            for preset in presets:
                log(f"(a) generation, {preset} model")
                out["generation"].append(bench_generation(preset, Path(tmp), args))
    if args.params > 0:
        out["weight_update"] = bench_weights(
            int(args.params),
            max(1, args.weight_repeats),
            adopt=not args.copy_apply,
            bucket_bytes=int(args.bucket_bytes),
        )
    if args.push_params > 0:
        out["trainer_push"] = bench_trainer_push(
            int(args.push_params), max(1, args.weight_repeats), args.threads
        )
    out["host"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
