"""A fault-injecting TCP proxy on 127.0.0.1, for putting S3 (moto's server) behind it.

``FaultProxy(upstream_url)`` listens on a free port of 127.0.0.1 and forwards every
connection to the upstream. ``inject(fault, count=...)`` makes the next ``count`` requests
(None: every request until ``inject(Fault.PASS)``) meet a fault; a request is the first
data a client sends on a connection after it got a response (HTTP/1.1 keep-alive), so
faults hit connections the client pooled before they were switched on too:

- ``RESET``: the connection is closed with a TCP reset before the request is forwarded.
- ``STALL``: the request is swallowed and nothing is answered; after ``stall_seconds``
  the connection is closed (as a load balancer drops an idle connection), unless the
  client timed out and closed it before.
- ``TRUNCATE``: the response is cut ``truncate_after`` bytes after its headers, and the
  connection closed (a response shorter than its Content-Length).
- ``SLOW``: the response is forwarded at ``bytes_per_second`` (read as it goes: set it
  higher to let a slowed response finish).

``injected`` counts the faults injected so far, per fault.
"""

from __future__ import annotations

import contextlib
import enum
import socket
import struct
import threading
import time
from collections import Counter
from types import TracebackType
from urllib.parse import urlsplit

_CHUNK = 64 * 1024
_HEADERS_END = b"\r\n\r\n"


class Fault(enum.Enum):
    """What happens to a request that meets a fault."""

    PASS = "pass"
    RESET = "reset"
    STALL = "stall"
    TRUNCATE = "truncate"
    SLOW = "slow"


class FaultProxy:
    """A threaded TCP proxy in front of ``upstream_url`` (``http://host:port``) that injects
    faults into requests on demand; a context manager that starts and stops it."""

    def __init__(
        self,
        upstream_url: str,
        *,
        truncate_after: int = 16,
        bytes_per_second: int = 64 * 1024,
        stall_seconds: float = 5.0,
    ) -> None:
        parts = urlsplit(upstream_url)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"upstream {upstream_url!r} needs a host and a port")
        self._upstream = (parts.hostname, parts.port)
        self.truncate_after = truncate_after
        self.bytes_per_second = bytes_per_second
        self.stall_seconds = stall_seconds
        self.injected: Counter[Fault] = Counter()
        self._fault = Fault.PASS
        self._remaining: int | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._sockets: set[socket.socket] = set()
        self.port = self._listener.getsockname()[1]

    @property
    def url(self) -> str:
        """The proxy's ``http://127.0.0.1:<port>``, to use as the S3 endpoint URL."""
        return f"http://127.0.0.1:{self.port}"

    def inject(self, fault: Fault, count: int | None = None) -> None:
        """Make the next ``count`` requests (None: all of them) meet ``fault``."""
        with self._lock:
            self._fault, self._remaining = fault, count

    def _next_fault(self) -> Fault:
        """The fault the request starting now meets (and count it)."""
        with self._lock:
            fault = self._fault
            if fault is Fault.PASS:
                return fault
            if self._remaining is not None:
                self._remaining -= 1
                if self._remaining <= 0:
                    self._fault, self._remaining = Fault.PASS, None
            self.injected[fault] += 1
            return fault

    def __enter__(self) -> FaultProxy:
        threading.Thread(target=self._accept, name="faultproxy-accept", daemon=True).start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop accepting and close every open connection."""
        self._stopped.set()
        self._listener.close()
        with self._lock:
            sockets, self._sockets = list(self._sockets), set()
        for sock in sockets:
            _close(sock)

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.add(sock)

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._track(client)
            threading.Thread(
                target=self._serve, args=(client,), name="faultproxy-conn", daemon=True
            ).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self._upstream)
        except OSError:
            _reset(client)
            return
        self._track(upstream)
        connection = _Connection(self, client, upstream)
        threading.Thread(target=connection.responses, name="faultproxy-down", daemon=True).start()
        connection.requests()


class _Connection:
    """One proxied connection: a thread forwards requests, another responses."""

    def __init__(self, proxy: FaultProxy, client: socket.socket, upstream: socket.socket) -> None:
        self._proxy = proxy
        self._client = client
        self._upstream = upstream
        self._fault = Fault.PASS
        self._awaiting_request = True
        self._state = threading.Lock()

    def requests(self) -> None:
        """Client -> upstream; picks the fault of each new request."""
        try:
            while data := self._client.recv(_CHUNK):
                with self._state:
                    starts_request = self._awaiting_request
                    if starts_request:
                        self._awaiting_request = False
                        self._fault = self._proxy._next_fault()
                    fault = self._fault
                if fault is Fault.RESET:
                    _reset(self._client)
                    break
                if fault is Fault.STALL:
                    if starts_request:
                        timer = threading.Timer(self._proxy.stall_seconds, self.close)
                        timer.daemon = True
                        timer.start()
                    continue  # swallow the request; never answer
                self._upstream.sendall(data)
        except OSError:
            pass
        finally:
            self.close()

    def close(self) -> None:
        """Close both sides."""
        _close(self._upstream)
        _close(self._client)

    def responses(self) -> None:
        """Upstream -> client, truncating or throttling as the current request's fault says."""
        response = b""  # what a TRUNCATE fault's response has received so far
        try:
            while data := self._upstream.recv(_CHUNK):
                with self._state:
                    fault = self._fault
                    self._awaiting_request = True
                if fault is Fault.TRUNCATE:
                    sent = len(response)
                    response += data
                    end = response.find(_HEADERS_END)
                    if end < 0:
                        self._client.sendall(data)
                        continue
                    keep = end + len(_HEADERS_END) + self._proxy.truncate_after
                    self._client.sendall(response[sent:keep])
                    break
                if fault is Fault.SLOW:
                    start = 0
                    while start < len(data):  # the rate now: a test may change it
                        step = max(1, self._proxy.bytes_per_second // 20)
                        self._client.sendall(data[start : start + step])
                        start += step
                        time.sleep(0.05)
                    continue
                self._client.sendall(data)
        except OSError:
            pass
        finally:
            self.close()


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a TCP reset (linger 0) instead of an orderly FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    _close(sock)


def _close(sock: socket.socket) -> None:
    """Shut ``sock`` down (waking a thread blocked on it) and close it."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
