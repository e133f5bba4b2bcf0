"""A minimal OpenAI-compatible chat server with none of the RL extensions, for tests/test_probe.py.

It answers GET /v1/models and POST /v1/chat/completions (plain and streamed) with random words;
it ignores seed, logprobs, tools and every extension field, has no /v1/completions, and with
--key refuses any other bearer key (401). With --strict it refuses (400) any field beyond the
plain chat fields, logprobs included, as a strict provider does. So each "no" is real.

    python tests/probe_stub.py PORT [--key KEY] [--strict]
"""

from __future__ import annotations

import json
import random
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")
KEY = sys.argv[sys.argv.index("--key") + 1] if "--key" in sys.argv else None
STRICT = "--strict" in sys.argv
PLAIN_FIELDS = {"model", "messages", "max_tokens", "temperature", "seed", "stream", "tools", "tool_choice"}


class Stub(BaseHTTPRequestHandler):
    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorised(self) -> bool:
        if KEY is None or self.headers.get("Authorization") == f"Bearer {KEY}":
            return True
        self._send(401, {"error": {"message": "bad key", "type": "invalid_request_error"}})
        return False

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/healthz":
            self._send(200, {"ok": True})
        elif self.path == "/v1/models" and self._authorised():
            self._send(200, {"object": "list", "data": [{"id": "stub", "object": "model", "owned_by": "test"}]})
        elif self.path != "/v1/models":
            self._send(404, {"error": {"message": "not found"}})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path != "/v1/chat/completions":
            self._send(404, {"error": {"message": f"no route {self.path}", "type": "invalid_request_error"}})
            return
        if not self._authorised():
            return
        unknown = sorted(set(body) - PLAIN_FIELDS)
        if STRICT and unknown:
            self._send(400, {"error": {"message": f"unknown fields {unknown}", "type": "invalid_request_error"}})
            return
        words = [random.choice(WORDS) for _ in range(6)]
        if not body.get("stream"):
            self._send(200, {"id": "chatcmpl-stub", "object": "chat.completion", "created": 0, "model": "stub",
                             "choices": [{"index": 0, "finish_reason": "length", "logprobs": None,
                                          "message": {"role": "assistant", "content": " ".join(words)}}],
                             "usage": {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for word in words:
            chunk = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": 0, "model": "stub",
                     "choices": [{"index": 0, "delta": {"content": word + " "}, "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):  # quiet
        pass


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Stub).serve_forever()
