"""A small, deterministic OpenAI-compatible upstream that speaks the vLLM extensions.

It stands in for a real engine where the tests need behaviour no real engine shows on demand:
a stream that breaks off, a slow stream, an upstream that refuses the extra fields, routed experts
as the MoE engines pack them (neither runs here with them: vLLM's CPU build cannot return them,
SGLang does not run on this CPU). `--sglang` packs them as SGLang does (raw int32 base64 over every
fed position and hidden layer, at the top of the answer in `sglext`, and in a last streamed chunk of
its own; token ids stay vLLM's `return_token_ids`); the model `packed` packs them as vLLM does (a base64 `.npy` over every fed position on each whole
answer's choice, as `vllm.utils.serial_utils.numpy2base64` writes it). Tokens are bytes (id = byte + 3) under a fixed chat template, so token ids
decode to text without a tokenizer file. Run it as a process:

    python tests/fake_upstream.py --port 8123 [--refuse-experts] [--sglang]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import io
import json
import time

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

OFFSET = 3
LAYERS, TOP_K, EXPERTS = 2, 2, 4
WORDS = ["alpha", "beta", "gamma", "delta", "echo", "fox", "golf", "hotel", "ink", "jade"]
MODEL = "fake-moe"


def encode(text: str) -> list[int]:
    return [b + OFFSET for b in text.encode()]


def decode(ids: list[int]) -> str:
    return bytes(i - OFFSET for i in ids).decode()


def chat_template(messages: list[dict]) -> str:
    parts = []
    for m in messages:
        content = m.get("content") or ""
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content)
        calls = "".join(
            "<tool_call>" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
            + "</tool_call>" for c in m.get("tool_calls") or [])
        parts.append(f"<|{m['role']}|>{content}{calls}\n")
    return "".join(parts) + "<|assistant|>"


def logprob(token: int, position: int) -> float:
    return -round(((token * 7 + position) % 13) / 5 + 0.05, 4)


def experts(token: int) -> list[list[int]]:
    return [[(token + layer) % EXPERTS, (token + layer + 1) % EXPERTS] for layer in range(LAYERS)]


def fed_experts(prompt_ids: list[int], ids: list[int]) -> np.ndarray:
    """int32 [P + R - 1, L, K]: row j is the step fed token j, which produced token j + 1."""
    sequence = prompt_ids + ids
    return np.asarray([experts(t) for t in sequence[1:]], "<i4").reshape(-1, LAYERS, TOP_K)


def npy_base64(array: np.ndarray) -> str:
    """vLLM's encoding (`numpy2base64`): the array's `.npy` file, base64."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def generate(prompt: str, seed: int, max_tokens: int) -> tuple[str, str]:
    """Deterministic words from the prompt and seed; ('text', finish_reason)."""
    digest = hashlib.sha256(f"{prompt}|{seed}".encode()).digest()
    words = [WORDS[b % len(WORDS)] for b in digest[: 2 + digest[0] % 4]]
    text = " ".join(words) + "."
    if len(encode(text)) > max_tokens:
        return decode(encode(text)[:max_tokens]), "length"
    return text, "stop"


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    return JSONResponse({"object": "error", "message": message, "type": kind, "param": param, "code": status},
                        status_code=status)


def create_app(*, refuse_experts: bool = False, sglang: bool = False) -> FastAPI:
    app = FastAPI()

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "tests"}]}

    async def run(req: dict, chat: bool):
        if req.get("model") not in (MODEL, "slow", "break", "packed"):
            return error(404, f"The model `{req.get('model')}` does not exist.", "model")
        if refuse_experts and req.get("return_routed_experts"):
            return error(400, "this server was started without routed-expert returns", "return_routed_experts")
        max_tokens = req.get("max_tokens") or 64
        if max_tokens > 4096:
            return error(400, f"max_tokens={max_tokens} exceeds the context", "max_tokens")
        n = req.get("n") or 1
        seed = req.get("seed") or 0
        if chat:
            messages = req["messages"]
            prompt = chat_template(messages)
            tools = req.get("tools") or []
            wants_tool = bool(tools) and messages[-1]["role"] == "user"
        else:
            prompt, tools, wants_tool = req["prompt"], [], False
        prompt_ids = encode(prompt)
        choices = []
        for i in range(n):
            if wants_tool:
                name = tools[0]["function"]["name"]
                arguments = json.dumps({"query": f"q{seed + i}"})
                raw = f"<tool_call>{json.dumps({'name': name, 'arguments': json.loads(arguments)})}</tool_call>"
                choices.append({"text": raw, "reason": "tool_calls", "content": None,
                                "tool_calls": [{"id": f"call_{i}", "type": "function",
                                                "function": {"name": name, "arguments": arguments}}]})
            else:
                text, reason = generate(prompt, seed + i, max_tokens)
                choices.append({"text": text, "reason": reason, "content": text, "tool_calls": None})
        for c in choices:
            c["ids"] = encode(c["text"])
        if req.get("stream"):
            return StreamingResponse(stream(req, chat, prompt_ids, choices), media_type="text/event-stream")
        return JSONResponse(whole(req, chat, prompt_ids, choices))

    def extras(req: dict, chat: bool, ids: list[int], start: int, entry: dict) -> None:
        if chat and req.get("logprobs"):
            k = req.get("top_logprobs") or 0
            entry["logprobs"] = {"content": [
                {"token": decode([t]), "logprob": logprob(t, start + j), "bytes": [t - OFFSET],
                 "top_logprobs": [{"token": decode([t]), "logprob": logprob(t, start + j), "bytes": [t - OFFSET]}][:k]}
                for j, t in enumerate(ids)]}
        elif not chat and req.get("logprobs") is not None:
            entry["logprobs"] = {"tokens": [decode([t]) for t in ids],
                                 "token_logprobs": [logprob(t, start + j) for j, t in enumerate(ids)],
                                 "top_logprobs": [{decode([t]): logprob(t, start + j)} for j, t in enumerate(ids)],
                                 "text_offset": list(range(start, start + len(ids)))}
        else:
            entry["logprobs"] = None
        if req.get("return_token_ids"):
            entry["token_ids"] = ids
        if req.get("return_routed_experts") and not sglang and req.get("model") != "packed":
            entry["routed_experts"] = [experts(t) for t in ids]

    def sglang_experts(prompt_ids: list[int], ids: list[int]) -> str:
        """SGLang's routed experts: raw int32 over every hidden layer, a dense first layer of -1."""
        routed = fed_experts(prompt_ids, ids)
        dense = np.full((len(routed), 1, TOP_K), -1, "<i4")
        return base64.b64encode(np.concatenate([dense, routed], axis=1).tobytes()).decode()

    def usage(prompt_ids: list[int], choices: list[dict]) -> dict:
        completion = sum(len(c["ids"]) for c in choices)
        return {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
                "total_tokens": len(prompt_ids) + completion}

    def whole(req: dict, chat: bool, prompt_ids: list[int], choices: list[dict]) -> dict:
        out = []
        for i, c in enumerate(choices):
            entry: dict = {"index": i, "finish_reason": c["reason"]}
            if chat:
                entry["message"] = {"role": "assistant", "content": c["content"], "tool_calls": c["tool_calls"] or []}
            else:
                entry["text"] = c["text"]
            extras(req, chat, c["ids"], 0, entry)
            if not chat and req.get("return_token_ids"):
                entry["prompt_token_ids"] = prompt_ids
            if req.get("return_routed_experts") and req.get("model") == "packed":
                entry["routed_experts"] = npy_base64(fed_experts(prompt_ids, c["ids"]).astype(np.uint8))
            out.append(entry)
        body = {"id": "cmpl-fake", "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": MODEL, "choices": out, "usage": usage(prompt_ids, choices)}
        if chat and req.get("return_token_ids"):
            body["prompt_token_ids"] = prompt_ids
        if req.get("return_routed_experts") and sglang:  # the first choice's, as SGLang does
            body["sglext"] = {"routed_experts": sglang_experts(prompt_ids, choices[0]["ids"])}
        return body

    async def stream(req: dict, chat: bool, prompt_ids: list[int], choices: list[dict]):
        kind = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": "cmpl-fake", "object": kind, "created": int(time.time()), "model": MODEL}
        with_usage = (req.get("stream_options") or {}).get("include_usage")

        def event(body: dict) -> bytes:
            if with_usage:
                body.setdefault("usage", None)
            return b"data: " + json.dumps(body).encode() + b"\n\n"

        if chat:
            first = {**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                          "finish_reason": None} for i in range(len(choices))]}
            if req.get("return_token_ids"):
                first["prompt_token_ids"] = prompt_ids
            yield event(first)
        for i, c in enumerate(choices):
            if chat and c["tool_calls"]:
                call = c["tool_calls"][0]
                pieces = [call["function"]["arguments"][:5], call["function"]["arguments"][5:]]
                # the whole tool-call text is one step here: its tokens go out with the first piece
                for j, piece in enumerate(pieces):
                    delta_call = {"index": 0, "function": {"arguments": piece}}
                    if j == 0:
                        delta_call.update(id=call["id"], type="function")
                        delta_call["function"]["name"] = call["function"]["name"]
                    entry = {"index": i, "delta": {"tool_calls": [delta_call]}, "finish_reason": None}
                    extras(req, chat, c["ids"] if j == 0 else [], 0, entry)
                    yield event({**base, "choices": [entry]})
            else:
                for j, t in enumerate(c["ids"]):
                    if req.get("model") == "slow":
                        await asyncio.sleep(0.05)
                    if req.get("model") == "break" and j == 3:
                        raise RuntimeError("engine died mid-stream")
                    piece = decode([t])
                    entry = {"index": i, "finish_reason": None}
                    if chat:
                        entry["delta"] = {"content": piece}
                    else:
                        entry["text"] = piece
                    extras(req, chat, [t], j, entry)
                    if not chat and j == 0 and req.get("return_token_ids"):
                        entry["prompt_token_ids"] = prompt_ids
                    yield event({**base, "choices": [entry]})
            last = {"index": i, "finish_reason": c["reason"]}
            last["delta" if chat else "text"] = {} if chat else ""
            yield event({**base, "choices": [last]})
        if req.get("return_routed_experts") and sglang:
            sglext = {"routed_experts": sglang_experts(prompt_ids, choices[0]["ids"])}
            yield b"data: " + json.dumps({**base, "choices": [], "sglext": sglext}).encode() + b"\n\n"
        if with_usage:
            yield b"data: " + json.dumps({**base, "choices": [], "usage": usage(prompt_ids, choices)}).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(await request.json(), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(await request.json(), chat=False)

    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--refuse-experts", action="store_true")
    parser.add_argument("--sglang", action="store_true")
    args = parser.parse_args()
    uvicorn.run(create_app(refuse_experts=args.refuse_experts, sglang=args.sglang), host="127.0.0.1",
                port=args.port, log_level="warning")
