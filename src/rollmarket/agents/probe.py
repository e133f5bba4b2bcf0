"""What an OpenAI-compatible endpoint gives an RL user, found by asking it.

`probe` sends a few small real requests (the official `openai` client for the standard API, raw
httpx for the extensions it would refuse to type) and says, per capability, yes / no / partial
with the evidence it saw. The extensions are probed under the names the RL engines use: vLLM's
``return_token_ids`` (``prompt_token_ids`` on the response, ``token_ids`` on each choice) and
``prompt_logprobs``; vLLM/SGLang's ``return_routed_experts`` (``routed_experts`` on the choice as
nested lists or vLLM's base64 ``.npy``, or SGLang's base64 in ``sglext.routed_experts``; read by
`contracts.upstream`).
Our `serve-model` and the capture proxy answer the same names.

A server that answers at all is probed to the end: a refused extension is a "no", not an error.
Only an endpoint that cannot be probed (unreachable, not OpenAI-compatible, refusing the key) is
a typed error.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any, Literal

import httpx
import openai
from pydantic import BaseModel, ConfigDict, Field

from ..contracts import upstream

Status = Literal["yes", "no", "partial"]

CAPABILITIES = ("chat", "completions", "prompt_token_ids", "response_token_ids", "sampled_logprobs",
                "top_logprobs", "routed_experts", "prompt_logprobs", "seed_reproducible", "tool_calls",
                "system_fingerprint", "streaming")
"""Every capability a report holds, in the order it is shown."""

SEED = 1234
MAX_TOKENS = 8
TOP_LOGPROBS = 2
TOOL_MAX_TOKENS = 64
PROMPT = [{"role": "user", "content": "Say something random."}]
WEATHER_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class ProbeError(Exception):
    """The endpoint could not be probed at all."""

    fix = "check the URL (an OpenAI-compatible base such as http://HOST:PORT/v1)"


class EndpointUnreachable(ProbeError):
    """Nothing answered HTTP at the URL."""

    fix = "start the server, or check the host and port"


class NotOpenAICompatible(ProbeError):
    """Something answered, but not as an OpenAI-compatible server (no `GET /models` list)."""

    fix = "give the server's OpenAI base URL (usually ending in /v1)"


class AuthRejected(ProbeError):
    """The server refused the API key (401 or 403)."""

    fix = "pass the server's key with --api-key (or OPENAI_API_KEY)"


class UnknownModel(ProbeError):
    """--model names a model that `GET /models` does not list."""

    fix = "pick one of the models the server lists (leave --model out for the first)"


class Capability(BaseModel):
    """One capability's verdict and what showed it."""

    model_config = ConfigDict(frozen=True)

    name: str
    status: Status
    detail: str
    evidence: dict[str, Any] = Field(default_factory=dict)


class ProbeReport(BaseModel):
    """What one endpoint gave, capability by capability."""

    model_config = ConfigDict(frozen=True)

    url: str
    model: str
    probed_at: str
    capabilities: tuple[Capability, ...]

    def get(self, name: str) -> Capability:
        """The capability called `name` (KeyError if the report has none)."""
        for cap in self.capabilities:
            if cap.name == name:
                return cap
        raise KeyError(name)

    def statuses(self) -> dict[str, Status]:
        """Capability name → status."""
        return {c.name: c.status for c in self.capabilities}


def base_url(url: str) -> str:
    """The OpenAI base of `url`: `/v1` appended unless the URL already ends in it."""
    base = url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def _short(value: Any, limit: int = 200) -> Any:
    """Evidence kept small: long lists cut to their first items, long strings cut."""
    if isinstance(value, list) and len(value) > 64:
        return [_short(v, limit) for v in value[:64]] + [f"... {len(value)} items"]
    if isinstance(value, list):
        return [_short(v, limit) for v in value]
    if isinstance(value, str) and len(value) > limit:
        return value[:limit] + "..."
    return value


class _Prober:
    """One probe's HTTP clients and the answers the verdicts are read from."""

    def __init__(self, url: str, api_key: str | None, timeout: float):
        self.base = base_url(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.base, headers=headers, timeout=timeout)
        self.client = openai.OpenAI(base_url=self.base, api_key=api_key or "none", timeout=timeout,
                                    max_retries=0)

    def close(self) -> None:
        self.http.close()
        self.client.close()

    def models(self) -> list[str]:
        try:
            resp = self.http.get("/models")
        except httpx.TransportError as exc:
            raise EndpointUnreachable(f"{self.base}: {type(exc).__name__}: {exc}") from None
        if resp.status_code in (401, 403):
            raise AuthRejected(f"{self.base}/models answered {resp.status_code}")
        try:
            data = resp.json()["data"] if resp.status_code == 200 else None
            ids = [m["id"] for m in data] if isinstance(data, list) else None
        except (ValueError, KeyError, TypeError):
            ids = None
        if ids is None:
            raise NotOpenAICompatible(f"{self.base}/models answered {resp.status_code} without a model list")
        return ids

    def post(self, path: str, body: dict) -> tuple[dict | None, str | None]:
        """(the JSON answer, None) or (None, why it failed)."""
        try:
            resp = self.http.post(path, json=body)
        except httpx.TransportError as exc:
            return None, f"{type(exc).__name__}: {exc}"
        if resp.status_code != 200:
            return None, f"HTTP {resp.status_code}: {resp.text[:200]}"
        try:
            return resp.json(), None
        except ValueError:
            return None, "answer is not JSON"

    def stream(self, path: str, body: dict) -> tuple[list[dict], str | None]:
        """The chunks of a streamed answer, and why it failed (None if it did not)."""
        chunks: list[dict] = []
        try:
            with self.http.stream("POST", path, json=dict(body, stream=True)) as resp:
                if resp.status_code != 200:
                    return [], f"HTTP {resp.status_code}: {resp.read().decode(errors='replace')[:200]}"
                for line in resp.iter_lines():
                    payload = line[len("data:"):].strip() if line.startswith("data:") else ""
                    if payload and payload != "[DONE]":
                        chunks.append(json.loads(payload))
        except (httpx.TransportError, ValueError) as exc:
            return chunks, f"{type(exc).__name__}: {exc}"
        return chunks, None


def _cap(name: str, status: Status, detail: str, **evidence: Any) -> Capability:
    return Capability(name=name, status=status, detail=detail,
                      evidence={k: _short(v) for k, v in evidence.items()})


def _first_choice(body: dict | None) -> dict:
    choices = (body or {}).get("choices") or [{}]
    return choices[0] if isinstance(choices[0], dict) else {}


def _sampled(choice: dict) -> list[dict]:
    """The chat logprobs entries of a choice ([] when there are none)."""
    content = (choice.get("logprobs") or {}).get("content")
    return content if isinstance(content, list) else []


def _chat_capabilities(p: _Prober, model: str) -> list[Capability]:
    """chat, sampled and top logprobs, seed, system fingerprint: from the official client.

    Asked with logprobs first; a server that refuses them is asked again without, so that the
    chat itself is judged on its own."""
    plain: dict[str, Any] = dict(model=model, messages=PROMPT, max_tokens=MAX_TOKENS, temperature=1.0, seed=SEED)
    refusal = None
    for kwargs in (dict(plain, logprobs=True, top_logprobs=TOP_LOGPROBS), plain):
        try:
            first = p.client.chat.completions.create(**kwargs).model_dump()
            break
        except openai.APIError as exc:
            refusal = refusal or f"{type(exc).__name__}: {exc}"
    else:
        return [_cap("chat", "no", "a seeded chat request failed", error=refusal),
                *(_cap(n, "no", "the chat request failed", error=refusal)
                  for n in ("sampled_logprobs", "top_logprobs", "seed_reproducible", "system_fingerprint"))]
    if refusal:
        return [_chat_cap(first, " once asked without logprobs"),
                *(_cap(n, "no", "logprobs=true was refused", error=refusal) for n in ("sampled_logprobs", "top_logprobs")),
                *_seed_and_fingerprint(p, kwargs, first)]
    caps = [_chat_cap(first)]
    entries = _sampled(_first_choice(first))
    if entries and all(isinstance(e.get("logprob"), float | int) for e in entries):
        caps.append(_cap("sampled_logprobs", "yes", f"{len(entries)} sampled tokens with a logprob",
                         logprobs=[e["logprob"] for e in entries]))
    else:
        caps.append(_cap("sampled_logprobs", "no", "logprobs=true gave no logprobs.content",
                         logprobs=_first_choice(first).get("logprobs")))
    tops = [len(e.get("top_logprobs") or []) for e in entries]
    if tops and all(n == TOP_LOGPROBS for n in tops):
        caps.append(_cap("top_logprobs", "yes", f"top_logprobs={TOP_LOGPROBS} gave {TOP_LOGPROBS} per token",
                         per_token=tops))
    elif any(tops):
        caps.append(_cap("top_logprobs", "partial", f"asked {TOP_LOGPROBS} per token, got other counts",
                         per_token=tops))
    else:
        caps.append(_cap("top_logprobs", "no", "no top_logprobs on the sampled tokens", per_token=tops))
    return caps + _seed_and_fingerprint(p, kwargs, first)


def _seed_and_fingerprint(p: _Prober, kwargs: dict, first: dict) -> list[Capability]:
    """Ask `kwargs` (seeded) a second time and compare with `first`; read its system_fingerprint."""
    caps = []
    try:
        second = p.client.chat.completions.create(**kwargs).model_dump()
    except openai.APIError as exc:
        caps.append(_cap("seed_reproducible", "no", "the second seeded call failed", error=str(exc)))
    else:
        a, b = _seeded_sample(first), _seeded_sample(second)
        same = a == b
        caps.append(_cap("seed_reproducible", "yes" if same else "no",
                         f"two identical calls with seed={SEED} gave {'the same' if same else 'different'} samples",
                         first=a, second=b))
    fingerprint = first.get("system_fingerprint")
    caps.append(_cap("system_fingerprint", "yes" if fingerprint else "no",
                     "system_fingerprint set" if fingerprint else "no system_fingerprint on the answer",
                     system_fingerprint=fingerprint))
    return caps


def _seeded_sample(body: dict) -> list:
    """A sample's tokens where the answer has them (exact), else its text."""
    entries = _sampled(_first_choice(body))
    return [e.get("token") for e in entries] if entries else [_content(body)]


def _content(body: dict) -> Any:
    """The first choice's message content (None where the answer has none)."""
    message = _first_choice(body).get("message")
    return message.get("content") if isinstance(message, dict) else None


def _chat_cap(body: dict, how: str = "") -> Capability:
    if isinstance(_first_choice(body).get("message"), dict):
        return _cap("chat", "yes", f"POST /chat/completions answered{how}", content=_content(body))
    return _cap("chat", "partial", f"POST /chat/completions answered 200{how} but with no choice message",
                body=str(body)[:200])


def _token_id_capabilities(p: _Prober, model: str) -> list[Capability]:
    """vLLM's return_token_ids: prompt ids on the response (or the choice), response ids on the choice."""
    body, error = p.post("/chat/completions", {"model": model, "messages": PROMPT, "max_tokens": MAX_TOKENS,
                                               "return_token_ids": True})
    if body is None:
        return [_cap(n, "no", "return_token_ids was refused", error=error)
                for n in ("prompt_token_ids", "response_token_ids")]
    choice = _first_choice(body)
    prompt_ids = body.get("prompt_token_ids", choice.get("prompt_token_ids"))
    ids = choice.get("token_ids")
    usage = body.get("usage") or {}
    return [_ids_cap("prompt_token_ids", prompt_ids, usage.get("prompt_tokens")),
            _ids_cap("response_token_ids", ids, usage.get("completion_tokens"))]


def _ids_cap(name: str, ids: Any, count: int | None) -> Capability:
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        return _cap(name, "no", "return_token_ids=true gave no token id list", value=ids)
    if count is not None and count != len(ids):
        return _cap(name, "partial", f"{len(ids)} ids but usage counts {count} tokens", token_ids=ids)
    return _cap(name, "yes", f"{len(ids)} token ids (return_token_ids)", token_ids=ids)


def _routed_experts(p: _Prober, model: str) -> Capability:
    """return_routed_experts, in any engine's format (`contracts.upstream`): nested lists of the
    response (ours), vLLM's base64 `.npy` over prompt and response (split by the usage counts), or
    SGLang's shapeless base64 (seen, not unpacked: its shape is the model's)."""
    body, error = p.post("/chat/completions", {"model": model, "messages": PROMPT, "max_tokens": MAX_TOKENS,
                                               "return_routed_experts": True})
    if body is None:
        return _cap("routed_experts", "no", "return_routed_experts was refused", error=error)
    choice = _first_choice(body)
    value = choice.get("routed_experts", body.get("routed_experts"))
    usage = body.get("usage") or {}
    sglang = upstream.sglang_experts_field(body, choice)
    if value is None and isinstance(sglang, str) and sglang:
        return _cap("routed_experts", "yes", "SGLang's base64 int32 over prompt and response, without a shape "
                    "(sglext.routed_experts; the proxy unpacks it with --moe-shape)", routed_experts=sglang)
    try:
        split = upstream.read_choice_experts(value, prompt_tokens=usage.get("prompt_tokens"),
                                             response_tokens=usage.get("completion_tokens"))
    except upstream.RoutedExpertsError as exc:
        return _cap("routed_experts", "partial", f"routed_experts came back but cannot be read: "
                    f"{type(exc).__name__}: {exc}", value=value if isinstance(value, str) else str(value)[:200])
    if split is None and "routed_experts" in choice:
        return _cap("routed_experts", "no", "routed_experts came back empty: the server knows the extension but "
                    "recorded no routing (a dense model, or a server started without it, such as vLLM without "
                    "--enable-return-routed-experts, which needs its GPU model runner)", value=value)
    if split is None:
        return _cap("routed_experts", "no", "return_routed_experts=true gave no routed_experts "
                    "(a dense model, or the server does not record routing)", value=value)
    response = split.response_RLK
    packed = split.prompt_PLK is not None
    return _cap("routed_experts", "yes",
                "vLLM's base64 .npy over prompt and response, split at the prompt" if packed
                else "routed_experts [tokens][moe_layers][top_k]",
                shape=list(response.shape), first_token=response[0].tolist() if len(response) else None,
                prompt_shape=list(split.prompt_PLK.shape) if split.prompt_PLK is not None else None)


def _prompt_logprobs(p: _Prober, model: str) -> Capability:
    body, error = p.post("/completions", {"model": model, "prompt": "The sky is", "max_tokens": 1,
                                          "prompt_logprobs": 1})
    if body is None:
        return _cap("prompt_logprobs", "no", "prompt_logprobs=1 was refused", error=error)
    found = _first_choice(body).get("prompt_logprobs", body.get("prompt_logprobs"))
    prompt_tokens = (body.get("usage") or {}).get("prompt_tokens")
    if isinstance(found, list) and any(found) and prompt_tokens not in (None, len(found)):
        return _cap("prompt_logprobs", "partial", f"logprobs for {len(found)} positions of a {prompt_tokens}-token "
                    "prompt", prompt_logprobs=found)
    if isinstance(found, list) and any(found):
        return _cap("prompt_logprobs", "yes", f"logprobs for {len(found)} prompt positions (prompt_logprobs)",
                    prompt_logprobs=found)
    return _cap("prompt_logprobs", "no", "prompt_logprobs=1 was accepted but nothing came back", value=found)


def _completions(p: _Prober, model: str) -> Capability:
    try:
        body = p.client.completions.create(model=model, prompt="The sky is", max_tokens=MAX_TOKENS,
                                           logprobs=1).model_dump()
    except openai.APIError as exc:
        return _cap("completions", "no", "POST /completions failed", error=f"{type(exc).__name__}: {exc}")
    text = _first_choice(body).get("text")
    if isinstance(text, str):
        return _cap("completions", "yes", "POST /completions answered", text=text)
    return _cap("completions", "partial", "POST /completions answered 200 but with no choice text",
                body=str(body)[:200])


def _tool_calls(p: _Prober, model: str) -> Capability:
    try:
        request: dict[str, Any] = dict(
            model=model, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=TOOL_MAX_TOKENS, temperature=0.0)
        body = p.client.chat.completions.create(**request).model_dump()
    except openai.APIError as exc:
        return _cap("tool_calls", "no", "a request with tools and a named tool_choice was refused",
                    error=f"{type(exc).__name__}: {exc}")
    choice = _first_choice(body)
    message = choice.get("message") or {}
    calls = message.get("tool_calls")
    if calls:
        return _cap("tool_calls", "yes", "the named tool_choice gave a tool call", tool_calls=calls)
    reason = choice.get("finish_reason")
    if reason == "length":  # a call begun but not closed (tiny-moe on vLLM writes past 64 tokens)
        return _cap("tool_calls", "partial", f"tools were accepted but the answer ran out of max_tokens "
                    f"({TOOL_MAX_TOKENS}) before a tool call was complete", content=message.get("content"),
                    finish_reason=reason)
    return _cap("tool_calls", "partial", "tools were accepted but the answer has no tool_calls "
                "(the server does not force a named tool_choice, or the model did not call)",
                content=message.get("content"), finish_reason=reason)


def _streaming(p: _Prober, model: str) -> Capability:
    """A streamed chat asked for logprobs and token ids; asked plain if the server refuses those."""
    plain = {"model": model, "messages": PROMPT, "max_tokens": MAX_TOKENS}
    chunks, error = p.stream("/chat/completions", dict(plain, logprobs=True, return_token_ids=True))
    refused = None
    if error and error.startswith("HTTP 4"):
        refused, (chunks, error) = error, p.stream("/chat/completions", plain)
    choices = [c for chunk in chunks for c in chunk.get("choices") or [] if isinstance(c, dict)]
    if error or not choices:
        return _cap("streaming", "no", "stream=true gave no chunks" if not error else "the stream failed",
                    error=error, chunks=len(chunks), refused=refused)
    ids = [i for c in choices for i in (c.get("token_ids") or [])]
    logprobs = [e.get("logprob") for c in choices for e in _sampled(c)]
    evidence = {"chunks": len(chunks), "token_ids": ids, "logprobs": logprobs, "refused": refused}
    if ids and logprobs:
        return _cap("streaming", "yes", "the stream carries token ids and logprobs", **evidence)
    missing = " and ".join(n for n, v in (("token ids", ids), ("logprobs", logprobs)) if not v)
    return _cap("streaming", "partial", f"the stream works but carries no {missing}", **evidence)


def probe(url: str, *, model: str | None = None, api_key: str | None = None, timeout: float = 60.0) -> ProbeReport:
    """Probe the OpenAI-compatible endpoint at `url` (its base, with or without /v1).

    `model` defaults to the first model `GET /models` lists. Raises EndpointUnreachable,
    NotOpenAICompatible, AuthRejected or UnknownModel when the endpoint cannot be probed at all; every
    answer after that, refusals included, becomes a capability's verdict.
    """
    p = _Prober(url, api_key, timeout)
    try:
        models = p.models()
        if model is None:
            if not models:
                raise NotOpenAICompatible(f"{p.base}/models lists no model; name one with --model")
            model = models[0]
        elif model not in models:
            raise UnknownModel(f"{p.base} serves {', '.join(models) or 'no model'}, not {model!r}")
        caps = [*_chat_capabilities(p, model), _completions(p, model), *_token_id_capabilities(p, model),
                _routed_experts(p, model), _prompt_logprobs(p, model), _tool_calls(p, model), _streaming(p, model)]
    finally:
        p.close()
    order = {name: i for i, name in enumerate(CAPABILITIES)}
    return ProbeReport(url=p.base, model=model, probed_at=datetime.now(UTC).isoformat(timespec="seconds"),
                       capabilities=tuple(sorted(caps, key=lambda c: order[c.name])))
