"""The model side of an agent: one chat-completions call over HTTP, with the ids the engine returned.

It speaks the OpenAI chat-completions API plus the RL extensions vLLM defines
(`return_token_ids` → `prompt_token_ids` on the response and `token_ids` on each choice;
`return_routed_experts` → `routed_experts` on each choice: nested lists of the response's rows
from `rollmarket serve-model`, vLLM's base64 `.npy` over prompt and response, read by
`contracts.upstream`), so the same code runs against `rollmarket serve-model`, the capture proxy,
or vLLM; and SGLang's spellings of them (`return_prompt_token_ids`, `return_meta_info`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from ..contracts import upstream


class ModelCallError(Exception):
    """The model server failed or answered something the agent cannot use."""

    def __init__(self, message: str, *, status: int | None = None, context_overflow: bool = False):
        super().__init__(message)
        self.status = status
        self.context_overflow = context_overflow


@dataclass(frozen=True)
class ModelTurn:
    """One assistant turn as the server returned it."""

    content: str
    tool_calls: list[dict[str, Any]]
    """OpenAI tool calls: {"id", "type": "function", "function": {"name", "arguments" (a string)}}."""
    finish_reason: str
    prompt_token_ids_P: np.ndarray | None
    token_ids_R: np.ndarray | None
    logprobs_R: np.ndarray | None
    routed_experts_RLK: np.ndarray | None
    reasoning: str | None = None
    prompt_routed_experts_PLK: np.ndarray | None = None
    """Prompt positions 0 .. P-2, where the engine returns them (vLLM); see `contracts.upstream`."""
    model: str = ""
    latency_s: float = 0.0
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class Sampling:
    """What each turn samples with; `seed` is offset per turn and per sample by the loop."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    seed: int | None = None
    stop: tuple[str, ...] = ()


_OVERFLOW_WORDS = ("context", "maximum", "too long", "exceeds")


MAX_CONNECTIONS = 256
"""Connections (and so calls in flight) of one ChatModel."""

class ChatModel:
    """A chat-completions endpoint. Thread-safe: one instance serves all of a group's runs.

    base_url ends before `/chat/completions` (e.g. ``http://127.0.0.1:8000/v1``). `model` None
    asks the server's `/v1/models` once. `extensions` adds the token-id and routed-expert
    requests; turn it off for servers that reject unknown fields. `moe_shape` (hidden layers,
    top-k) lets SGLang's shapeless routed experts be read.
    """

    def __init__(self, base_url: str, model: str | None = None, *, api_key: str | None = None,
                 timeout: float = 300.0, extensions: bool = True, routed_experts: bool = True,
                 headers: dict[str, str] | None = None, transport: httpx.BaseTransport | None = None,
                 moe_shape: tuple[int, int] | None = None):
        self.base_url = base_url.rstrip("/")
        if not self.base_url.endswith("/v1"):
            self.base_url += "/v1"
        hdrs = dict(headers or {})
        if api_key:
            hdrs["authorization"] = f"Bearer {api_key}"
        self.http = httpx.Client(timeout=timeout, headers=hdrs, transport=transport,
                                 limits=httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=64))
        # More threads than connections made httpx's pool slow, and some calls died with a ReadError
        # (bad file descriptor): 512 agent runs at once on one instance, 2026-11-26. Calls beyond the
        # pool wait here for a connection instead.
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.extensions = extensions
        self.routed_experts = routed_experts
        self.moe_shape = moe_shape
        self._model = model

    @property
    def model(self) -> str:
        if self._model is None:
            try:
                answer = self.http.get(self.base_url + "/models")
                answer.raise_for_status()
                self._model = answer.json()["data"][0]["id"]
            except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
                raise ModelCallError(f"could not list models at {self.base_url}/models: {exc}") from None
        return self._model

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "ChatModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def request_body(self, messages: list[dict], tools: list[dict], sampling: Sampling,
                     seed: int | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "temperature": sampling.temperature,
            "top_p": sampling.top_p, "max_tokens": sampling.max_tokens, "logprobs": True,
        }
        if tools:
            body["tools"] = tools
        if sampling.top_k > 0:
            body["top_k"] = sampling.top_k
        if seed is not None:
            body["seed"] = seed
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if self.extensions:
            body["return_token_ids"] = True
            # SGLang's names: it has no return_token_ids, and gives response ids only in meta_info
            # (beside the logprobs). vLLM and our server ignore fields they do not know.
            body["return_prompt_token_ids"] = True
            body["return_meta_info"] = True
            if self.routed_experts:
                body["return_routed_experts"] = True
        return body

    def complete(self, messages: list[dict], tools: list[dict], sampling: Sampling,
                 seed: int | None = None, headers: dict[str, str] | None = None) -> ModelTurn:
        """One turn. Raises ModelCallError for transport failures and unusable answers."""
        body = self.request_body(messages, tools, sampling, seed)
        started = time.perf_counter()
        try:
            with self._slots:
                answer = self.http.post(self.base_url + "/chat/completions", json=body, headers=headers)
        except httpx.HTTPError as exc:
            raise ModelCallError(f"{type(exc).__name__}: {exc}") from None
        latency = time.perf_counter() - started
        if answer.status_code != 200:
            message = _error_message(answer)
            overflow = answer.status_code == 400 and any(w in message.lower() for w in _OVERFLOW_WORDS)
            raise ModelCallError(f"HTTP {answer.status_code}: {message}", status=answer.status_code,
                                 context_overflow=overflow)
        try:
            data = answer.json()
            return parse_turn(data, latency, moe_shape=self.moe_shape)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ModelCallError(f"unusable chat completion: {type(exc).__name__}: {exc}") from None


def _error_message(answer: httpx.Response) -> str:
    try:
        data = answer.json()
        error = data.get("error", data)
        return str(error.get("message", error) if isinstance(error, dict) else error)[:2000]
    except ValueError:
        return answer.text[:2000]


def parse_turn(data: dict[str, Any], latency_s: float = 0.0, *, moe_shape: tuple[int, int] | None = None) -> ModelTurn:
    """The first choice of a chat completion, with the RL extensions as arrays where present.

    Raises ValueError (`contracts.upstream.RoutedExpertsError` for unreadable routed experts),
    KeyError, IndexError or TypeError for an answer that is not a usable chat completion.
    SGLang's spellings are read too (`contracts.upstream`): response ids from `meta_info`, and its
    shapeless routed experts where `moe_shape` (every hidden layer, top-k) says how to cut them."""
    choice = data["choices"][0]
    message = choice.get("message") or {}
    content = message.get("content") or ""
    calls = []
    for i, call in enumerate(message.get("tool_calls") or []):
        fn = call.get("function") or {}
        arguments = fn.get("arguments", "")
        if not isinstance(arguments, str):  # some servers send an object; keep the model's text form
            import json

            arguments = json.dumps(arguments)
        calls.append({"id": call.get("id") or f"call_{i}", "type": "function",
                      "function": {"name": str(fn.get("name", "")), "arguments": arguments}})
    ids = choice.get("token_ids")
    if ids is None:
        ids = upstream.sglang_output_ids(choice)
    prompt = data.get("prompt_token_ids", choice.get("prompt_token_ids"))
    entries = (choice.get("logprobs") or {}).get("content")
    logprobs = None if entries is None else np.asarray([e["logprob"] for e in entries], np.float32)
    usage = data.get("usage") or {}
    prompt_tokens = len(prompt) if prompt is not None else usage.get("prompt_tokens")
    response_tokens = len(ids) if ids is not None else usage.get("completion_tokens")
    experts = upstream.read_choice_experts(choice.get("routed_experts"), prompt_tokens=prompt_tokens,
                                           response_tokens=response_tokens)
    if experts is None and moe_shape:
        sglang = upstream.sglang_experts_field(data, choice)
        if sglang is not None:
            experts = upstream.read_sglang_experts(sglang, layers=moe_shape[0], top_k=moe_shape[1],
                                                   prompt_tokens=prompt_tokens, response_tokens=response_tokens)
    return ModelTurn(
        content=content, tool_calls=calls, finish_reason=str(choice.get("finish_reason") or "stop"),
        prompt_token_ids_P=None if prompt is None else np.asarray(prompt, np.int32),
        token_ids_R=None if ids is None else np.asarray(ids, np.int32),
        logprobs_R=logprobs,
        routed_experts_RLK=None if experts is None else experts.response_RLK,
        reasoning=message.get("reasoning_content") or message.get("reasoning"),
        prompt_routed_experts_PLK=None if experts is None else experts.prompt_PLK,
        model=str(data.get("model", "")), latency_s=latency_s, raw=data,
    )
