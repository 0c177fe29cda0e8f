"""The world's store: torch.distributed's TCPStore, served from the driver without torch.

Every process group of a run rendezvouses through one store that the driver serves (replicas come
and go, the driver stays); the ranks dial it with `torch.distributed.TCPStore(host, port,
is_master=False)`, and the driver reads their heartbeats and settles aborted fragment syncs in it.
torch's own server needs `import torch` in the driver (~2 CPU-seconds and ~300 MB on every launch,
for a process that never touches a tensor). `StoreServer` serves the same wire protocol in
Python, so the driver never imports torch.

The protocol is the one torch's libuv server speaks (torch/csrc/distributed/c10d/
TCPStoreLibUvBackend.cpp, the default server since torch 2.4; its clients are what torch ships).
Integers are in native byte order (little-endian on every platform torch is built for); a key or
a value is a uint64 length and its bytes. A request is one command byte and its fields:

    0  VALIDATE     u32 magic (0x3C85F7CE); the first request of a connection; no answer
    1  SET          key, value
    2  COMPARE_SET  key, expected, new -> the value now (see `_compare_set`)
    3  GET          key -> value (empty when missing: the client waits for the key first)
    4  ADD          key, i64 -> i64 (the value is the decimal string of a counter)
    5  CHECK        u64 n, n keys -> u8 0 ready / 1 not ready
    6  WAIT         u64 n, n keys -> u8 0 (stop waiting) once every key is set
    7  GETNUMKEYS   -> i64
    8  DELETE_KEY   key -> i64 deleted
    9  APPEND       key, value
    10 MULTI_GET    u64 n, n keys -> n values
    11 MULTI_SET    u64 n, n (key, value)
    12 CANCEL_WAIT  -> u8 1 (wait cancelled)
    13 PING         u32 nonce -> the nonce
    14 QUEUE_PUSH   key, value
    15 QUEUE_POP    key -> i64 length before the pop, then the value when it was not empty
    16 QUEUE_LEN    key -> i64

Requests without an answer (SET, APPEND, MULTI_SET, QUEUE_PUSH) are not acknowledged: a client's
next request on the same connection is read after them. Limits are torch's: a request over them
closes its connection, as torch's server does. torch's `TCPStore` puts "/" before every key it
sends; the driver's calls here (`compare_set`, `check`, `multi_get`) do the same, so both name a key
alike.
"""

from __future__ import annotations

import collections
import logging
import selectors
import socket
import struct
import threading
import time

log = logging.getLogger(__name__)

VALIDATION_MAGIC = 0x3C85F7CE
MAX_KEY_LEN = 128 * 1024
MAX_PAYLOAD_LEN = 8 * 1024 * 1024
MAX_KEY_COUNT = 128 * 1024

(VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY, APPEND, MULTI_GET,
 MULTI_SET, CANCEL_WAIT, PING, QUEUE_PUSH, QUEUE_POP, QUEUE_LEN) = range(17)
READY, NOT_READY = b"\x00", b"\x01"
STOP_WAITING, WAIT_CANCELED = b"\x00", b"\x01"

_U32, _U64, _I64 = struct.Struct("=I"), struct.Struct("=Q"), struct.Struct("=q")


class _Incomplete(Exception):
    """The buffer ends inside a request: read more and parse it again."""


class _BadRequest(Exception):
    """A request the protocol does not allow: its connection is closed."""


class _Reader:
    """Reads one request's fields from the front of a connection's buffer."""

    def __init__(self, buf: bytearray):
        self._buf, self.pos = buf, 0

    def _take(self, n: int) -> bytes:
        if self.pos + n > len(self._buf):
            raise _Incomplete
        out = bytes(self._buf[self.pos:self.pos + n])
        self.pos += n
        return out

    def u8(self) -> int:
        return self._take(1)[0]

    def u32(self) -> int:
        return _U32.unpack(self._take(4))[0]

    def u64(self) -> int:
        return _U64.unpack(self._take(8))[0]

    def i64(self) -> int:
        return _I64.unpack(self._take(8))[0]

    def blob(self, limit: int) -> bytes:
        n = self.u64()
        if n > limit:
            raise _BadRequest(f"a field of {n} bytes (at most {limit})")
        return self._take(n)

    def count(self) -> int:
        n = self.u64()
        if n > MAX_KEY_COUNT:
            raise _BadRequest(f"{n} keys in one request (at most {MAX_KEY_COUNT})")
        return n


def _vector(value: bytes) -> bytes:
    return _U64.pack(len(value)) + value


class _Client:
    __slots__ = ("sock", "inbuf", "out", "validated", "awaited")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.inbuf = bytearray()
        self.out = bytearray()
        self.validated = False
        self.awaited = 0   # keys of its WAIT not set yet (0: it waits for none)


class StoreServer:
    """A TCPStore server on a listening socket, on a thread of its own, until `close`.

    Args:
        listen_fd: a listening TCP socket's file descriptor (`elastic.net.netaddr.store_listener`);
            the server owns it from here on.
        timeout_s: how long `multi_get` waits for keys not set yet (torch's store timeout).
    """

    def __init__(self, listen_fd: int, timeout_s: float = 300.0):
        self.timeout_s = timeout_s
        self._listener = socket.socket(fileno=listen_fd)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)   # in-process waiters (`multi_get`)
        self._data: dict[bytes, bytes] = {}
        self._queues: dict[bytes, collections.deque[bytes]] = {}
        self._waiting: dict[bytes, list[_Client]] = {}
        self._clients: dict[socket.socket, _Client] = {}
        self._dirty: set[_Client] = set()   # clients with output to send
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="world-store", daemon=True)
        self._thread.start()

    # -- in-process use (the driver) -------------------------------------------------------------

    def compare_set(self, key: str, expected: bytes | str, new: bytes | str) -> bytes:
        """Set `key` to `new` if it holds `expected` (or is missing and `expected` is empty);
        returns what it holds now, as torch's `TCPStore.compare_set` does."""
        with self._lock:
            out = self._compare_set(_key(key), _bytes(expected), _bytes(new))
        self._poke()
        return out

    def check(self, keys: list[str]) -> bool:
        """Whether every one of `keys` is set (torch's `TCPStore.check`)."""
        with self._lock:
            return self._ready([_key(k) for k in keys])

    def multi_get(self, keys: list[str], timeout_s: float | None = None) -> list[bytes]:
        """The values of `keys`, once every one is set (as torch's client waits for them first);
        TimeoutError after `timeout_s` (default: the store's timeout)."""
        wanted = [_key(k) for k in keys]
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        with self._changed:
            while missing := [k for k in wanted if k not in self._data]:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise TimeoutError(f"the store's keys {[k.decode()[1:] for k in missing][:3]} were "
                                       f"not set within {self.timeout_s:.0f} s")
                self._changed.wait(left)
            return [self._data[k] for k in wanted]

    def close(self) -> None:
        """Stop serving: every connection and the listening socket are closed (safe to call twice)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._changed.notify_all()
        self._poke()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    # -- the store's state (callers hold the lock) -----------------------------------------------

    def _set(self, key: bytes, value: bytes) -> None:
        self._data[key] = value
        self._wake(key)

    def _compare_set(self, key: bytes, expected: bytes, new: bytes) -> bytes:
        held = self._data.get(key)
        if held is None:
            if expected:
                out = expected   # torch answers the expected value for a missing key, unset
            else:
                self._data[key] = out = new
        else:
            if held == expected:
                self._data[key] = new
            out = self._data[key]
        self._wake(key)
        return out

    def _wake(self, key: bytes, one: bool = False) -> None:
        """Answer the connections waiting for `key` (`one`: the first whose wait it completes)."""
        self._changed.notify_all()
        clients = self._waiting.get(key)
        if not clients:
            return
        for c in list(clients):
            clients.remove(c)
            c.awaited -= 1
            if c.awaited == 0:
                self._send(c, STOP_WAITING)
                if one:
                    break
        if not clients:
            del self._waiting[key]

    def _ready(self, keys: list[bytes]) -> bool:
        return all(k in self._data or self._queues.get(k) for k in keys)

    def _forget_waits(self, c: _Client) -> None:
        if c.awaited:
            for key in [k for k, cs in self._waiting.items() if c in cs]:
                self._waiting[key] = [x for x in self._waiting[key] if x is not c]
                if not self._waiting[key]:
                    del self._waiting[key]
            c.awaited = 0

    def _send(self, c: _Client, data: bytes) -> None:
        c.out += data
        self._dirty.add(c)

    # -- one request ------------------------------------------------------------------------------

    def _handle(self, c: _Client, r: _Reader) -> None:
        """Parse and carry out the request at the front of `c`'s buffer (raises _Incomplete
        before changing anything when it is not all there)."""
        cmd = r.u8()
        if not c.validated:
            if cmd != VALIDATE or r.u32() != VALIDATION_MAGIC:
                raise _BadRequest("a connection's first request is not VALIDATE")
            c.validated = True
            return
        if cmd == PING:
            self._send(c, _U32.pack(r.u32()))
        elif cmd in (SET, APPEND, QUEUE_PUSH):
            key, value = r.blob(MAX_KEY_LEN), r.blob(MAX_PAYLOAD_LEN)
            if cmd == SET:
                self._set(key, value)
            elif cmd == APPEND:
                self._set(key, self._data.get(key, b"") + value)
            else:
                self._queues.setdefault(key, collections.deque()).append(value)
                self._wake(key, one=True)
        elif cmd == COMPARE_SET:
            key, expected, new = r.blob(MAX_KEY_LEN), r.blob(MAX_PAYLOAD_LEN), r.blob(MAX_PAYLOAD_LEN)
            self._send(c, _vector(self._compare_set(key, expected, new)))
        elif cmd == GET:
            self._send(c, _vector(self._data.get(r.blob(MAX_KEY_LEN), b"")))
        elif cmd == ADD:
            key, delta = r.blob(MAX_KEY_LEN), r.i64()
            try:
                total = int(self._data.get(key, b"0")) + delta
            except ValueError:
                raise _BadRequest(f"ADD to a key that holds no integer: {key[:64]!r}") from None
            self._set(key, str(total).encode())
            self._send(c, _I64.pack(total))
        elif cmd in (CHECK, WAIT):
            keys = [r.blob(MAX_KEY_LEN) for _ in range(r.count())]
            if cmd == CHECK:
                self._send(c, READY if self._ready(keys) else NOT_READY)
            elif self._ready(keys):
                self._send(c, STOP_WAITING)
            else:
                missing = [k for k in keys if k not in self._data]
                for k in missing:
                    self._waiting.setdefault(k, []).append(c)
                c.awaited = len(missing)
        elif cmd == GETNUMKEYS:
            self._send(c, _I64.pack(len(self._data)))
        elif cmd == DELETE_KEY:
            self._send(c, _I64.pack(1 if self._data.pop(r.blob(MAX_KEY_LEN), None) is not None else 0))
        elif cmd == MULTI_GET:
            keys = [r.blob(MAX_KEY_LEN) for _ in range(r.count())]
            self._send(c, b"".join(_vector(self._data.get(k, b"")) for k in keys))
        elif cmd == MULTI_SET:
            pairs = [(r.blob(MAX_KEY_LEN), r.blob(MAX_PAYLOAD_LEN)) for _ in range(r.count())]
            for key, value in pairs:
                self._set(key, value)
        elif cmd == CANCEL_WAIT:
            self._forget_waits(c)
            self._send(c, WAIT_CANCELED)
        elif cmd == QUEUE_POP:
            q = self._queues.setdefault(r.blob(MAX_KEY_LEN), collections.deque())
            self._send(c, _I64.pack(len(q)) + (_vector(q.popleft()) if q else b""))
        elif cmd == QUEUE_LEN:
            self._send(c, _I64.pack(len(self._queues.get(r.blob(MAX_KEY_LEN), ()))))
        else:
            raise _BadRequest(f"unknown command {cmd}")

    # -- the serving thread -----------------------------------------------------------------------

    def _poke(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass   # a wake-up is pending already, or the server is closed

    def _serve(self) -> None:
        try:
            while not self._closed:
                for key, mask in self._sel.select():
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        try:
                            while self._wake_r.recv(4096):
                                pass
                        except BlockingIOError:
                            pass
                    else:
                        c = key.data
                        if mask & selectors.EVENT_READ:
                            self._read(c)
                        if mask & selectors.EVENT_WRITE and c.sock in self._clients:
                            with self._lock:
                                self._dirty.add(c)
                self._flush()
        except Exception:
            log.exception("the world's store stopped")
        finally:
            self._shut()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            c = _Client(sock)
            self._clients[sock] = c
            self._sel.register(sock, selectors.EVENT_READ, c)

    def _read(self, c: _Client) -> None:
        try:
            data = c.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(c)
            return
        c.inbuf += data
        with self._lock:
            try:
                while c.inbuf:
                    r = _Reader(c.inbuf)
                    try:
                        self._handle(c, r)
                    except _Incomplete:
                        break
                    del c.inbuf[:r.pos]
            except _BadRequest as e:
                log.warning("the world's store closed a connection: %s", e)
                self._drop_locked(c)

    def _flush(self) -> None:
        with self._lock:
            dirty, self._dirty = self._dirty, set()
            for c in dirty:
                if c.sock not in self._clients:
                    continue
                try:
                    while c.out:
                        sent = c.sock.send(c.out)
                        del c.out[:sent]
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError:
                    self._drop_locked(c)
                    continue
                self._sel.modify(c.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if c.out else 0), c)

    def _drop(self, c: _Client) -> None:
        with self._lock:
            self._drop_locked(c)

    def _drop_locked(self, c: _Client) -> None:
        if self._clients.pop(c.sock, None) is None:
            return
        self._forget_waits(c)
        self._dirty.discard(c)
        self._sel.unregister(c.sock)
        c.sock.close()

    def _shut(self) -> None:
        with self._lock:
            self._closed = True
            for c in list(self._clients.values()):
                self._drop_locked(c)
            self._changed.notify_all()
        for s in (self._listener, self._wake_r):
            self._sel.unregister(s)
            s.close()
        self._sel.close()
        self._wake_w.close()


def _key(key: str) -> bytes:
    return b"/" + key.encode()


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
