"""A TCP proxy between scheduler processes and the PostgreSQL server, for partitions on demand.

``Proxy(("127.0.0.1", port))`` listens on a free port of 127.0.0.1 (``proxy.port``) and forwards
every connection to the server. ``freeze()`` stops forwarding in both directions without closing
anything (a partition: no FIN, no RST; the bytes wait in the buffers), ``thaw()`` resumes, and
``reset()`` ends every connection with a TCP reset. One thread runs it all (``selectors``).
"""

from __future__ import annotations

import selectors
import socket
import struct
import threading


class Proxy:
    def __init__(self, server: tuple[str, int]):
        self.server = server
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._watched: set[socket.socket] = {self._listener}
        self._peers: dict[socket.socket, socket.socket] = {}
        self._frozen = threading.Event()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._closed = False
        self._resets: list[threading.Event] = []
        self._thread = threading.Thread(target=self._run, name="tcp-proxy", daemon=True)
        self._thread.start()

    @property
    def frozen(self) -> bool:
        return self._frozen.is_set()

    def freeze(self) -> None:
        self._frozen.set()
        self._poke()

    def thaw(self) -> None:
        self._frozen.clear()
        self._poke()

    def reset(self) -> None:
        """End every connection now with a reset (RST), as a dropped NAT entry or a proxy restart."""
        done = threading.Event()
        self._resets.append(done)
        self._poke()
        done.wait(5)

    def _reset_all(self) -> None:
        with self._lock:
            socks = list(self._peers)
            self._peers.clear()
        for sock in socks:
            if sock in self._watched:
                self._selector.unregister(sock)
                self._watched.discard(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()

    def close(self) -> None:
        self._closed = True
        self._poke()
        self._thread.join(5)
        self._reset_all()
        self._listener.close()

    def _poke(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _run(self) -> None:
        while not self._closed:
            for key, _ in self._selector.select(timeout=0.5):
                sock = key.fileobj
                if sock is self._wake_r:
                    self._wake_r.recv(4096)
                elif sock is self._listener:
                    self._accept()
                elif not self._frozen.is_set():
                    self._forward(sock)  # type: ignore[arg-type]
            while self._resets:
                self._reset_all()
                self._resets.pop().set()
            self._watch_reads()

    def _watch_reads(self) -> None:
        """While frozen, read nothing and accept nothing (bytes and connections wait in the
        kernel's buffers and backlog); else watch every socket."""
        with self._lock:
            socks = [self._listener, *self._peers]
        for sock in socks:
            watched = sock in self._watched
            if self._frozen.is_set() and watched:
                self._selector.unregister(sock)
                self._watched.discard(sock)
            elif not self._frozen.is_set() and not watched:
                self._selector.register(sock, selectors.EVENT_READ)
                self._watched.add(sock)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        try:
            upstream = socket.create_connection(self.server, timeout=5)
        except OSError:
            client.close()
            return
        for one, other in ((client, upstream), (upstream, client)):
            one.setblocking(False)
            with self._lock:
                self._peers[one] = other
            self._selector.register(one, selectors.EVENT_READ)
            self._watched.add(one)

    def _forward(self, sock: socket.socket) -> None:
        with self._lock:
            other = self._peers.get(sock)
        if other is None:
            return
        try:
            data = sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            try:
                other.setblocking(True)
                other.sendall(data)
                other.setblocking(False)
                return
            except OSError:
                pass
        self._drop(sock, other)

    def _drop(self, sock: socket.socket, other: socket.socket) -> None:
        with self._lock:
            self._peers.pop(sock, None)
            self._peers.pop(other, None)
        for one in (sock, other):
            if one in self._watched:
                self._selector.unregister(one)
                self._watched.discard(one)
            one.close()
