"""Precision profiles: the numerics an engine runs a checkpoint at.

A profile fixes the compute dtype and, for fp8, how weights are quantized. fp8 here is weight
quantize-dequantize (e4m3, one scale per output channel) followed by bf16 compute: the rounding
that FP8 serving stacks apply to weights, without needing FP8 matmul kernels. Embeddings, the
lm-head, norms and MoE router weights stay in bf16, as FP8 checkpoints usually leave them.
"""

from __future__ import annotations

from enum import Enum

import torch


class Precision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"
    fp8 = "fp8"

    @property
    def compute_dtype(self) -> torch.dtype:
        return _COMPUTE_DTYPE[self]

    @property
    def quantization(self) -> str:
        """The quantization class a PolicyManifest or WorkerManifest names."""
        return "fp8-e4m3-per-channel" if self is Precision.fp8 else "none"


_COMPUTE_DTYPE = {
    Precision.fp32: torch.float32,
    Precision.bf16: torch.bfloat16,
    Precision.fp16: torch.float16,
    Precision.fp8: torch.bfloat16,
}

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
"""448: the largest finite e4m3 value; each output channel's absolute maximum maps onto it."""


def parse_precision(value: str | Precision) -> Precision:
    try:
        return Precision(value)
    except ValueError:
        names = ", ".join(p.value for p in Precision)
        raise ValueError(f"unknown precision {value!r}; expected one of {names}") from None


def fp8_quantize_dequantize(weight: torch.Tensor) -> torch.Tensor:
    """Round a weight to e4m3 with one scale per output channel and return it in float32.

    The input dimension is the last one (``nn.Linear`` stores ``[out, in]``; fused expert weights
    store ``[experts, out, in]``), so the scale is the absolute maximum over the last axis.
    """
    w = weight.detach().float()
    scale = w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    quantized = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return quantized.float() * scale


def _keeps_full_precision(name: str, param: torch.Tensor) -> bool:
    if param.ndim < 2:
        return True  # norms and biases
    lowered = name.lower()
    return ("embed" in lowered or "lm_head" in lowered or lowered.endswith("mlp.gate.weight")
            or ".router." in lowered)


@torch.no_grad()
def apply_precision(model: torch.nn.Module, precision: Precision) -> torch.nn.Module:
    """Cast (and for fp8, quantize) a float32 model's parameters in place; returns it for chaining.

    Buffers keep their dtype: the rotary ``inv_freq`` is float32 by design (``from_pretrained``
    at bf16 and serving stacks keep it so); rounded to bf16, the angle of the fastest rotary
    pair is off by up to position × 2^-9 radians, 8 radians at position 4096.
    """
    if precision is Precision.fp8:
        for name, param in model.named_parameters():
            if not _keeps_full_precision(name, param):
                param.copy_(fp8_quantize_dequantize(param).to(param.dtype))
    for param in model.parameters():
        param.data = param.data.to(precision.compute_dtype)
    return model
