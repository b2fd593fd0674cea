"""Reward service throughput: GSM8K rule scoring through gRPC vs in-process.

Prints one JSON object:

* ``in_process``: the GSM8K scorer called in a loop in this process (one thread),
  samples/s — the ceiling a caller gets without the service. Measured before and
  after the service run; the faster of the two is the baseline, so a moment of
  load from other work on the machine cannot flatter the ratio.
* ``service``: ``--clients`` threads each sending batches of ``--batch-size``
  samples to a reward service started as a separate process (``rlfleet serve
  reward``, port 0), samples/s over all clients, and per-request latency p50/p99.
  Requests are built once per client, so the figure is the service's cost.
* ``ratio`` = service / in-process, and whether the targets (ratio >= 0.8,
  p99 < 50 ms) are met.

Responses are the 1,319 GSM8K test solutions (``$RLFLEET_DATA_DIR`` or
``../shared/data``); without the file, synthetic ones of the same shape.

    python bench/reward.py [--clients 8] [--batch-size 256] [--seconds 5] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
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


def start_service(workers: int) -> tuple[subprocess.Popen[str], str]:
    code = "import sys; from rlfleet.reward.server import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            "--port=0",
            f"-o=reward.num_workers={workers}",
            "--log-level=WARNING",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("{") and json.loads(line).get("event") == "serving":
            return proc, json.loads(line)["address"]
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError("reward service did not start")


def bench_service(
    address: str, pairs: list[tuple[str, str]], batch: int, clients: int, seconds: float
) -> dict[str, Any]:
    from rlfleet.common.rpc import create_channel
    from rlfleet.v1 import reward_pb2, reward_pb2_grpc

    def request(k: int) -> Any:
        req = reward_pb2.ScoreRequest()
        for j in range(batch):
            response, truth = pairs[(k * batch + j) % len(pairs)]
            s = req.samples.add(data_source="openai/gsm8k", response=response)
            s.ground_truth.string_value = truth
        return req

    latencies: list[float] = []
    scored = [0] * clients
    wrong = [0] * clients
    lock = threading.Lock()
    go = threading.Event()
    stop_at = [0.0]

    def client(k: int) -> None:
        channel = create_channel(address)
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        req = request(k)
        stub.Score(req, timeout=30)  # warm-up: connection and workers
        mine: list[float] = []
        go.wait()
        while time.perf_counter() < stop_at[0]:
            t = time.perf_counter()
            resp = stub.Score(req, timeout=30)
            mine.append(time.perf_counter() - t)
            scored[k] += len(resp.results)
            wrong[k] += sum(r.score != 1.0 for r in resp.results)
        channel.close()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    start = time.perf_counter()
    stop_at[0] = start + seconds
    go.set()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return {
        "samples_per_s": sum(scored) / wall,
        "requests": len(latencies),
        "latency_ms": {
            "p50": 1000 * statistics.median(latencies),
            "p99": 1000 * percentile(latencies, 99),
            "max": 1000 * max(latencies),
        },
        "wrong_scores": sum(wrong),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--workers", type=int, default=2, help="reward.num_workers")
    args = parser.parse_args()
    pairs, source = load_samples()
    in_process_s = min(args.seconds, 3.0) / 2
    before = bench_in_process(pairs, args.batch_size, in_process_s)
    proc, address = start_service(args.workers)
    try:
        service = bench_service(address, pairs, args.batch_size, args.clients, args.seconds)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    after = bench_in_process(pairs, args.batch_size, in_process_s)
    in_process = max(before, after)
    ratio = service["samples_per_s"] / in_process
    print(
        json.dumps(
            {
                "bench": "reward",
                "data": source,
                "cpu_count": os.cpu_count(),
                "batch_size": args.batch_size,
                "clients": args.clients,
                "num_workers": args.workers,
                "in_process_samples_per_s": round(in_process, 1),
                "in_process_before_after": [round(before, 1), round(after, 1)],
                "service_samples_per_s": round(service["samples_per_s"], 1),
                "ratio": round(ratio, 3),
                "latency_ms": {k: round(v, 2) for k, v in service["latency_ms"].items()},
                "requests": service["requests"],
                "wrong_scores": service["wrong_scores"],
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
