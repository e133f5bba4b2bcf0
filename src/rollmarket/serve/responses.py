"""OpenAI's Responses API on top of the chat path: input items in, output items out.

A Responses request is turned into the chat messages and function tools the chat template reads;
the finished choice is turned into output items (an assistant ``message`` and one
``function_call`` per parsed tool call). The RL extensions use NeMo Gym's names, so that a Gym
agent reads our answers as it reads its own model servers': ``prompt_token_ids``,
``generation_token_ids`` and ``generation_log_probs`` (and ``routed_experts`` on an MoE model)
on the last output item, which covers the whole generation.
"""

from __future__ import annotations

import json
import secrets
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from ..contracts.responses import ResponsesInputError, input_messages
from ..sqlite_commit import commit_each, connect
from .choice import ChoiceState
from .protocol import OpenAIError, ResponsesRequest

LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""The ``include`` value that asks for per-token logprobs on each ``output_text`` part."""

UNSUPPORTED_RESPONSES_FIELDS = ("conversation", "background")
"""Stateful Responses features beyond `previous_response_id`: ignoring them would answer a
different conversation, so they are refused."""


class StoredResponses:
    """The latest stored responses, by id: each one's conversation, for `previous_response_id`, and
    its whole Response object, for `GET /v1/responses/{id}`.

    A conversation holds the chat messages of its turns (input and output, without the
    instructions, which OpenAI does not carry over to the next response). The oldest go first
    beyond `capacity`; an id that is gone, deleted, or never was, is a 404 in OpenAI's shape.

    In memory by default; with `path`, in that SQLite file (WAL): a response is in the file before
    its answer leaves, so a conversation continues across a restart of the server, kill -9
    included.
    """

    def __init__(self, capacity: int, path: Path | None = None):
        self.capacity = capacity
        self._kept: OrderedDict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = OrderedDict()
        self._db = None
        self._lock = threading.Lock()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = connect(path, "NORMAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS responses (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
                             "response_id TEXT NOT NULL UNIQUE, turns TEXT NOT NULL, body TEXT NOT NULL)")

    @staticmethod
    def _missing(rid: str, param: str) -> OpenAIError:
        if param == "previous_response_id":
            return OpenAIError(f"Previous response with id '{rid}' not found.", status=404, param=param,
                               code="previous_response_not_found")
        return OpenAIError(f"Response with id '{rid}' not found.", status=404, param=param)

    def _find(self, rid: str, param: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        if self._db is None:
            found = self._kept.get(rid)
        else:
            with self._lock:
                row = self._db.execute("SELECT turns, body FROM responses WHERE response_id = ?", (rid,)).fetchone()
            found = None if row is None else (json.loads(row[0]), json.loads(row[1]))
        if found is None:
            raise self._missing(rid, param)
        return found

    def get(self, rid: str) -> list[dict[str, Any]]:
        """The conversation a request naming `rid` as `previous_response_id` continues."""
        return self._find(rid, "previous_response_id")[0]

    def body(self, rid: str) -> dict[str, Any]:
        """The Response object as it was answered (`GET /v1/responses/{id}`)."""
        return self._find(rid, "response_id")[1]

    def put(self, rid: str, turns: list[dict[str, Any]], body: dict[str, Any]) -> None:
        if self.capacity < 1:
            return
        if self._db is None:
            self._kept[rid] = (turns, body)
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)
            return

        def insert_keeping_the_latest(conn) -> None:
            seq = conn.execute("INSERT INTO responses (response_id, turns, body) VALUES (?, ?, ?)",
                               (rid, json.dumps(turns), json.dumps(body))).lastrowid
            conn.execute("DELETE FROM responses WHERE seq <= ?", (seq - self.capacity,))

        with self._lock:
            ((_, error),) = commit_each(self._db, [insert_keeping_the_latest])
        if error is not None:
            raise error

    def delete(self, rid: str) -> None:
        """Forget `rid` (a 404 when it is not held): later requests naming it are 404s."""
        if self._db is None:
            gone = self._kept.pop(rid, None) is not None
        else:
            with self._lock:
                gone = self._db.execute("DELETE FROM responses WHERE response_id = ?", (rid,)).rowcount > 0
        if not gone:
            raise self._missing(rid, "response_id")

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


def input_turns(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of a request's input items (`contracts.responses`), as typed 400s."""
    try:
        return input_messages(req.input)
    except ResponsesInputError as exc:
        raise OpenAIError(str(exc), param="input") from None


def chat_messages(req: ResponsesRequest, turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages a Responses request stands for: its instructions, then its `turns` (those
    of the response it continues, then its input items)."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += turns
    if not messages:
        raise OpenAIError("input has no messages", param="input")
    return messages


def chat_tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    """Responses function tools (flat) as chat tools (nested under ``function``)."""
    if not req.tools:
        return None
    tools = []
    for i, tool in enumerate(req.tools):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise OpenAIError(f"tools.{i}: only function tools with a `name` are supported", param="tools")
        # The template prints the function as JSON: its fields keep the client's order.
        function = {key: value for key, value in tool.items() if key not in ("type", "strict")}
        function.setdefault("parameters", {"type": "object"})
        tools.append({"type": "function", "function": function})
    return tools


def output_items(c: ChoiceState, *, prompt: list[int], logprob_entries: list[dict] | None,
                 token_ids: bool, experts: bool) -> tuple[list[dict[str, Any]], str]:
    """The output items of a finished choice, and the response's status."""
    content, calls, reason = c.final()
    items: list[dict[str, Any]] = []
    if content or not calls:
        part: dict[str, Any] = {"type": "output_text", "text": content or "", "annotations": []}
        if logprob_entries is not None:
            part["logprobs"] = logprob_entries
        items.append({"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant",
                      "status": "completed", "content": [part]})
    for call in calls:
        items.append({"id": "fc_" + secrets.token_hex(12), "type": "function_call", "status": "completed",
                      "call_id": call["id"], "name": call["function"]["name"],
                      "arguments": call["function"]["arguments"]})
    if token_ids:
        items[-1].update(prompt_token_ids=prompt, generation_token_ids=c.token_ids,
                         generation_log_probs=c.logprobs)
    if experts:
        items[-1]["routed_experts"] = c.experts
    return items, ("incomplete" if reason == "length" else "completed")


def response_body(req: ResponsesRequest, *, rid: str, created: int, model: str, prompt: list[int],
                  items: list[dict[str, Any]], status: str, output_tokens: int) -> dict[str, Any]:
    """The whole Response object, as OpenAI's client reads it."""
    return {
        "id": rid, "object": "response", "created_at": created, "model": model, "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "output": items, "tools": req.tools or [],
        "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": True,
        "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
        "metadata": {}, "text": {"format": {"type": "text"}},
        "previous_response_id": req.previous_response_id, "store": req.store,
        "usage": {"input_tokens": len(prompt), "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": len(prompt) + output_tokens},
    }


class ResponseEvents:
    """The server-sent events of one streamed Response, in OpenAI's order and shapes.

    Text opens an assistant ``message`` item on its first delta; each tool call, once parsed
    whole, is a ``function_call`` item (added, its arguments in one delta, done when the next item
    opens or the Response ends). The closing ``response.completed`` carries the whole Response,
    with the token fields when asked for.

    Each ``response.output_text.delta`` carries the tokens generated since the last delta: their
    ``logprobs`` in OpenAI's shape (when asked for; else ``[]``) and, with ``return_token_ids``,
    their ``generation_token_ids`` and ``generation_log_probs`` (and ``routed_experts``). A tool
    call's ``response.function_call_arguments.delta`` carries the token fields of the tokens behind
    it the same way (OpenAI's event has no ``logprobs``), so the deltas of a whole Response
    concatenate to the generation its last item carries. Tokens still unsent when the generation
    ends (held by the detokenizer, or the end-of-turn token after a call) go out on a last, empty
    delta of the open item.
    """

    def __init__(self, base: dict[str, Any]):
        self.base = base
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None
        self._call: dict[str, Any] | None = None
        """The function_call item whose done events wait for the next item or the end."""
        self._text: list[str] = []

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return (f"event: {kind}\ndata: ".encode() + json.dumps(payload, separators=(",", ":")).encode()
                + b"\n\n")

    def start(self) -> list[bytes]:
        response = {**self.base, "status": "in_progress", "output": [], "usage": None}
        return [self.event("response.created", response=response), self.event("response.in_progress",
                                                                                response=response)]

    def text(self, delta: str, **tokens: Any) -> list[bytes]:
        """The events of a text delta; `tokens` are the per-token fields of the tokens behind it."""
        out = self.close_call()
        if self._message is None:
            self._message = {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant",
                             "status": "in_progress", "content": []}
            self.items.append(self._message)
            out += [self.event("response.output_item.added", output_index=len(self.items) - 1, item=self._message),
                    self.event("response.content_part.added", item_id=self._message["id"],
                               output_index=len(self.items) - 1, content_index=0,
                               part={"type": "output_text", "text": "", "annotations": []})]
        self._text.append(delta)
        out.append(self.event("response.output_text.delta", item_id=self._message["id"],
                              output_index=self.items.index(self._message), content_index=0, delta=delta,
                              **{"logprobs": [], **tokens}))
        return out

    def close_message(self, final: dict[str, Any] | None = None) -> list[bytes]:
        """Close the open message item (with `final`'s part, logprobs included, when given)."""
        if self._message is None:
            return []
        message, self._message = self._message, None
        index = self.items.index(message)
        part = (final or {}).get("content", [None])[0] or {"type": "output_text", "text": "".join(self._text),
                                                             "annotations": []}
        message.update(status="completed", content=[part])
        return [self.event("response.output_text.done", item_id=message["id"], output_index=index,
                           content_index=0, text=part["text"], logprobs=part.get("logprobs", [])),
                self.event("response.content_part.done", item_id=message["id"], output_index=index,
                           content_index=0, part=part),
                self.event("response.output_item.done", output_index=index, item=message)]

    def call(self, call: dict[str, Any], **tokens: Any) -> list[bytes]:
        """The events of a parsed tool call; `tokens` are the per-token fields of the tokens behind it."""
        out = self.close_message() + self.close_call()
        item = {"id": "fc_" + secrets.token_hex(12), "type": "function_call", "status": "in_progress",
                "call_id": call["id"], "name": call["function"]["name"], "arguments": ""}
        self.items.append(item)
        index = len(self.items) - 1
        arguments = call["function"]["arguments"]
        out.append(self.event("response.output_item.added", output_index=index, item=dict(item)))
        out.append(self._arguments_delta(item, arguments, tokens))
        item.update(arguments=arguments)
        self._call = item
        return out

    def _arguments_delta(self, item: dict[str, Any], delta: str, tokens: dict[str, Any]) -> bytes:
        fields = {k: v for k, v in tokens.items() if k != "logprobs"}  # OpenAI's call delta has none
        return self.event("response.function_call_arguments.delta", item_id=item["id"],
                          output_index=self.items.index(item), delta=delta, **fields)

    def close_call(self) -> list[bytes]:
        if self._call is None:
            return []
        item, self._call = self._call, None
        index = self.items.index(item)
        item.update(status="completed")
        return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=index, item=item)]

    def finish(self, body: dict[str, Any], rest: dict[str, Any] | None = None) -> list[bytes]:
        """Close what is open and send the whole Response; streamed items keep their ids. `rest`
        are the per-token fields of tokens no delta has carried yet."""
        final = body["output"]
        messages = [item for item in final if item["type"] == "message"]
        out = []
        if rest and self._call is not None:
            out.append(self._arguments_delta(self._call, "", rest))
        elif rest and (self._message is not None or (not self.items and messages)):
            out += self.text("", **rest)
        out += self.close_call() + self.close_message(messages[0] if messages else None)
        if not self.items and messages:  # an empty answer is still one (empty) message item
            out += self.text("") + self.close_message(messages[0])
        for streamed, item in zip(self.items, final):
            item["id"] = streamed["id"]
        return out + [self.event("response.completed", response=body)]
