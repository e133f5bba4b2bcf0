"""Supervised training of a tiny model on gold trajectories: a flat AdamW loop, read top to bottom.

Warmup then cosine decay over `steps`; `max_minutes` only caps wall time (the schedule stays
step-based so a rebuild with the same steps and seed gives the same weights). For MoE models the
router load-balancing loss is on (`output_router_logits=True`) so every expert gets traffic.

Two savings that change no result: batches are grouped by length (little padding), and the
system turn every example starts with runs once per step, its KV cache broadcast to the batch.
"""

from __future__ import annotations

import inspect
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, Qwen3Model
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from .corpus import Example


@dataclass
class TrainConfig:
    steps: int = 4000  # optimizer steps (the cosine schedule spans these)
    batch_size: int = 16  # sequences per step
    lr: float = 6e-3  # peak learning rate
    min_lr_ratio: float = 0.05  # final lr = lr * min_lr_ratio
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    max_minutes: float = 30.0  # hard wall-time cap; training stops early if reached
    threads: int = 1  # torch intra-op threads (1 is fastest on a busy shared CPU)
    bucket_batches: int = 8  # batches per length-sorting window
    share_prefix: bool = True  # run the common system-turn prefix once per step


@dataclass
class TrainResult:
    steps_done: int
    wall_s: float
    losses: list[float] = field(default_factory=list)  # per-step assistant-token loss (without aux loss)
    aux_losses: list[float] = field(default_factory=list)  # per-step router aux loss (MoE only)
    stopped_by_time: bool = False
    prefix_len: int = 0  # tokens of shared prefix computed once per step

    def summary(self, points: int = 10) -> dict:
        """First/last/min loss and the loss averaged over `points` equal windows."""
        n = len(self.losses)
        window = max(n // points, 1)
        curve = [sum(self.losses[i:i + window]) / len(self.losses[i:i + window]) for i in range(0, n, window)]
        out = {"first": self.losses[0] if n else None, "last": self.losses[-1] if n else None,
               "min": min(self.losses) if n else None, "window_steps": window,
               "curve": [round(x, 4) for x in curve]}
        if self.aux_losses:
            out["router_aux_last"] = round(self.aux_losses[-1], 4)
        return out


# transformers 5.x renamed the forward's cache argument.
_CACHE_KWARG = "cache" if "cache" in inspect.signature(Qwen3Model.forward).parameters else "past_key_values"


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warmup to `lr`, then cosine down to `lr * min_lr_ratio` at `steps`."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = min((step - config.warmup_steps) / max(config.steps - config.warmup_steps, 1), 1.0)
    floor = config.lr * config.min_lr_ratio
    return floor + (config.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def shared_prefix_len(examples: list[Example]) -> int:
    """Length of the token prefix every example shares and trains on no token of (the system turn)."""
    first = examples[0].input_ids_T
    n = min(len(e.input_ids_T) for e in examples) - 1
    for e in examples:
        i = 0
        while i < n and e.input_ids_T[i] == first[i] and not e.loss_mask_T[i]:
            i += 1
        n = i
    return max(n, 0)


def collate(batch: list[Example], pad_id: int, start: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad tokens `start:` to the longest; labels are -100 outside assistant tokens."""
    T = max(len(e.input_ids_T) - start for e in batch)
    input_ids_BT = torch.full((len(batch), T), pad_id, dtype=torch.long)
    attention_mask_BT = torch.zeros((len(batch), T), dtype=torch.long)
    labels_BT = torch.full((len(batch), T), -100, dtype=torch.long)
    for i, e in enumerate(batch):
        ids = torch.tensor(e.input_ids_T[start:])
        input_ids_BT[i, :len(ids)] = ids
        attention_mask_BT[i, :len(ids)] = 1
        labels_BT[i, :len(ids)] = torch.where(torch.tensor(e.loss_mask_T[start:], dtype=torch.bool), ids, -100)
    return {"input_ids": input_ids_BT, "attention_mask": attention_mask_BT, "labels": labels_BT}


def batches(n_examples: int, lengths: list[int], config: TrainConfig, rng: random.Random):
    """Endless batches of example indices: shuffled, then grouped by length within windows of
    `bucket_batches` batches so little compute goes to padding."""
    window = config.batch_size * config.bucket_batches
    while True:
        order = rng.sample(range(n_examples), n_examples)
        for w in range(0, n_examples - config.batch_size + 1, window):
            chunk = sorted(order[w:w + window], key=lambda i: lengths[i])
            group = [chunk[i:i + config.batch_size] for i in range(0, len(chunk) - config.batch_size + 1,
                                                                   config.batch_size)]
            rng.shuffle(group)
            yield from group


def step_loss(model: PreTrainedModel, batch: list[Example], pad_id: int, prefix_len: int,
              is_moe: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mean cross-entropy over assistant tokens (and the router aux loss for MoE).

    The shared prefix runs once at batch size 1 and its KV cache is broadcast to the batch, which
    halves the work when the prefix is the ~230-token system turn; gradients flow through it.
    """
    inputs = collate(batch, pad_id, start=prefix_len)
    B = len(batch)
    kwargs: dict = {"output_router_logits": True} if is_moe else {}
    if prefix_len:
        prefix_1P = torch.tensor([batch[0].input_ids_T[:prefix_len]])
        prefix_out = model.model(input_ids=prefix_1P, use_cache=True)
        cache = getattr(prefix_out, "cache", None) or prefix_out.past_key_values
        for layer in cache.layers:
            layer.keys = layer.keys.expand(B, -1, -1, -1)
            layer.values = layer.values.expand(B, -1, -1, -1)
        kwargs[_CACHE_KWARG] = cache
    attention_mask_BT = torch.cat([torch.ones(B, prefix_len, dtype=torch.long), inputs["attention_mask"]], dim=1)
    # The base model, not the LM wrapper: the wrapper's built-in aux loss assumes no cache.
    out = model.model(input_ids=inputs["input_ids"], attention_mask=attention_mask_BT, use_cache=bool(prefix_len),
                      **kwargs)
    logits_BTV = model.lm_head(out.last_hidden_state[:, :-1]).float()
    labels_BT = inputs["labels"][:, 1:]
    loss = torch.nn.functional.cross_entropy(logits_BTV.reshape(-1, logits_BTV.shape[-1]), labels_BT.reshape(-1),
                                             ignore_index=-100)
    aux = None
    if is_moe:
        aux = load_balancing_loss_func(out.router_logits, model.config.num_experts,
                                       model.config.num_experts_per_tok, inputs["attention_mask"])
    return loss, aux


def train(model: PreTrainedModel, examples: list[Example], config: TrainConfig, pad_id: int,
          on_step: Callable[[int, float], None] | None = None) -> TrainResult:
    """Train `model` in place on `examples`; `on_step(step, loss)` is called after every step."""
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    is_moe = getattr(model.config, "num_experts", None) is not None
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=config.lr, betas=(0.9, 0.95), eps=1e-8)
    model.train()
    prefix_len = shared_prefix_len(examples) if config.share_prefix else 0
    feed = batches(len(examples), [len(e.input_ids_T) for e in examples], config, rng)
    result = TrainResult(steps_done=0, wall_s=0.0, prefix_len=prefix_len)
    start = time.monotonic()
    for step in range(config.steps):
        if time.monotonic() - start > config.max_minutes * 60:
            result.stopped_by_time = True
            break
        batch = [examples[i] for i in next(feed)]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        loss, aux = step_loss(model, batch, pad_id, prefix_len, is_moe)
        total = loss + model.config.router_aux_loss_coef * aux if aux is not None else loss
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        result.losses.append(float(loss.detach()))
        if aux is not None:
            result.aux_losses.append(float(aux.detach()))
        result.steps_done = step + 1
        if on_step is not None:
            on_step(step, result.losses[-1])
    model.eval()
    result.wall_s = time.monotonic() - start
    return result

