"""The TCP transport of the bulk plane: a raw byte stream, one connection per transfer.

The replica's plan names ``host:port`` of a one-shot listener and a one-time token.
The sender connects, writes the token, then every tensor's bytes in offer order
straight from the tensors' own storage (no copy: ``sendmsg`` gathers up to 4 MiB
from many tensors per call, so a model of many small tensors costs one system
call per few MiB, not one per tensor), shuts its side
down and waits for the replica to close. The replica reads into its staging
buffer with ``recv_into`` (no copy beyond the kernel's) and publishes the count of
bytes received, which its verifier thread follows
(:class:`rlfleet.weightsync.checksum.StreamVerifier`).

**Who may connect.** The listener keeps up to :data:`MAX_PENDING_CONNECTIONS` at
once, each given ``token_timeout_s`` (:data:`TOKEN_TIMEOUT_S`) to send the token as
its first bytes: a wrong token, a close or silence drops that connection alone,
and the first with the right token is the data connection (the listener and every
other connection close then). One more connection drops the oldest waiting one of
the address that holds the most places, so strangers that connect and stall,
however many, cannot hold the real sender up (it sends its token as soon as it
connects), and a flood from fewer other addresses than there are places cannot push
it out while it is still in its TLS handshake (one from as many addresses, one
connection each, still can); one that connects after the sender is refused.

**TLS.** Where the cluster runs with TLS, so does this transport: the listener
wraps each connection in the replica's server context (client certificates
required under mTLS) and the sender verifies the replica's certificate and
presents its own, so the token and the model never cross the network in clear.
The handshake counts against the same ``token_timeout_s``. TLS has no ``sendmsg``:
the sender writes each block with ``sendall``, and the receiver reads a record
(16 KiB) per ``recv_into``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import logging
import selectors
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from rlfleet.common.codec.batch import TensorSpec
from rlfleet.weightsync.checksum import CrcThread, SourceCrcs, as_u8, tensor_bytes
from rlfleet.weightsync.wire import TransferPlan

__all__ = [
    "MAX_PENDING_CONNECTIONS",
    "TOKEN_TIMEOUT_S",
    "TcpUnreachable",
    "TransferWatch",
    "accept_sender",
    "endpoint_of",
    "open_listener",
    "receive",
    "send_tcp",
]

logger = logging.getLogger(__name__)

#: Seconds a connection has to present the one-time token before it is dropped.
TOKEN_TIMEOUT_S = 5.0
#: Connections waiting to present their token at once; more are closed at once.
MAX_PENDING_CONNECTIONS = 16
# Sender: bytes per ``sendmsg``, gathered from one or many tensors (1, 4 and 8 MiB
# measured alike; the socket buffers are the kernel's, autotuned: fixing them at
# 8 MiB with SO_SNDBUF / SO_RCVBUF measured slower on loopback).
_SEND_BLOCK = 4 << 20
# Sender: buffers per ``sendmsg`` at most (below every platform's IOV_MAX).
_IOV = 512
# Receiver: largest single read into the staging buffer.
_BLOCK = 16 << 20
# Sender: seconds to connect (a reachable endpoint answers in milliseconds; an
# unreachable one should not hold the push up for the whole transfer time-out).
_CONNECT_TIMEOUT_S = 10.0
# Sender: bytes the receiver may send back before it closes (read and dropped).
_DRAIN_BYTES = 1 << 20
# Listener: longest wait between looks at the transfer's stop flag.
_ACCEPT_POLL_S = 0.25


# --------------------------------------------------------------------- sender side


class TcpUnreachable(OSError):
    """The plan's endpoint could not be connected to (nothing was sent)."""


def send_tcp(
    plan: TransferPlan,
    named_tensors: Mapping[str, Any],
    specs: Sequence[TensorSpec],
    *,
    timeout_s: float = 600.0,
    crcs: SourceCrcs | None = None,
    tls: ssl.SSLContext | None = None,
    server_name: str | None = None,
    watch: TransferWatch | None = None,
) -> list[int]:
    """Connect to the plan's endpoint, present the token, stream the bytes in order.

    Args:
        crcs: the bucket's checksums, shared by every replica it goes to; None: this
            transfer's own. When this transfer claims them, a :class:`CrcThread`
            checksums each block right after it is sent.
        tls: a client context: the connection is TLS, the replica's certificate
            verified against ``server_name`` (None: the endpoint's host).
        watch: told the bytes sent as they go, and holds the socket while the
            transfer runs, so that another thread can cut it (a replica given up).

    Raises:
        TcpUnreachable: nothing listens at the endpoint (nothing was sent).
        ssl.SSLError: the TLS handshake failed (a certificate that does not verify,
            or a listener without TLS); nothing of the token or the data was sent.

    Returns:
        The CRC-32C of each tensor, in ``specs`` order (for the commit).
    """
    arrays = [as_u8(tensor_bytes(named_tensors[s.name])) for s in specs]
    checksums = SourceCrcs(arrays) if crcs is None else crcs
    follower = CrcThread(len(specs)) if checksums.claim() else None
    try:
        host, _, port = plan.endpoint.rpartition(":")
        try:
            sock = socket.create_connection(
                (host.strip("[]"), int(port)), timeout=min(timeout_s, _CONNECT_TIMEOUT_S)
            )
        except OSError as e:
            raise TcpUnreachable(f"cannot connect to {plan.endpoint}: {e}") from e
        try:
            sock.settimeout(timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:  # the plain socket is detached into the TLS one
                sock = tls.wrap_socket(sock, server_hostname=server_name or host.strip("[]"))
            send = _send_all if tls is None else _send_each
            if watch is not None:
                watch.hold(sock)
            for batch in _batches(arrays, plan.token.encode()):
                send(sock, [b for _, b in batch])
                if watch is not None:
                    watch.moved(sum(memoryview(b).nbytes for _, b in batch))
                if follower is not None:
                    follower.put([(i, b) for i, b in batch if i >= 0])
            # Over TLS this drops the TLS layer (no close_notify: the receiver counts
            # the bytes it expects and checksums them, so a cut is caught anyway).
            sock.shutdown(socket.SHUT_WR)
            # Wait for the receiver to close: it has everything once it does (what it
            # may still send, such as TLS records, is read and dropped, a bounded amount).
            drained = 0
            while drained <= _DRAIN_BYTES and (part := sock.recv(1 << 16)):
                drained += len(part)
        finally:
            if watch is not None:
                watch.hold(None)
            sock.close()
        if follower is not None:
            checksums.publish(follower.result())
            follower = None
        return checksums.result(timeout_s)
    finally:
        if follower is not None:  # failed: others waiting for the values compute them
            follower.close()
            checksums.abandon()
        if crcs is None:
            checksums.close()


class TransferWatch:
    """A sender's view of its transfers in progress, for another thread: the bytes
    moved so far (:attr:`bytes`, as progress) and a way to :meth:`cut` the socket of
    the one running, which unblocks a send to a peer that stopped reading."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._cut = False
        self.bytes = 0

    def moved(self, nbytes: int) -> None:
        self.bytes += nbytes

    def hold(self, sock: socket.socket | None) -> None:
        with self._lock:
            self._sock = sock
            cut = self._cut and sock is not None
        if cut:  # cut before this socket existed
            self._shutdown(sock)

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            sock = self._sock
        if sock is not None:
            self._shutdown(sock)

    @staticmethod
    def _shutdown(sock: socket.socket | None) -> None:
        if sock is not None:
            with contextlib.suppress(OSError, ValueError):
                sock.shutdown(socket.SHUT_RDWR)


def _batches(arrays: Sequence[np.ndarray], head: bytes) -> Iterator[list[tuple[int, Any]]]:
    """Lists of ``(tensor index, buffer)`` of about :data:`_SEND_BLOCK` bytes in all:
    large tensors cut into blocks, small ones gathered, in order; ``head`` (index -1)
    goes first."""
    batch: list[tuple[int, Any]] = [(-1, head)]
    size = len(head)
    for index, a in enumerate(arrays):
        for i in range(0, a.nbytes, _SEND_BLOCK):
            piece = a[i : i + _SEND_BLOCK]
            batch.append((index, piece))
            size += piece.nbytes
            if size >= _SEND_BLOCK or len(batch) >= _IOV:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


def _send_all(sock: socket.socket, buffers: list[Any]) -> None:
    """``sendmsg`` until every byte of ``buffers`` is sent (a call may send part)."""
    views = [memoryview(b) for b in buffers]
    first = 0
    while first < len(views):
        sent = sock.sendmsg(views[first:] if first else views)
        while first < len(views) and sent >= views[first].nbytes:
            sent -= views[first].nbytes
            first += 1
        if sent:
            views[first] = views[first][sent:]


def _send_each(sock: socket.socket, buffers: list[Any]) -> None:
    """``sendall`` of each buffer in turn (a TLS socket has no ``sendmsg``)."""
    for b in buffers:
        sock.sendall(b)


# --------------------------------------------------------------------- receiver side


def open_listener(host: str, timeout_s: float) -> socket.socket:
    """A listener on an ephemeral port of ``host`` for one transfer."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(MAX_PENDING_CONNECTIONS)
        listener.settimeout(timeout_s)
    except BaseException:
        listener.close()
        raise
    return listener


def endpoint_of(listener: socket.socket) -> str:
    """The plan's ``endpoint`` for ``listener``: ``host:port`` (``[host]:port`` for IPv6)."""
    host, port = listener.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclasses.dataclass
class _Waiting:
    """A connection that has not presented the token yet."""

    due: float  # ``time.monotonic()`` by which it must have
    peer: str  # the address it came from
    got: bytearray = dataclasses.field(default_factory=bytearray)  # the token so far
    handshaking: bool = False  # TLS: the handshake is not done yet


def accept_sender(
    listener: socket.socket,
    token: str,
    *,
    deadline: float,
    token_timeout_s: float,
    stop: threading.Event,
    label: str,
    tls: ssl.SSLContext | None = None,
) -> socket.socket | None:
    """Accept connections until one presents ``token`` as its first bytes and return
    it (blocking, with the rest of the token read); None if ``stop`` is set or
    ``deadline`` (``time.monotonic()``) passes first. Connections wait concurrently,
    each for ``token_timeout_s`` at most: one that sends a wrong token, closes, or
    stays silent is dropped alone. With ``tls`` (a server context) each connection
    completes a TLS handshake first, within the same time, and the token is read
    through it; one that fails the handshake is dropped alone."""
    expected = token.encode()
    waiting: dict[socket.socket, _Waiting] = {}
    listener.setblocking(False)
    with selectors.DefaultSelector() as sel:
        sel.register(listener, selectors.EVENT_READ)
        try:
            while not stop.is_set():
                now = time.monotonic()
                if now >= deadline:
                    return None
                for conn, w in list(waiting.items()):
                    if now >= w.due:
                        logger.warning(
                            "transfer %s: connection without the token within %.1fs dropped",
                            label,
                            token_timeout_s,
                        )
                        _drop_conn(sel, waiting, conn)
                wake = min([deadline, *(w.due for w in waiting.values())])
                events = sel.select(min(_ACCEPT_POLL_S, max(0.0, wake - now)))
                for key, _ in events:
                    if key.fileobj is listener:
                        _accept_one(listener, sel, waiting, token_timeout_s, label, tls)
                        continue
                    peer = key.fileobj
                    assert isinstance(peer, socket.socket)
                    w = waiting[peer]
                    state = _handshake(peer, label) if w.handshaking else "token"
                    if state == "done":
                        w.handshaking = False
                        state = "token"
                    if state == "token":  # (the TLS layer may hold it already)
                        state = _read_token(peer, w.got, expected, label)
                    if state == "token":
                        del waiting[peer]
                        sel.unregister(peer)
                        peer.setblocking(True)
                        return peer
                    if state == "drop":
                        _drop_conn(sel, waiting, peer)
            return None
        finally:
            for conn in list(waiting):
                _drop_conn(sel, waiting, conn)


def _accept_one(
    listener: socket.socket,
    sel: selectors.BaseSelector,
    waiting: dict[socket.socket, _Waiting],
    token_timeout_s: float,
    label: str,
    tls: ssl.SSLContext | None,
) -> None:
    try:
        conn, address = listener.accept()
    except (BlockingIOError, InterruptedError):
        return
    peer = str(address[0])
    if len(waiting) >= MAX_PENDING_CONNECTIONS:
        victim = _victim(waiting, peer)
        logger.warning(
            "transfer %s: %d connections wait to present the token: the oldest from %s dropped",
            label,
            len(waiting),
            waiting[victim].peer,
        )
        _drop_conn(sel, waiting, victim)
    conn.setblocking(False)
    if tls is not None:
        try:
            conn = tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        except (OSError, ValueError) as e:
            logger.warning("transfer %s: connection dropped before TLS: %s", label, e)
            conn.close()
            return
    waiting[conn] = _Waiting(
        due=time.monotonic() + token_timeout_s, peer=peer, handshaking=tls is not None
    )
    sel.register(conn, selectors.EVENT_READ)


def _victim(waiting: dict[socket.socket, _Waiting], newcomer: str) -> socket.socket:
    """The waiting connection to drop for a newcomer from ``newcomer`` when every place
    is taken: the oldest of the address with the most places (the newcomer counted).
    Not the newcomer: strangers that connect early and stall would keep the real
    sender out. Not the oldest of all: a flood from elsewhere would push out a sender
    that is still in its TLS handshake (a round trip at least). Where every address
    holds one place (a flood from as many addresses as there are places), this is
    the oldest of all again."""
    counts = Counter(w.peer for w in waiting.values())
    counts[newcomer] += 1
    most = max(counts.values())
    crowded = [c for c, w in waiting.items() if counts[w.peer] == most]
    return min(crowded or waiting, key=lambda c: waiting[c].due)


def _handshake(conn: socket.socket, label: str) -> Literal["done", "wait", "drop"]:
    """Advance a non-blocking server-side TLS handshake."""
    assert isinstance(conn, ssl.SSLSocket)
    try:
        conn.do_handshake()
    except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
        # (Wanting to write: the kernel's send buffer is full mid-handshake, which a
        # few KiB of handshake cannot make happen but a stalled peer: its time runs.)
        return "wait"
    except (OSError, ValueError) as e:
        logger.warning("transfer %s: TLS handshake failed: %s", label, e)
        return "drop"
    return "done"


def _read_token(
    conn: socket.socket, got: bytearray, token: bytes, label: str
) -> Literal["token", "wait", "drop"]:
    """Read more of what ``conn`` sent of its first ``len(token)`` bytes (into
    ``got``): ``"token"`` once they are the token, ``"wait"`` while they may still
    be, ``"drop"`` for a wrong token, a close or an error."""
    while len(got) < len(token):
        try:
            part = conn.recv(len(token) - len(got))
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return "wait"
        except OSError as e:
            logger.warning("transfer %s: connection failed before its token: %s", label, e)
            return "drop"
        if not part:
            return "drop"
        got += part
    if hmac.compare_digest(bytes(got), token):
        return "token"
    logger.warning("transfer %s: connection with a wrong token dropped", label)
    return "drop"


def _drop_conn(
    sel: selectors.BaseSelector,
    waiting: dict[socket.socket, _Waiting],
    conn: socket.socket,
) -> None:
    waiting.pop(conn, None)
    with contextlib.suppress(KeyError, ValueError):
        sel.unregister(conn)
    with contextlib.suppress(OSError):
        conn.close()


def receive(
    conn: socket.socket,
    buffer: np.ndarray,
    *,
    deadline: float,
    on_bytes: Callable[[int], None],
    stop: threading.Event | None = None,
) -> str:
    """Read ``len(buffer)`` bytes from the data connection into ``buffer`` (uint8),
    calling ``on_bytes(received so far)`` after each read. Returns "" when exactly
    that many arrived, else what went wrong (the sender closed early, or sent more,
    or was still sending at ``deadline`` or when ``stop`` was set: the transfer was
    dropped, and its connection goes with it)."""
    total = buffer.nbytes
    received = 0
    view = buffer.data  # a memoryview of the array, released below
    try:
        while received < total:
            left = deadline - time.monotonic()
            if left <= 0:  # a sender that trickles does not keep the transfer past it
                return f"the transfer's time-out passed after {received} of {total} bytes"
            if stop is not None and stop.is_set():
                return f"the transfer was dropped after {received} of {total} bytes"
            conn.settimeout(max(0.05, min(left, 1.0)))
            try:
                n = conn.recv_into(view[received : received + _BLOCK])
            except TimeoutError:
                continue  # a quiet second: look at the deadline and the stop again
            if n == 0:
                break
            received += n
            on_bytes(received)
    finally:
        view.release()
    if received < total:
        return f"sender closed after {received} of {total} bytes"
    conn.settimeout(max(0.05, deadline - time.monotonic()))  # its end of the stream
    if conn.recv(1):
        return f"sender sent more than the {total} bytes offered"
    return ""
