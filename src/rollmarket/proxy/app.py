"""The capture proxy's ASGI app: forward every `/v1/*` call, record the generation calls.

Generation calls (`POST /v1/chat/completions`, `POST /v1/completions`) are augmented (see
`augment.py`), forwarded over a pool of keep-alive connections (see `upstream.py`), and recorded
(see `capture.py`).
A streamed answer goes through event by event as it arrives; each event is parsed on the way to
accumulate the capture. Every other `/v1/*` call is forwarded byte for byte and not recorded.

Upstream errors reach the client unchanged (status, headers, body); an unreachable upstream is a
502 and a silent one a 504, both with an OpenAI-style error body. Every generation call is
recorded, errors included.

With `ack_after_write` the last bytes of each answer (the body of a whole answer, the final
`data: [DONE]` of a stream) leave only after the capture is committed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import __version__
from ..bodies import BodyError, parse_json
from ..contracts.capture import CaptureOutcome
from .augment import (
    GENERATION,
    NOTHING,
    REFUSABLE,
    Augmentation,
    augment_request,
    strip_chunk,
    strip_response,
)
from .capture import CallRecorder, CaptureDraft, parse_error_body
from .openapi import proxy_openapi
from .settings import ProxySettings
from .sse import DONE, EventSplitter, data_event, event_data
from .store import CaptureStore
from .upstream import (
    HttpxUpstream,
    RawUpstream,
    UpstreamBroken,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
    connect,
)

log = logging.getLogger(__name__)

# Hop-by-hop headers and those the proxy sets itself. Accept-Encoding is replaced by identity so
# that the answer can be read on the way; Content-Length is recomputed whenever a body changes.
_REQUEST_DROP = frozenset({b"host", b"connection", b"keep-alive", b"proxy-authorization", b"proxy-connection",
                           b"te", b"trailer", b"transfer-encoding", b"upgrade", b"content-length",
                           b"accept-encoding"})
_RESPONSE_DROP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"trailer",
                            b"transfer-encoding", b"upgrade", b"content-length"})


_RESPONSE_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed"})
"""The last event of a streamed Response, which has no `data: [DONE]`."""


def _dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def _error_body(code: str, message: str) -> bytes:
    return _dumps({"error": {"message": message, "type": code, "param": None, "code": code}})


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _wait_for_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class Proxy:
    """Forwards `/v1/*` to the upstream and records generation calls into a `CaptureStore`."""

    def __init__(self, settings: ProxySettings, store: CaptureStore | None = None):
        self.settings = settings
        self.store = store or CaptureStore(settings.store, synchronous=settings.sqlite_synchronous,
                                           batch_max=settings.write_batch_max,
                                           experts_shape=settings.experts_shape)
        self.upstream: RawUpstream | HttpxUpstream | None = None
        self._conversation_header = settings.conversation_header.lower().encode()
        self.calls = 0
        self.in_flight = 0
        self.outcomes: dict[str, int] = {}
        self._refused: frozenset[str] = frozenset()

    async def start(self) -> None:
        self.store.open(self.settings.model_dump(mode="json"))
        self.upstream = connect(self.settings.upstream, max_connections=self.settings.max_connections,
                                timeout_s=self.settings.timeout_s, connect_timeout_s=self.settings.connect_timeout_s)

    async def stop(self) -> None:
        if self.upstream is not None:
            await self.upstream.aclose()
        await asyncio.to_thread(self.store.close)

    # -- ASGI entry for /v1/* ---------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        received_at = time.time()
        t0 = time.perf_counter()
        body = await _read_body(receive)
        path = scope["path"]
        headers = [(k, v) for k, v in scope["headers"] if k not in _REQUEST_DROP]
        headers.append((b"accept-encoding", b"identity"))
        target = scope.get("raw_path") or path.encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        target = target.decode("latin-1")
        if scope["method"] != "POST" or path not in GENERATION:
            await self._forward(scope["method"], target, headers, body, send)
            return
        self.calls += 1
        self.in_flight += 1
        try:
            await self._generate(path, target, headers, body, receive, send, received_at, t0)
        finally:
            self.in_flight -= 1

    def _connected(self) -> RawUpstream | HttpxUpstream:
        if self.upstream is None:
            raise RuntimeError("the proxy's upstream client is not open: the app's lifespan has not started")
        return self.upstream

    async def _forward(self, method: str, target: str, headers: list, body: bytes, send) -> None:
        """Any other call: bytes in, bytes out, nothing recorded."""
        try:
            response = await self._connected().send(method, target, headers, body)
        except UpstreamError as exc:
            code = "upstream_timeout" if isinstance(exc, UpstreamTimeout) else "upstream_unreachable"
            await _send_whole(send, 504 if code == "upstream_timeout" else 502, [], _error_body(code, str(exc)))
            return
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": _response_headers(response)})
            async for data in response.aiter_raw():
                await send({"type": "http.response.body", "body": data, "more_body": True})
        except UpstreamError as exc:
            log.warning("upstream broke off %s %s: %s", method, target, exc)
        finally:
            await response.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    # -- generation calls -------------------------------------------------------------------------
    async def _generate(self, path: str, target: str, headers: list, body: bytes, receive, send,
                        received_at: float, t0: float) -> None:
        # A body the proxy cannot read (not JSON, nested too deep, a lone surrogate) is forwarded
        # untouched for the upstream to judge, and recorded without its request.
        unreadable = None
        try:
            request = parse_json(body)
        except BodyError as exc:
            request, unreadable = None, str(exc)
        if not isinstance(request, dict):
            request = None
        stream = bool(request and request.get("stream"))
        conversation = next((v.decode("latin-1") for k, v in headers if k == self._conversation_header), None)
        timings: dict[str, Any] = {"received_at": received_at}
        while True:
            aug: Augmentation = NOTHING
            upstream_body = body
            if request is not None and self.settings.augment:
                augmented, aug = augment_request(path, request, self._refused)
                if aug.any:
                    upstream_body = _dumps(augmented)
            recorder = CallRecorder(endpoint=path, stream=stream, upstream=self.settings.upstream, request=request,
                                    augmented=aug.added, header_conversation=conversation, received_at=received_at)
            if unreadable:
                recorder.notes.append(f"request not recorded: {unreadable}")
            t_sent = time.perf_counter()
            try:
                response = await self._connected().send("POST", target, headers, upstream_body)
            except UpstreamTimeout as exc:
                await self._fail(send, recorder, timings, t0, 504, CaptureOutcome.upstream_timeout,
                                 "upstream_timeout", str(exc))
                return
            except UpstreamError as exc:
                outcome = (CaptureOutcome.upstream_broken if isinstance(exc, UpstreamBroken)
                           else CaptureOutcome.upstream_unreachable)
                await self._fail(send, recorder, timings, t0, 502, outcome, outcome.value, str(exc))
                return
            if response.status_code == 400 and await self._refuses_extras(response, aug):
                await response.aclose()
                continue  # once per refused field for the life of the proxy
            break
        strip = aug if aug.any and not self.settings.keep_extras else None
        timings["upstream_headers_s"] = time.perf_counter() - t0
        try:
            content_type = response.header(b"content-type") or b""
            if response.status_code < 400 and content_type.startswith(b"text/event-stream"):
                await self._relay_stream(response, recorder, strip, receive, send, timings, t0, t_sent)
            else:
                await self._relay_whole(response, recorder, strip, send, timings, t0, t_sent)
        finally:
            await response.aclose()

    async def _refuses_extras(self, response: UpstreamResponse, aug: Augmentation) -> bool:
        """True when a 400 names an extension field the proxy added: that field is then never
        asked of this upstream again, and the call is re-sent without it."""
        added = [name for name in REFUSABLE if name in aug.added]
        if not added:
            return False
        try:
            raw = await response.aread()
        except UpstreamError:
            return False
        named = [name for name in added if name.encode() in raw]
        if named:
            log.warning("the upstream refuses %s; no longer asking for it", ", ".join(named))
            self._refused = self._refused | frozenset(named)
        return bool(named)

    async def _relay_whole(self, response: UpstreamResponse, recorder: CallRecorder, strip: Augmentation | None,
                           send, timings: dict, t0: float, t_sent: float) -> None:
        try:
            raw = await response.aread()
        except UpstreamError as exc:
            outcome = CaptureOutcome.upstream_timeout if isinstance(exc, UpstreamTimeout) \
                else CaptureOutcome.upstream_broken
            status = 504 if outcome is CaptureOutcome.upstream_timeout else 502
            await self._fail(send, recorder, timings, t0, status, outcome, outcome.value,
                             f"upstream broke off: {exc}", t_sent=t_sent)
            return
        t_done = time.perf_counter()
        out = raw
        error = None
        outcome = CaptureOutcome.ok
        encoded = (response.header(b"content-encoding") or b"identity") != b"identity"
        if response.status_code >= 400:
            outcome, error = CaptureOutcome.upstream_error, parse_error_body(raw)
        elif encoded:
            recorder.notes.append("the upstream answered with a content-encoding; passed through unread")
        else:
            try:
                answer = json.loads(raw)
            except ValueError:
                answer = None
                recorder.notes.append("the upstream's answer is not JSON")
            if isinstance(answer, dict):
                recorder.response(answer)
                if strip is not None:
                    out = _dumps(strip_response(answer, strip))
        headers = _response_headers(response)
        headers.append((b"content-length", str(len(out)).encode()))
        draft = recorder.draft(status_code=response.status_code, outcome=outcome, error=error,
                               timings=_finish(timings, t0, t_sent, t_done))
        await self._record(draft)
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": out, "more_body": False})

    async def _relay_stream(self, response: UpstreamResponse, recorder: CallRecorder, strip: Augmentation | None,
                            receive, send, timings: dict, t0: float, t_sent: float) -> None:
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": _response_headers(response)})
        state: dict[str, Any] = {"held": b"", "outcome": CaptureOutcome.ok}
        pump = asyncio.create_task(self._pump(response, recorder, strip, send, timings, t0, state))
        watcher = asyncio.create_task(_wait_for_disconnect(receive))
        await asyncio.wait((pump, watcher), return_when=asyncio.FIRST_COMPLETED)
        disconnected = not pump.done()
        if disconnected:
            pump.cancel()
            state["outcome"] = CaptureOutcome.client_disconnected
        else:
            watcher.cancel()
        try:
            await pump
        except asyncio.CancelledError:
            if not disconnected:
                raise
        except Exception as exc:  # the upstream broke off (or its stream could not be read): data, not a crash
            if not isinstance(exc, UpstreamError):
                log.exception("stream from %s could not be relayed", self.settings.upstream)
            state["outcome"] = (CaptureOutcome.upstream_timeout if isinstance(exc, UpstreamTimeout)
                                else CaptureOutcome.upstream_broken)
            recorder.error = {"message": f"upstream broke off mid-stream: {exc}", "type": state["outcome"].value}
            state["held"] = data_event(_dumps({"error": {**recorder.error, "param": None,
                                                         "code": state["outcome"].value}}))
        t_done = time.perf_counter()
        draft = recorder.draft(status_code=response.status_code, outcome=state["outcome"],
                               timings=_finish(timings, t0, t_sent, t_done))
        await self._record(draft)
        if not disconnected:
            await send({"type": "http.response.body", "body": state["held"], "more_body": False})

    async def _pump(self, response: UpstreamResponse, recorder: CallRecorder, strip: Augmentation | None,
                    send, timings: dict, t0: float, state: dict) -> None:
        """Forward the upstream's events as they arrive, all but the final [DONE], which is held."""
        splitter = EventSplitter()
        async for data in response.aiter_raw():
            out = []
            for event in splitter.feed(data):
                payload = event_data(event)
                if payload is None:  # comments and keep-alives
                    out.append(event)
                    continue
                if payload == DONE:
                    state["held"] += event
                    continue
                try:
                    chunk = json.loads(payload)
                except ValueError:
                    recorder.notes.append("a streamed event is not JSON")
                    out.append(event)
                    continue
                if not isinstance(chunk, dict):
                    out.append(event)
                    continue
                recorder.chunk(chunk)
                if "first_token_s" not in timings and recorder.saw_output:
                    timings["first_token_s"] = time.perf_counter() - t0
                if strip is not None:
                    stripped = strip_chunk(chunk, strip)
                    event = data_event(_dumps(stripped)) if stripped is not None else b""
                if chunk.get("type") in _RESPONSE_ENDS:
                    state["held"] += event  # a Responses stream's [DONE]: sent once the capture is written
                elif event:
                    out.append(event)
            if out:
                await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
        rest = splitter.rest()
        if rest.strip():
            recorder.notes.append("the stream ended inside an event")
            await send({"type": "http.response.body", "body": rest, "more_body": True})

    # -- recording ----------------------------------------------------------------------------------
    async def _record(self, draft: CaptureDraft) -> None:
        self.outcomes[draft.outcome.value] = self.outcomes.get(draft.outcome.value, 0) + 1
        future = self.store.submit_async(draft)
        if self.settings.ack_after_write:
            try:
                await future
            except Exception:  # logged by the store; the client still gets its answer
                pass
        else:
            future.add_done_callback(_log_failure)

    async def _fail(self, send, recorder: CallRecorder, timings: dict, t0: float, status: int,
                    outcome: CaptureOutcome, code: str, message: str, *, t_sent: float | None = None) -> None:
        body = _error_body(code, message)
        draft = recorder.draft(status_code=status, outcome=outcome, error=json.loads(body),
                               timings=_finish(timings, t0, t_sent, None))
        await self._record(draft)
        await _send_whole(send, status, [], body)

    def status(self) -> dict[str, Any]:
        return {
            "upstream": self.settings.upstream,
            "store": str(self.settings.store),
            "calls": self.calls,
            "in_flight": self.in_flight,
            "outcomes": dict(self.outcomes),
            "captures_written": self.store.written,
            "captures_failed": self.store.failed,
            "write_batches": self.store.batches,
            "write_queue": self.store.pending,
            "refused_extras": sorted(self._refused),
            "settings": self.settings.model_dump(mode="json"),
        }


def _finish(timings: dict, t0: float, t_sent: float | None, t_done: float | None) -> dict:
    now = time.perf_counter()
    total = now - t0
    upstream = None if t_sent is None or t_done is None else t_done - t_sent
    timings["upstream_s"] = upstream
    timings["total_s"] = total
    timings["proxy_s"] = total - (upstream or 0.0)
    return timings


def _response_headers(response: UpstreamResponse) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in response.headers if k not in _RESPONSE_DROP]


async def _send_whole(send, status: int, headers: list, body: bytes) -> None:
    headers = [*headers, (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _log_failure(future) -> None:
    if future.exception() is not None:
        log.error("a capture was not stored: %r", future.exception())


def create_proxy_app(settings: ProxySettings, store: CaptureStore | None = None) -> Starlette:
    """The ASGI app of one proxy: `/v1/*` forwarded (and recorded), `/healthz`, `/proxy/status`."""
    proxy = Proxy(settings, store)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        await proxy.start()
        try:
            yield
        finally:
            await proxy.stop()

    async def healthz(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "version": __version__, "time": time.time()})

    async def status(request: Request) -> JSONResponse:
        return JSONResponse(proxy.status())

    document = proxy_openapi()

    async def openapi(request: Request) -> JSONResponse:
        return JSONResponse(document)

    async def refused(request: Request, exc: Exception) -> Response:
        """The proxy's own 404 and 405 (routes other than /v1/*) in the OpenAI error shape."""
        assert isinstance(exc, HTTPException)  # registered for HTTPException only
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        return Response(_error_body(code, str(exc.detail)), status_code=exc.status_code,
                        media_type="application/json", headers=getattr(exc, "headers", None))

    async def crashed(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return Response(_error_body("internal_error", f"internal error: {type(exc).__name__}"), status_code=500,
                        media_type="application/json")

    app = Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            Route("/proxy/status", status, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"]),
            Route("/v1/{path:path}", proxy),
        ],
        exception_handlers={HTTPException: refused, Exception: crashed},
        lifespan=lifespan,
    )
    app.state.proxy = proxy
    return app
