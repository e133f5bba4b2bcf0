"""How the turns of one conversation find each other without the client's help.

Turn k sends messages M_k and gets reply R_k. A client that goes on with the conversation sends
M_{k+1} = M_k + [R_k] + (tool results, the next user message). So the proxy keys every reply by
hash(M_k + [R_k]) (one key per choice), and looks turn k+1 up by the hash of its messages up to
and including the last assistant message. A hit links the call to that capture and its
conversation; a miss starts a new conversation.

Messages are normalized before hashing, so that the echo of a reply matches the reply whatever
the client library adds or drops: only role, name, the text of the content (stripped of outer
whitespace) and each tool call's name and arguments count; ids, nulls and extra fields do not.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

_TEXT_PARTS = ("text", "input_text", "output_text")


def _arguments(arguments: Any) -> Any:
    """Tool-call arguments as a canonical value: parsed when they are JSON text, as-is otherwise."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments.strip()
    return arguments


def _content(content: Any) -> Any:
    if content is None:
        return ""
    if isinstance(content, str):
        return content.strip()
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in _TEXT_PARTS:
                parts.append(str(part.get("text", "")))
            else:
                parts.append(part)  # images and other parts count as they are
        if all(isinstance(p, str) for p in parts):
            return "".join(parts).strip()
        return parts
    return content


def normalize_message(message: Any) -> Any:
    """The part of a message that identifies it across a client's round trip."""
    if not isinstance(message, dict):
        return message
    out: dict[str, Any] = {"role": message.get("role"), "content": _content(message.get("content"))}
    if message.get("name"):
        out["name"] = message["name"]
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            [(call.get("function") or {}).get("name"), _arguments((call.get("function") or {}).get("arguments"))]
            for call in calls if isinstance(call, dict)
        ]
    return out


def messages_hash(messages: Iterable[Any]) -> str:
    """sha256 (hex) over the normalized messages as canonical JSON."""
    normalized = [normalize_message(m) for m in messages]
    data = json.dumps(normalized, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(data.encode()).hexdigest()


def prefix_hash(messages: list[Any]) -> str | None:
    """The key a call is looked up by: the hash of its messages through the last assistant
    message, or None when it has none (a first turn)."""
    for i in range(len(messages) - 1, -1, -1):
        message = messages[i]
        if isinstance(message, dict) and message.get("role") == "assistant":
            return messages_hash(messages[: i + 1])
    return None


def turn_index(messages: list[Any]) -> int:
    """Assistant messages already in the conversation: 0 for a first turn."""
    return sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")


def reply_message(content: str | None, tool_calls: list[tuple[str, str]]) -> dict[str, Any]:
    """The assistant message a client sends back for a reply (tool calls as (name, arguments))."""
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [{"function": {"name": name, "arguments": arguments}} for name, arguments in tool_calls],
    }


def reply_key(messages: list[Any], reply: dict[str, Any]) -> str:
    """The key under which the next turn will look a reply up."""
    return messages_hash([*messages, reply])
