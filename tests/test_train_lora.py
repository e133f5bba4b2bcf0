"""LoRA training and publishing (train/lora.py) on the shipped tiny models.

What these protect: only adapters train; a LoRA policy published as merged full weights loads
with the ordinary loader and computes what the training model computes; publishing leaves the
training model untouched; bad settings fail with a message that says what to change.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors import safe_open
from safetensors.torch import save_file

from rollmarket.engines.loading import load_model
from rollmarket.train.lora import LoraSettings, apply_lora, merged_state_dict, trainable_summary

MODELS = Path(__file__).resolve().parents[1] / "models"
NON_WEIGHT_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                    "tokenizer_config.json")


def _tokens_BT(vocab_size: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (2, 12), generator=gen)


def _toy_loss(model: torch.nn.Module, tokens_BT: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on fixed random tokens: any loss that moves the adapters."""
    logits_BTV = model(input_ids=tokens_BT).logits
    return torch.nn.functional.cross_entropy(
        logits_BTV[:, :-1].reshape(-1, logits_BTV.shape[-1]), tokens_BT[:, 1:].reshape(-1))


def _train(model: torch.nn.Module, tokens_BT: torch.Tensor, steps: int, lr: float) -> None:
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        _toy_loss(model, tokens_BT).backward()
        opt.step()
    model.eval()


@torch.no_grad()
def _logits(model: torch.nn.Module, tokens_BT: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens_BT).logits


def test_only_adapters_train_and_base_weights_stay():
    loaded = load_model(MODELS / "tiny-moe", "fp32", "cpu")
    base_before = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    base_total = sum(p.numel() for p in loaded.model.parameters())
    model = apply_lora(loaded.model, LoraSettings(enabled=True, r=4))

    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable, "apply_lora left nothing trainable"
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable), trainable
    # 4 layers × 4 attention projections × (A, B)
    assert len(trainable) == 4 * 4 * 2
    assert not any(".mlp." in n for n in trainable), "the MoE block must be left alone"

    summary = trainable_summary(model)
    assert summary["trainable_params"] == sum(
        model.get_parameter(n).numel() for n in trainable)
    assert summary["total_params"] == base_total + summary["trainable_params"]
    assert 0 < summary["trainable_fraction"] < 0.05

    tokens_BT = _tokens_BT(loaded.info.vocab_size)
    lora_before = {n: model.get_parameter(n).clone() for n in trainable}
    _train(model, tokens_BT, steps=2, lr=1e-2)

    assert any(not torch.equal(model.get_parameter(n), lora_before[n]) for n in trainable)
    for key, value in model.get_base_model().state_dict().items():
        if ".lora_" in key:
            continue
        base_key = key.replace(".base_layer.", ".")
        assert torch.equal(value, base_before[base_key]), f"{base_key} moved"


def test_disabled_settings_leave_the_model_alone():
    loaded = load_model(MODELS / "tiny-dense", "fp32", "cpu")
    assert apply_lora(loaded.model, LoraSettings()) is loaded.model
    assert all(p.requires_grad for p in loaded.model.parameters())


@pytest.mark.parametrize("model_name,targets", [
    ("tiny-moe", None),
    ("tiny-dense", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
])
def test_merged_weights_load_as_the_plain_model(tmp_path, model_name, targets):
    src = MODELS / model_name
    loaded = load_model(src, "fp32", "cpu")
    tokens_BT = _tokens_BT(loaded.info.vocab_size, seed=1)
    base_logits_BTV = _logits(loaded.model, tokens_BT)
    extra = {"target_modules": targets} if targets else {}
    model = apply_lora(loaded.model, LoraSettings(enabled=True, r=4, alpha=8, **extra))
    _train(model, tokens_BT, steps=4, lr=1e-2)

    lora_logits_BTV = _logits(model, tokens_BT)
    # Without this the test would pass with a merge that forgets the adapters.
    assert (lora_logits_BTV - base_logits_BTV).abs().max() > 1e-3

    state = merged_state_dict(model)
    assert torch.equal(_logits(model, tokens_BT), lora_logits_BTV), "publishing changed the model"
    assert any(".lora_" in n for n, _ in model.named_parameters()), "adapters were unloaded"

    with safe_open(str(src / "model.safetensors"), "pt") as shipped:
        assert set(state) == set(shipped.keys()), "keys differ from the base checkpoint's"
        for key in state:
            assert list(state[key].shape) == shipped.get_slice(key).get_shape(), key
        q_key = "model.layers.0.self_attn.q_proj.weight"
        assert not torch.allclose(state[q_key], shipped.get_tensor(q_key)), "no delta merged"

    out = tmp_path / f"{model_name}-merged"
    out.mkdir()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in NON_WEIGHT_FILES:
        shutil.copy(src / name, out / name)

    reloaded = load_model(out, "fp32", "cpu")
    assert type(reloaded.model) is type(loaded.model)  # peft wrapped loaded.model in place
    reloaded_logits_BTV = _logits(reloaded.model, tokens_BT)
    torch.testing.assert_close(reloaded_logits_BTV, lora_logits_BTV, atol=1e-4, rtol=0)


def test_bad_settings_say_what_is_wrong():
    with pytest.raises(ValidationError, match="r"):
        LoraSettings(enabled=True, r=0)
    with pytest.raises(ValidationError):
        LoraSettings(enabled=True, rank=8)
    with pytest.raises(ValidationError):
        LoraSettings(enabled=True, target_modules=[])
    with pytest.raises(ValidationError):
        LoraSettings(enabled=True).r = 4

    moe = load_model(MODELS / "tiny-moe", "fp32", "cpu").model
    with pytest.raises(ValueError, match=r"'qkv_proj' is not in Qwen3MoeForCausalLM.*q_proj"):
        apply_lora(moe, LoraSettings(enabled=True, target_modules=["q_proj", "qkv_proj"]))
    with pytest.raises(ValueError, match=r"'experts' matches .*Qwen3MoeExperts, not a Linear"):
        apply_lora(moe, LoraSettings(enabled=True, target_modules=["experts"]))
    with pytest.raises(ValueError, match=r"'lm_head' .* tied"):
        apply_lora(moe, LoraSettings(enabled=True, target_modules=["lm_head"]))
    # the failed calls left no adapters behind
    assert not any(".lora_" in n for n, _ in moe.named_parameters())
