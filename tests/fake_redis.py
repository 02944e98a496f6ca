"""A Redis server written for the tests: enough of the protocol for ``RedisStore`` (HELLO,
CLIENT, PING, SELECT, AUTH, EXISTS, GET, MGET, SET, DEL) over a dict, on 127.0.0.1 at a free
port, on threads, and able to misbehave on purpose:

- ``"bad_handshake"``: HELLO is answered ``+OK`` (a proxy that is not Redis, say); redis-py
  then raises ``AttributeError`` (no ``RedisError``) while connecting.
- ``"drip"``: every reply is sent one byte at a time, one every ``drip_s``: each socket read
  returns well within any socket timeout, the reply takes far longer than a call may.
- ``"silent"``: commands are read and never answered (connections stay open).

``misbehave(mode, commands)`` applies a mode to those commands only (None: every command;
HELLO for ``"bad_handshake"``); ``behave()`` ends it. ``commands`` lists every command
received (its name, upper case) and ``num_connections`` the connections open now.
"""

from __future__ import annotations

import socket
import threading
import time

MODES = ("ok", "bad_handshake", "drip", "silent")

_HELLO = {"server": "redis", "version": "7.2.0", "proto": 3, "id": 1, "mode": "standalone",
          "role": "master", "modules": []}  # fmt: skip


def _encode(value, resp3: bool) -> bytes:
    """One reply: str as a simple string, bytes as a bulk string, int, None, list, dict."""
    if value is None:
        return b"_\r\n" if resp3 else b"$-1\r\n"
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, int):
        return b":%d\r\n" % value
    if isinstance(value, str):
        return b"+" + value.encode() + b"\r\n"
    if isinstance(value, bytes):
        return b"$%d\r\n%s\r\n" % (len(value), value)
    if isinstance(value, list):
        return b"*%d\r\n" % len(value) + b"".join(_encode(v, resp3) for v in value)
    if isinstance(value, dict):
        items = b"".join(_encode(k.encode(), resp3) + _encode(v, resp3) for k, v in value.items())
        if resp3:
            return b"%%%d\r\n" % len(value) + items
        return b"*%d\r\n" % (2 * len(value)) + items
    raise TypeError(type(value))


class _Error(str):
    """An error reply."""


def _parse(buf: bytearray) -> list[bytes] | None:
    """Take one command (an array of bulk strings) off the front of ``buf``; None: not whole
    yet."""
    if not buf.startswith(b"*"):
        end = buf.find(b"\r\n")  # an inline command: redis-cli style
        if end < 0:
            return None
        line = bytes(buf[:end])
        del buf[: end + 2]
        return line.split()
    end = buf.find(b"\r\n")
    if end < 0:
        return None
    count, at, args = int(buf[1:end]), end + 2, []
    for _ in range(count):
        end = buf.find(b"\r\n", at)
        if end < 0:
            return None
        size = int(buf[at + 1 : end])
        if len(buf) < end + 2 + size + 2:
            return None
        args.append(bytes(buf[end + 2 : end + 2 + size]))
        at = end + 2 + size + 2
    del buf[:at]
    return args


class FakeRedis:
    """``with FakeRedis() as server: RedisStore(server.url)``; see the module docstring."""

    def __init__(self, drip_s: float = 0.1) -> None:
        self.drip_s = drip_s
        self.data: dict[bytes, bytes] = {}
        self.commands: list[str] = []
        self._modes: dict[str | None, str] = {}  # command (None: any) -> mode
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name="fake-redis", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def num_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def misbehave(self, mode: str, commands: set[str] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode: one of {MODES}, got {mode!r}")
        with self._lock:
            self._modes = {None: mode} if commands is None else dict.fromkeys(commands, mode)

    def behave(self) -> None:
        with self._lock:
            self._modes = {}

    def wait_connections(self, num: int, timeout_s: float = 5.0) -> bool:
        """True once at most ``num`` connections are open."""
        deadline = time.monotonic() + timeout_s
        while self.num_connections > num:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        self._stop.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone does not)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
        self._thread.join(5)

    def __enter__(self) -> FakeRedis:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the server's threads -----------------------------------------------------------

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _mode(self, command: str) -> str:
        with self._lock:
            return self._modes.get(command, self._modes.get(None, "ok"))

    def _serve(self, conn: socket.socket) -> None:
        buf, resp3 = bytearray(), False
        try:
            while not self._stop.is_set():
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
                while (args := _parse(buf)) is not None:
                    if not args:
                        continue
                    name = args[0].decode().upper()
                    with self._lock:
                        self.commands.append(name)
                    mode = self._mode(name)
                    if mode == "silent":
                        continue
                    if name == "HELLO" and mode == "bad_handshake":
                        reply: object = "OK"
                    else:
                        reply = self._reply(name, args[1:])
                        if name == "HELLO" and args[1:2] == [b"3"]:
                            resp3 = True
                    out = (b"-" + reply.encode() + b"\r\n" if isinstance(reply, _Error)
                           else _encode(reply, resp3))  # fmt: skip
                    if mode == "drip":
                        for i in range(len(out)):
                            if self._stop.wait(self.drip_s):
                                return
                            conn.sendall(out[i : i + 1])
                    else:
                        conn.sendall(out)
        except OSError:
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _reply(self, name: str, args: list[bytes]) -> object:
        data = self.data
        with self._lock:
            if name == "HELLO":
                return dict(_HELLO, proto=int(args[0]) if args else 2)
            if name in ("CLIENT", "SELECT", "AUTH"):
                return "OK"
            if name == "PING":
                return "PONG"
            if name == "EXISTS":
                return sum(k in data for k in args)
            if name == "GET":
                return data.get(args[0])
            if name == "MGET":
                return [data.get(k) for k in args]
            if name == "SET":
                data[args[0]] = args[1]
                return "OK"
            if name == "DEL":
                return sum(data.pop(k, None) is not None for k in args)
            if name == "DBSIZE":
                return len(data)
        return _Error(f"ERR unknown command '{name}'")
