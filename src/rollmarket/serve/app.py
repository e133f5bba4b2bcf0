"""The HTTP face of the embedded engine: /v1/models, /v1/chat/completions, /v1/completions, /v1/responses.

Responses follow OpenAI's shapes; the RL extensions follow vLLM: ``prompt_token_ids`` on the
response and ``token_ids`` on each choice when ``return_token_ids`` is set, and
``routed_experts`` ([tokens][moe_layers][top_k], the experts of the step that produced each
token) on each choice when ``return_routed_experts`` is set on an MoE model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..bodies import (
    OPENAI_ERROR_SCHEMA,
    BodyError,
    BodyProblem,
    add_component_schemas,
    json_body,
    parse_json,
    read_body,
)
from ..contracts.responses import input_messages
from ..engines import RolloutEngine, SamplingParams
from .batcher import DONE, Batcher, Pending
from .choice import ChoiceState
from .detok import Detokenizer
from .engine_process import EngineFace, RemoteBatcher
from .protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    ResponsesRequest,
    TokenizeRequest,
)
from .responses import (
    LOGPROBS_INCLUDE,
    UNSUPPORTED_RESPONSES_FIELDS,
    ResponseEvents,
    StoredResponses,
    chat_messages,
    chat_tools,
    input_turns,
    output_items,
    response_body,
)
from .settings import ServeSettings

log = logging.getLogger(__name__)


def _error(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _validation_error(exc: ValidationError | RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ())) or None
    # `param` is the request's field, as OpenAI names it; the message keeps the whole path.
    param = str(first["loc"][0]) if first.get("loc") else None
    return OpenAIError(f"{where}: {first.get('msg')}" if where else str(first.get("msg", "invalid request")),
                       param=param)


_BODY_MODELS: list[type[BaseModel]] = [ChatRequest, CompletionRequest, ResponsesRequest, TokenizeRequest,
                                      DetokenizeRequest]
_ERRORS: dict[int | str, dict[str, Any]] = {status: {"description": text, "content": {"application/json": {"schema": {
    "$ref": "#/components/schemas/OpenAIErrorBody"}}}} for status, text in (
    (400, "Bad JSON or values (OpenAI's error shape)"), (404, "Unknown model or route"),
    (405, "Method not allowed"), (413, "Body too large"))}


class ModelServer:
    """Turns requests into engine work and engine events into OpenAI-shaped responses."""

    def __init__(self, engine: RolloutEngine | EngineFace, settings: ServeSettings,
                 batcher: Batcher | RemoteBatcher | None = None):
        """``engine``: the engine itself (its decode loop a thread of this process), or an
        ``EngineFace`` with ``batcher`` the ``RemoteBatcher`` of an engine process."""
        self.engine = engine
        self.settings = settings
        self.name = settings.served_model_name or engine.info.name
        self.detok = Detokenizer(engine.tokenizer)
        self.eos_ids = frozenset(engine.info.eos_token_ids)
        if batcher is None:  # an EngineFace always comes with its RemoteBatcher
            batcher = Batcher(engine, max_seqs=settings.max_batch_seqs, window_s=settings.batch_window_ms / 1000.0,
                              profile_path=settings.profile_decode,
                              profile_after_steps=settings.profile_decode_after_steps)
        self.batcher: Batcher | RemoteBatcher = batcher
        self.created = int(time.time())
        self.stored = StoredResponses(settings.responses_kept, settings.responses_db)

    # ---- request → engine work -------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise OpenAIError(f"The model `{model}` does not exist.", status=404,
                              type_="NotFoundError", param="model", code="model_not_found")

    def _params(self, req, *, max_tokens: int | None, prompt_len: int, top_logprobs: int
                ) -> SamplingParams:
        context = self.engine.info.max_context_tokens
        room = context - prompt_len
        if room < 1:
            raise OpenAIError(f"prompt of {prompt_len} tokens fills the model's context of {context}",
                              param="messages", code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(self.settings.default_max_tokens, room)
        if prompt_len + max_tokens > context:
            raise OpenAIError(
                f"This model's maximum context length is {context} tokens; the prompt has "
                f"{prompt_len} and max_tokens asks for {max_tokens}.", param="max_tokens",
                code="context_length_exceeded")
        if top_logprobs > self.settings.max_top_logprobs:
            raise OpenAIError(f"top_logprobs may be at most {self.settings.max_top_logprobs}",
                              param="top_logprobs")
        try:
            return SamplingParams(
                temperature=req.temperature, top_p=req.top_p, top_k=max(req.top_k, 0),
                max_tokens=max_tokens, seed=req.seed, top_logprobs=top_logprobs,
                stop=req.stop_list(), stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos, logprobs_mode=req.logprobs_mode)
        except ValueError as exc:
            raise OpenAIError(str(exc)) from None

    def chat_prompt(self, req: ChatRequest) -> list[int]:
        return self.encode_messages(req.messages, req.tools if req.tool_choice != "none" else None)

    def encode_messages(self, messages: list[dict], tools: list[dict] | None, param: str = "messages") -> list[int]:
        """The prompt ids of chat messages (and tools) under the model's chat template."""
        messages = [_normalise_message(m) for m in messages]
        try:
            return self.engine.encode_chat(messages, tools)
        except Exception as exc:  # template errors are the client's input, not a crash
            raise OpenAIError(f"could not apply the chat template: {exc}", param=param) from None

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        prompt = req.prompt
        vocab = self.engine.info.vocab_size
        prompts: list = [prompt] if isinstance(prompt, str) or (
            prompt and all(isinstance(p, int) for p in prompt)) else list(prompt)
        if not prompts:
            raise OpenAIError("prompt is empty", param="prompt")
        out = []
        for p in prompts:
            ids = self.engine.tokenizer.encode(p) if isinstance(p, str) else list(p)
            if not ids:
                raise OpenAIError("prompt is empty", param="prompt")
            if any(not (0 <= int(i) < vocab) for i in ids):
                raise OpenAIError(f"prompt token ids must be in [0, {vocab})", param="prompt")
            out.append([int(i) for i in ids])
        return out

    def new_choices(self, n: int, offset: int, stops, parse_tools: bool) -> list[ChoiceState]:
        return [ChoiceState(offset + i, self.detok, self.eos_ids, stops, parse_tools) for i in range(n)]

    async def run(self, pending: Pending, choices: list[ChoiceState]) -> AsyncIterator[list]:
        """Feed engine events into the choices; yield each batch of (choice, event)."""
        events = pending.events
        assert events is not None, "a request of this process has its queue"
        try:
            while True:
                item = await events.get()
                if item is DONE:
                    return
                if isinstance(item, Exception):
                    raise OpenAIError(f"generation failed: {item}", status=500, type_="server_error")
                for choice_index, ev in item:
                    choices[choice_index].add(ev)
                yield item
        finally:
            pending.cancel()

    # ---- engine results → response bodies --------------------------------------------------

    def chat_logprob_entry(self, token_id: int, logprob: float, top) -> dict:
        entry = {"token": self.detok.token_text(token_id), "logprob": logprob,
                 "bytes": list(self.detok.token_bytes(token_id))}
        entry["top_logprobs"] = [{"token": self.detok.token_text(t), "logprob": lp,
                                  "bytes": list(self.detok.token_bytes(t))} for t, lp in (top or [])]
        return entry

    def completion_logprobs(self, c: ChoiceState, start: int = 0, text_offset: int = 0) -> dict:
        tokens, offsets, tops = [], [], []
        offset = text_offset
        for t, top in zip(c.token_ids[start:], c.tops[start:]):
            text = self.detok.token_text(t)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            tops.append({self.detok.token_text(i): lp for i, lp in top} if top else None)
        return {"tokens": tokens, "token_logprobs": c.logprobs[start:], "top_logprobs": tops,
                "text_offset": offsets}


def _normalise_message(message: dict) -> dict:
    """OpenAI content parts become text; tool-call arguments become dicts for the template."""
    m = dict(message)
    content = m.get("content")
    if isinstance(content, list):
        m["content"] = "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    calls = m.get("tool_calls")
    if calls:
        if not isinstance(calls, list) or not all(
                isinstance(call, dict) and isinstance(call.get("function") or {}, dict) for call in calls):
            raise OpenAIError("tool_calls must be a list of objects with a `function` object", param="messages")
        fixed = []
        for call in calls:
            call = dict(call)
            fn = dict(call.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = parse_json(fn["arguments"])
                except BodyError:
                    pass
            call["function"] = fn
            fixed.append(call)
        m["tool_calls"] = fixed
    return m


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def create_serve_app(engine: RolloutEngine | EngineFace, settings: ServeSettings,
                     batcher: Batcher | RemoteBatcher | None = None) -> FastAPI:
    """The app over ``engine``; with an engine process, its ``EngineFace`` and ``RemoteBatcher``
    (``serve.engine_process.start_engine_process``)."""
    server = ModelServer(engine, settings, batcher)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        server.batcher.start()
        try:
            yield
        finally:
            server.batcher.stop()
            server.stored.close()

    app = FastAPI(title="rollmarket model server", version="1", lifespan=lifespan,
                  description="OpenAI-compatible chat and completions with vLLM's RL extensions. Every "
                  "error is OpenAI's {\"error\": {message, type, param, code}}.")
    app.state.server = server

    @app.exception_handler(OpenAIError)
    async def _openai_error(_request, exc: OpenAIError):
        return _error(exc)

    # The framework's own refusals (unknown route, wrong method, bad query) in the same shape.
    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        type_ = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
        return _error(OpenAIError(str(exc.detail), status=exc.status_code, type_=type_, code=code))

    @app.exception_handler(RequestValidationError)
    async def _request_error(_request, exc: RequestValidationError):
        return _error(_validation_error(exc))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _error(OpenAIError(f"internal error: {type(exc).__name__}", status=500, type_="server_error"))

    async def _object(request: Request) -> dict:
        try:
            payload = parse_json(await read_body(request, settings.max_body_bytes))
        except BodyError as exc:
            if exc.problem is BodyProblem.too_large:
                raise OpenAIError(str(exc), status=413, code="payload_too_large") from None
            raise OpenAIError(f"request body: {exc}", code=exc.problem.value) from None
        if not isinstance(payload, dict):
            raise OpenAIError("request body must be a JSON object")
        return payload

    async def _body(request: Request, model_cls, payload: dict | None = None):
        payload = await _object(request) if payload is None else payload
        try:
            return model_cls.model_validate(payload)
        except ValidationError as exc:
            raise _validation_error(exc) from None

    @app.get("/health")
    @app.get("/healthz")
    async def health():
        if not server.batcher.alive:
            return JSONResponse({"status": "engine process exited"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": server.name, "object": "model", "created": server.created, "owned_by": "rollmarket",
            "root": engine.info.path, "max_model_len": engine.info.max_context_tokens}]}

    @app.get("/v1/engine")
    async def engine_info():
        """rollmarket extension: what numerics this server runs, for manifests and reports."""
        info = engine.info
        return {"model": server.name, "engine_name": engine.name, "precision": engine.precision.value,
                "quantization": engine.precision.quantization, "device": engine.device,
                "engine_fingerprint": await asyncio.to_thread(engine.fingerprint),
                "checkpoint_digest": info.checkpoint_digest, "tokenizer_hash": info.tokenizer_hash,
                "model_config_hash": info.model_config_hash, "architecture": info.architecture,
                "moe_layers": info.num_moe_layers, "num_experts": info.num_experts, "top_k": info.top_k,
                "max_context_tokens": info.max_context_tokens,
                "kv_cache": engine.kv, "decode_graphs": engine.graphs, "step_buckets": engine.step_buckets,
                "engine_process": not isinstance(engine, RolloutEngine), "engine_pid": server.batcher.pid,
                **await server.batcher.read_counters()}

    @app.post("/tokenize", openapi_extra=json_body(TokenizeRequest), responses=_ERRORS)
    async def tokenize(request: Request):
        payload = await _object(request)
        req: TokenizeRequest = await _body(request, TokenizeRequest, payload)
        if req.messages is not None:
            try:
                chat_req = ChatRequest.model_validate({"model": server.name, **payload})
            except ValidationError as exc:
                raise _validation_error(exc) from None
            ids = await asyncio.to_thread(server.chat_prompt, chat_req)
        elif req.prompt is not None:
            ids = engine.tokenizer.encode(req.prompt)
        else:
            raise OpenAIError("give `prompt` (string) or `messages`")
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.info.max_context_tokens}

    @app.post("/detokenize", openapi_extra=json_body(DetokenizeRequest), responses=_ERRORS)
    async def detokenize(request: Request):
        req: DetokenizeRequest = await _body(request, DetokenizeRequest)
        vocab = engine.info.vocab_size
        if not all(0 <= t < vocab for t in req.tokens):
            raise OpenAIError(f"`tokens` must be a list of integers in [0, {vocab})", param="tokens")
        return {"prompt": server.detok.text(req.tokens)}

    @app.post("/v1/chat/completions", openapi_extra=json_body(ChatRequest), responses=_ERRORS)
    async def chat(request: Request):
        req: ChatRequest = await _body(request, ChatRequest)
        server._check_model(req.model)
        prompt = await asyncio.to_thread(server.chat_prompt, req)
        top_n = (req.top_logprobs or 0) if req.logprobs else 0
        params = server._params(req, max_tokens=req.max_completion_tokens or req.max_tokens,
                                prompt_len=len(prompt), top_logprobs=top_n)
        parse_tools = bool(req.tools) and req.tool_choice != "none"
        choices = server.new_choices(req.n, 0, params.stop, parse_tools)
        moe = bool(engine.info.is_moe and req.return_routed_experts and settings.return_routed_experts)
        pending = server.batcher.submit(prompt, params, req.n, stream=bool(req.stream), experts=moe)
        rid = "chatcmpl-" + secrets.token_hex(12)
        created = int(time.time())
        if req.stream:
            return StreamingResponse(_chat_stream(server, req, rid, created, prompt, pending, choices, moe),
                                     media_type="text/event-stream")
        async for _ in server.run(pending, choices):
            pass
        body_choices = []
        for c in choices:
            content, calls, reason = c.final()
            message: dict = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            choice: dict = {"index": c.index, "message": message, "finish_reason": reason,
                            "logprobs": None}
            if req.logprobs:
                choice["logprobs"] = {"content": [server.chat_logprob_entry(t, lp, top) for t, lp, top
                                                  in zip(c.token_ids, c.logprobs, c.tops)]}
            if req.return_token_ids:
                choice["token_ids"] = c.token_ids
            if moe:
                choice["routed_experts"] = c.experts
            body_choices.append(choice)
        completion = sum(len(c.token_ids) for c in choices)
        body = {"id": rid, "object": "chat.completion", "created": created, "model": server.name,
                "choices": body_choices,
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": completion,
                          "total_tokens": len(prompt) + completion}}
        if req.return_token_ids:
            body["prompt_token_ids"] = prompt
        return JSONResponse(body)

    @app.post("/v1/responses", openapi_extra=json_body(ResponsesRequest), responses=_ERRORS)
    async def responses(request: Request):
        req: ResponsesRequest = await _body(request, ResponsesRequest)
        server._check_model(req.model)
        if req.n != 1:
            raise OpenAIError("a response has one generation; n must be 1", param="n")
        for name in UNSUPPORTED_RESPONSES_FIELDS:
            if (req.model_extra or {}).get(name):
                raise OpenAIError(f"{name} is not supported: continue a conversation with previous_response_id "
                                  "or send it whole as input", param=name, code="unsupported_parameter")
        earlier = server.stored.get(req.previous_response_id) if req.previous_response_id else []
        turns = [*earlier, *input_turns(req)]
        tools = chat_tools(req) if req.tool_choice != "none" else None
        prompt = await asyncio.to_thread(server.encode_messages, chat_messages(req, turns), tools, "input")
        want_logprobs = LOGPROBS_INCLUDE in (req.include or ()) or bool(req.top_logprobs)
        params = server._params(req, max_tokens=req.max_output_tokens, prompt_len=len(prompt),
                                top_logprobs=(req.top_logprobs or 0) if want_logprobs else 0)
        choices = server.new_choices(1, 0, params.stop, bool(tools))
        moe = bool(engine.info.is_moe and req.return_routed_experts and settings.return_routed_experts)
        pending = server.batcher.submit(prompt, params, 1, stream=bool(req.stream), experts=moe)
        rid, created = "resp_" + secrets.token_hex(12), int(time.time())

        def logprob_entries(start: int = 0) -> list[dict]:
            c = choices[0]
            return [server.chat_logprob_entry(t, lp, top)
                    for t, lp, top in zip(c.token_ids[start:], c.logprobs[start:], c.tops[start:])]

        def body() -> dict:
            c = choices[0]
            items, status = output_items(c, prompt=prompt, logprob_entries=logprob_entries() if want_logprobs else None,
                                         token_ids=req.return_token_ids, experts=moe)
            answer = response_body(req, rid=rid, created=created, model=server.name, prompt=prompt, items=items,
                                   status=status, output_tokens=len(c.token_ids))
            if req.store:  # the next turn may name this one; what it said is read as its input would be
                server.stored.put(rid, [*turns, *input_messages(items)], answer)
            return answer

        def delta_tokens(start: int) -> dict:
            """The per-token fields of a stream delta: the tokens from `start` on."""
            c = choices[0]
            fields: dict = {"logprobs": logprob_entries(start) if want_logprobs else []}
            if req.return_token_ids:
                fields.update(generation_token_ids=c.token_ids[start:], generation_log_probs=c.logprobs[start:])
            if moe:
                fields["routed_experts"] = c.experts[start:]
            return fields

        if req.stream:
            return StreamingResponse(_responses_stream(server, pending, choices, body, delta_tokens, ResponseEvents(
                response_body(req, rid=rid, created=created, model=server.name, prompt=prompt, items=[],
                              status="in_progress", output_tokens=0))), media_type="text/event-stream")
        async for _ in server.run(pending, choices):
            pass
        return JSONResponse(body())

    @app.get("/v1/responses/{response_id}", responses=_ERRORS)
    async def get_response(response_id: str):
        """A stored Response object, as it was answered (OpenAI's `responses.retrieve`)."""
        return JSONResponse(await asyncio.to_thread(server.stored.body, response_id))

    @app.delete("/v1/responses/{response_id}", responses=_ERRORS)
    async def delete_response(response_id: str):
        """Forget a stored response (OpenAI's `responses.delete`): it can no longer be retrieved or continued."""
        await asyncio.to_thread(server.stored.delete, response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.post("/v1/completions", openapi_extra=json_body(CompletionRequest), responses=_ERRORS)
    async def completions(request: Request):
        req: CompletionRequest = await _body(request, CompletionRequest)
        server._check_model(req.model)
        if req.echo:
            raise OpenAIError("echo is not supported", param="echo")
        prompts = await asyncio.to_thread(server.completion_prompts, req)
        top_n = req.logprobs or 0
        moe = bool(engine.info.is_moe and req.return_routed_experts and settings.return_routed_experts)
        runs = []
        for k, prompt in enumerate(prompts):
            params = server._params(req, max_tokens=req.max_tokens, prompt_len=len(prompt), top_logprobs=top_n)
            choices = server.new_choices(req.n, k * req.n, params.stop, False)
            runs.append((prompt, choices, server.batcher.submit(prompt, params, req.n, stream=bool(req.stream),
                                                                experts=moe)))
        rid = "cmpl-" + secrets.token_hex(12)
        created = int(time.time())
        if req.stream:
            return StreamingResponse(_completion_stream(server, req, rid, created, runs, moe),
                                     media_type="text/event-stream")

        async def drain(run):
            async for _ in server.run(run[2], run[1]):
                pass
        await asyncio.gather(*(drain(r) for r in runs))
        body_choices, completion_tokens, prompt_tokens = [], 0, 0
        for prompt, choices, _ in runs:
            prompt_tokens += len(prompt)
            for c in choices:
                content, _, reason = c.final()
                choice = {"index": c.index, "text": content or "", "finish_reason": reason,
                          "logprobs": server.completion_logprobs(c) if req.logprobs is not None else None}
                if req.return_token_ids:
                    choice["token_ids"] = c.token_ids
                    choice["prompt_token_ids"] = prompt
                if moe:
                    choice["routed_experts"] = c.experts
                completion_tokens += len(c.token_ids)
                body_choices.append(choice)
        return JSONResponse({"id": rid, "object": "text_completion", "created": created,
                             "model": server.name, "choices": body_choices,
                             "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                       "total_tokens": prompt_tokens + completion_tokens}})

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        add_component_schemas(schema, _BODY_MODELS)
        schema["components"]["schemas"]["OpenAIErrorBody"] = OPENAI_ERROR_SCHEMA
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


async def _chat_stream(server: ModelServer, req: ChatRequest, rid: str, created: int, prompt,
                       pending: Pending, choices: list[ChoiceState], moe: bool) -> AsyncIterator[bytes]:
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": server.name}
    first = dict(base, choices=[{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None} for c in choices])
    if req.return_token_ids:
        first["prompt_token_ids"] = prompt
    yield _sse(first)
    try:
        async for batch in server.run(pending, choices):
            out = []
            for choice_index, ev in batch:
                c = choices[choice_index]
                text, calls = c.stream_delta()
                delta: dict = {}
                if text:
                    delta["content"] = text
                if calls:
                    delta["tool_calls"] = [dict(call, index=c._calls_emitted - len(calls) + i)
                                           for i, call in enumerate(calls)]
                entry: dict = {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None}
                if req.logprobs:
                    entry["logprobs"] = {"content": [server.chat_logprob_entry(ev.token_id, ev.logprob, ev.top)]}
                if req.return_token_ids:
                    entry["token_ids"] = [ev.token_id]
                if moe and ev.experts_LK is not None:
                    entry["routed_experts"] = [ev.experts_LK.tolist()]
                if c.done:
                    entry["finish_reason"] = c.final()[2]
                out.append(entry)
            yield _sse(dict(base, choices=out))
    except OpenAIError as exc:
        yield _sse(exc.body())
    if req.stream_options and req.stream_options.include_usage:
        completion = sum(len(c.token_ids) for c in choices)
        yield _sse(dict(base, choices=[], usage={"prompt_tokens": len(prompt), "completion_tokens": completion,
                                                 "total_tokens": len(prompt) + completion}))
    yield b"data: [DONE]\n\n"


async def _responses_stream(server: ModelServer, pending: Pending, choices: list[ChoiceState], body,
                            delta_tokens, events: ResponseEvents) -> AsyncIterator[bytes]:
    for event in events.start():
        yield event
    c = choices[0]
    sent = 0  # tokens whose per-token fields a delta has carried
    try:
        async for _ in server.run(pending, choices):
            text, calls = c.stream_delta()
            out = []
            if text:
                out += events.text(text, **delta_tokens(sent))
                sent = len(c.token_ids)
            for call in calls:
                out += events.call(call, **delta_tokens(sent))
                sent = len(c.token_ids)
            for event in out:
                yield event
    except OpenAIError as exc:
        yield events.event("error", code=exc.code or exc.type, message=exc.message, param=exc.param)
        return
    rest = delta_tokens(sent) if sent < len(c.token_ids) else None
    for event in events.finish(body(), rest):
        yield event


async def _completion_stream(server: ModelServer, req: CompletionRequest, rid: str, created: int, runs,
                             moe: bool) -> AsyncIterator[bytes]:
    base = {"id": rid, "object": "text_completion", "created": created, "model": server.name}
    merged: asyncio.Queue = asyncio.Queue()

    sent_prompt: set[int] = set()

    def entries(prompt, choices: list[ChoiceState], batch) -> list[dict]:
        out = []
        for choice_index, ev in batch:
            c = choices[choice_index]
            start = len(c.token_ids) - 1
            text, _ = c.stream_delta()
            entry: dict = {"index": c.index, "text": text, "finish_reason": c.final()[2] if c.done else None,
                           "logprobs": server.completion_logprobs(c, start) if req.logprobs is not None else None}
            if req.return_token_ids:
                entry["token_ids"] = [ev.token_id]
                if c.index not in sent_prompt:
                    entry["prompt_token_ids"] = prompt
                    sent_prompt.add(c.index)
            if moe and ev.experts_LK is not None:
                entry["routed_experts"] = [ev.experts_LK.tolist()]
            out.append(entry)
        return out

    async def pump(run):
        # Entries are built here, right after ``server.run`` adds the step to the choices: the
        # consumer may lag behind, and by then the choice state would already hold later tokens.
        prompt, choices, pending = run
        try:
            async for batch in server.run(pending, choices):
                await merged.put(entries(prompt, choices, batch))
        except OpenAIError as exc:
            await merged.put(exc)
        await merged.put(None)

    tasks = [asyncio.create_task(pump(r)) for r in runs]
    remaining = len(tasks)
    try:
        while remaining:
            item = await merged.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, OpenAIError):
                yield _sse(item.body())
                continue
            yield _sse(dict(base, choices=item))
    finally:
        for t in tasks:
            t.cancel()
    if req.stream_options and req.stream_options.include_usage:
        p = sum(len(r[0]) for r in runs)
        c = sum(len(ch.token_ids) for r in runs for ch in r[1])
        yield _sse(dict(base, choices=[], usage={"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}))
    yield b"data: [DONE]\n\n"
