"""Ask the upstream for what a capture needs; give the client back only what it asked for.

`augment_request` adds, where the client left them out, the fields that make an upstream return
logprobs, token ids, routed experts and (streamed) usage, and says what it added. `strip_response`
and `strip_chunk` take exactly those additions back out of the answer, so the client sees the
answer it would have had without the proxy. A field the client asked for is never touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
GENERATION = (CHAT, COMPLETIONS, RESPONSES)

TRAINING_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
"""NeMo Gym's token fields on a Responses output item, which `return_token_ids` asks for."""


@dataclass(frozen=True)
class Augmentation:
    """What the proxy added to one request."""

    logprobs: bool = False
    token_ids: bool = False
    routed_experts: bool = False
    usage: bool = False

    @property
    def added(self) -> list[str]:
        names = [("logprobs", self.logprobs), ("return_token_ids", self.token_ids),
                 ("return_routed_experts", self.routed_experts), ("stream_options.include_usage", self.usage)]
        return [name for name, on in names if on]

    @property
    def any(self) -> bool:
        return self.logprobs or self.token_ids or self.routed_experts or self.usage


NOTHING = Augmentation()


REFUSABLE = ("return_token_ids", "return_routed_experts")
"""Extension fields an upstream may refuse outright (a server started without routed experts)."""


def augment_request(endpoint: str, body: dict[str, Any],
                    skip: frozenset[str] = frozenset()) -> tuple[dict[str, Any], Augmentation]:
    """A copy of `body` that asks for everything a capture needs (but the fields in `skip`), and
    what was added."""
    out = dict(body)
    if endpoint == RESPONSES:
        logprobs = False  # NeMo Gym's token fields carry the logprobs with the ids
    elif endpoint == CHAT:
        logprobs = not out.get("logprobs")
        if logprobs:
            out["logprobs"] = True
            out.pop("top_logprobs", None)
    else:
        logprobs = out.get("logprobs") is None
        if logprobs:
            out["logprobs"] = 0
    token_ids = not out.get("return_token_ids") and "return_token_ids" not in skip
    if token_ids:
        out["return_token_ids"] = True
    experts = not out.get("return_routed_experts") and "return_routed_experts" not in skip
    if experts:
        out["return_routed_experts"] = True
    usage = False
    if endpoint != RESPONSES and out.get("stream"):  # a Responses stream has no usage option
        options = out.get("stream_options")
        if not (isinstance(options, dict) and options.get("include_usage")):
            out["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
            usage = True
    return out, Augmentation(logprobs, token_ids, experts, usage)


def _strip_choice(choice: dict[str, Any], aug: Augmentation) -> None:
    if aug.logprobs and "logprobs" in choice:
        choice["logprobs"] = None
    if aug.token_ids:
        choice.pop("token_ids", None)
        choice.pop("prompt_token_ids", None)
    if aug.routed_experts:
        choice.pop("routed_experts", None)
        ext = choice.get("sgl_ext")
        if isinstance(ext, dict):
            ext.pop("routed_experts", None)


def _strip_top(body: dict[str, Any], aug: Augmentation) -> None:
    if aug.token_ids:
        body.pop("prompt_token_ids", None)
    if aug.routed_experts:
        body.pop("routed_experts", None)
        ext = body.get("sglext")  # SGLang's answer-level extensions
        if isinstance(ext, dict):
            ext.pop("routed_experts", None)
            if not ext:
                body.pop("sglext")
    for choice in body.get("choices") or ():
        if isinstance(choice, dict):
            _strip_choice(choice, aug)
    output = body.get("output") if body.get("object") == "response" else None
    for item in output if isinstance(output, list) else ():
        if not isinstance(item, dict):
            continue
        if aug.token_ids:
            for name in TRAINING_FIELDS:
                item.pop(name, None)
        if aug.routed_experts:
            item.pop("routed_experts", None)


def strip_response(body: dict[str, Any], aug: Augmentation) -> dict[str, Any]:
    """Remove from a whole answer (in place) what the proxy asked for and the client did not."""
    _strip_top(body, aug)
    return body


def strip_chunk(chunk: dict[str, Any], aug: Augmentation) -> dict[str, Any] | None:
    """Remove from one streamed chunk (in place) what the client did not ask for; None when the
    whole chunk is the proxy's own (the usage chunk it asked for)."""
    if isinstance(chunk.get("response"), dict):  # a Responses event that carries the whole Response
        strip_response(chunk["response"], aug)
        return chunk
    if chunk.get("type") in ("response.output_text.delta", "response.function_call_arguments.delta") \
            and aug.token_ids:
        for name in TRAINING_FIELDS:  # the delta's share of the output item's token fields
            chunk.pop(name, None)
    if aug.usage and chunk.get("usage") is not None and not chunk.get("choices"):
        return None
    if aug.routed_experts and not chunk.get("choices") and isinstance(chunk.get("sglext"), dict) \
            and set(chunk["sglext"]) == {"routed_experts"}:
        return None  # SGLang's last chunk that carries only the routed experts the proxy asked for
    if aug.usage:
        chunk.pop("usage", None)
    _strip_top(chunk, aug)
    return chunk
