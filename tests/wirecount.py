"""A counting TCP relay in front of a storage server (moto's S3): the bytes a client sent,
counted where they land.

Tests and the LoRA benchmark point a root's endpoint at the relay (127.0.0.1, its own
port); it copies each connection's bytes both ways unchanged (HTTP, keep-alive,
`Expect: 100-continue` and all) and counts them: `sent` is what clients sent the server,
request lines, headers and bodies, every request included (an upload, a copy, a listing, a
retry). So a figure taken from it is what the server received, not what nebula's own
counters say. It also keeps each request's head (`heads`: the request line and headers,
found by their Content-Length; no body), for tests that look at what was asked.

Not for: injecting faults (faultproxy.py), or speed (two threads per connection).
"""

from __future__ import annotations

import contextlib
import socket
import threading


class CountingRelay:
    """Relays 127.0.0.1:<port> to 127.0.0.1:`upstream_port`, counting the bytes each way.

    Example (not run here: it needs a server behind it):
        relay = CountingRelay(moto.port); opts = {..., "endpoint_url": relay.endpoint}
        before = relay.sent; ...; print(relay.sent - before); relay.close()
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._sent = 0
        self._received = 0
        self._open: set[socket.socket] = set()
        self._closed = False
        self.heads: list[str] = []  # each request's line and headers, in arrival order
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def endpoint(self) -> str:
        """The relay's URL (an S3 `endpoint_url`)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def sent(self) -> int:
        """Bytes clients have sent the server through the relay."""
        with self._lock:
            return self._sent

    @property
    def received(self) -> int:
        """Bytes the server has answered through the relay."""
        with self._lock:
            return self._received

    def close(self) -> None:
        """Stop accepting, and cut the connections still open."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            conns = list(self._open)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.close()

    def _serve(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=60)
        except OSError:
            client.close()
            return
        server.settimeout(None)
        with self._lock:
            self._open.update((client, server))
        back = threading.Thread(target=self._pump, args=(server, client, False), daemon=True)
        back.start()
        self._pump(client, server, True)
        back.join()
        with self._lock:
            self._open.difference_update((client, server))
        for conn in (client, server):
            with contextlib.suppress(OSError):
                conn.close()

    def _pump(self, source: socket.socket, sink: socket.socket, upstream: bool) -> None:
        """Copy `source` to `sink` until `source` ends, counting (and, upstream, keeping
        each request's head); then end `sink`'s side."""
        pending, body_left = b"", 0  # upstream: a head's start; the body bytes to pass
        try:
            while chunk := source.recv(1 << 20):
                sink.sendall(chunk)
                with self._lock:
                    if not upstream:
                        self._received += len(chunk)
                        continue
                    self._sent += len(chunk)
                while upstream and chunk:
                    if body_left:
                        taken = min(body_left, len(chunk))
                        body_left, chunk = body_left - taken, chunk[taken:]
                        continue
                    pending += chunk
                    head, found, chunk = pending.partition(b"\r\n\r\n")
                    if not found:
                        chunk = b""
                        continue
                    pending, body_left = b"", _content_length(head)
                    with self._lock:
                        self.heads.append(head.decode("latin-1"))
        except OSError:
            pass
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0
