"""LoRA for the trainer: wrap a causal LM with peft adapters, publish merged full weights.

Rollout workers load plain Hugging Face checkpoint directories, so a LoRA policy is published as
full weights W' = W + (B·A)·alpha/r with the checkpoint's own key names, never as an adapter.
`merged_state_dict` computes those weights beside the live model without merging into it, so
training goes on from the same adapters after every publish.

    model = apply_lora(loaded.model, LoraSettings(enabled=True))
    ...                                   # train; only lora_A / lora_B receive gradients
    save_file(merged_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})

Default targets are the attention projections (q/k/v/o_proj), the Linear layers that every
Qwen3 and Qwen3-MoE layer has under the same names. In Qwen3-MoE (transformers 5) the experts are
one fused module (`mlp.experts`, 3-D `gate_up_proj` / `down_proj` tensors, not Linear layers) and
the router (`mlp.gate`) is not a Linear either, so the MoE block is left alone: its weights, and
with them the routing, stay at the base checkpoint's. The dense model's MLP (gate_proj, up_proj,
down_proj) can be added to `target_modules`.
"""

from __future__ import annotations

import logging

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .sharded import full_value

log = logging.getLogger(__name__)

DEFAULT_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
ADAPTER = "default"


class LoraSettings(BaseModel):
    """Low-rank adapters on a frozen base model. Off by default: full fine-tuning."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(False, description="Train LoRA adapters instead of every weight.")
    """Train LoRA adapters instead of every weight."""
    r: int = Field(8, ge=1, description="Adapter rank: A is r × in, B is out × r.")
    """Adapter rank: A is r × in, B is out × r."""
    alpha: float = Field(16, gt=0, description="Scale numerator: the update is B·A·alpha/r.")
    """Scale numerator: the update is B·A·alpha/r."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0,
                           description="Dropout on the adapter's input while training.")
    """Dropout on the adapter's input while training (off in eval, so merged weights match)."""
    target_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_TARGET_MODULES),
        min_length=1,
        description="Last names of the Linear layers that get adapters; attention only by default, "
                    "so the MoE experts and router keep the base weights.",
    )
    """Last names of the Linear layers that get adapters (e.g. "q_proj" matches every layer's).
    Attention only by default: Qwen3-MoE's fused experts and router are not Linear layers."""

    @field_validator("target_modules")
    @classmethod
    def _names_are_plain(cls, names: list[str]) -> list[str]:
        for name in names:
            if not name or name != name.strip():
                raise ValueError(f"target module name {name!r} is empty or padded")
        if len(set(names)) != len(names):
            raise ValueError(f"target_modules has duplicates: {names}")
        return names


def _peft():
    try:
        import peft
    except ImportError as exc:  # pragma: no cover - peft is a core dependency
        raise ImportError(
            "LoRA training needs the 'peft' package, a core dependency of rollmarket: "
            "pip install 'peft>=0.21' (or reinstall rollmarket: pip install -e .)"
        ) from exc
    return peft


def _is_peft(model: torch.nn.Module) -> bool:
    peft = _peft()
    return isinstance(model, peft.PeftModel)


def _tied_names(model: torch.nn.Module) -> set[str]:
    """Module names whose weight is shared with another module (tied input/output embeddings)."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        weight = module._parameters.get("weight")  # its own, not a wrapped layer's
        if weight is not None:
            owners.setdefault(id(weight), []).append(name)
    return {name for names in owners.values() if len(names) > 1 for name in names}


def _check_targets(model: torch.nn.Module, targets: list[str]) -> None:
    """Fail early, naming what the model has, instead of peft's generic errors."""
    by_last_name: dict[str, list[tuple[str, torch.nn.Module]]] = {}
    for name, module in model.named_modules():
        if name:
            by_last_name.setdefault(name.rsplit(".", 1)[-1], []).append((name, module))
    linear_names = sorted(k for k, mods in by_last_name.items()
                          if any(isinstance(m, torch.nn.Linear) for _, m in mods))
    tied = _tied_names(model)
    for target in targets:
        found = by_last_name.get(target)
        if not found:
            raise ValueError(f"LoRA target module {target!r} is not in {type(model).__name__}; "
                             f"its Linear layers are named {linear_names}")
        for name, module in found:
            if not isinstance(module, torch.nn.Linear):
                raise ValueError(
                    f"LoRA target {target!r} matches {name}, a {type(module).__name__}, not a "
                    f"Linear layer; LoRA here wraps Linear layers only ({linear_names})")
            if name in tied:
                raise ValueError(
                    f"LoRA target {target!r} matches {name}, whose weight is tied to another "
                    "module's (tie_word_embeddings); an adapter there would untie them in the "
                    "published checkpoint")


def apply_lora(model: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """Wrap `model` with fresh LoRA adapters; afterwards only the adapters require grad.

    Returns `model` unchanged when `settings.enabled` is false (full fine-tuning). peft injects
    the adapter layers into `model` itself, so use only the returned module from here on.
    """
    if not settings.enabled:
        return model
    peft = _peft()
    if _is_peft(model):
        raise ValueError("model already carries peft adapters")
    _check_targets(model, settings.target_modules)
    config = peft.LoraConfig(
        task_type=peft.TaskType.CAUSAL_LM,
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        bias="none",
    )
    wrapped = peft.get_peft_model(model, config, adapter_name=ADAPTER)
    summary = trainable_summary(wrapped)
    log.info("LoRA r=%d alpha=%g on %s: %d of %d params trainable", settings.r, settings.alpha,
             settings.target_modules, summary["trainable_params"], summary["total_params"])
    return wrapped


def _revert_to_checkpoint_format(model: torch.nn.Module,
                                 state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """In-memory names/layouts → the checkpoint's, as `save_pretrained` writes them.

    transformers 5 fuses some weights at load (Qwen3-MoE: per-expert gate/up/down_proj into
    3-D `mlp.experts.gate_up_proj`/`down_proj`) and splits them again on save; without this the
    published file would carry names only transformers ≥ 5 understands.
    """
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: state_dict keys are the checkpoint's
        return state
    return revert_weight_conversion(model, state)


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full weights with the active adapters merged in, keyed as the base checkpoint is.

    The result is what `safetensors.torch.save_file` writes as `model.safetensors` so that a
    directory with the base model's config and tokenizer loads as the plain model. Every value is
    a fresh contiguous CPU tensor; the live model is only read (no merge, no unmerge), so its
    forward is bit-for-bit the same afterwards. Tied weights appear once, under the first name
    (Qwen3: `model.embed_tokens.weight`, no `lm_head.weight`), as the shipped checkpoints do.
    A model without adapters gives its own weights, so full fine-tuning publishes the same way.
    A model sharded by FSDP2 gives its whole weights on every rank (collective: all ranks call it).
    """
    base = model.get_base_model() if _is_peft(model) else model
    lora_layers = {}
    if base is not model:
        from peft.tuners.lora import LoraLayer

        lora_layers = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}

    state: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    with torch.no_grad():
        for key, tensor in base.state_dict(keep_vars=True).items():
            if ".lora_" in key:
                continue
            if id(tensor) in seen:  # a tied weight's second name
                continue
            seen.add(id(tensor))
            state[key.replace(".base_layer.", ".")] = full_value(tensor.detach())

        tied = _tied_names(base)
        for name, layer in lora_layers.items():
            if layer.disable_adapters:
                continue
            pending = [a for a in layer.active_adapters
                       if a in layer.lora_A and a not in layer.merged_adapters]
            if not pending:
                continue
            if f"{name}.base_layer" in tied:
                raise ValueError(f"{name} has a LoRA adapter but its weight is tied; "
                                 "cannot publish one merged weight for both names")
            key = f"{name}.weight"
            if key not in state:
                raise KeyError(f"no base weight {key} for the LoRA layer {name}")
            weight = state[key]
            for adapter in pending:
                weight = weight + full_value(layer.get_delta_weight(adapter)).to(weight.dtype)
            state[key] = weight

    state = _revert_to_checkpoint_format(base, state)
    return {key: value.detach().to(device="cpu", memory_format=torch.contiguous_format, copy=True)
            for key, value in state.items()}


def trainable_summary(model: torch.nn.Module) -> dict:
    """Trainable and total parameter counts (tied weights counted once), for config.json."""
    params = list(model.parameters())  # parameters() yields a shared Parameter once
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    return {
        "trainable_params": trainable,
        "total_params": total,
        "trainable_fraction": trainable / total if total else 0.0,
    }
