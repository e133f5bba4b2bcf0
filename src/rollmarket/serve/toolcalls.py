"""Hermes tool calls (Qwen3's convention) parsed into OpenAI ``tool_calls``.

The model writes ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``; anything that
does not parse stays in the content, so a malformed call is visible rather than lost.
"""

from __future__ import annotations

import json
import re
import secrets

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def parse_block(body: str) -> dict | None:
    """One block's JSON as an OpenAI tool call, or None when it is not a valid call."""
    try:
        payload = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return None
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return {"id": new_call_id(), "type": "function",
            "function": {"name": payload["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def split_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content before the first call or None, parsed calls). Unparseable text stays content."""
    calls: list[dict] = []
    matches = list(_BLOCK.finditer(text))
    for match in matches:
        call = parse_block(match.group(1))
        if call is None:
            return text, []
        calls.append(call)
    if not calls:
        return text, []
    content = text[: matches[0].start()].strip()
    return (content or None), calls
