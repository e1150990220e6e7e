"""The one HTTP server core under serve() and view(): connection cap, read timeout, malformed requests.

Loopback only; every wait is bounded (sockets time out, the server's read timeout is half a second).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import fwdtrace
from fwdtrace.live.explorer import ExplorerServer

CAP, TIMEOUT = 4, 0.5


def _start(kind: str, folder: Path, cap: int) -> Any:
    if kind == "serve":
        return fwdtrace.serve(torch.nn.Linear(2, 2), port=0, max_connections=cap, timeout=TIMEOUT)
    (folder / "index.html").write_text("<html></html>")
    (folder / "graph.json").write_text("{}")
    return ExplorerServer(folder, [folder / "graph.json"], port=0, max_connections=cap, timeout=TIMEOUT)


@pytest.fixture(params=["serve", "view"])
def service(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A service under a small cap and read timeout, the same settings for both."""
    server = _start(request.param, tmp_path, CAP)
    try:
        yield server
    finally:
        server.stop()


def _exchange(port: int, data: bytes) -> bytes:
    """Send ``data`` and read until the server closes the connection (or 30 s pass: a hang fails the test)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
        c.sendall(data)
        answer = b""
        while chunk := c.recv(65536):
            answer += chunk
    return answer


def _until_closed(c: socket.socket) -> bytes:
    answer = b""
    try:
        while chunk := c.recv(4096):
            answer += chunk
    except ConnectionResetError:
        pass
    return answer


def test_half_sent_requests_stay_under_the_cap_and_every_request_is_answered(
        service: Any, capfd: pytest.CaptureFixture[str]) -> None:
    port, host = service.port, b"Host: 127.0.0.1:%d\r\n" % service.port
    base = threading.active_count()
    clients, most = [], 0
    try:
        for _ in range(60):  # 15 times the cap, each sending half a request line and no more
            c = socket.create_connection(("127.0.0.1", port), timeout=30)
            clients.append(c)
            c.sendall(b"GET / HTTP/1.1\r\nHo")
            most = max(most, threading.active_count() - base)
        # Threads are bounded by the cap (connections closed to make room hold theirs until they see
        # the close: under twice the cap), never by the clients.
        assert most <= 2 * CAP + 1, most
        for c in clients:  # each is closed: replaced to make room, or after the read timeout
            assert not _until_closed(c).startswith(b"HTTP/1.1 200")
    finally:
        for c in clients:
            c.close()
    # Malformed requests get an HTTP answer, each.
    fields = "&".join(f"f{i}=1" for i in range(65))
    answer = _exchange(port, b"GET /?%s HTTP/1.1\r\n%sConnection: close\r\n\r\n" % (fields.encode(), host))
    assert answer.startswith(b"HTTP/1.1 400 ") and b"at most 64 query fields" in answer
    assert _exchange(port, b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 414 ")
    many = b"".join(b"X-%d: 1\r\n" % i for i in range(101))
    assert _exchange(port, b"GET / HTTP/1.1\r\n%s%s\r\n" % (host, many)).startswith(b"HTTP/1.1 431 ")
    assert _exchange(port, b"GET / HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n").startswith(b"HTTP/1.1 431 ")
    assert _exchange(port, b"NOT HTTP AT ALL\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert _exchange(port, b"GET / HTTP/1.1\r\n%sContent-Length: x\r\nConnection: close\r\n\r\n" % host)[:9] \
        == b"HTTP/1.1 "
    # The service still answers its owner, and nothing was printed into the user's process.
    assert _exchange(port, b"GET / HTTP/1.1\r\n%sConnection: close\r\n\r\n" % host).startswith(b"HTTP/1.1 200 ")
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception" not in err, err


@pytest.mark.parametrize("kind", ["serve", "view"])
def test_the_owners_requests_are_all_answered_while_half_sent_connections_hold_the_places(kind: str,
                                                                                         tmp_path: Path) -> None:
    """Load held: 80 half-sent connections open (five times the cap), then 4 clients x 25 requests, each on a
    connection of its own: a new connection takes the place of the one that has waited longest."""
    server = _start(kind, tmp_path, 16)
    host = b"Host: 127.0.0.1:%d\r\n" % server.port
    statuses: list[bytes] = []
    lock = threading.Lock()

    def owner() -> None:
        for _ in range(25):
            answer = _exchange(server.port, b"GET / HTTP/1.1\r\n%sConnection: close\r\n\r\n" % host)
            with lock:
                statuses.append(answer[:12])

    attackers: list[socket.socket] = []
    threads = [threading.Thread(target=owner) for _ in range(4)]
    try:
        for _ in range(80):
            c = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            attackers.append(c)
            c.sendall(b"GET / HTTP/1.1\r\nHo")
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert statuses == [b"HTTP/1.1 200"] * 100  # nothing lost: every request answered, none refused
        assert len(server.httpd.connections) <= 2 * 16
    finally:
        for c in attackers:
            c.close()
        server.stop()
