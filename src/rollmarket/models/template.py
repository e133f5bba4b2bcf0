"""The chat template of the tiny models and the parser of the tool calls it renders.

The template follows Qwen3's (Hermes tool calls) with two changes that suit a tiny context:
a shorter tools preamble, and no `<think>` block injected into assistant turns (assistant
content renders exactly as given). What an assistant tool call looks like, on the wire and in
the tokens, is::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "17 * 23"}}
    </tool_call>

one JSON object on one line; several calls are separated by a newline. Tool results go back
inside a user turn, each wrapped in `<tool_response>` ... `</tool_response>`.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

TOOLS_PREAMBLE = "# Tools\n\nYou may call one or more functions to answer the user. Their signatures:\n<tools>"
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nTo call a function, reply with:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)

CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- " + json.dumps(TOOLS_PREAMBLE) + " }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- '\\n' }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- " + json.dumps(TOOLS_POSTAMBLE) + " }}\n"
    "    {{- '<|im_end|>\\n' }}\n"
    "{%- elif messages[0].role == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.content is string %}\n"
    "        {%- set content = message.content %}\n"
    "    {%- else %}\n"
    "        {%- set content = '' %}\n"
    "    {%- endif %}\n"
    "    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == 'assistant' %}\n"
    "        {{- '<|im_start|>assistant\\n' + content }}\n"
    "        {%- if message.tool_calls %}\n"
    "            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if (loop.first and content) or (not loop.first) %}\n"
    "                    {{- '\\n' }}\n"
    "                {%- endif %}\n"
    "                {%- if tool_call.function %}\n"
    "                    {%- set tool_call = tool_call.function %}\n"
    "                {%- endif %}\n"
    "                {{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}\n"
    "                {%- if tool_call.arguments is string %}\n"
    "                    {{- tool_call.arguments }}\n"
    "                {%- else %}\n"
    "                    {{- tool_call.arguments | tojson }}\n"
    "                {%- endif %}\n"
    "                {{- '}\\n</tool_call>' }}\n"
    "            {%- endfor %}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == 'tool' %}\n"
    "        {%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)



@lru_cache(maxsize=4)
def _compiled(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    # transformers' tojson: plain json.dumps, no HTML escaping, unicode kept.
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    return env.from_string(template)


def render_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
                add_generation_prompt: bool = False) -> str:
    """Render `messages` with the chat template, without a tokenizer (same text as
    `tokenizer.apply_chat_template(..., tokenize=False)`)."""
    return _compiled(CHAT_TEMPLATE).render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)


_TOOL_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Split an assistant reply into its plain content and its tool calls.

    Returns `(content, calls)`; each call is `{"name": str, "arguments": dict}`. A block whose
    JSON does not parse, or lacks a name, is left in the content (a bad call is data, not a
    crash: the agent sees no call and the reply counts as an answer).
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for match in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                continue
        if not isinstance(args, dict):
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append({"name": obj["name"], "arguments": args})
    kept.append(text[last:])
    return "".join(kept).strip(), calls
