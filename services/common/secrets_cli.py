"""`rlfleet secrets`: make, rotate and inspect a cluster's credentials and TLS material.

::

    rlfleet secrets init --dir secrets/            # one token per role (0600 files in a 0700 dir)
    rlfleet secrets rotate --dir secrets/          # new tokens; restart the services to use them
    rlfleet secrets tls --dir tls/ --host 10.0.0.5 --host node1   # a CA and one cert (openssl)

A service reads its role's file from ``RLFLEET_CREDENTIALS=secrets/<role>.json``;
Prometheus reads ``secrets/observer.token``. See docs/security.md.
"""

from __future__ import annotations

import argparse
import ipaddress
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from rlfleet.common import cli_args
from rlfleet.common.auth import TLS_SERVER_NAME, write_credential_set
from rlfleet.common.roles import PRINCIPALS

__all__ = ["add_arguments", "make_tls", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="secrets_command", metavar="ACTION", required=True)
    init = sub.add_parser("init", help="write a new credential set (refuses to overwrite)")
    init.add_argument("--dir", required=True, help="directory to write (made 0700)")
    init.add_argument(
        "--if-missing",
        action="store_true",
        help="succeed without writing when the directory already holds a set (init containers)",
    )
    init.add_argument(
        "--tls-host",
        action="append",
        default=None,
        metavar="HOST",
        help="also make TLS material in DIR/tls for these hosts (see `tls`)",
    )
    rotate = sub.add_parser("rotate", help="replace a credential set with new tokens")
    rotate.add_argument("--dir", required=True)
    tls = sub.add_parser("tls", help="a CA and a server/client certificate for the hosts")
    tls.add_argument("--dir", required=True)
    tls.add_argument(
        "--host",
        action="append",
        default=[],
        help="name or IP the services are dialed at (repeatable; 127.0.0.1 and localhost "
        "are always included)",
    )
    tls.add_argument("--days", type=cli_args.positive_int, default=365)


def run(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    if args.secrets_command == "init":
        if any((root / f"{role}.json").exists() for role in PRINCIPALS):
            if args.if_missing:
                print(f"{root} already holds credentials: kept")
                return 0
            print(
                f"rlfleet secrets init: {root} already holds credentials; use "
                "`rlfleet secrets rotate` to replace them",
                file=sys.stderr,
            )
            return 1
        write_credential_set(root)
        print(f"wrote credentials for {', '.join(PRINCIPALS)} to {root}")
        if args.tls_host is not None:
            make_tls(root / "tls", args.tls_host)
            print(f"wrote a CA and a certificate to {root / 'tls'}")
        return 0
    if args.secrets_command == "rotate":
        if not any((root / f"{role}.json").is_file() for role in PRINCIPALS):
            print(
                f"rlfleet secrets rotate: {root} holds no credential set to rotate; "
                "make one with `rlfleet secrets init`",
                file=sys.stderr,
            )
            return 1
        write_credential_set(root)
        print(f"rotated credentials in {root}: restart every service of the cluster")
        return 0
    try:
        paths = make_tls(root, args.host, days=args.days)
    except (OSError, subprocess.CalledProcessError, ValueError) as e:
        print(f"rlfleet secrets tls: {e}", file=sys.stderr)
        return 1
    print("\n".join(f"{k}: {v}" for k, v in paths.items()))
    print(f"every certificate also names {TLS_SERVER_NAME!r} (RLFLEET_TLS_SERVER_NAME)")
    return 0


def make_tls(directory: str | Path, hosts: list[str], *, days: int = 365) -> dict[str, Path]:
    """A self-signed CA and one certificate (server and client use) for ``hosts``.

    Returns:
        ``{"ca": ..., "cert": ..., "key": ...}``: give ``RLFLEET_TLS_CA``,
        ``RLFLEET_TLS_CERT`` and ``RLFLEET_TLS_KEY`` (or ``security.tls.*``) these.

    Raises:
        OSError: no ``openssl`` on PATH.
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        raise OSError("the openssl command is needed to make certificates")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o700)
    # TLS_SERVER_NAME is in every certificate: clients that dial replicas by
    # addresses no certificate can list (container ids, DHCP) verify this name.
    names = ["127.0.0.1", "localhost", TLS_SERVER_NAME, *hosts]
    san = []
    for name in dict.fromkeys(names):
        try:
            ipaddress.ip_address(name)
            san.append(f"IP:{name}")
        except ValueError:
            san.append(f"DNS:{name}")
    ca_key, ca, key, cert = (root / n for n in ("ca.key", "ca.pem", "cert.key", "cert.pem"))

    def ssl(*argv: str) -> None:
        subprocess.run([openssl, *argv], check=True, capture_output=True, timeout=60)

    ssl("genrsa", "-out", str(ca_key), "2048")
    ssl(
        "req", "-x509", "-new", "-key", str(ca_key), "-sha256", "-days", str(days),
        "-subj", "/CN=rlfleet cluster CA", "-out", str(ca),
    )  # fmt: skip
    ssl("genrsa", "-out", str(key), "2048")
    with tempfile.TemporaryDirectory() as tmp:
        csr, ext = Path(tmp) / "cert.csr", Path(tmp) / "ext.cnf"
        ext.write_text(
            f"subjectAltName={','.join(san)}\n"
            "extendedKeyUsage=serverAuth,clientAuth\n"
            "basicConstraints=CA:FALSE\n"
        )
        ssl("req", "-new", "-key", str(key), "-subj", "/CN=rlfleet", "-out", str(csr))
        ssl(
            "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
            "-CAcreateserial", "-days", str(days), "-sha256", "-extfile", str(ext),
            "-out", str(cert),
        )  # fmt: skip
    for path in (ca_key, key):
        path.chmod(0o600)
    return {"ca": ca, "cert": cert, "key": key}
