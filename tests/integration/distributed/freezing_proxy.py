"""A TCP proxy that can freeze an upload half-way: it forwards both ways until,
once armed, the client has sent a given number of bytes; then it stops reading
from that client (the bytes after stay unsent, the connection stays open), as a
process killed in the middle of an upload leaves it. It can also cut every
connection and refuse new ones for a while (``cut``, then ``restore``): the
store unreachable, then back."""

from __future__ import annotations

import contextlib
import socket
import threading


class FreezingProxy:
    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._budget: int | None = None  # bytes the client may still send; None: no limit
        self.frozen = threading.Event()
        self._closed = threading.Event()
        self._refusing = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, after_bytes: int) -> None:
        """Freeze once clients have sent ``after_bytes`` more bytes (all clients)."""
        with self._lock:
            self._budget = after_bytes
            self.frozen.clear()

    def cut(self) -> None:
        """Close every connection through the proxy and refuse new ones (each is
        closed as soon as it is accepted) until ``restore``."""
        self._refusing.set()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def restore(self) -> None:
        """Forward new connections again (after ``cut``)."""
        self._refusing.clear()

    def close(self) -> None:
        self._closed.set()
        for sock in [self._listener, *self._sockets]:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._refusing.is_set():
                with contextlib.suppress(OSError):
                    client.close()
                continue
            server = socket.create_connection(self.target)
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, upload: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if upload:
                    with self._lock:
                        if self._budget is not None:
                            data = data[: max(0, self._budget)]
                            self._budget -= len(data)
                            if self._budget <= 0:
                                self.frozen.set()
                    if data:
                        dst.sendall(data)
                    if self.frozen.is_set():
                        self._closed.wait()  # read no more from this client
                        return
                else:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            if not upload or not self.frozen.is_set():
                for sock in (src, dst):
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
