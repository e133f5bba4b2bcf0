"""Token ids to exact bytes and text, one table for the whole vocabulary.

Logprob entries carry each token's bytes, and the content is the concatenation of those same
bytes, so token ids, logprobs and text line up one to one by construction.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    # GPT-2's reversible byte <-> printable-unicode map, used by byte-level BPE (Qwen, Llama 3).
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.added = {int(i): str(getattr(t, "content", t)) for i, t in added.items()}
        self._cache: dict[int, bytes] = {}

    def token_bytes(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is not None:
            return cached
        if token_id in self.added:
            value = self.added[token_id].encode()
        else:
            piece = self.tokenizer.convert_ids_to_tokens(int(token_id)) or ""
            table = _byte_decoder()
            if all(ch in table for ch in piece):
                value = bytes(table[ch] for ch in piece)
            else:
                value = self.tokenizer.decode([int(token_id)]).encode()
        self._cache[token_id] = value
        return value

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def text(self, token_ids) -> str:
        return b"".join(self.token_bytes(int(t)) for t in token_ids).decode("utf-8", errors="replace")
