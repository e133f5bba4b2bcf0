"""The trainer engine's model body: eager, fused with Liger-Kernel's Triton kernels, or compiled.

Teacher forcing spends almost all of its time in the model body, and about half of that in the
elementwise kernels eager Qwen3 launches one operation at a time (RMSNorm, rotary embedding,
SwiGLU, residual adds; docs/benchmarks.md). Four bodies:

    eager           the model as transformers built it (the only body on the CPU by default)
    liger           Liger-Kernel's fused Triton RMSNorm, SwiGLU and rotary embedding in Qwen3's
                    modules (CUDA, ``pip install liger-kernel``)
    compiled        each decoder layer ``torch.compile``d (regional compilation: identical layers
                    share one graph), which also fuses the residual adds
    compiled-liger  the Liger kernels inside the compiled layers

A body applies only inside ``with BodyPatch(...)``, which the engine holds around its own forward:
the model object is shared (a rollout engine decodes with it, the learner trains it), so outside
that span every module is exactly as transformers built it, and a cache-decoding forward never
meets a graph compiled for teacher forcing.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch

Body = Literal["eager", "liger", "compiled", "compiled-liger"]
BODIES: tuple[str, ...] = get_args(Body)
CUDA_BODY: Body = "compiled"
"""The default on CUDA for dense models. Chosen from the H100 runs so far (docs/benchmarks.md): the
compiled body was the fastest on every Qwen3 shape, and its mean |Δ logprob| from the float32
model was below eager bf16's. benchmarks/teacher_forcing.py re-decides
it on every run ("Trainer engine: the model body"): the fastest body that meets the numerics
criterion there is the one this should name. MoE models and FSDP-sharded ones keep the eager body
by default: their router hooks (capture, replay) and sharding hooks would run inside the graph."""

# Qwen3's modules whose forward the fused kernels replace, and its rotary function's name.
_RMS_NORM = "Qwen3RMSNorm"
_MLP = "Qwen3MLP"
_ATTENTION = "Qwen3Attention"
_ROPE = "apply_rotary_pos_emb"


class BodyUnavailable(ValueError):
    """The body asked for cannot run on this model or machine (nothing was changed)."""


@dataclass(frozen=True)
class Kernels:
    """Fused replacements for the eager body's elementwise work, and where they run."""

    device_type: str
    """Tensors on this device type take the kernels; others keep the eager function (the rotary
    function is swapped module-wide for the span, so another model on another device may call it)."""
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    """(x, weight, eps) → weight · (x / rms(x)), normalized in float32, cast back before the weight."""
    swiglu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(gate, up) → silu(gate) · up."""
    rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                   tuple[torch.Tensor, torch.Tensor]]
    """(q, k, cos, sin) → rotated (q, k); q and k are [batch, heads, seq, head_dim]."""


def liger_kernels() -> Kernels:
    """Liger-Kernel's Triton RMSNorm, SwiGLU and rotary embedding (CUDA only)."""
    if not torch.cuda.is_available():
        raise BodyUnavailable("the liger body needs CUDA: Liger-Kernel's kernels are Triton GPU kernels")
    try:
        from liger_kernel.transformers.functional import liger_rms_norm, liger_rope, liger_swiglu
    except ImportError as exc:
        raise BodyUnavailable(f"the liger body needs Liger-Kernel (pip install liger-kernel): {exc}") from exc
    return Kernels(
        device_type="cuda",
        # "llama" casting is Qwen3RMSNorm's: float32 statistics, cast to the input dtype, then the
        # weight. No gradient flows through teacher forcing, so the backward's in-place flag is moot.
        rms_norm=lambda x, weight, eps: liger_rms_norm(x, weight, eps, 0.0, "llama", False),
        swiglu=liger_swiglu,
        rope=lambda q, k, cos, sin: liger_rope(q, k, cos, sin),
    )


def default_body(decoder: torch.nn.Module, device: torch.device | str, *, moe: bool) -> Body:
    """The body an engine gets when none is named: ``CUDA_BODY`` for a dense model on CUDA, eager
    everywhere else (the CPU path stays as transformers runs it)."""
    layers = getattr(decoder, "layers", None)
    if torch.device(device).type != "cuda" or moe or layers is None or _sharded(layers):
        return "eager"
    return CUDA_BODY


def _sharded(layers) -> bool:
    # FSDP2's per-layer hooks gather the weights; compiling them into each layer's graph is a
    # different (and separately tested) matter from fusing the body, so sharded bodies stay eager.
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(layer, FSDPModule) for layer in layers)


class BodyPatch:
    """Applies one body to a decoder for the span of each ``with`` block (reusable, not reentrant).

    The replacement forwards and compiled callables are made once here and reattached on every
    entry, so a compiled graph's guards (which check those very objects) hold from call to call.
    """

    def __init__(self, decoder: torch.nn.Module, body: Body, *, kernels: Kernels | None = None,
                 compile_mode: str | None = None):
        """``compile_mode``: ``torch.compile``'s mode for the compiled bodies (None: its default;
        benchmarks/teacher_forcing.py measures the others)."""
        if body not in BODIES:
            raise BodyUnavailable(f"unknown body {body!r}; choose from {', '.join(BODIES)}")
        self.body = body
        self._forwards: list[tuple[torch.nn.Module, Callable]] = []
        self._globals: list[tuple[types.ModuleType, Callable, Callable]] = []
        self._compiled: list[tuple[torch.nn.Module, Callable]] = []
        if "liger" in body:
            self._prepare_kernels(decoder, kernels or liger_kernels())
        if body.startswith("compiled"):
            layers = getattr(decoder, "layers", None)
            if layers is None:
                raise BodyUnavailable(f"{type(decoder).__name__} has no .layers to compile")
            for layer in layers:
                # Module.compile wraps _call_impl; keeping the wrapper and detaching it outside the
                # span leaves the layer eager there (compilation itself happens on the first call).
                layer.compile(mode=compile_mode)
                self._compiled.append((layer, layer._compiled_call_impl))
                layer._compiled_call_impl = None

    def _prepare_kernels(self, decoder: torch.nn.Module, kernels: Kernels) -> None:
        device = next(decoder.parameters()).device.type
        if device != kernels.device_type:
            raise BodyUnavailable(f"the liger body's kernels run on {kernels.device_type}; this model is on {device}")
        for module in decoder.modules():
            name = type(module).__name__
            if name == _RMS_NORM:
                self._forwards.append((module, types.MethodType(
                    lambda self, x: kernels.rms_norm(x, self.weight, self.variance_epsilon), module)))
            elif name == _MLP:
                act = getattr(module.config, "hidden_act", None)
                if act not in ("silu", "swish"):
                    raise BodyUnavailable(f"the liger body fuses SwiGLU; this MLP's activation is {act!r}")
                self._forwards.append((module, types.MethodType(
                    lambda self, x: self.down_proj(kernels.swiglu(self.gate_proj(x), self.up_proj(x))),
                    module)))
            elif name == _ATTENTION:
                home = sys.modules[type(module).__module__]
                original = getattr(home, _ROPE, None)
                if original is not None and all(h is not home for h, _, _ in self._globals):
                    self._globals.append((home, original, _dispatching_rope(original, kernels)))
        if not any(type(m).__name__ == _MLP for m, _ in self._forwards):
            raise BodyUnavailable(f"the liger body knows Qwen3's modules ({_RMS_NORM}, {_MLP}, "
                                  f"{_ATTENTION}); {type(decoder).__name__} has no {_MLP}")

    @property
    def fused(self) -> tuple[str, ...]:
        """What the kernels replaced: the module class names and the rotary function."""
        names = sorted({type(m).__name__ for m, _ in self._forwards})
        return tuple(names + ([_ROPE] if self._globals else []))

    def __enter__(self) -> "BodyPatch":
        for module, forward in self._forwards:
            module.forward = forward  # an instance attribute shadows the class's forward
        for home, _, fused in self._globals:
            setattr(home, _ROPE, fused)
        for layer, compiled in self._compiled:
            layer._compiled_call_impl = compiled
        return self

    def __exit__(self, *exc) -> None:
        for module, _ in self._forwards:
            del module.forward
        for home, original, _ in self._globals:
            setattr(home, _ROPE, original)
        for layer, _ in self._compiled:
            layer._compiled_call_impl = None


def _dispatching_rope(original: Callable, kernels: Kernels) -> Callable:
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if q.device.type == kernels.device_type and unsqueeze_dim == 1:
            return kernels.rope(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)
    return apply_rotary_pos_emb
