"""A fault-injecting HTTP proxy in front of a storage server (Azurite, moto's S3,
gcp-storage-emulator): the network, misbehaving on cue.

Tests point a root's endpoint at the proxy (127.0.0.1, its own port). Each request is
read whole (head and Content-Length body), then, by the faults queued for requests whose
method and path match, either answered by the proxy itself (`status`: e.g. 503, 403),
cut off before the server sees it (`reset`: the connection is reset), or forwarded and its
answer lost (`drop_response`: the server acts on it, the client sees a reset). Everything
else is forwarded to the server unchanged, one request per connection (`Connection: close`).
Every request is recorded in `log` as (method, path, outcome), and the size of its body
in `bodies` as (method, path, bytes): what the client sent, counted on the wire.

The whole endpoint can go away too (`refuse`: connections refused, those in flight reset,
as when a server stops) and come back on the same port (`listen`), while the server behind
it keeps its data: an outage of a store whose server forgets its data when stopped (moto,
the GCS emulator).

Not for: speed (a thread per connection) or HTTP beyond what the Azure SDK, s3fs and
gcsfs send.
May import: tests/azurite.py (the account of `connection_string`).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from dataclasses import dataclass

from azurite import ACCOUNT, KEY


@dataclass
class Fault:
    kind: str  # "status", "reset" or "drop_response"
    times: int  # how many matching requests it applies to
    method: str | None = None  # e.g. "PUT"; None: any
    path_contains: str | None = None  # e.g. "manifest.json", "comp=block"; None: any
    status: int = 503


class FaultProxy:
    """Forwards 127.0.0.1:<port> to the server's port (`upstream_port`), injecting queued
    faults."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self.log: list[tuple[str, str, str]] = []
        self.bodies: list[tuple[str, str, int]] = []
        self._closed = False
        self._open: set[socket.socket] = set()  # connections being served
        self.port = 0
        self.listen()

    @property
    def endpoint(self) -> str:
        """The proxy's URL (an S3 `endpoint_url`)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def connection_string(self) -> str:
        """An Azure connection string (Azurite's account and key) whose blob endpoint is
        this proxy: a root opened with it reaches Azurite through here."""
        return (
            f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
            f"BlobEndpoint=http://127.0.0.1:{self.port}/{ACCOUNT};"
        )

    # control -------------------------------------------------------------------------------
    def inject(self, fault: Fault) -> None:
        with self._lock:
            self._faults.append(fault)

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()
            self.log.clear()
            self.bodies.clear()

    def sent_bytes(self, path_contains: str, method: str = "PUT") -> int:
        """The body bytes of the requests of `method` whose path holds `path_contains`."""
        with self._lock:
            return sum(n for m, p, n in self.bodies if m == method and path_contains in p)

    def outcomes(self, outcome: str | None = None) -> list[tuple[str, str, str]]:
        with self._lock:
            return [e for e in self.log if outcome is None or e[2] == outcome]

    def refuse(self) -> None:
        """Away, as a stopped server is: new connections refused, those in flight reset."""
        with contextlib.suppress(OSError):  # wakes the thread blocked in accept()
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            serving, self._open = list(self._open), set()
        for conn in serving:
            _reset(conn)
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def listen(self) -> None:
        """Accept connections (again: on the same port after `refuse`)."""
        self._listener = socket.create_server(("127.0.0.1", self.port))  # SO_REUSEADDR
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._serve, args=(self._listener,), daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self.refuse()

    # serving -------------------------------------------------------------------------------
    def _serve(self, listener: socket.socket) -> None:
        while not self._closed:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with self._lock:
                self._open.add(conn)
            threading.Thread(target=self._handle_open, args=(conn,), daemon=True).start()

    def _handle_open(self, conn: socket.socket) -> None:
        try:
            self._handle(conn)
        except OSError:
            pass  # reset by `refuse`, or by the client
        finally:
            with self._lock:
                self._open.discard(conn)

    def _take_fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.times <= 0:
                    continue
                if fault.method and fault.method != method:
                    continue
                if fault.path_contains and fault.path_contains not in path:
                    continue
                fault.times -= 1
                return fault
        return None

    def _record(self, method: str, path: str, outcome: str) -> None:
        with self._lock:
            self.log.append((method, path, outcome))

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            request = _read_request(conn)
            if request is None:
                return
            head, body = request
            request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
            method, path = request_line.split(" ")[:2]
            with self._lock:
                self.bodies.append((method, path, len(body)))
            fault = self._take_fault(method, path)
            if fault is not None and fault.kind == "status":
                self._record(method, path, f"status {fault.status}")
                reply = (
                    f"HTTP/1.1 {fault.status} Injected\r\nContent-Type: application/xml\r\n"
                    f"Content-Length: 0\r\nConnection: close\r\n\r\n"
                )
                conn.sendall(reply.encode())
                return
            if fault is not None and fault.kind == "reset":
                self._record(method, path, "reset")
                _reset(conn)
                return
            response = self._forward(_close_after(head + body))
            if fault is not None and fault.kind == "drop_response":
                self._record(method, path, "drop_response")
                _reset(conn)
                return
            self._record(method, path, "forwarded")
            conn.sendall(_close_after(response, response=True))

    def _forward(self, data: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", self.upstream_port), timeout=60) as up:
            up.sendall(data)
            chunks = []
            while chunk := up.recv(1 << 20):
                chunks.append(chunk)
        return b"".join(chunks)


def _read_request(conn: socket.socket) -> tuple[bytes, bytes] | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, first = data.partition(b"\r\n\r\n")
    length, lines, expect = 0, [], False
    for line in head.split(b"\r\n"):
        name = line.partition(b":")[0].strip().lower()
        if name == b"content-length":
            length = int(line.partition(b":")[2].strip())
        if name == b"expect":  # botocore's uploads: the proxy answers it, the server is
            expect = True  # sent the body whole and never asked
            continue
        lines.append(line)
    if expect and len(first) < length:
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    if len(first) >= length:
        return b"\r\n".join(lines) + b"\r\n\r\n", first
    body = bytearray(first)
    while len(body) < length:
        chunk = conn.recv(1 << 20)
        if not chunk:
            return None
        body += chunk
    return b"\r\n".join(lines) + b"\r\n\r\n", bytes(body)


def _close_after(message: bytes, *, response: bool = False) -> bytes:
    """A request or response with `Connection: close`: one request per connection, so
    that the client never reuses a connection the proxy is about to close."""
    head, sep, body = message.partition(b"\r\n\r\n")
    if response and not sep:
        return message
    lines = [line for line in head.split(b"\r\n") if not line.lower().startswith(b"connection:")]
    return b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n" + body


def _reset(conn: socket.socket) -> None:
    """Close with RST (SO_LINGER 0): the client sees a connection reset. A connection its
    relay thread closed meanwhile (its end came as the proxy went away) is left as it is."""
    with contextlib.suppress(OSError):  # EBADF: closed by its relay
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
