"""The long fuzz run (``make fuzz``): thousands of hostile requests per service.

Starts each service in-process on 127.0.0.1 (port 0) with authentication on, sends
``--count`` seeded requests from the generators the test suite uses
(``tests/fuzz/fuzzlib.py``, ``tests/fuzz/targets.py``), checks health and a normal
request afterwards, and prints one JSON line per service::

    {"service": "reward", "seed": 0, "requests": 2000, "codes": {"OK": 1044, ...},
     "crashes": 0, "known_crashes": {"name": n}, "hangs": 0, "policy_violations": 0,
     "rss_growth_bytes": ..., "seconds": ..., "healthy_after": true, "failures": [...]}

``crashes`` are INTERNAL/UNKNOWN answers no known bug explains, ``known_crashes``
those explained by a reported bug (each has a strict xfail test), ``hangs`` calls
past their deadline on methods that are not legitimately long. ``rss_growth_bytes``
is this process's (servers and client share it). Exits 1 if any service had a crash,
a hang, a policy violation, failed its health check or normal request, or ran out of
``--budget-s`` before it was sent ``--count`` requests (a slow machine does not pass
with fewer requests than asked for).

Replay one request: ``--service trainer --seed S --only I`` (indices are in
``failures``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "fuzz"))

import fuzzlib  # noqa: E402
import targets  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=2000, help="requests per service")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--service", action="append", choices=targets.SERVICES, help="default: all four"
    )
    parser.add_argument("--workers", type=int, default=4, help="concurrent requests")
    parser.add_argument(
        "--budget-s", type=float, default=600.0, help="stop sending after this, per service"
    )
    parser.add_argument("--only", type=int, action="append", default=[], help="request index")
    parser.add_argument("-v", "--verbose", action="store_true", help="log the services' errors")
    args = parser.parse_args(argv)
    if args.count < 1 or args.workers < 1:
        parser.error("--count and --workers must be >= 1")
    logging.basicConfig(level=logging.WARNING if args.verbose else logging.CRITICAL)

    failed = False
    creds = fuzzlib.Credentials.fresh()
    with tempfile.TemporaryDirectory(prefix="rlfleet-fuzz-") as tmp:
        for service in args.service or targets.SERVICES:
            workdir = Path(tmp) / service
            workdir.mkdir()
            model_dir = (
                fuzzlib.model_dir_for(Path(tmp) / "tiny")
                if service in ("rollout", "trainer")
                else None
            )
            try:
                with targets.serve(service, creds, workdir, model_dir) as target:
                    report = fuzzlib.storm(
                        target,
                        seed=args.seed,
                        count=args.count,
                        workers=args.workers,
                        budget_s=args.budget_s,
                        only=args.only,
                    )
                    report.healthy_after = fuzzlib.healthy(target.address)
                    summary = report.summary()
                    try:
                        target.check()
                        summary["normal_request_after"] = "ok"
                    except Exception as e:  # reported, and the run fails
                        summary["normal_request_after"] = f"{type(e).__name__}: {e}"[:500]
            except Exception:
                traceback.print_exc()
                print(json.dumps({"service": service, "error": "the target failed"}), flush=True)
                failed = True
                continue
            print(json.dumps(summary), flush=True)
            failed |= bool(
                report.crashes
                or report.hangs
                or report.policy
                or not report.healthy_after
                or summary["normal_request_after"] != "ok"
                or (report.stopped_early and not args.only)
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
