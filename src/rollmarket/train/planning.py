"""Planning tokens: which response tokens belong to a "strategic gram" such as "wait let me".

HICRA and SEPA (train/transforms.py) treat planning tokens apart from execution tokens. The
research guide's retrain finds them by matching strategic grams, short phrases of self-reflection
and planning ("let me check", "try another approach"), in the response. This detector does the same
on the decoded text:

1. decode the response ids once, and find each token's character span in that text
   (``token_spans``; the engine's ids are never re-tokenized);
2. find every case-insensitive match of every configured phrase, on word boundaries, with any run
   of whitespace between its words (``PlanningDetector.match_spans``);
3. mark each token whose span overlaps a match (``PlanningDetector.mask``).

Differences from retrain's ``identify_planning_tokens`` (written from its description, not its
code): retrain joins stripped token fragments with spaces and marks every token from the start of
its sliding window to the end of the match, which can take in tokens before the phrase; here the
text is the tokenizer's own decoding, so word boundaries are the real ones and only the tokens that
span the phrase are marked. Overlapping phrases ("wait let me" in "wait let me think") are each
matched. No torch here: the mask is a numpy array the learner places into its batch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

PLANNING_DETECTORS = ("none", "strategic_grams")

DEFAULT_PLANNING_GRAMS = (
    "wait let me", "let me think", "on second thought", "let me check", "let me verify", "is this right",
    "double check", "try another approach", "go back and", "start over", "that's not right",
    "that doesn't work", "another way to", "or we could", "what if we", "notice that", "the key is",
    "the key insight",
)
"""The shipped phrase list: retrain's 18 default strategic grams, so that HICRA/SEPA runs here mark
the same phrases as the research guide's campaigns. Override with ``algorithm.planning_grams``."""


class PlanningConfigError(ValueError):
    """A phrase list the detector cannot use (empty, or a phrase with no letter or digit)."""


def _phrase_pattern(phrase: str) -> re.Pattern[str]:
    words = phrase.split()
    # (?<!\w) / (?!\w) rather than \b: a phrase may start or end with punctuation ("that's").
    return re.compile(r"(?<!\w)" + r"\s+".join(re.escape(w) for w in words) + r"(?!\w)", re.IGNORECASE)


def check_grams(grams: Sequence[str]) -> tuple[str, ...]:
    """The phrases, stripped; raises PlanningConfigError for an empty list or a phrase without a word."""
    cleaned = tuple(" ".join(str(g).split()) for g in grams)
    if not cleaned:
        raise PlanningConfigError("the planning phrase list is empty")
    bad = [g for g in cleaned if not re.search(r"\w", g)]
    if bad:
        raise PlanningConfigError(f"planning phrases need a letter or digit: {bad}")
    return cleaned


@dataclass(frozen=True)
class PlanningDetector:
    """Marks the tokens of a response that span one of ``grams`` (case-insensitive, whole words)."""

    grams: tuple[str, ...] = DEFAULT_PLANNING_GRAMS
    """The phrases; any whitespace between a phrase's words matches any run of whitespace."""
    _patterns: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        grams = check_grams(self.grams)
        object.__setattr__(self, "grams", grams)
        unique = dict.fromkeys(g.lower() for g in grams)  # the patterns ignore case anyway
        object.__setattr__(self, "_patterns", tuple(_phrase_pattern(g) for g in unique))

    def match_spans(self, text: str) -> list[tuple[int, int]]:
        """Character spans [start, end) of every phrase match in ``text``, sorted (overlaps kept)."""
        return sorted({(m.start(), m.end()) for p in self._patterns for m in p.finditer(text)})

    def mask(self, token_ids: Sequence[int], decode: Callable[[list[int]], str]) -> np.ndarray:
        """bool [T]: tokens of ``token_ids`` whose decoded span overlaps a phrase match.

        ``decode`` turns a list of ids into text exactly as the tokenizer does (``decode_fn``)."""
        text, starts_T, ends_T = token_spans(token_ids, decode)
        plan_T = np.zeros(len(starts_T), dtype=bool)
        for lo, hi in self.match_spans(text):
            plan_T |= (starts_T < hi) & (ends_T > lo) & (ends_T > starts_T)
        return plan_T


def decode_fn(tokenizer) -> Callable[[list[int]], str]:
    """A Hugging Face tokenizer's decode, with nothing skipped or cleaned up, so that a prefix of the
    ids decodes to a prefix of the text."""
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def token_spans(token_ids: Sequence[int], decode: Callable[[list[int]], str]) -> tuple[str, np.ndarray, np.ndarray]:
    """(text, starts_T, ends_T): the decoded text and each token's character span [start, end) in it.

    Fast path: when the tokens decoded one by one concatenate to the whole text, those pieces are the
    spans. Otherwise (a tokenizer that merges spaces, or a character split across byte-level
    tokens) token t ends where the decoding of ids[:t + 1] stops agreeing with the text; a token
    holding part of a character gets an empty span and the token completing it the character.
    """
    ids = [int(i) for i in token_ids]
    text = decode(ids)
    pieces = [decode([i]) for i in ids]
    if "".join(pieces) == text:
        ends_T = np.cumsum([len(p) for p in pieces], dtype=np.int64) if ids else np.zeros(0, dtype=np.int64)
    else:
        ends = []
        for t in range(len(ids)):
            prefix = decode(ids[:t + 1])
            n = 0
            limit = min(len(prefix), len(text))
            while n < limit and prefix[n] == text[n]:
                n += 1
            ends.append(n)
        ends_T = np.maximum.accumulate(np.asarray(ends, dtype=np.int64)) if ids else np.zeros(0, dtype=np.int64)
        if ids:
            ends_T[-1] = len(text)
    starts_T = np.concatenate([[0], ends_T[:-1]]).astype(np.int64) if ids else np.zeros(0, dtype=np.int64)
    return text, starts_T, ends_T


def make_detector(kind: str, grams: Sequence[str] | None = None) -> PlanningDetector | None:
    """The detector ``algorithm.planning_detector`` names (None for "none"); ``grams`` None: the shipped list."""
    if kind == "none":
        return None
    if kind == "strategic_grams":
        return PlanningDetector(tuple(grams) if grams is not None else DEFAULT_PLANNING_GRAMS)
    raise PlanningConfigError(f"unknown planning detector {kind!r}; expected one of {PLANNING_DETECTORS}")
