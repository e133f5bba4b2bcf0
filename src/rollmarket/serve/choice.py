"""One choice as it is produced: tokens, logprob entries, experts, and the text they spell.

The same state object serves non-streaming responses (read once at the end) and streaming ones
(``stream_delta`` hands out only the text that is safe to show: no half UTF-8 characters, nothing
that may still turn out to be part of a stop string or a tool call).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .detok import Detokenizer
from .toolcalls import CLOSE, OPEN, parse_block, split_tool_calls


@dataclass
class ChoiceState:
    index: int
    detok: Detokenizer
    eos_ids: frozenset[int]
    stops: tuple[str, ...] = ()
    parse_tools: bool = False
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    experts: list[list[list[int]]] = field(default_factory=list)
    finish_reason: str | None = None
    _bytes: bytearray = field(default_factory=bytearray)
    _emitted: int = 0
    _calls_emitted: int = 0

    def add(self, ev) -> None:
        self.token_ids.append(ev.token_id)
        self.logprobs.append(ev.logprob)
        self.tops.append(ev.top)
        if ev.experts_LK is not None:
            self.experts.append(ev.experts_LK.tolist())
        # Special tokens (end of turn, <|im_start|>, padding) are in token_ids and logprobs but
        # never in the text, wherever they fall (ignore_eos lets them appear mid-sequence).
        if ev.token_id not in self.detok.special_ids and not (
                ev.finish_reason == "stop" and ev.token_id in self.eos_ids):
            self._bytes += self.detok.token_bytes(ev.token_id)
        if ev.finish_reason is not None:
            self.finish_reason = ev.finish_reason

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def raw_text(self) -> str:
        text = self._bytes.decode("utf-8", errors="replace")
        if self.done:
            cut = min((text.find(s) for s in self.stops if s in text), default=-1)
            if cut >= 0:
                text = text[:cut]
        return text

    def final(self) -> tuple[str | None, list[dict], str]:
        """(content, tool_calls, finish_reason) for the finished choice."""
        text = self.raw_text()
        calls: list[dict] = []
        content: str | None = text
        if self.parse_tools:
            content, calls = split_tool_calls(text)
        reason = "tool_calls" if calls else (self.finish_reason or "length")
        return content, calls, reason

    def stream_delta(self) -> tuple[str, list[dict]]:
        """New content that is safe to send now, and tool calls completed since the last call."""
        text = self.raw_text()
        if self.done:
            safe = len(text)
        else:
            safe = len(text)
            while safe > 0 and text[safe - 1] == "\ufffd":
                safe -= 1
            hold = max((len(s) - 1 for s in self.stops), default=0)
            safe = max(self._emitted, safe - hold)
        calls: list[dict] = []
        if self.parse_tools:
            opened = text.find(OPEN, self._emitted)
            if opened >= 0 and self._calls_emitted and not text[self._emitted:opened].strip():
                self._emitted = opened  # only whitespace between two calls
            if opened >= 0:
                safe = min(safe, opened)
                if self.done:
                    content, calls = split_tool_calls(text)
                    if calls:
                        new = (content or "")[self._emitted:] if content and len(content) > self._emitted else ""
                        self._emitted = len(text)
                        return new, calls[self._calls_emitted:]
                    safe = len(text)
                else:
                    closed = text.find(CLOSE, opened)
                    if closed >= 0 and self._emitted == opened:
                        call = parse_block(text[opened + len(OPEN): closed])
                        if call is not None:
                            self._calls_emitted += 1
                            self._emitted = closed + len(CLOSE)
                            return "", [call]
            else:
                # A partial "<tool_call>" typed as plain text may still be completing.
                for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
                    if text.endswith(OPEN[:k]) and not self.done:
                        safe = min(safe, len(text) - k)
                        break
        new = text[self._emitted:safe] if safe > self._emitted else ""
        self._emitted = max(self._emitted, safe)
        return new, calls
