"""Write a model directory in Hugging Face layout (float32 safetensors, tokenizer, chat template)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from .configs import generation_config
from .tokenizer import IM_END, PAD, save_tokenizer


def write_model_dir(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, out_dir: Path,
                    report: dict[str, Any] | None = None) -> Path:
    """Save `model` (as float32) and `tokenizer` into `out_dir`, plus `build_report.json` if given."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("chat_template.jinja", "model.safetensors.index.json", "build_report.json"):
        (out / stale).unlink(missing_ok=True)
    pad_id, eos_id = tokenizer.convert_tokens_to_ids(PAD), tokenizer.convert_tokens_to_ids(IM_END)
    model = model.to(torch.float32)
    model.config.use_cache = True
    model.generation_config = generation_config(pad_id, [eos_id, pad_id])
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tokenizer, out)
    if report is not None:
        (out / "build_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return out
