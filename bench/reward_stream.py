"""ScoreStream vs Score on the same samples: prints one JSON object.

A reward service on 127.0.0.1 (in this process, auth on); ``--samples`` GSM8K-shaped
rule samples sent (a) as one ``Score`` call per ``--batch-size`` samples, in turn (the
baseline), (b) as one ``ScoreStream`` of those batches with ``pack_results`` (what
``RemoteRewardClient.score_stream`` sends), (c) the same stream without it (one message
per result, what a client written before it gets). Medians of ``--repeats`` after one
warm-up, the three interleaved. ``packed_vs_score`` near 1 means streaming costs
nothing over plain calls.

    python bench/reward_stream.py [--samples 2001] [--batch-size 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from rlfleet.reward.client import RemoteRewardClient
from rlfleet.reward.serde import sample_to_proto
from rlfleet.reward.server import start_reward_service
from rlfleet.reward.types import Sample
from rlfleet.v1 import reward_pb2, reward_pb2_grpc

TOKEN = "bench-reward-stream-token"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=2001)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    samples = [
        Sample("openai/gsm8k", f"so the answer is\n#### {i % 7}", str(i % 5))
        for i in range(args.samples)
    ]
    batches = [samples[i : i + args.batch_size] for i in range(0, len(samples), args.batch_size)]
    requests = [reward_pb2.ScoreRequest(samples=[sample_to_proto(s) for s in b]) for b in batches]
    metadata = [("authorization", f"Bearer {TOKEN}")]
    with (
        start_reward_service(auth_token=TOKEN) as svc,
        RemoteRewardClient(svc.address, auth_token=TOKEN) as client,
    ):
        from rlfleet.common.rpc import create_channel

        channel = create_channel(svc.address)
        stub = reward_pb2_grpc.RewardServiceStub(channel)

        def score() -> int:
            return sum(len(client.score(b)) for b in batches)

        def packed() -> int:
            return sum(1 for _ in client.score_stream(batches))

        def unpacked() -> int:
            return sum(1 for _ in stub.ScoreStream(iter(requests), metadata=metadata, timeout=120))

        methods: dict[str, Callable[[], int]] = {
            "score": score,
            "stream_packed": packed,
            "stream_one_per_message": unpacked,
        }
        times: dict[str, list[float]] = {k: [] for k in methods}
        for fn in methods.values():
            assert fn() == len(samples)
        for _ in range(args.repeats):
            for name, fn in methods.items():
                t0 = time.perf_counter()
                assert fn() == len(samples)
                times[name].append(time.perf_counter() - t0)
        channel.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    out: dict[str, Any] = {
        "samples": len(samples),
        "batch_size": args.batch_size,
        "seconds": {k: round(v, 4) for k, v in med.items()},
        "samples_per_s": {k: round(len(samples) / v) for k, v in med.items()},
        "packed_vs_score": round(med["score"] / med["stream_packed"], 3),
        "packed_vs_one_per_message": round(med["stream_one_per_message"] / med["stream_packed"], 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
