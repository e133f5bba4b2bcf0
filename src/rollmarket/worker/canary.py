"""Does a server really serve a checkpoint? Its logprobs on a fixed canary against the checkpoint's own.

A digest says which files a server was pointed at, not what it computes with: a server that
answered "reloaded" but kept its old weights (or half-loaded the new ones) would pass a digest
check. So before a worker acks a policy it teacher-forces the canary (the fingerprint's
canonical (prompt, response) pairs) twice:

* on the server, by `prompt_logprobs` (vLLM's completions extension: the server scores given
  tokens, no sampling);
* on the checkpoint directory itself, with our trainer engine at fp32 (the reference).

Why the worker computes the reference, rather than the trainer shipping one in the manifest: the
reference then comes from the very files whose digest the worker has just checked against the
manifest, so "digest equal" and "logprobs equal" together tie the server's numbers to the
published policy without trusting the server, the trainer's numerics or a new contract field. The
cost is loading the checkpoint once per reload in the worker (seconds for the shipped models; for
large models a trainer-side reference would be cheaper and is the natural next step).

The two sides run different kernels and precisions (vLLM bf16, ours fp32), so they agree only
within a tolerance on the mean |Δlogp| over the canary's tokens; a checkpoint a training step
away moves it by far more than bf16 noise (docs/vllm.md gives the numbers).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

DEFAULT_TOLERANCE = 0.25
"""Mean |Δlogp| (nats per canary token) under which the server is taken to serve the checkpoint.
Measured on tiny-moe: vLLM 0.32 CPU bf16 against our fp32 is 0.05 (compiled) to 0.15
(--enforce-eager, where one canary token flips an expert); a server on other weights was 4–6."""


class CanaryError(RuntimeError):
    """The server did not score the canary (no `prompt_logprobs`, an error, a wrong length)."""


@dataclass(frozen=True)
class CanaryCheck:
    """The server's canary logprobs against the checkpoint's own."""

    tokens: int
    """Canary tokens compared (response tokens of every canonical pair)."""
    mean_abs_delta: float
    """mean |logp_server − logp_reference| over those tokens (nats)."""
    max_abs_delta: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.mean_abs_delta <= self.tolerance


def canary_pairs(model_dir: str | Path) -> list[tuple[list[int], list[int]]]:
    """The canary: the fingerprint's canonical pairs in the checkpoint's own tokenizer."""
    from transformers import AutoTokenizer

    from ..engines.fingerprint import canonical_pairs

    return canonical_pairs(AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True))


def reference_logprobs(model_dir: str | Path, pairs: list[tuple[list[int], list[int]]]) -> list[np.ndarray]:
    """Each pair's response logprobs from the checkpoint's files (trainer engine, fp32)."""
    from ..engines.teacher import TrainerEngine

    engine = TrainerEngine.from_path(model_dir, "fp32")
    return [tf.logprobs_T for tf in engine.score_batch(pairs)]


def served_logprobs(url: str, model: str, pairs: list[tuple[list[int], list[int]]], *,
                    headers: dict[str, str] | None = None, timeout: float = 120) -> list[np.ndarray]:
    """Each pair's response logprobs as the server at `url` (…/v1) scores them (`prompt_logprobs`)."""
    out = []
    for prompt, response in pairs:
        try:
            answer = httpx.post(url.rstrip("/") + "/completions", headers=headers or {}, timeout=timeout, json={
                "model": model, "prompt": prompt + response, "max_tokens": 1, "temperature": 0,
                "prompt_logprobs": 0})
        except httpx.HTTPError as exc:
            raise CanaryError(f"{url}: {exc}") from None
        if answer.status_code != 200:
            raise CanaryError(f"{url} answered {answer.status_code}: {answer.text[:300]}")
        try:
            scored = answer.json()["choices"][0]["prompt_logprobs"]
            # Entry i scores token i given tokens < i; each holds at least the token itself.
            out.append(np.array([scored[len(prompt) + i][str(token)]["logprob"] for i, token in enumerate(response)],
                                dtype=np.float64))
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise CanaryError(f"{url} gave no prompt_logprobs for the canary ({type(exc).__name__}: {exc})") from None
    return out


def compare(served: list[np.ndarray], reference: list[np.ndarray], tolerance: float) -> CanaryCheck:
    """The check of `served` against `reference` (same pairs, same order)."""
    deltas = np.abs(np.concatenate(served) - np.concatenate([np.asarray(r, dtype=np.float64) for r in reference]))
    return CanaryCheck(tokens=int(deltas.size), mean_abs_delta=float(deltas.mean()),
                       max_abs_delta=float(deltas.max()), tolerance=tolerance)


def check_server(url: str, model: str, model_dir: str | Path, *, tolerance: float = DEFAULT_TOLERANCE,
                 headers: dict[str, str] | None = None) -> CanaryCheck:
    """Does the server at `url` serve the weights in `model_dir`? CanaryError when it cannot say."""
    pairs = canary_pairs(model_dir)
    return compare(served_logprobs(url, model, pairs, headers=headers), reference_logprobs(model_dir, pairs),
                   tolerance)
