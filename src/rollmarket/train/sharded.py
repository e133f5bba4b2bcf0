"""The learner's policy under FSDP2: data parallel over a process group, weights sharded.

Each decoder layer is a ``fully_shard`` unit and the root holds the rest (``engines.fsdp.shard_model``),
so the embeddings, the final norm and the lm-head live in the root unit. The learner's forward
(body, then the chunked head on the hidden states) is registered as a forward method of the root,
so the root's hooks gather those weights around it and again in its backward; the chunked head's
backward then sees the whole lm-head weight, and FSDP reduce-scatters its gradient like any other.

Every rank trains on its own rows. FSDP averages the gradients over ranks; the learner scales each
rank's loss by ``world · d_rank / Σ d`` (d: what the loss's aggregation divides by on that rank), so
the average is the gradient of the loss over the whole batch, as one process would take it
(``global_loss_scale``).

Importing this module starts nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

TOKEN_STATS_METHOD = "_rollmarket_token_stats"


def shard_policy(model: torch.nn.Module, mesh, token_stats, *, layout=None) -> torch.nn.Module:
    """Shard ``model`` over ``mesh`` (one unit per decoder layer, the root for the rest; ``layout``:
    an ``engines.fsdp.ShardLayout``) and register ``token_stats(model, ...)`` as its forward method
    ``TOKEN_STATS_METHOD``."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    from ..engines.fsdp import shard_model

    shard_model(model, mesh, layout=layout)
    setattr(model, TOKEN_STATS_METHOD, lambda *args, **kw: token_stats(model, *args, **kw))
    register_fsdp_forward_method(model, TOKEN_STATS_METHOD)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` went through ``shard_policy``."""
    return hasattr(model, TOKEN_STATS_METHOD)


def world_size() -> int:
    """Ranks in the default process group; 1 without one."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def global_loss_scale(divides_by: float, device: torch.device) -> float:
    """``world · d / Σ_ranks d`` for this rank's divisor ``d`` (1 in one process): the factor that
    makes FSDP's average of the ranks' gradients the whole batch's gradient. Collective."""
    n = world_size()
    if n == 1:
        return 1.0
    total = torch.tensor([divides_by], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return n * divides_by / float(total) if float(total) > 0 else 0.0


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a sharded one (``DTensor.full_tensor``, collective); others unchanged."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
