"""A synthetic 'model' both the simulated workers and the simulated trainer can evaluate.

The reference logprob of a token depends on the token, the previous token, its position and the
policy version, so it is the same on every host. Token ids divisible by FORBIDDEN_MODULUS are
tokens the policy considers impossible (logprob -28): honest samplers never emit them, a broken
low-precision engine does.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np

from ..contracts import PolicyManifest, SamplingConfig, TaskSpec

VOCAB_SIZE = 512
FORBIDDEN_MODULUS = 17
FORBIDDEN_LOGPROB = -28.0
MODEL_PATH = os.environ.get("ROLLMARKET_DEMO_MODEL") or None
"""The real model the demo's policy is (set by the demo for its child processes). With it, the
policy carries that model's tokenizer and config hashes and vocabulary, and every version is a real
checkpoint directory (`write_checkpoint`); the simulated profiles pretend to run it, and the real
workers (`rollmarket worker`) do."""

if MODEL_PATH:
    from ..engines.provenance import model_config, model_config_hash, tokenizer_hash

    TOKENIZER_HASH = tokenizer_hash(MODEL_PATH)
    MODEL_CONFIG_HASH = model_config_hash(MODEL_PATH)
    POLICY_VOCAB_SIZE = max(int(model_config(MODEL_PATH)["vocab_size"]), VOCAB_SIZE)
else:
    TOKENIZER_HASH = hashlib.sha256(b"rollmarket-sim-tokenizer").hexdigest()
    MODEL_CONFIG_HASH = hashlib.sha256(b"rollmarket-sim-config").hexdigest()
    POLICY_VOCAB_SIZE = VOCAB_SIZE
_ALLOWED_IDS = np.array([i for i in range(1, VOCAB_SIZE) if i % FORBIDDEN_MODULUS], dtype=np.int32)
_FORBIDDEN_IDS = np.array([i for i in range(1, VOCAB_SIZE) if i % FORBIDDEN_MODULUS == 0], dtype=np.int32)


def checkpoint_digest(version: int) -> str:
    """The digest of a synthetic policy version (no weights behind it)."""
    return hashlib.sha256(f"rollmarket-sim-checkpoint-{version}".encode()).hexdigest()


def write_checkpoint(version: int, root: Path) -> Path:
    """Version `version` of a real-model demo as a checkpoint directory workers can load.

    Nothing trains in the demo (the reference trainer does that), so each version holds the
    shipped weights re-saved with the version in the safetensors metadata: the same numbers, a
    new file and so a new digest. Real workers load it, check its digest and ack, as they would a
    trained checkpoint.
    """
    from safetensors.torch import load_file, save_file

    target = root / f"v{version:04d}"
    if (target / "model.safetensors").exists():
        return target
    partial = root / f".v{version:04d}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    source = Path(MODEL_PATH)
    for item in source.iterdir():
        if item.is_file() and item.suffix != ".safetensors":
            shutil.copy2(item, partial / item.name)
    for weights in sorted(source.glob("*.safetensors")):
        save_file(load_file(str(weights)), str(partial / weights.name),
                  metadata={"format": "pt", "policy_version": str(version)})
    partial.rename(target)
    return target


def policy_manifest(version: int, checkpoints: Path | None = None) -> PolicyManifest:
    """The demo's policy at `version`: a real checkpoint under `checkpoints` when the demo runs a
    real model, else a synthetic label."""
    if MODEL_PATH and checkpoints is not None:
        from ..engines.provenance import checkpoint_digest as _digest

        path = write_checkpoint(version, checkpoints)
        digest, uri = _digest(path), str(path)
    else:
        digest, uri = checkpoint_digest(version), f"sim://checkpoint/{version}"
    return PolicyManifest(
        policy_version=version, parent_version=None if version == 0 else version - 1,
        checkpoint_digest=digest, checkpoint_uri=uri,
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
