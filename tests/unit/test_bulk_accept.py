"""Who the bulk TCP listener lets in while it waits for the sender's token
(:func:`rlfleet.weightsync.tcp.accept_sender`): real sockets on loopback addresses."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from rlfleet.weightsync import tcp

TOKEN = "k" * 32
#: Long enough that no connection is dropped for silence while a test runs: every
#: close a test sees is the listener making room.
PATIENCE_S = 60.0


def _connect(port: int, source: str) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(PATIENCE_S)
    try:
        s.bind((source, 0))
    except OSError as e:
        s.close()
        pytest.skip(f"cannot use the loopback address {source} on this host: {e}")
    try:
        s.connect(("127.0.0.1", port))
    except BaseException:
        s.close()
        raise
    return s


def _closed_by_listener(s: socket.socket, within_s: float) -> bool:
    """True once the listener closed ``s``; False if it is still open after
    ``within_s`` (the listener makes room at once: a short wait says "still open",
    a long one leaves a loaded machine time to say "closed")."""
    s.settimeout(within_s)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    finally:
        s.settimeout(PATIENCE_S)


class _Accepting:
    """``accept_sender`` in a thread on a fresh listener of 127.0.0.1."""

    def __init__(self) -> None:
        self.listener = tcp.open_listener("127.0.0.1", 30)
        self.port = self.listener.getsockname()[1]
        self.stop = threading.Event()
        self.got: list[socket.socket | None] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.got.append(
            tcp.accept_sender(
                self.listener,
                TOKEN,
                deadline=time.monotonic() + PATIENCE_S,
                token_timeout_s=PATIENCE_S,
                stop=self.stop,
                label="test",
            )
        )

    def result(self) -> socket.socket | None:
        self._thread.join(PATIENCE_S + 10)
        assert not self._thread.is_alive()
        return self.got[0]

    def close(self) -> None:
        self.stop.set()
        self._thread.join(PATIENCE_S + 10)
        for conn in self.got:
            if conn is not None:
                conn.close()
        self.listener.close()


def test_a_flood_from_another_address_does_not_push_out_a_sender_mid_handshake() -> None:
    """The sender has connected but not yet sent its token (as while its TLS handshake
    runs); more stalled connections than the listener keeps then arrive from another
    address. Each newcomer drops the oldest of the crowded address, not the sender,
    which gets in once its token arrives. (Before: the oldest of all went, the
    sender first.)"""
    acc = _Accepting()
    flood: list[socket.socket] = []
    sender = _connect(acc.port, "127.0.0.1")
    try:
        time.sleep(0.2)  # accepted first, as a sender that connected first would be
        flood = [_connect(acc.port, "127.0.0.2") for _ in range(tcp.MAX_PENDING_CONNECTIONS + 8)]
        assert _closed_by_listener(flood[0], 30)  # dropped: its address held the most places
        assert not _closed_by_listener(flood[-1], 2)  # the newest stays
        sender.sendall(TOKEN.encode())
        conn = acc.result()
        assert conn is not None, "the sender was pushed out by the flood"
        conn.settimeout(30)
        sender.sendall(b"data")
        assert conn.recv(4) == b"data"  # the connection handed back is the sender's
    finally:
        sender.close()
        for s in flood:
            s.close()
        acc.close()


def test_strangers_from_the_senders_own_address_drop_the_oldest() -> None:
    """All from one address: each newcomer drops the oldest waiting one (checked before
    the sender comes, while the others wait), so stalled strangers that came first
    cannot keep out a sender that comes later."""
    acc = _Accepting()
    strangers = [_connect(acc.port, "127.0.0.1") for _ in range(tcp.MAX_PENDING_CONNECTIONS + 2)]
    sender = None
    try:
        assert _closed_by_listener(strangers[0], 30) and _closed_by_listener(strangers[1], 30)
        assert not _closed_by_listener(strangers[2], 2)
        sender = _connect(acc.port, "127.0.0.1")
        sender.sendall(TOKEN.encode())
        assert acc.result() is not None
    finally:
        if sender is not None:
            sender.close()
        for s in strangers:
            s.close()
        acc.close()
