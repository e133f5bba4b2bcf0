"""Content hashes of a model directory: weights, tokenizer and config. No torch needed, so
processes that only label or check checkpoints (the demo's simulated workers) stay light."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


class ModelLoadError(ValueError):
    """The path does not hold a loadable Hugging Face causal LM."""


def _sha256_files(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def checkpoint_digest(path: str | Path) -> str:
    """sha256 over the checkpoint's weight files, in name order."""
    root = Path(path)
    files = sorted(root.glob("*.safetensors")) or sorted(root.glob("*.bin"))
    if not files:
        raise ModelLoadError(f"{root} holds no *.safetensors or *.bin weights")
    return _sha256_files(files)


def tokenizer_hash(path: str | Path) -> str:
    """sha256 over the tokenizer files that decide token ids and the chat template."""
    root = Path(path)
    names = ["tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
             "special_tokens_map.json", "chat_template.jinja"]
    return _sha256_files([root / n for n in names if (root / n).exists()])


def model_config(path: str | Path) -> dict:
    config = Path(path) / "config.json"
    if not config.exists():
        raise ModelLoadError(f"{Path(path)} has no config.json; expected a Hugging Face model directory")
    return json.loads(config.read_text())


def model_config_hash(path: str | Path) -> str:
    canonical = json.dumps(model_config(path), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()
