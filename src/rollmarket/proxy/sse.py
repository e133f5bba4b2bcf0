"""Server-sent events, read incrementally: bytes in, whole events out, nothing buffered past them."""

from __future__ import annotations

import re

_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n|\r\r")
DONE = b"[DONE]"


class EventSplitter:
    """Feed it the bytes as they arrive; it hands back each complete event's raw bytes (with its
    terminating blank line), so that they can be forwarded exactly as they came."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._buffer + data if self._buffer else data
        events = []
        start = 0
        while True:
            match = _BOUNDARY.search(buffer, start)
            if match is None:
                break
            events.append(buffer[start:match.end()])
            start = match.end()
        self._buffer = buffer[start:]
        return events

    def rest(self) -> bytes:
        """Bytes of an unfinished event (an upstream that stopped mid-event)."""
        rest, self._buffer = self._buffer, b""
        return rest


def event_data(event: bytes) -> bytes | None:
    """The `data:` payload of one event (lines joined by newlines), or None if it has none."""
    lines = [line for line in event.splitlines() if line.startswith(b"data:")]
    if not lines:
        return None
    if len(lines) == 1:
        return lines[0][5:].strip()
    return b"\n".join(line[5:].removeprefix(b" ") for line in lines).strip()


def data_event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"
