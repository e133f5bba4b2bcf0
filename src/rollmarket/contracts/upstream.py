"""What inference engines put in their answers, read into our layout.

Our `serve-model` returns routed experts as nested lists, one row per response token. vLLM and
SGLang send them as base64 bytes over every position the model was fed, prompt included:

- **vLLM** (0.32, `--enable-return-routed-experts`, GPU model runner only): `choices[i].routed_experts`,
  a base64 `.npy` file (`vllm.utils.serial_utils.numpy2base64`: `np.save`, no pickle) of shape
  (prompt + response − 1 − `routed_experts_prompt_start`, layers, top-k), dtype uint8, uint16 or
  int32. The last sampled token was never fed, so it has no row.
- **SGLang** (`--enable-return-routed-experts`): base64 of raw int32 bytes without a shape, of
  (prompt + response − 1 − `routed_experts_start_len`, all hidden layers, top-k); dense layers of a MoE family hold −1. Recent
  versions put it at the top of the answer (`sglext.routed_experts`, and in a last streamed chunk
  with no choices), older ones on the choice (`choices[i].sgl_ext.routed_experts`), and the
  choice's `meta_info` (`return_meta_info`) holds them too, beside `output_token_logprobs`
  (`[logprob, token_id, text]`), SGLang's only spelling of response token ids.

Row j of either is the routing of the forward pass fed token j. Our layout (`engines.rollout.
Generation`): response row t holds the experts of the step that produced response token t, which
was fed token P − 1 + t; the prompt part holds prompt positions 0 .. P − 2. So the last R rows are
the response's and the rows before them the prompt's.

A malformed array is a typed error (`RoutedExpertsError`), never a guess. vLLM's `prompt_logprobs`
are read here too (`read_prompt_logprobs`).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from dataclasses import dataclass

import numpy as np
from pydantic_core import PydanticCustomError

from .arrays import ROUTED_EXPERTS


class RoutedExpertsError(ValueError):
    """An engine's routed experts cannot be read; the subclass says why."""


class RoutedExpertsEncoding(RoutedExpertsError):
    """Not base64, or the bytes are not what the engine's format holds (a `.npy` file, int32 data)."""


class RoutedExpertsShape(RoutedExpertsError):
    """Decoded, but not an integer [positions, layers, top-k] array of expert ids."""


class RoutedExpertsTokenCount(RoutedExpertsError):
    """The array has a row count that does not match the prompt and response it came with."""


@dataclass(frozen=True)
class SplitExperts:
    """An engine's routed experts in our layout (int16, column 0 = top-1 where the engine sorts)."""

    prompt_PLK: np.ndarray | None
    """Prompt positions `prompt_start` .. P − 2, each the step fed that token (P − 1 − start rows);
    None where the engine returns the response's only (our `serve-model`)."""
    response_RLK: np.ndarray
    """Row t: the step that produced response token t."""


def _b64(encoded: object) -> bytes:
    if not isinstance(encoded, str):
        raise RoutedExpertsEncoding(f"routed experts must be a base64 string, got {type(encoded).__name__}")
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RoutedExpertsEncoding(f"routed experts are not base64: {exc}") from None


def _validated(array: np.ndarray) -> np.ndarray:
    """`array` as the contract's int16 [N, L, K], or RoutedExpertsShape saying what is wrong."""
    try:
        return ROUTED_EXPERTS.validate(array)
    except PydanticCustomError as exc:
        raise RoutedExpertsShape(str(exc)) from None


def decode_vllm(encoded: object) -> np.ndarray:
    """vLLM's base64 `.npy` routed experts as int16 [N, L, K] (N = every fed position).

    Raises RoutedExpertsEncoding (not base64, not a `.npy` file, a pickled object) or
    RoutedExpertsShape (not an integer array of rank 3, ids out of range)."""
    data = _b64(encoded)
    buffer = io.BytesIO(data)
    try:  # the header first: a shape the bytes cannot hold is refused before anything is allocated
        version = np.lib.format.read_magic(buffer)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(buffer)
        if dtype.hasobject:
            raise ValueError("it holds pickled objects")
        if math.prod(shape) * dtype.itemsize != len(data) - buffer.tell():
            raise ValueError(f"its header says {shape} {dtype}, its data is {len(data) - buffer.tell()} bytes")
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise RoutedExpertsEncoding(f"routed experts are not a .npy array: {exc}") from None
    if array.dtype.kind not in "iu":
        raise RoutedExpertsShape(f"routed experts have dtype {array.dtype}; expert ids are integers")
    return _validated(array)


def decode_sglang(encoded: object, layers: int, top_k: int) -> np.ndarray:
    """SGLang's base64 raw int32 routed experts as int16 [N, L', K]: the shape comes from the model
    (`layers` = every hidden layer, `top_k`), and layers that are −1 throughout (dense) are left out.

    Raises RoutedExpertsEncoding (not base64, a byte count that is not whole int32 rows of
    layers × top_k) or RoutedExpertsShape (ids out of range)."""
    data = _b64(encoded)
    row = 4 * layers * top_k
    if layers <= 0 or top_k <= 0 or len(data) % row:
        raise RoutedExpertsEncoding(f"{len(data)} bytes of routed experts are not whole rows of "
                                    f"{layers} layers x {top_k} int32 expert ids")
    experts = np.frombuffer(data, dtype="<i4").reshape(-1, layers, top_k)
    dense = (experts < 0).all(axis=(0, 2)) if len(experts) else np.zeros(layers, bool)
    return _validated(experts[:, ~dense, :] if dense.any() else experts)


def split(experts_NLK: np.ndarray, *, prompt_tokens: int, response_tokens: int,
          prompt_start: int = 0) -> SplitExperts:
    """Cut an engine's routed experts over every fed position into prompt and response parts.

    `experts_NLK` must have prompt_tokens + response_tokens − 1 − prompt_start rows (vLLM skips
    the first `prompt_start` prompt positions when asked to; a start past P − 1 would drop the
    step that produced the first response token, and is refused); RoutedExpertsTokenCount otherwise.
    """
    rows = len(experts_NLK)
    fed = prompt_tokens + response_tokens - 1 - prompt_start
    if prompt_tokens <= 0 or not 0 <= prompt_start < prompt_tokens or rows != fed:
        raise RoutedExpertsTokenCount(
            f"{rows} rows of routed experts for {prompt_tokens} prompt and {response_tokens} response "
            f"tokens (expected {fed}: every fed position"
            + (f" from prompt position {prompt_start}" if prompt_start else "") + ")")
    cut = rows - response_tokens
    return SplitExperts(prompt_PLK=experts_NLK[:cut], response_RLK=experts_NLK[cut:])


def _count(tokens: int | None, what: str) -> int:
    if tokens is None:
        raise RoutedExpertsTokenCount(f"routed experts cannot be split without the {what} token count")
    return tokens


def read_choice_experts(value: object, *, prompt_tokens: int | None, response_tokens: int | None,
                        prompt_start: int = 0) -> SplitExperts | None:
    """A choice's `routed_experts`, whichever engine sent it: None when absent or empty; nested
    lists (our `serve-model`: response rows only) as they are; a string as vLLM's base64 `.npy`
    over every fed position, split by the call's token counts. Raises RoutedExpertsError."""
    if value is None or (isinstance(value, list) and not value):
        return None
    if isinstance(value, list):
        try:
            array = np.asarray(value)
        except ValueError as exc:
            raise RoutedExpertsShape(f"routed experts are ragged: {exc}") from None
        response = _validated(array)
        if response_tokens is not None and len(response) != response_tokens:
            raise RoutedExpertsTokenCount(f"{len(response)} rows of routed experts for {response_tokens} "
                                          "response tokens")
        return SplitExperts(prompt_PLK=None, response_RLK=response)
    return split(decode_vllm(value), prompt_tokens=_count(prompt_tokens, "prompt"),
                 response_tokens=_count(response_tokens, "response"), prompt_start=prompt_start)


def read_sglang_experts(value: object, *, layers: int, top_k: int, prompt_tokens: int | None,
                        response_tokens: int | None, prompt_start: int = 0) -> SplitExperts:
    """SGLang's `sglext.routed_experts` (or the older `sgl_ext`) split into prompt and response parts,
    given the model's MoE shape (every hidden layer x top-k). `prompt_start` is SGLang's
    `routed_experts_start_len` (positions [start, seqlen - 1), as vLLM's prompt start). Raises
    RoutedExpertsError."""
    return split(decode_sglang(value, layers, top_k), prompt_tokens=_count(prompt_tokens, "prompt"),
                 response_tokens=_count(response_tokens, "response"), prompt_start=prompt_start)


def sglang_experts_field(body: dict, choice: dict) -> object:
    """Where SGLang put a choice's routed experts: the choice's `meta_info` (`return_meta_info`,
    the same dict its native /generate answers with), the answer's `sglext` (recent), or the
    choice's `sgl_ext` (older); None when none holds any."""
    for ext in (choice.get("meta_info"), choice.get("sgl_ext"), body.get("sglext")):
        if isinstance(ext, dict) and ext.get("routed_experts") is not None:
            return ext["routed_experts"]
    return None


def sglang_output_ids(choice: dict) -> list[int] | None:
    """A choice's response token ids from SGLang's `meta_info.output_token_logprobs` (entries
    `[logprob, token_id, text]`, present when logprobs were asked with `return_meta_info`); None
    when it has none."""
    meta = choice.get("meta_info")
    entries = meta.get("output_token_logprobs") if isinstance(meta, dict) else None
    if not isinstance(entries, list) or not entries:
        return None
    if not all(isinstance(e, list | tuple) and len(e) >= 2 and isinstance(e[1], int) for e in entries):
        return None
    return [e[1] for e in entries]


class PromptLogprobsError(ValueError):
    """An engine's prompt logprobs cannot be read against the prompt they came with."""


def read_prompt_logprobs(entries: object, prompt_ids: list[int] | None) -> np.ndarray | None:
    """vLLM's `prompt_logprobs` as float32 [P-1]: the logprob of prompt token i (i >= 1) given the
    tokens before it. vLLM sends one entry per prompt position, None for the first and otherwise a
    map from token id (a string in JSON) to {"logprob", "rank", "decoded_token"} that holds the
    prompt token and the top-k asked for; so the prompt's ids pick each position's own token.

    None when `entries` is None; PromptLogprobsError when it does not fit `prompt_ids`."""
    if entries is None:
        return None
    if not isinstance(entries, list):
        raise PromptLogprobsError(f"prompt_logprobs must be a list, got {type(entries).__name__}")
    if prompt_ids is None:
        raise PromptLogprobsError("prompt_logprobs cannot be read without the prompt's token ids")
    if len(entries) != len(prompt_ids):
        raise PromptLogprobsError(f"{len(entries)} prompt_logprobs entries for {len(prompt_ids)} prompt tokens")
    out = np.empty(max(len(entries) - 1, 0), np.float32)
    for i, (entry, token) in enumerate(zip(entries[1:], prompt_ids[1:])):
        own = entry.get(str(token)) if isinstance(entry, dict) else None
        logprob = own.get("logprob") if isinstance(own, dict) else None
        if isinstance(logprob, bool) or not isinstance(logprob, int | float):
            raise PromptLogprobsError(f"prompt position {i + 1}: no logprob for its token {token}")
        out[i] = logprob
    return out
