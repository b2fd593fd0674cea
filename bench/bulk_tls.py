"""What TLS costs the bulk weight plane's TCP transport. Prints one JSON object.

    .venv/bin/python bench/bulk_tls.py [--mb 256] [--repeats 5]

The same transfer (float32 tensors, ``--mb`` in all) goes from ``send_tcp`` to a
listener (``accept_sender`` + ``receive``, in a thread of the same process) over
127.0.0.1, alternately as plain TCP and as TLS with client certificates (mTLS, the
certificates ``rlfleet secrets tls`` makes). The ratio is TLS / plain in GB/s, the
medians of ``--repeats`` runs each. Checksums are computed as in a real push.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import tempfile
import threading
import time

import numpy as np
import torch

from rlfleet.common.rpc import TLSConfig
from rlfleet.common.secrets_cli import make_tls
from rlfleet.weightsync import tcp
from rlfleet.weightsync.sender import make_offer
from rlfleet.weightsync.wire import TransferPlan


def _transfer(tensors: dict[str, torch.Tensor], tls: TLSConfig | None) -> float:
    offer = make_offer(tensors, 1, ("tcp",))
    buffer = np.empty(offer.total_bytes, np.uint8)
    listener = tcp.open_listener("127.0.0.1", 60.0)
    token = secrets.token_hex(16)
    errors: list[str] = []

    def serve() -> None:
        conn = tcp.accept_sender(
            listener,
            token,
            deadline=time.monotonic() + 60,
            token_timeout_s=5.0,
            stop=threading.Event(),
            label="bench",
            tls=tls.ssl_server_context() if tls is not None else None,
        )
        listener.close()
        if conn is None:
            errors.append("no sender")
            return
        with conn:
            errors.append(
                tcp.receive(conn, buffer, deadline=time.monotonic() + 60, on_bytes=lambda n: None)
            )

    thread = threading.Thread(target=serve)
    thread.start()
    plan = TransferPlan("bench", "tcp", tcp.endpoint_of(listener), token)
    start = time.perf_counter()
    tcp.send_tcp(
        plan,
        tensors,
        offer.tensors,
        timeout_s=60,
        tls=tls.ssl_client_context() if tls is not None else None,
        server_name=tls.server_name_override if tls is not None else None,
    )
    thread.join(60)
    seconds = time.perf_counter() - start
    if errors != [""]:
        raise RuntimeError(f"transfer failed: {errors}")
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="MiB moved per transfer")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    per = (args.mb << 20) // 4 // 4
    tensors = {f"layer{i}.weight": torch.randn(per) for i in range(4)}
    nbytes = sum(t.nbytes for t in tensors.values())
    with tempfile.TemporaryDirectory() as tmp:
        files = make_tls(tmp, [])
        tls = TLSConfig(
            cert=files["cert"],
            key=files["key"],
            ca=files["ca"],
            require_client_cert=True,
            server_name_override="rlfleet",
        )
        times: dict[str, list[float]] = {"plain": [], "tls": []}
        _transfer(tensors, None)  # warm-up
        _transfer(tensors, tls)
        for i in range(args.repeats):
            times["plain"].append(_transfer(tensors, None))
            times["tls"].append(_transfer(tensors, tls))
            print(f"round {i + 1}/{args.repeats}", file=sys.stderr)
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    print(
        json.dumps(
            {
                "bytes": nbytes,
                "plain_tcp_GBps": round(gbps["plain"], 3),
                "tls_tcp_GBps": round(gbps["tls"], 3),
                "tls_over_plain": round(gbps["tls"] / gbps["plain"], 3),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
