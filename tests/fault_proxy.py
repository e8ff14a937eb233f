"""A TCP relay in front of the local S3 server that goes down on cue: the storage outage the remote-checkpoint
tests need, at a chosen request, without losing the server's objects (moto keeps them in memory, so killing the
server itself would lose the earlier checkpoints too).

The relay reads the HTTP request lines that pass through it. `fail_from(pattern, nth)` takes it down at the
`nth` request whose line matches `pattern`: that request's connection is reset, and so is every connection whose
next request arrives while it is down (requests already under way finish, as on a server that stops accepting
work), except a request whose line matches `recover_on`, which brings it back up. The clients (s3fs,
botocore) see what they would see of a dead server: reset connections.
"""

from __future__ import annotations

import re
import socket
import struct
import threading

REQUEST_LINE = re.compile(rb"(GET|PUT|POST|HEAD|DELETE) (\S+) HTTP/1\.[01]\r\n")


class FaultProxy:
    def __init__(self, target_port: int):
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.down = False
        self.trigger: tuple[re.Pattern, int] | None = None
        self.recover_on: re.Pattern | None = None
        self.seen = 0
        self.open: set[socket.socket] = set()
        self.requests: list[str] = []  # every request line seen (for a failing test's message)
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fail_from(self, pattern: str, nth: int = 1, recover_on: str | None = None) -> None:
        with self.lock:
            self.trigger, self.seen = (re.compile(pattern.encode()), nth), 0
            self.recover_on = re.compile(recover_on.encode()) if recover_on else None

    def restore(self) -> None:
        with self.lock:
            self.down, self.trigger, self.recover_on = False, None, None

    def close(self) -> None:
        self.listener.close()
        self._reset_all()

    # ------------------------------------------------------------ relay
    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(("127.0.0.1", self.target_port))
        except OSError:
            _reset(client)
            return
        with self.lock:
            self.open |= {client, server}
        threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()
        self._pump(client, server, True)

    def _pump(self, source: socket.socket, sink: socket.socket, inspect: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if inspect and not self._passes(data):
                    break
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            _reset(sock)
            with self.lock:
                self.open.discard(sock)

    def _passes(self, data: bytes) -> bool:
        """Whether this chunk goes through: the rest of a request under way does; a new request (a request line,
        which may take the relay down or up) does while the relay is up."""
        with self.lock:
            lines = list(REQUEST_LINE.finditer(data))
            for match in lines:
                line = match.group(0).strip()
                self.requests.append(line.decode(errors="replace"))
                if self.down and self.recover_on is not None and self.recover_on.search(line):
                    self.down, self.recover_on = False, None
                elif not self.down and self.trigger is not None and self.trigger[0].search(line):
                    self.seen += 1
                    if self.seen >= self.trigger[1]:
                        self.down, self.trigger = True, None
            return not (lines and self.down)

    def _reset_all(self) -> None:
        with self.lock:
            sockets, self.open = list(self.open), set()
        for sock in sockets:
            _reset(sock)


def _reset(sock: socket.socket) -> None:
    """Close with a reset (RST), as a dead server's connection ends. The shutdown wakes the relay's thread blocked
    reading it (a plain close from another thread would leave that read, and the connection, open)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RD)
    except OSError:
        pass
    sock.close()
