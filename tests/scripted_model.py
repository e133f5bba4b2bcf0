"""A chat-completions server whose turns follow a script, for tests of the agent loop's plumbing.

A real model here (tests' tiny models) cannot be made to call a tool on demand; this one does, so
that tests can check where tool calls go and what comes back:

    tools offered, no tool result yet  -> a read_file call on "secret.txt"
    a tool result in the conversation   -> answers that result's text
    no tools                            -> answers "tools=0: <the last user text>"
    a user text holding FAIL-UPSTREAM   -> HTTP 500

Token ids are the text's bytes + 3 and every logprob is -0.5, so tests can compute them. GET /stats
counts the completions served.

    python tests/scripted_model.py --port 8123
"""

from __future__ import annotations

import argparse
import asyncio
import json

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

MODEL = "scripted"


def encode(text: str) -> list[int]:
    return [b + 3 for b in text.encode()]


def create_app() -> FastAPI:
    app = FastAPI()
    served = {"completions": 0}

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/stats")
    async def stats():
        return served

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await request.json()
        messages = req["messages"]
        users = [m["content"] for m in messages if m["role"] == "user"]
        if users and "FAIL-UPSTREAM" in users[-1]:
            return JSONResponse({"error": {"message": "scripted failure"}}, status_code=500)
        served["completions"] += 1
        await asyncio.sleep(0.1)  # keep concurrent runs in flight together
        results = [m["content"] for m in messages if m["role"] == "tool"]
        calls = None
        if results:
            content = results[-1]
        elif req.get("tools"):
            content = ""
            calls = [{"id": "call_0", "type": "function",
                      "function": {"name": "read_file", "arguments": json.dumps({"path": "secret.txt"})}}]
        else:
            content = f"tools=0: {users[-1] if users else ''}"
        ids = encode(content or json.dumps(calls))
        prompt = encode(json.dumps(messages))
        return {"id": "chatcmpl-1", "object": "chat.completion", "model": MODEL, "prompt_token_ids": prompt,
                "choices": [{"index": 0, "finish_reason": "tool_calls" if calls else "stop", "token_ids": ids,
                             "message": {"role": "assistant", "content": content, "tool_calls": calls},
                             "logprobs": {"content": [{"token": "", "logprob": -0.5} for _ in ids]}}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids)}}

    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(create_app(), host="127.0.0.1", port=args.port, log_level="warning")
