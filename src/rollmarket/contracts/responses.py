"""What a Responses API conversation is in chat messages: one reading for the model server and the proxy.

The model server renders a Responses request through the chat template, so it must turn input
items into chat messages; the capture proxy links Responses turns into conversations by the same
chat-message hashes as chat completions, so it must read the items the same way. Both call
`input_messages`, so that the conversation the proxy records is the one the model was shown.
"""

from __future__ import annotations

from typing import Any

_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesInputError(ValueError):
    """A Responses input this reading cannot turn into chat messages; the message says where."""


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        for part in content:
            if part.get("type", "input_text") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
                raise ResponsesInputError(f"{where}: only text content parts are supported, not {part.get('type')!r}")
        return "".join(part["text"] for part in content)
    raise ResponsesInputError(f"{where}: content must be a string or a list of text parts")


def input_messages(items: str | list[Any]) -> list[dict[str, Any]]:
    """The chat messages that Responses input items stand for (a string is one user message).

    A ``function_call`` joins the assistant message before it (the text and the calls of one
    generation are one assistant turn, as the model wrote it); reasoning items are left out, as
    the chat template would leave them out.
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise ResponsesInputError("input must be a string or a list of items")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise ResponsesInputError(f"{where}: an input item must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ResponsesInputError(f"{where}.role: must be user, assistant, system or developer")
            # The chat templates know no developer role; it is the system prompt by another name.
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str):
                raise ResponsesInputError(f"{where}: a function_call needs string `name` and `arguments`")
            call = {"id": str(item.get("call_id") or item.get("id") or ""), "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ResponsesInputError(f"{where}: a function_call_output needs a string `call_id`")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output", ""), where)})
        elif kind == "reasoning":
            continue
        else:
            raise ResponsesInputError(f"{where}.type: unsupported input item {kind!r}")
    return messages

