"""Reward service throughput: GSM8K rule scoring through gRPC vs in-process.

Prints one JSON object:

* ``in_process``: the GSM8K scorer called in a loop in this process (one thread),
  samples/s — the ceiling a caller gets without the service. Measured before and
  after the service run; the faster of the two is the baseline, so a moment of
  load from other work on the machine cannot flatter the ratio.
* ``service``: ``--clients`` client processes (fresh interpreters, so the client
  side is not held to one core by the GIL), each sending one batch of
  ``--batch-size`` samples at a time to a reward service started as a separate
  process (``rlfleet serve reward --port 0 --processes N``), samples/s over all
  clients, and per-request latency p50/p99. Requests are built once per client, so
  the figure is the service's cost. With several server processes sharing the port
  (``SO_REUSEPORT``), the kernel spreads connections, not calls, over them, so each
  client spreads its calls over ``--channels-per-client`` connections in turn.
* ``ratio`` = service / in-process, and whether the targets (ratio >= 0.8,
  p99 < 50 ms) are met.

Responses are the 1,319 GSM8K test solutions (``$RLFLEET_DATA_DIR`` or
``../shared/data``); without the file, synthetic ones of the same shape.

    python bench/reward.py [--clients 8] [--batch-size 256] [--seconds 5] [--workers 2]
                           [--processes 1] [--channels-per-client N]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("RLFLEET_DATA_DIR", REPO.parent / "shared" / "data"))


def load_samples() -> tuple[list[tuple[str, str]], str]:
    path = DATA / "gsm8k" / "test.jsonl"
    if path.is_file():
        pairs = []
        for line in path.read_text(encoding="utf-8").splitlines():
            answer = json.loads(line)["answer"]
            pairs.append((answer, answer.rsplit("####", 1)[1].strip()))
        return pairs, str(path)
    pairs = [
        (f"She has {i} apples and buys {i} more.\n#### {2 * i}", str(2 * i)) for i in range(1319)
    ]
    return pairs, "synthetic"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def bench_in_process(pairs: list[tuple[str, str]], batch: int, seconds: float) -> float:
    from rlfleet.reward.scorers import gsm8k

    batches = [pairs[i : i + batch] for i in range(0, len(pairs) - batch + 1, batch)]
    n = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for b in batches:
            for response, truth in b:
                gsm8k.compute_score(response, truth)
            n += len(b)
    return n / (time.perf_counter() - start)


def start_service(workers: int, processes: int) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """``rlfleet serve reward`` as a process; its serving line."""
    code = "import sys; from rlfleet.reward.server import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "RLFLEET_CREDENTIALS": str(_SECRETS / "reward.json")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            "--port=0",
            f"-o=reward.num_workers={workers}",
            f"--processes={processes}",
            "--log-level=WARNING",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("{") and json.loads(line).get("event") == "serving":
            event: dict[str, Any] = json.loads(line)
            return proc, event
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError("reward service did not start")


def stop_service(proc: subprocess.Popen[str]) -> int | None:
    """SIGTERM, as a supervisor would; the exit code (None: had to be killed)."""
    proc.terminate()
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def run_client(
    k: int,
    address: str,
    pairs: list[tuple[str, str]],
    batch: int,
    channels: int,
    seconds: float,
    barrier: Any,
    results: Any,
) -> None:
    """One client process: warm up, wait for the others, send batches for ``seconds``."""
    from rlfleet.common.rpc import client_security_from_env, create_channel, set_security

    set_security(client_security_from_env())  # the driver's credential (see main)
    from rlfleet.v1 import reward_pb2, reward_pb2_grpc

    req = reward_pb2.ScoreRequest()
    for j in range(batch):
        response, truth = pairs[(k * batch + j) % len(pairs)]
        s = req.samples.add(data_source="openai/gsm8k", response=response)
        s.ground_truth.string_value = truth
    # A local subchannel pool per channel: its own TCP connection, so with several
    # server processes on the port the kernel can hand each to a different one.
    opened = [
        create_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(channels)
    ]
    stubs = [reward_pb2_grpc.RewardServiceStub(c) for c in opened]
    for stub in stubs:
        stub.Score(req, timeout=60)  # warm-up: connections and workers
    latencies: list[float] = []
    scored = wrong = 0
    barrier.wait(timeout=300)
    stop_at = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < stop_at:
        stub = stubs[i % channels]
        i += 1
        t = time.perf_counter()
        resp = stub.Score(req, timeout=60)
        latencies.append(time.perf_counter() - t)
        scored += len(resp.results)
        wrong += sum(r.score != 1.0 for r in resp.results)
    for c in opened:
        c.close()
    results.put((k, scored, wrong, latencies))


def bench_service(
    address: str,
    pairs: list[tuple[str, str]],
    batch: int,
    clients: int,
    channels: int,
    seconds: float,
) -> dict[str, Any]:
    # spawn: fresh interpreters, no gRPC state crossing a fork.
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(clients + 1)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=run_client,
            args=(k, address, pairs, batch, channels, seconds, barrier, results),
            daemon=True,
        )
        for k in range(clients)
    ]
    for p in procs:
        p.start()
    try:
        barrier.wait(timeout=300)  # every client connected and warmed up
        start = time.perf_counter()
        done = [results.get(timeout=seconds + 120) for _ in procs]
        wall = time.perf_counter() - start
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    latencies = [t for *_, mine in done for t in mine]
    per_client = [scored / wall for _, scored, _, _ in sorted(done)]
    return {
        "samples_per_s": sum(scored for _, scored, _, _ in done) / wall,
        "per_client_samples_per_s": [round(x, 1) for x in per_client],
        "requests": len(latencies),
        "latency_ms": {
            "p50": 1000 * statistics.median(latencies),
            "p99": 1000 * percentile(latencies, 99),
            "max": 1000 * max(latencies),
        },
        "wrong_scores": sum(wrong for _, _, wrong, _ in done),
    }


# Auth is on, as in a deployment: the service gets the reward role's credential, the
# clients (this process and its client processes, through the environment) the driver's.
_SECRETS = Path(tempfile.mkdtemp(prefix="rlfleet-bench-")) / "secrets"


def _use_credentials() -> None:
    from rlfleet.common.auth import write_credential_set
    from rlfleet.common.rpc import client_security_from_env, set_security

    write_credential_set(_SECRETS)
    os.environ["RLFLEET_CREDENTIALS"] = str(_SECRETS / "driver.json")
    set_security(client_security_from_env())


def main() -> int:
    _use_credentials()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", type=int, default=8, help="client processes")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--workers", type=int, default=2, help="reward.num_workers")
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="server processes (rlfleet serve reward --processes; 0: one per core)",
    )
    parser.add_argument(
        "--channels-per-client",
        type=int,
        default=None,
        help="connections each client uses in turn; default 1 with one server "
        "process, else 4 (SO_REUSEPORT spreads connections, not calls)",
    )
    args = parser.parse_args()
    channels = args.channels_per_client or (1 if args.processes == 1 else 4)
    pairs, source = load_samples()
    load_before = os.getloadavg()[0]
    in_process_s = min(args.seconds, 3.0) / 2
    before = bench_in_process(pairs, args.batch_size, in_process_s)
    proc, serving = start_service(args.workers, args.processes)
    try:
        service = bench_service(
            serving["address"], pairs, args.batch_size, args.clients, channels, args.seconds
        )
    finally:
        service_exit = stop_service(proc)
    after = bench_in_process(pairs, args.batch_size, in_process_s)
    in_process = max(before, after)
    ratio = service["samples_per_s"] / in_process
    print(
        json.dumps(
            {
                "bench": "reward",
                "data": source,
                "cpu_count": os.cpu_count(),
                "usable_cpus": len(os.sched_getaffinity(0))
                if hasattr(os, "sched_getaffinity")
                else os.cpu_count(),
                "loadavg_1m_before": round(load_before, 2),
                "batch_size": args.batch_size,
                "clients": args.clients,
                "clients_are": "processes",
                "channels_per_client": channels,
                "server_processes": serving.get("processes", 1),
                "num_workers": args.workers,
                "in_process_samples_per_s": round(in_process, 1),
                "in_process_before_after": [round(before, 1), round(after, 1)],
                "service_samples_per_s": round(service["samples_per_s"], 1),
                "per_client_samples_per_s": service["per_client_samples_per_s"],
                "ratio": round(ratio, 3),
                "latency_ms": {k: round(v, 2) for k, v in service["latency_ms"].items()},
                "requests": service["requests"],
                "wrong_scores": service["wrong_scores"],
                "service_exit_code": service_exit,
                "targets": {"ratio": 0.8, "p99_ms": 50.0},
                "met": {
                    "ratio": ratio >= 0.8,
                    "p99_ms": service["latency_ms"]["p99"] < 50.0,
                },
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
