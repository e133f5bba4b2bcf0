"""A synthetic 'model' both the simulated workers and the simulated trainer can evaluate.

The reference logprob of a token depends on the token, the previous token, its position and the
policy version, so it is the same on every host. Token ids divisible by FORBIDDEN_MODULUS are
tokens the policy considers impossible (logprob -28): honest samplers never emit them, a broken
low-precision engine does.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from ..contracts import PolicyManifest, SamplingConfig, TaskSpec

VOCAB_SIZE = 512
FORBIDDEN_MODULUS = 17
FORBIDDEN_LOGPROB = -28.0
MODEL_PATH = os.environ.get("ROLLMARKET_DEMO_MODEL") or None
"""The real model the demo's policy is (set by the demo for its child processes). With it, the
policy carries that model's tokenizer and config hashes and vocabulary, and version 0 is its real
checkpoint digest; the simulated profiles then pretend to run it, and the engine profile really
does."""

if MODEL_PATH:
    from ..engines.provenance import checkpoint_digest as _digest
    from ..engines.provenance import model_config, model_config_hash, tokenizer_hash

    TOKENIZER_HASH = tokenizer_hash(MODEL_PATH)
    MODEL_CONFIG_HASH = model_config_hash(MODEL_PATH)
    POLICY_VOCAB_SIZE = max(int(model_config(MODEL_PATH)["vocab_size"]), VOCAB_SIZE)
    _BASE_DIGEST = _digest(MODEL_PATH)
else:
    TOKENIZER_HASH = hashlib.sha256(b"rollmarket-sim-tokenizer").hexdigest()
    MODEL_CONFIG_HASH = hashlib.sha256(b"rollmarket-sim-config").hexdigest()
    POLICY_VOCAB_SIZE = VOCAB_SIZE
    _BASE_DIGEST = None
_ALLOWED_IDS = np.array([i for i in range(1, VOCAB_SIZE) if i % FORBIDDEN_MODULUS], dtype=np.int32)
_FORBIDDEN_IDS = np.array([i for i in range(1, VOCAB_SIZE) if i % FORBIDDEN_MODULUS == 0], dtype=np.int32)


def checkpoint_digest(version: int) -> str:
    """Version 0 of a real-model demo is the shipped checkpoint. Nothing trains in the demo yet,
    so later versions are labels derived from it (the weights stay the same)."""
    if _BASE_DIGEST is not None:
        return _BASE_DIGEST if version == 0 else hashlib.sha256(f"{_BASE_DIGEST}:{version}".encode()).hexdigest()
    return hashlib.sha256(f"rollmarket-sim-checkpoint-{version}".encode()).hexdigest()


def policy_manifest(version: int) -> PolicyManifest:
    return PolicyManifest(
        policy_version=version, parent_version=None if version == 0 else version - 1,
        checkpoint_digest=checkpoint_digest(version), checkpoint_uri=f"sim://checkpoint/{version}",
        tokenizer_hash=TOKENIZER_HASH, model_config_hash=MODEL_CONFIG_HASH, vocab_size=POLICY_VOCAB_SIZE,
        precision_class="bf16",
    )


def fingerprint(engine: str, version: int) -> str:
    return hashlib.sha256(f"{engine}:{version}".encode()).hexdigest()[:32]


def reference_logprobs(prompt_ids_P: np.ndarray, response_ids_T: np.ndarray, version: int) -> np.ndarray:
    """float32 [T]: the policy's logprob of each response token at `version`."""
    response = response_ids_T.astype(np.uint64)
    previous = np.concatenate([prompt_ids_P[-1:], response_ids_T[:-1]]).astype(np.uint64)
    position = np.arange(response.shape[0], dtype=np.uint64)
    mixed = (response * np.uint64(2654435761) + previous * np.uint64(40503) + position * np.uint64(7)) % np.uint64(10007)
    u = mixed.astype(np.float64) / 10007.0
    # Each version moves the policy a little, so stale groups drift as well as lag.
    logprob = -(0.01 + 6.0 * u * u) + 0.01 * version * np.sin(response.astype(np.float64))
    logprob = np.minimum(logprob, -1e-3)
    logprob[response_ids_T % FORBIDDEN_MODULUS == 0] = FORBIDDEN_LOGPROB
    return logprob.astype(np.float32)


def sample_tokens(rng: np.random.Generator, n: int, *, forbidden_share: float = 0.0) -> np.ndarray:
    """int32 [n] token ids; a `forbidden_share` of them drawn from the forbidden set."""
    ids = rng.choice(_ALLOWED_IDS, size=n)
    if forbidden_share > 0:
        pick = rng.random(n) < forbidden_share
        ids[pick] = rng.choice(_FORBIDDEN_IDS, size=int(pick.sum()))
    return ids.astype(np.int32)


def encode_prompt(task: TaskSpec) -> np.ndarray:
    """A deterministic stand-in tokenizer: bytes of the prompt folded into the vocabulary."""
    text = task.prompt or " ".join(str(m.get("content", "")) for m in task.messages or [])
    data = np.frombuffer(text.encode()[:256] or b"?", dtype=np.uint8).astype(np.int32)
    return (data % (VOCAB_SIZE - 1)) + 1


def reward(task: TaskSpec, sample_index: int, response_ids_T: np.ndarray) -> float:
    """A verifier stand-in: deterministic, about one in three samples correct."""
    return float((int(response_ids_T[:4].sum()) + sample_index + len(task.task_id)) % 3 == 0)


def demo_sampling() -> SamplingConfig:
    return SamplingConfig(temperature=1.0, top_p=1.0, max_tokens=128)
