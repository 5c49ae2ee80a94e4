"""A TCP proxy the test can pause or hang. Paused, open connections are cut and new ones
are accepted and closed at once, so clients see the service as unreachable. Hung, every
byte is swallowed and nothing answers: a client waits until its own timeout."""

from __future__ import annotations

import contextlib
import socket
import threading

from tests.services import free_port


class PausableProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.port = free_port()
        self.listener = socket.create_server(("127.0.0.1", self.port))
        self.is_paused = threading.Event()
        self.is_hung = threading.Event()
        self.lock = threading.Lock()
        self.sockets: set[socket.socket] = set()
        self.is_running = True
        threading.Thread(target=self._accept, daemon=True, name="proxy").start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def pause(self) -> None:
        self.is_paused.set()
        with self.lock:
            for sock in self.sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            self.sockets.clear()

    def resume(self) -> None:
        self.is_paused.clear()
        self.is_hung.clear()

    def hang(self) -> None:
        self.is_hung.set()

    def close(self) -> None:
        self.is_running = False
        self.pause()
        self.listener.close()

    def _accept(self) -> None:
        while self.is_running:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.is_paused.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.sockets.update((client, upstream))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                if not self.is_hung.is_set():
                    sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.close()
            with self.lock:
                self.sockets.discard(source)
                self.sockets.discard(sink)
