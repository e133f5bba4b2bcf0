"""The HTTP plumbing both clients share: encoding, retries with backoff, typed errors.

Retries use tenacity: exponential backoff with jitter, bounded in attempts and in total time.
What is retried:

- a request that never left (the connection was refused or could not be opened): every call,
  since the exchange cannot have acted on it;
- any other transport failure and 502/503/504: only calls marked idempotent, which are safe to
  repeat (heartbeats, reload acks, submissions — the exchange answers a resubmitted group with
  its first receipt —, enqueues — idempotency keys —, policy publishes of the same content, reads).

Several replicas: the client takes a list of base URLs (or one string of them separated by
commas) and sticks with one while it answers. A transport error or a 502/503/504 moves the client to
the next URL — for the following call, and for this call's retry when the rules above allow one,
which goes out at once on the new URL (the backoff applies after a round of all of them).

`wait_for_exchange` is for a process's first contact: it waits (with backoff, for minutes if need
be) until one of the URLs answers, saying so in one log line every few seconds.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

import httpx
from pydantic import BaseModel, TypeAdapter
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential_jitter,
)
from tenacity.stop import stop_base

from ..contracts.wire import JSON, MSGPACK, packb, unpackb
from .errors import ExchangeUnavailable, ExchangeUnreachable, error_for

log = logging.getLogger(__name__)
M = TypeVar("M")

Wire = Literal["msgpack", "json"]
RETRY_STATUS = frozenset({502, 503, 504})
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)
"""Transport errors after which the request certainly never reached the server."""


class _RetryableStatus(Exception):
    """A 502/503/504 answer, raised so that tenacity retries it; carries the last response."""

    def __init__(self, response: httpx.Response):
        super().__init__(f"HTTP {response.status_code}")
        self.response = response


def exchange_urls(urls: str | Sequence[str]) -> tuple[str, ...]:
    """Base URLs from a list or from one string of them separated by commas ('http://a:1,http://b:2')."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    cleaned = tuple(u.strip().rstrip("/") for u in items if u.strip())
    if not cleaned:
        raise ValueError("no exchange URL given")
    return cleaned


def describe(exc: BaseException | None) -> str:
    """A short reason for a failed contact, for one log line: 'connection refused', 'HTTP 503'."""
    if exc is None:
        return "no error"
    if isinstance(exc, _RetryableStatus):
        return str(exc)
    if isinstance(exc, httpx.ConnectError):
        text = str(exc).lower()
        if "refused" in text:
            return "connection refused"
        if "name or service" in text or "nodename" in text or "name resolution" in text:
            return "host not found"
        return f"cannot connect: {exc}" if str(exc) else "cannot connect"
    if isinstance(exc, httpx.TimeoutException):
        return f"timed out ({type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class _StopWhenSet(stop_base):
    """Stop retrying once `event` is set (never, without one)."""

    def __init__(self, event: threading.Event | None):
        self.event = event

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self.event is not None and self.event.is_set()


def _last_error(state: RetryCallState) -> BaseException | None:
    return state.outcome.exception() if state.outcome is not None else None


class HttpClient:
    """A thin httpx wrapper with typed errors, retries and failover (see the module docstring).

    `urls` is one base URL, several (a list, or one string separated by commas) for exchange
    replicas. `retries` bounds the attempts after the first — plus one for each further URL, so
    that every replica gets a try —, `retry_total_s` the time spent retrying one call; waits grow
    from `backoff_initial_s` by doubling, with up to as much again of random jitter, to at most
    `backoff_max_s`.
    """

    def __init__(self, urls: str | Sequence[str], token: str | None = None, *, timeout: float = 60.0,
                 retries: int = 4, wire: Wire = "msgpack", transport: httpx.BaseTransport | None = None,
                 retry_total_s: float = 30.0, backoff_initial_s: float = 0.1, backoff_max_s: float = 2.0):
        self.urls = exchange_urls(urls)
        self.token = token
        self.retries = retries
        self.retry_total_s = retry_total_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.wire = wire
        self._clients = [httpx.Client(base_url=url, timeout=timeout, transport=transport,
                                      headers={"user-agent": "rollmarket-client"}) for url in self.urls]
        self._current = 0
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        """The base URL calls go to now."""
        return self.urls[self._current]

    def _fail_over(self, failed: int) -> None:
        """Move on from URL number `failed`, unless another thread already has."""
        if len(self.urls) == 1:
            return
        with self._lock:
            if self._current == failed:
                self._current = (failed + 1) % len(self.urls)
                log.info("exchange at %s failed; moving to %s", self.urls[failed], self.urls[self._current])

    def close(self) -> None:
        for client in self._clients:
            client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _headers(self, extra: dict[str, str] | None) -> dict[str, str]:
        headers = {"accept": f"{MSGPACK}, {JSON};q=0.5" if self.wire == "msgpack" else JSON}
        if self.token:
            headers["authorization"] = f"Bearer {self.token}"
        if extra:
            headers.update(extra)
        return headers

    def encode(self, body: Any) -> tuple[bytes, str]:
        if self.wire == "msgpack":
            return packb(body), MSGPACK
        if isinstance(body, BaseModel):
            return body.model_dump_json().encode(), JSON
        return json.dumps(body, default=lambda m: m.model_dump(mode="json")).encode(), JSON

    def _wait(self):
        return self._round_wait(wait_exponential_jitter(multiplier=self.backoff_initial_s, max=self.backoff_max_s,
                                                        jitter=self.backoff_initial_s))

    def _round_wait(self, backoff):
        """`backoff` after each full round of the URLs; a retry on the next URL goes at once."""
        rounds = len(self.urls)

        def wait(state: RetryCallState) -> float:
            return backoff(state) if state.attempt_number % rounds == 0 else 0.0

        return wait

    def call(self, method: str, path: str, *, body: Any = None, params: dict[str, Any] | None = None,
             answer: type[M] | Any = None, idempotent: bool = False,
             headers: dict[str, str] | None = None, content: bytes | None = None) -> M | Any:
        """Send a request and return the answer validated as `answer` (or plain data)."""
        request_headers = self._headers(headers)
        if content is None and body is not None:
            content, request_headers["content-type"] = self.encode(body)
        elif content is not None:
            request_headers.setdefault("content-type", MSGPACK if self.wire == "msgpack" else JSON)
        params = {k: v for k, v in (params or {}).items() if v is not None}

        def retryable(exc: BaseException) -> bool:
            if isinstance(exc, _NOT_SENT):
                return True
            return idempotent and isinstance(exc, (httpx.TransportError, _RetryableStatus))

        def send() -> httpx.Response:
            index = self._current
            try:
                response = self._clients[index].request(method, path, content=content, params=params,
                                                        headers=request_headers)
            except httpx.TransportError:
                self._fail_over(index)
                raise
            if response.status_code in RETRY_STATUS:
                self._fail_over(index)
                raise _RetryableStatus(response)
            return response

        def note(state: RetryCallState) -> None:
            log.debug("retrying %s %s in %.2fs after %s", method, path, state.upcoming_sleep,
                      describe(_last_error(state)))

        retrying = Retrying(
            stop=stop_after_attempt(self.retries + len(self.urls)) | stop_after_delay(self.retry_total_s),
            wait=self._wait(), retry=retry_if_exception(retryable), before_sleep=note, reraise=True,
        )
        try:
            response = retrying(send)
        except _RetryableStatus as last:
            response = last.response
        except httpx.TransportError as exc:
            raise ExchangeUnavailable(f"{method} {path}: {describe(exc)}") from exc
        return self._answer(response, answer)

    def wait_for_exchange(self, give_up_after_s: float, *, say_every_s: float = 5.0,
                          stop: threading.Event | None = None) -> None:
        """Block until one of the URLs answers `GET /healthz` (trying them in turn), backing off
        up to 5 s between rounds; the client then sticks with the one that answered.

        While none does, log one WARNING line — "waiting for the exchange at URL (reason);
        retrying in Ns" — at most every `say_every_s`. Raise ExchangeUnreachable (one line, no
        traceback needed) after `give_up_after_s`, or return early when `stop` is set.
        """
        said = [float("-inf")]
        started = time.monotonic()

        def healthy() -> None:
            index = self._current
            try:
                response = self._clients[index].get("/healthz", headers={"accept": JSON})
            except httpx.TransportError:
                self._fail_over(index)
                raise
            if response.status_code != 200:
                self._fail_over(index)
                raise _RetryableStatus(response)

        def say(state: RetryCallState) -> None:
            now = time.monotonic()
            if now - said[0] >= say_every_s:
                said[0] = now
                log.warning("waiting for the exchange at %s (%s); retrying in %.0fs", ", ".join(self.urls),
                            describe(_last_error(state)), max(state.upcoming_sleep, 1.0))

        def pause(seconds: float) -> None:
            if stop is not None:
                stop.wait(seconds)
            else:
                time.sleep(seconds)

        retrying = Retrying(
            stop=stop_after_delay(give_up_after_s) | _StopWhenSet(stop),
            wait=self._round_wait(wait_exponential_jitter(multiplier=0.2, max=5.0, jitter=0.5)),
            retry=retry_if_exception(lambda exc: isinstance(exc, (httpx.TransportError, _RetryableStatus))),
            before_sleep=say, reraise=True, sleep=pause,
        )
        try:
            retrying(healthy)
        except (httpx.TransportError, _RetryableStatus) as exc:
            if stop is not None and stop.is_set():
                return
            raise ExchangeUnreachable(
                f"the exchange at {', '.join(self.urls)} did not answer for "
                f"{time.monotonic() - started:.0f}s ({describe(exc)})") from None
        if said[0] > float("-inf"):
            log.warning("the exchange at %s answers; going on", self.url)

    @staticmethod
    def _decode(response: httpx.Response) -> Any:
        kind = response.headers.get("content-type", "").split(";")[0].strip()
        if kind == MSGPACK:
            return unpackb(response.content)
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            return response.text

    def _answer(self, response: httpx.Response, answer: Any) -> Any:
        data = self._decode(response)
        if response.status_code >= 400:
            raise error_for(response.status_code, data)
        if answer is None:
            return data
        if isinstance(answer, type) and issubclass(answer, BaseModel):
            return answer.model_validate(data)
        adapter = _ADAPTERS.get(answer)
        if adapter is None:
            adapter = _ADAPTERS[answer] = TypeAdapter(answer)
        return adapter.validate_python(data)


_ADAPTERS: dict[Any, TypeAdapter] = {}
