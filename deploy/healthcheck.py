"""Container health check: exit 0 iff a gRPC server answers SERVING.

    rlfleet-healthcheck HOST:PORT      # that server
    rlfleet-healthcheck                # every TCP port PID 1 listens on, until one answers

The second form is for services started with ``--port 0`` (rollout replicas under
``docker compose up --scale`` with host networking, where ports must not collide):
the ports are read from /proc (PID 1's socket inodes matched against
/proc/net/tcp{,6}), so nothing has to record them.

gRPC health needs no token, but a server with TLS on takes only TLS connections (and
with mTLS only clients with a certificate): the check dials with the container's own
``RLFLEET_TLS_CA`` / ``_CERT`` / ``_KEY`` and ``RLFLEET_TLS_SERVER_NAME``, as the
service does.
"""

from __future__ import annotations

import os
import sys

from rlfleet.common.rpc import TLSConfig, check_health, create_channel, tls_from_env

_LISTEN = "0A"


def _listening_ports(pid: int = 1) -> list[int]:
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == _LISTEN and cols[9] in inodes:
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def client_tls() -> TLSConfig | None:
    """The TLS a client of this container's service dials with (None: plaintext)."""
    tls = tls_from_env(os.environ)
    if tls is None:
        return None
    return TLSConfig(
        cert=tls.cert, key=tls.key, ca=tls.ca, server_name_override=tls.server_name_override
    )


def healthy(address: str, timeout_s: float = 3.0) -> bool:
    channel = create_channel(address, tls=client_tls(), retry_unavailable=False)
    try:
        return check_health(channel, timeout_s=timeout_s)
    finally:
        channel.close()


def main(argv: list[str]) -> int:
    addresses = argv or [f"127.0.0.1:{p}" for p in _listening_ports()]
    for address in addresses:
        if healthy(address):
            return 0
    print(f"no SERVING gRPC server at {addresses}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
