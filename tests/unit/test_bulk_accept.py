"""Who the bulk TCP listener lets in while it waits for the sender's token
(:func:`rlfleet.weightsync.tcp.accept_sender`): real sockets on loopback addresses."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from rlfleet.weightsync import tcp

TOKEN = "k" * 32


def _connect(port: int, source: str) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(30)
    try:
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
    except OSError as e:
        s.close()
        pytest.skip(f"cannot connect from {source} on this host: {e}")
    return s


class _Accepting:
    """``accept_sender`` in a thread on a fresh listener of 127.0.0.1."""

    def __init__(self, deadline_s: float) -> None:
        self.listener = tcp.open_listener("127.0.0.1", 30)
        self.port = self.listener.getsockname()[1]
        self.stop = threading.Event()
        self.got: list[socket.socket | None] = []
        self._thread = threading.Thread(target=self._run, args=(deadline_s,), daemon=True)
        self._thread.start()

    def _run(self, deadline_s: float) -> None:
        self.got.append(
            tcp.accept_sender(
                self.listener,
                TOKEN,
                deadline=time.monotonic() + deadline_s,
                token_timeout_s=deadline_s,
                stop=self.stop,
                label="test",
            )
        )

    def result(self) -> socket.socket | None:
        self._thread.join(60)
        assert not self._thread.is_alive()
        return self.got[0]

    def close(self) -> None:
        self.stop.set()
        self._thread.join(60)
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
    acc = _Accepting(deadline_s=10)
    flood: list[socket.socket] = []
    sender = _connect(acc.port, "127.0.0.1")
    try:
        time.sleep(0.2)  # accepted first, as a sender that connected first would be
        flood = [_connect(acc.port, "127.0.0.2") for _ in range(tcp.MAX_PENDING_CONNECTIONS + 8)]
        assert flood[0].recv(1) == b""  # dropped: its address held the most places
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


def test_strangers_from_the_senders_own_address_still_drop_the_oldest() -> None:
    """All from one address: each newcomer drops the oldest waiting one, so stalled
    strangers that came first cannot keep out a sender that comes later."""
    acc = _Accepting(deadline_s=10)
    strangers = [_connect(acc.port, "127.0.0.1") for _ in range(tcp.MAX_PENDING_CONNECTIONS)]
    sender = _connect(acc.port, "127.0.0.1")
    try:
        sender.sendall(TOKEN.encode())
        assert acc.result() is not None
        assert strangers[0].recv(1) == b""
    finally:
        sender.close()
        for s in strangers:
            s.close()
        acc.close()
