"""The proxy's side of the upstream connection: HTTP/1.1 keep-alive, bytes in and out.

For plain-HTTP upstreams (an engine on this host or this network: the case that matters) the
proxy speaks HTTP/1.1 itself over asyncio, with responses parsed by httptools (llhttp, which
uvicorn already uses). That costs a few tens of microseconds per call, where a general-purpose
client such as httpx costs several hundred, most of the proxy's whole budget. HTTPS upstreams go
through httpx. Both hand back an `UpstreamResponse`: status, headers, and the body as it arrives.

Errors are three kinds: the upstream could not be reached (nothing was sent), it did not answer
in time, or it broke off mid-answer. A keep-alive connection the upstream closed while idle is
retried once on a fresh one, and only when not a byte of the answer came back.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

try:
    import httptools
except ImportError:  # pragma: no cover - uvicorn[standard] brings it
    httptools = None  # type: ignore[assignment]

_HIGH_WATER = 1 << 20  # buffered answer bytes at which reading from the upstream pauses


class UpstreamError(Exception):
    """The upstream failed; the subclass says how."""


class UpstreamUnreachable(UpstreamError):
    """No connection could be made; nothing was sent."""


class UpstreamTimeout(UpstreamError):
    """No answer, or no next bytes of one, within the timeout."""


class UpstreamBroken(UpstreamError):
    """The connection closed, or the bytes were not HTTP, in the middle of an answer."""


class UpstreamResponse:
    """An answer in progress: status and headers are known, the body comes as it arrives."""

    status_code: int
    headers: list[tuple[bytes, bytes]]
    """Header names in lower case, in the upstream's order."""

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def aiter_raw(self) -> AsyncIterator[bytes]:
        raise NotImplementedError

    async def aread(self) -> bytes:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError


def _expire(future: asyncio.Future, message: str) -> None:
    if not future.done():
        future.set_exception(UpstreamTimeout(message))


async def _within(future: asyncio.Future, timeout: float, message: str):
    handle = asyncio.get_running_loop().call_later(timeout, _expire, future, message)
    try:
        return await future
    finally:
        handle.cancel()


class _Answer(UpstreamResponse):
    """The answer to one request on one `_Connection`."""

    def __init__(self, connection: "_Connection", timeout: float):
        self._connection = connection
        self._timeout = timeout
        loop = asyncio.get_running_loop()
        self._loop = loop
        self.head: asyncio.Future = loop.create_future()
        self.status_code = 0
        self.headers = []
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future | None = None
        self.complete = False
        self.error: UpstreamError | None = None
        self.got_bytes = False
        self._read: bytes | None = None
        self._closed = False

    # -- called by the connection --------------------------------------------------------------
    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > _HIGH_WATER:
            self._connection.pause()
        self._wake()

    def finish(self) -> None:
        self.complete = True
        self._wake()

    def fail(self, error: UpstreamError) -> None:
        if self.complete or self.error is not None:
            return
        self.error = error
        if not self.head.done():
            self.head.set_exception(error)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(error)

    # -- called by the proxy ---------------------------------------------------------------------
    async def aiter_raw(self) -> AsyncIterator[bytes]:
        if self._read is not None:
            if self._read:
                yield self._read
            return
        while True:
            if self._chunks:
                data = b"".join(self._chunks) if len(self._chunks) > 1 else self._chunks[0]
                self._chunks.clear()
                self._buffered = 0
                self._connection.resume()
                yield data
                continue
            if self.complete:
                return
            if self.error is not None:
                raise self.error
            self._waiter = self._loop.create_future()
            await _within(self._waiter, self._timeout, "the upstream stopped sending")

    async def aread(self) -> bytes:
        if self._read is None:
            self._read = b"".join([chunk async for chunk in self.aiter_raw()])
        return self._read

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._connection.done(self)


class _Connection(asyncio.Protocol):
    """One keep-alive connection; answers are parsed by httptools as the bytes arrive."""

    def __init__(self, pool: "RawUpstream"):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: _Answer | None = None
        self.closed = False
        self.paused = False
        self.head_only = False
        self.uses = 0

    # -- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        answer = self.answer
        if answer is None:  # bytes nobody asked for: this connection cannot be trusted again
            self.close()
            return
        answer.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            answer.fail(UpstreamBroken(f"unreadable answer from the upstream: {exc}"))
            self.close()

    def connection_lost(self, exc) -> None:
        self.closed = True
        answer = self.answer
        if answer is not None and not answer.complete:
            if answer.head.done() and not answer.error and self._ends_at_close():
                answer.finish()
            else:
                answer.fail(UpstreamBroken("the upstream closed the connection mid-answer"
                                           if answer.got_bytes else "the upstream closed the connection"))

    # -- httptools callbacks ---------------------------------------------------------------------
    def _current(self) -> _Answer:
        """The answer being parsed (the parser calls back only while ``send`` has one in flight)."""
        assert self.answer is not None, "a parser callback with no answer in flight"
        return self.answer

    def on_header(self, name: bytes, value: bytes) -> None:
        self._current().headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        answer = self._current()
        answer.status_code = self.parser.get_status_code()
        if not answer.head.done():
            answer.head.set_result(None)
        if self.head_only:  # an answer to HEAD has no body, whatever its headers say
            answer.finish()
            self.closed = True  # the parser would wait for that body: use a new connection next time

    def on_body(self, body: bytes) -> None:
        self._current().feed(bytes(body))

    def on_message_complete(self) -> None:
        self._current().finish()

    # -- used by the pool and the answer ----------------------------------------------------------
    def _ends_at_close(self) -> bool:
        """An answer without Content-Length or chunking runs until the connection closes."""
        names = {name for name, _ in self._current().headers}
        return b"content-length" not in names and b"transfer-encoding" not in names

    def send(self, data: bytes, timeout: float, *, head_only: bool = False) -> _Answer:
        self.uses += 1
        self.head_only = head_only
        self.answer = _Answer(self, timeout)
        assert self.transport is not None  # the pool hands out connected connections only
        self.transport.write(data)
        return self.answer

    def pause(self) -> None:
        if not self.paused and not self.closed and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and not self.closed and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def done(self, answer: _Answer) -> None:
        reusable = answer.complete and not self.closed and self.parser.should_keep_alive()
        self.answer = None
        if reusable:
            self.resume()
            self.pool.give_back(self)
        else:
            self.close()
            self.pool.give_back(None)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class RawUpstream:
    """Plain-HTTP upstream over a pool of keep-alive connections."""

    def __init__(self, base_url: str, *, max_connections: int, timeout_s: float, connect_timeout_s: float):
        if httptools is None:
            raise RuntimeError("httptools is not installed")
        parts = urlsplit(base_url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.host_header = parts.netloc.encode()
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(max_connections)

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self), self.host, self.port), self.connect_timeout_s)
        except asyncio.TimeoutError:
            raise UpstreamUnreachable(f"no connection to {self.host}:{self.port} "
                                      f"within {self.connect_timeout_s:g}s") from None
        except OSError as exc:
            raise UpstreamUnreachable(f"no connection to {self.host}:{self.port}: {exc}") from None
        return connection

    def give_back(self, connection: _Connection | None) -> None:
        if connection is not None:
            self._idle.append(connection)
        self._slots.release()

    async def send(self, method: str, target: str, headers: list[tuple[bytes, bytes]], body: bytes) -> UpstreamResponse:
        """Send one request; return once the answer's status and headers are in."""
        lines = [f"{method} {self.prefix}{target} HTTP/1.1\r\n".encode(), b"host: ", self.host_header, b"\r\n"]
        for name, value in headers:
            lines += (name, b": ", value, b"\r\n")
        if body or method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
            lines.append(b"content-length: %d\r\n" % len(body))
        lines += (b"\r\n", body)
        request = b"".join(lines)
        await self._slots.acquire()
        try:
            for _ in range(2):
                connection = None
                while self._idle:
                    candidate = self._idle.pop()
                    if (not candidate.closed and candidate.transport is not None
                            and not candidate.transport.is_closing()):
                        connection = candidate
                        break
                reused = connection is not None
                if connection is None:
                    connection = await self._connect()
                answer = connection.send(request, self.timeout_s, head_only=method == "HEAD")
                try:
                    await _within(answer.head, self.timeout_s, "the upstream did not answer")
                except UpstreamBroken:
                    connection.close()
                    if reused and not answer.got_bytes:
                        continue  # the upstream closed this idle connection as we sent: once more, fresh
                    raise
                except BaseException:
                    connection.close()
                    raise
                return answer
            raise UpstreamBroken("the upstream closed the connection")  # pragma: no cover
        except BaseException:
            self._slots.release()
            raise

    async def aclose(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()


class _HttpxAnswer(UpstreamResponse):
    def __init__(self, response):
        self._response = response
        self.status_code = response.status_code
        self.headers = [(k.lower(), v) for k, v in response.headers.raw]

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        import httpx

        try:
            async for data in self._response.aiter_raw():
                yield data
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(f"the upstream stopped sending: {exc!r}") from None
        except httpx.HTTPError as exc:
            raise UpstreamBroken(f"the upstream broke off: {exc!r}") from None

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_raw()])

    async def aclose(self) -> None:
        await self._response.aclose()


class HttpxUpstream:
    """Any upstream (HTTPS included) through one shared keep-alive `httpx.AsyncClient`."""

    def __init__(self, base_url: str, *, max_connections: int, timeout_s: float, connect_timeout_s: float):
        import httpx

        self.base_url = base_url
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                              keepalive_expiry=60)
        self.client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
                                        trust_env=False, follow_redirects=False)

    async def send(self, method: str, target: str, headers: list[tuple[bytes, bytes]], body: bytes) -> UpstreamResponse:
        import httpx

        request = self.client.build_request(method, self.base_url + target, headers=headers, content=body)
        try:
            return _HttpxAnswer(await self.client.send(request, stream=True))
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(f"the upstream did not answer: {exc!r}") from None
        except httpx.HTTPError as exc:
            raise UpstreamUnreachable(f"upstream unreachable: {exc!r}") from None

    async def aclose(self) -> None:
        await self.client.aclose()


def connect(base_url: str, *, max_connections: int, timeout_s: float,
            connect_timeout_s: float) -> RawUpstream | HttpxUpstream:
    """The fastest client that can reach `base_url`."""
    kind = RawUpstream if base_url.startswith("http://") and httptools is not None else HttpxUpstream
    return kind(base_url, max_connections=max_connections, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s)
