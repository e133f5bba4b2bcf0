"""Load any Hugging Face causal LM from a path at a precision profile, with its provenance.

The tiny shipped models and a 30B checkpoint on a GPU go through the same code: only the path and
the device differ. Nothing is fetched from a hub (``local_files_only``).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .provenance import ModelLoadError, checkpoint_digest, model_config_hash, tokenizer_hash
from .precision import Precision, apply_precision, parse_precision
from .routing import moe_routers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """Facts about a loaded checkpoint that contracts and reports need."""

    path: str
    name: str
    architecture: str
    vocab_size: int
    num_layers: int
    num_moe_layers: int
    num_experts: int
    top_k: int
    checkpoint_digest: str
    tokenizer_hash: str
    model_config_hash: str
    eos_token_ids: tuple[int, ...]
    max_context_tokens: int

    @property
    def is_moe(self) -> bool:
        return self.num_moe_layers > 0


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Any
    info: ModelInfo
    precision: Precision
    device: torch.device


_LOAD_LOCK = threading.Lock()


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_model(path: str | Path, precision: str | Precision = Precision.fp32,
               device: str | torch.device | None = "cpu") -> LoadedModel:
    """Load weights in float32, apply the precision profile, move to the device, eval mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    root = Path(path)
    if not (root / "config.json").exists():
        raise ModelLoadError(f"{root} has no config.json; expected a Hugging Face model directory")
    profile = parse_precision(precision)
    dev = resolve_device(device)
    # transformers 5 builds the model on the meta device and converts checkpoint keys as it loads;
    # two threads loading at once (in-process workers reloading together) left tensors on meta.
    with _LOAD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32, local_files_only=True)
    apply_precision(model, profile)
    model.to(dev).eval()  # type: ignore[arg-type]  # transformers types .to() by its own wrapper
    tokenizer = load_tokenizer(root)
    info = describe(root, model, tokenizer)
    log.info("loaded %s at %s on %s", info.name, profile.value, dev)
    return LoadedModel(model=model, tokenizer=tokenizer, info=info, precision=profile, device=dev)


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer of a model directory (its chat template included), without the weights."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(path), local_files_only=True)


def describe(root: Path, model: Any, tokenizer) -> ModelInfo:
    config = model.config
    routers = moe_routers(model)
    eos = getattr(model.generation_config, "eos_token_id", None) or config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids = eos_ids + (tokenizer.eos_token_id,)
    return ModelInfo(
        path=str(root),
        name=root.name,
        architecture=(config.architectures or [type(model).__name__])[0],
        vocab_size=int(config.vocab_size),
        num_layers=int(config.num_hidden_layers),
        num_moe_layers=len(routers),
        num_experts=int(getattr(config, "num_experts", 0) or 0) if routers else 0,
        top_k=int(getattr(config, "num_experts_per_tok", 0) or 0) if routers else 0,
        checkpoint_digest=checkpoint_digest(root),
        tokenizer_hash=tokenizer_hash(root),
        model_config_hash=model_config_hash(root),
        eos_token_ids=eos_ids,
        max_context_tokens=int(getattr(config, "max_position_embeddings", 4096)),
    )
