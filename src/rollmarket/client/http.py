"""The HTTP plumbing both clients share: encoding, retries, typed errors."""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Literal, TypeVar

import httpx
from pydantic import BaseModel, TypeAdapter

from ..contracts.wire import JSON, MSGPACK, packb, unpackb
from .errors import ExchangeUnavailable, error_for

log = logging.getLogger(__name__)
M = TypeVar("M")

Wire = Literal["msgpack", "json"]
_RETRY_STATUS = {502, 503, 504}


class HttpClient:
    """A thin httpx wrapper. Idempotent calls retry on connection errors and 502/503/504."""

    def __init__(self, url: str, token: str | None = None, *, timeout: float = 60.0, retries: int = 4,
                 wire: Wire = "msgpack", transport: httpx.BaseTransport | None = None):
        self.url = url.rstrip("/")
        self.token = token
        self.retries = retries
        self.wire = wire
        self._http = httpx.Client(base_url=self.url, timeout=timeout, transport=transport,
                                  headers={"user-agent": "rollmarket-client"})

    def close(self) -> None:
        self._http.close()

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
        attempts = self.retries + 1 if idempotent else 1
        for attempt in range(attempts):
            try:
                response = self._http.request(method, path, content=content, params=params,
                                              headers=request_headers)
            except httpx.TransportError as exc:
                if attempt + 1 >= attempts:
                    raise ExchangeUnavailable(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
                log.debug("retrying %s %s after %s", method, path, exc)
                time.sleep(min(0.1 * 2**attempt, 2.0))
                continue
            if response.status_code in _RETRY_STATUS and attempt + 1 < attempts:
                time.sleep(min(0.1 * 2**attempt, 2.0))
                continue
            return self._answer(response, answer)
        raise AssertionError("unreachable")

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
