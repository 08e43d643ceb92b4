"""An HTTP/1.1-aware TCP proxy for faults and latency in front of an HTTP
server (the S3 server of s3server.py), run in a thread of the test process.

    with FaultProxy(server.endpoint_url, delay_ms=10) as proxy:   # 20 ms round trip
        client = server.client(endpoint_url=proxy.url)
        rule = proxy.respond(503, times=2, path="/bucket/*")     # the next two GETs of an object
        ...
        assert rule.hits == 2 and proxy.count(path="/bucket/*") == 3

`tc netem` is not available on these kernels, so latency, bandwidth and
faults are emulated here, per request:

- the link (`set_link`, changeable at run time): every byte is delivered
  `delay_ms` after it arrived, in each direction, so a round trip takes at
  least 2 x delay_ms; `bandwidth` (bytes/s, each direction, shared by all
  connections) serialises the bytes as a link of that rate would;
- rules, matched in the order added against the request's method and path
  (a glob on the path without its query: "/bucket/*.npy"; listing a bucket
  is GET "/bucket"), each for the next `times` matching requests (None:
  every one) or a `fraction` of them (seeded), the first that applies wins:
    respond(status)         an S3-style error (503 SlowDown, 403 AccessDenied, ...)
                            instead of forwarding; the connection stays usable
    truncate(after_bytes)   forward, cut the response body after that many
                            bytes and close the connection
    stall(after_bytes=None) send nothing more (None: not even the head) until
                            the client gives up and closes
    hold()                  forward nothing until the rule is removed, then
                            forward the request as if no rule had matched
                            (a request that must wait for the test's next step)
    reset(after_bytes=None) close with a TCP reset (RST) instead of answering
                            (or after the head and that many body bytes)
- counts: `seen` lists every request (method, path, what was done), and
  `connections` counts the client connections accepted (keep-alive reuse
  shows as fewer connections than requests).

Keep-alive works: each client connection has its own upstream connection,
reused request after request; bodies are framed by Content-Length or
chunked encoding, and `Expect: 100-continue` is honoured. Requests on one
connection are handled one at a time (clients do not pipeline).

Every wait is bounded: `stop()` closes every connection (a stalled one too)
and joins the thread within STOP_TIMEOUT_S, or raises.
"""

from __future__ import annotations

import asyncio
import fnmatch
import random
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import NamedTuple
from urllib.parse import unquote, urlsplit

STOP_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 2.0           # a client that does not read: then abort
START_TIMEOUT_S = 10.0
CHUNK_BYTES = 256 * 1024
STREAM_LIMIT_BYTES = 1 << 20     # the longest head accepted, and the read buffer
QUEUED_CHUNKS = 16               # per direction and connection: then the reader waits
ACTIONS = ("respond", "truncate", "stall", "reset", "hold")

S3_ERROR_CODES = {403: "AccessDenied", 404: "NoSuchKey", 412: "PreconditionFailed",
                  500: "InternalError", 503: "SlowDown"}
REASONS = {200: "OK", 403: "Forbidden", 404: "Not Found", 412: "Precondition Failed",
           500: "Internal Server Error", 503: "Service Unavailable"}


class FaultProxyError(RuntimeError):
    """The proxy could not start or stop within its bound."""


class Seen(NamedTuple):
    """One request the proxy received."""
    method: str
    path: str          # without the query, percent-decoded
    query: str
    action: str        # "pass" or the rule's action
    status: int | None  # the status sent for "respond", else None


@dataclass(eq=False)
class Rule:
    """What to do with matching requests; returned by FaultProxy.respond() &c.
    `hits`: how many requests it was applied to."""
    action: str
    path: str = "*"
    method: str | None = None
    times: int | None = None
    fraction: float | None = None
    status: int | None = None
    after_bytes: int | None = None
    seed: int = 0
    hits: int = 0
    _rng: random.Random = field(init=False, repr=False)
    # hold: the requests waiting for remove(), each an asyncio.Event of the proxy's loop
    _held: list = field(init=False, repr=False, default_factory=list)
    # hold: set once a request is held (FaultProxy.wait_held)
    _holding: threading.Event = field(init=False, repr=False, default_factory=threading.Event)

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"action {self.action!r}: use one of {ACTIONS}")
        if self.times is not None and self.times < 0:
            raise ValueError(f"times={self.times}: a count of requests, or None for every one")
        if self.fraction is not None and not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"fraction={self.fraction}: a probability in [0, 1]")
        if self.after_bytes is not None and self.after_bytes < 0:
            raise ValueError(f"after_bytes={self.after_bytes}: a count of body bytes")
        if self.action == "respond" and not (isinstance(self.status, int) and 100 <= self.status <= 599):
            raise ValueError(f"status={self.status!r}: an HTTP status code to answer with")
        if self.action == "truncate" and self.after_bytes is None:
            raise ValueError("truncate needs after_bytes: how many body bytes get through")
        self._rng = random.Random(self.seed)

    def claim(self, method: str, path: str) -> bool:
        """Whether this rule applies to the request (counted in hits if so)."""
        if self.times is not None and self.hits >= self.times:
            return False
        if self.method is not None and self.method != method:
            return False
        if not fnmatch.fnmatchcase(path, self.path):
            return False
        if self.fraction is not None and self._rng.random() >= self.fraction:
            return False
        self.hits += 1
        return True


class _Link:
    """One direction of the emulated network, shared by all connections."""

    def __init__(self):
        self.delay_s = 0.0
        self.bytes_per_s: float | None = None
        self._free_at = 0.0

    @property
    def transparent(self) -> bool:
        return self.delay_s == 0.0 and self.bytes_per_s is None

    def delivery_time(self, nbytes: int, arrived: float) -> float:
        if self.bytes_per_s is None:
            return arrived + self.delay_s
        start = max(arrived, self._free_at)
        self._free_at = start + nbytes / self.bytes_per_s
        return self._free_at + self.delay_s


class _DelayLine:
    """Writes to one end of a connection what the other end sent, each piece
    at the time the link delivers it, in order; bounded (the reader waits)."""

    def __init__(self, writer: asyncio.StreamWriter, link: _Link):
        self._writer = writer
        self._link = link
        self._queue: asyncio.Queue = asyncio.Queue(QUEUED_CHUNKS)
        self._pending = 0
        self._task: asyncio.Task | None = None
        self._broken: BaseException | None = None

    async def send(self, data: bytes, arrived: float | None = None) -> None:
        if self._broken is not None:
            raise ConnectionError(f"peer gone: {self._broken!r}")
        if not data:
            return
        loop = asyncio.get_running_loop()
        if self._link.transparent and self._pending == 0:
            self._writer.write(data)
            await self._writer.drain()
            return
        if self._task is None:
            self._task = loop.create_task(self._deliver())
        self._pending += 1
        when = self._link.delivery_time(len(data), loop.time() if arrived is None else arrived)
        await self._queue.put((when, data))

    async def flush(self) -> None:
        """Until everything sent so far is written."""
        if self._pending:
            await self._queue.join()
        if self._broken is not None:
            raise ConnectionError(f"peer gone: {self._broken!r}")

    async def _deliver(self) -> None:
        """Writes queued pieces on time; after a write failed, only empties
        the queue, so that a sender never waits on a dead peer."""
        loop = asyncio.get_running_loop()
        while True:
            when, data = await self._queue.get()
            try:
                if self._broken is None:
                    wait = when - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    self._writer.write(data)
                    await self._writer.drain()
            except (ConnectionError, OSError) as e:
                self._broken = e
            finally:
                self._pending -= 1
                self._queue.task_done()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


class _Head(NamedTuple):
    raw: bytes
    start_line: str
    headers: dict[str, str]   # lower-cased names; the last of repeated ones
    arrived: float


class _Cut(Exception):
    """The rule's byte budget for a response body is spent."""


class _BodySink:
    """Sends body bytes down a delay line until `budget` bytes were sent,
    then raises _Cut (None: no budget)."""

    def __init__(self, line: _DelayLine, budget: int | None):
        self._line = line
        self._left = budget

    async def send(self, data: bytes, arrived: float | None = None) -> None:
        if self._left is not None and len(data) >= self._left:
            await self._line.send(data[:self._left], arrived)
            self._left = 0
            raise _Cut()
        if self._left is not None:
            self._left -= len(data)
        await self._line.send(data, arrived)


async def _read_head(reader: asyncio.StreamReader) -> _Head | None:
    """The next message head, None at a clean end of the stream."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if e.partial.strip():
            raise ConnectionError("connection closed in the middle of a message head") from None
        return None
    lines = raw.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    return _Head(raw, lines[0], headers, asyncio.get_running_loop().time())


def _body_framing(head: _Head) -> tuple[str, int]:
    """("chunked", 0), ("length", n) or ("none", 0) from the headers."""
    if "chunked" in head.headers.get("transfer-encoding", "").lower():
        return "chunked", 0
    if "content-length" in head.headers:
        return "length", int(head.headers["content-length"])
    return "none", 0


async def _relay_body(reader: asyncio.StreamReader, framing: tuple[str, int], sink,
                      until_eof: bool = False) -> None:
    """Copies one body from reader to sink, as framed."""
    kind, length = framing
    loop = asyncio.get_running_loop()
    if kind == "length":
        left = length
        while left:
            data = await reader.read(min(left, CHUNK_BYTES))
            if not data:
                raise ConnectionError(f"peer closed with {left} body bytes still to come")
            left -= len(data)
            await sink.send(data, loop.time())
    elif kind == "chunked":
        await _relay_chunked(reader, sink)
    elif until_eof:
        while data := await reader.read(CHUNK_BYTES):
            await sink.send(data, loop.time())


async def _relay_chunked(reader: asyncio.StreamReader, sink) -> None:
    loop = asyncio.get_running_loop()
    while True:
        size_line = await reader.readuntil(b"\r\n")
        await sink.send(size_line, loop.time())
        size = int(size_line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            while True:   # trailers, then the empty line
                line = await reader.readuntil(b"\r\n")
                await sink.send(line, loop.time())
                if line == b"\r\n":
                    return
        left = size + 2   # the data and its CRLF
        while left:
            data = await reader.read(min(left, CHUNK_BYTES))
            if not data:
                raise ConnectionError("peer closed inside a chunk")
            left -= len(data)
            await sink.send(data, loop.time())


def _carries_body(framing: tuple[str, int]) -> bool:
    return framing not in (("none", 0), ("length", 0))


def _response_has_body(method: str, status: int) -> bool:
    return method != "HEAD" and not (100 <= status < 200 or status in (204, 304))


def _status_of(head: _Head) -> int:
    return int(head.start_line.split(" ", 2)[1])


def _error_response(status: int, method: str, path: str, close: bool) -> bytes:
    code = S3_ERROR_CODES.get(status, "FaultProxy")
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>injected by faultproxy</Message><Resource>{path}</Resource>"
            f"<RequestId>faultproxy</RequestId></Error>").encode()
    head = (f"HTTP/1.1 {status} {REASONS.get(status, 'Fault')}\r\n"
            f"Content-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
            f"x-amz-request-id: faultproxy\r\n"
            + ("Connection: close\r\n" if close else "") + "\r\n").encode()
    return head + (body if method != "HEAD" else b"")


def _reset(writer: asyncio.StreamWriter) -> None:
    """Closes with RST: SO_LINGER on, timeout 0."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class _Connection:
    """One client connection and its own upstream connection."""

    def __init__(self, shared: _Shared, reader, writer):
        self.shared = shared
        self.client_reader, self.client_writer = reader, writer
        self.to_client = _DelayLine(writer, shared.down)
        self.upstream_reader = self.upstream_writer = self.to_upstream = None

    async def serve(self) -> None:
        try:
            while await self._one_request():
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass   # either side went away: what a client would see, not the proxy's failure
        finally:
            self._close_upstream()
            self.to_client.close()
            await self._close_client()

    async def _close_client(self) -> None:
        """FIN after what is buffered (a truncated body arrives whole);
        bounded, then abort."""
        writer = self.client_writer
        if self.shared.stopping:
            writer.transport.abort()
            return
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), CLOSE_TIMEOUT_S)
        except (asyncio.TimeoutError, ConnectionError, OSError):
            writer.transport.abort()

    async def _one_request(self) -> bool:
        """Handles one request; False when the connection is to end."""
        head = await _read_head(self.client_reader)
        if head is None:
            return False
        method, target = head.start_line.split(" ", 2)[:2]
        split = urlsplit(target)
        path = unquote(split.path)
        rule = self.shared.rule_for(method, path)
        self.shared.record(Seen(method, path, split.query, rule.action if rule else "pass",
                                rule.status if rule else None))
        if rule is not None and rule.action == "hold":
            await self._hold(rule)
            return await self._forward(head, method, None)
        if rule is None or rule.after_bytes is not None:
            return await self._forward(head, method, rule)
        await self._arrive(head)
        if rule.action == "respond":
            return await self._respond(head, method, path, rule.status)
        if rule.action == "reset":
            _reset(self.client_writer)
        else:   # stall
            await self._stall()
        return False

    async def _arrive(self, head: _Head) -> None:
        """The one-way delay a request answered here takes to reach us."""
        wait = head.arrived + self.shared.up.delay_s - asyncio.get_running_loop().time()
        if wait > 0:
            await asyncio.sleep(wait)

    async def _respond(self, head: _Head, method: str, path: str, status: int) -> bool:
        framing = _body_framing(head)
        has_body = _carries_body(framing)
        # A client that waits for 100 Continue will not send its body: the
        # stream cannot be resynchronised, so answer and close.
        close = has_body and head.headers.get("expect", "").lower() == "100-continue"
        if not close:
            await _relay_body(self.client_reader, framing, _Discard())
        await self.to_client.send(_error_response(status, method, path, close))
        await self.to_client.flush()
        return not close

    async def _hold(self, rule: Rule) -> None:
        """Until the test removes the rule (or the proxy stops: cancelled)."""
        released = asyncio.Event()
        with self.shared.lock:
            if rule not in self.shared.rules:
                return   # removed while this request was being matched
            rule._held.append(released)
        rule._holding.set()
        await released.wait()

    async def _stall(self) -> None:
        """Until the client closes (its deadline) or the proxy stops."""
        await self.to_client.flush()
        while await self.client_reader.read(CHUNK_BYTES):
            pass

    async def _forward(self, head: _Head, method: str, rule: Rule | None) -> bool:
        await self._open_upstream()
        await self.to_upstream.send(head.raw, head.arrived)
        framing = _body_framing(head)
        if head.headers.get("expect", "").lower() == "100-continue" and _carries_body(framing):
            response = await self._read_upstream_head()
            if _status_of(response) != 100:
                # refused before the body, which the client may still send: do not reuse
                await self._forward_response(method, response, rule)
                return False
            await self.to_client.send(response.raw, response.arrived)
        await _relay_body(self.client_reader, framing, self.to_upstream)
        response = await self._read_upstream_head()
        while _status_of(response) == 100:   # an unasked-for 100 Continue
            await self.to_client.send(response.raw, response.arrived)
            response = await self._read_upstream_head()
        return await self._forward_response(method, response, rule)

    async def _forward_response(self, method: str, response: _Head, rule: Rule | None) -> bool:
        """Relays the response (cut as the rule says); whether the
        connection can carry another request."""
        has_body = _response_has_body(method, _status_of(response))
        framing = _body_framing(response) if has_body else ("none", 0)
        until_eof = has_body and framing[0] == "none"   # HTTP/1.0 style: the body ends at close
        await self.to_client.send(response.raw, response.arrived)
        try:
            await _relay_body(self.upstream_reader, framing,
                              _BodySink(self.to_client, rule.after_bytes if rule else None),
                              until_eof=until_eof)
        except _Cut:
            await self._cut(rule)
            return False
        await self.to_client.flush()
        return not until_eof and "close" not in response.headers.get("connection", "").lower()

    async def _cut(self, rule: Rule) -> None:
        self._close_upstream()
        await self.to_client.flush()
        if rule.action == "reset":
            _reset(self.client_writer)
        elif rule.action == "stall":
            await self._stall()

    async def _read_upstream_head(self) -> _Head:
        head = await _read_head(self.upstream_reader)
        if head is None:
            raise ConnectionError("the server closed the connection before answering")
        return head

    async def _open_upstream(self) -> None:
        if self.upstream_reader is not None and not self.upstream_reader.at_eof():
            return
        self._close_upstream()
        host, port = self.shared.upstream
        self.upstream_reader, self.upstream_writer = await asyncio.open_connection(
            host, port, limit=STREAM_LIMIT_BYTES)
        self.to_upstream = _DelayLine(self.upstream_writer, self.shared.up)

    def _close_upstream(self) -> None:
        if self.to_upstream is not None:
            self.to_upstream.close()
        if self.upstream_writer is not None:
            self.upstream_writer.transport.abort()
        self.upstream_reader = self.upstream_writer = self.to_upstream = None


class _Discard:
    async def send(self, data: bytes, arrived: float | None = None) -> None:
        pass


class _Shared:
    """What the test's thread and the proxy's loop both touch: the links,
    the rules and the record of requests (under one lock)."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self.up, self.down = _Link(), _Link()
        self.lock = threading.Lock()
        self.rules: list[Rule] = []
        self.seen: list[Seen] = []
        self.connections = 0
        self.stopping = False

    def rule_for(self, method: str, path: str) -> Rule | None:
        with self.lock:
            for rule in self.rules:
                if rule.claim(method, path):
                    return rule
        return None

    def record(self, seen: Seen) -> None:
        with self.lock:
            self.seen.append(seen)

    def count_connection(self) -> None:
        with self.lock:
            self.connections += 1


class FaultProxy:
    """A proxy on 127.0.0.1 (a free port) in front of `upstream_url`; see the
    module's docstring. Start with `start()` or `with`."""

    def __init__(self, upstream_url: str, *, delay_ms: float = 0.0,
                 bandwidth: float | None = None):
        split = urlsplit(upstream_url)
        if split.scheme != "http" or not split.hostname or not split.port:
            raise ValueError(f"upstream_url {upstream_url!r}: give http://host:port (TLS is not proxied)")
        self._shared = _Shared((split.hostname, split.port))
        self.set_link(delay_ms=delay_ms, bandwidth=bandwidth)
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._failure: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def round_trip_ms(self) -> float:
        """The emulated round trip: both directions' delays."""
        return (self._shared.up.delay_s + self._shared.down.delay_s) * 1000.0

    @property
    def connections(self) -> int:
        """Client connections accepted (fewer than requests: keep-alive)."""
        return self._shared.connections

    # --- rules (from the test's thread, at any time) ------------------------------------

    def set_link(self, *, delay_ms: float | None = None, bandwidth: float | None | bool = False) -> None:
        """delay_ms: one-way delay in each direction (a round trip: twice
        that); bandwidth: bytes/s in each direction, None for no cap (leave
        out to keep the current one)."""
        if delay_ms is not None:
            if delay_ms < 0:
                raise ValueError(f"delay_ms={delay_ms}: a delay cannot be negative")
            self._shared.up.delay_s = self._shared.down.delay_s = delay_ms / 1000.0
        if bandwidth is not False:
            if bandwidth is not None and bandwidth <= 0:
                raise ValueError(f"bandwidth={bandwidth}: bytes per second > 0, or None for no cap")
            self._shared.up.bytes_per_s = self._shared.down.bytes_per_s = bandwidth

    def respond(self, status: int, **match) -> Rule:
        """Answer `status` (S3-style XML error body) instead of forwarding."""
        return self._add(Rule("respond", status=status, **match))

    def truncate(self, after_bytes: int, **match) -> Rule:
        """Forward, then close after the head and `after_bytes` of the body."""
        return self._add(Rule("truncate", after_bytes=after_bytes, **match))

    def stall(self, after_bytes: int | None = None, **match) -> Rule:
        """Send nothing (None) or the head and `after_bytes` of the body, then
        nothing more until the client closes."""
        return self._add(Rule("stall", after_bytes=after_bytes, **match))

    def reset(self, after_bytes: int | None = None, **match) -> Rule:
        """A TCP reset instead of the response (None) or after the head and
        `after_bytes` of the body."""
        return self._add(Rule("reset", after_bytes=after_bytes, **match))

    def hold(self, **match) -> Rule:
        """Keep matching requests waiting, unanswered, until `remove(rule)`;
        then forward them (the client's own deadline still applies)."""
        return self._add(Rule("hold", **match))

    def wait_held(self, rule: Rule, timeout: float) -> bool:
        """Wait until a request is held by `rule` (a hold()); False if none
        came within timeout seconds."""
        return rule._holding.wait(timeout)

    def remove(self, rule: Rule) -> None:
        with self._shared.lock:
            self._shared.rules.remove(rule)
            held, rule._held = rule._held, []
        for released in held:
            self._loop.call_soon_threadsafe(released.set)

    def clear(self) -> None:
        """Removes every rule (the link's delay and bandwidth stay)."""
        with self._shared.lock:
            self._shared.rules.clear()

    def _add(self, rule: Rule) -> Rule:
        with self._shared.lock:
            self._shared.rules.append(rule)
        return rule

    # --- what was seen ------------------------------------------------------------------

    @property
    def seen(self) -> list[Seen]:
        with self._shared.lock:
            return list(self._shared.seen)

    def count(self, *, method: str | None = None, path: str = "*", action: str | None = None) -> int:
        """How many requests matched (glob on the path)."""
        return sum(1 for s in self.seen
                   if (method is None or s.method == method) and fnmatch.fnmatchcase(s.path, path)
                   and (action is None or s.action == action))

    def reset_counts(self) -> None:
        """Forgets the requests and connections seen so far."""
        with self._shared.lock:
            self._shared.seen.clear()
            self._shared.connections = 0

    # --- lifetime -----------------------------------------------------------------------

    def start(self) -> FaultProxy:
        if self._thread is not None:
            raise FaultProxyError("FaultProxy already started")
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="faultproxy", daemon=True)
        self._thread.start()
        if not ready.wait(START_TIMEOUT_S):
            raise FaultProxyError(f"the proxy's thread did not start within {START_TIMEOUT_S:.0f} s")
        if self._failure is not None:
            self._thread.join(STOP_TIMEOUT_S)
            raise FaultProxyError(f"the proxy could not listen: {self._failure!r}")
        return self

    def stop(self) -> None:
        """Closes the listener and every connection, ends the thread (bounded)."""
        if self._thread is None:
            return
        if self._loop is not None and self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        self._thread.join(STOP_TIMEOUT_S)
        alive = self._thread.is_alive()
        self._thread = None
        if alive:
            raise FaultProxyError(f"the proxy's thread did not end within {STOP_TIMEOUT_S:.0f} s")

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self._server = loop.run_until_complete(asyncio.start_server(
                self._accept, "127.0.0.1", 0, limit=STREAM_LIMIT_BYTES))
            self.port = self._server.sockets[0].getsockname()[1]
        except BaseException as e:   # reported by start()
            self._failure = e
            ready.set()
            loop.close()
            return
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _accept(self, reader, writer) -> None:
        self._shared.count_connection()
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            await _Connection(self._shared, reader, writer).serve()
        except asyncio.CancelledError:
            pass   # stop(): asyncio's stream callback must not see a cancelled task
        finally:
            self._tasks.discard(task)

    async def _shutdown(self) -> None:
        self._shared.stopping = True
        self._server.close()
        # connections first (they abort their sockets), then what is left:
        # delay lines' writers, a wait_closed
        for group in (set(self._tasks), asyncio.all_tasks() - {asyncio.current_task()}):
            for task in group:
                task.cancel()
            if group:
                await asyncio.wait(group, timeout=STOP_TIMEOUT_S / 4)
        await asyncio.wait_for(self._server.wait_closed(), STOP_TIMEOUT_S / 4)
        asyncio.get_running_loop().stop()


__all__ = ["FaultProxy", "FaultProxyError", "Rule", "Seen"]
