"""A TCP listener that accepts every connection and never sends a byte (a store or lane peer gone silent)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def silent_listener() -> Iterator[str]:
    """Yields its "127.0.0.1:port"; connections are held open (never answered) until the block ends."""
    srv = socket.create_server(("127.0.0.1", 0), backlog=16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield f"127.0.0.1:{srv.getsockname()[1]}"
    finally:
        stop.set()
        t.join(5)
        for c in held:
            c.close()
        srv.close()
