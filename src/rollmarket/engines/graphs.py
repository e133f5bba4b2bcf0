"""The trainer engine's model body replayed as CUDA graphs, one per batch shape.

On a small model the GPU finishes a decoder layer faster than Python launches its kernels: the
0.6B Qwen3 shape at 16k tokens spends 40.6 ms in kernels but 44.7 ms of wall time per forward
(docs/benchmarks.md). A CUDA graph records the body's kernels once per ``[batch, seq]`` shape and
replays them with one launch, so the GPU never waits for the interpreter.

A graph holds its inputs and outputs at fixed addresses: the ids are copied into the captured
buffer before each replay, and the returned hidden states live in the graph's memory until the
next replay of any graph of this cache (they share one memory pool), so a caller consumes them
before it calls again. Only a plain forward is graphed: no attention mask (padding), no router
hooks (capture or replay of MoE experts), which the engine checks before it asks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch


class GraphUnavailable(RuntimeError):
    """The body could not be captured as a CUDA graph (the engine falls back to the plain forward)."""


class BodyGraphs:
    """An LRU cache of captured forwards keyed by their inputs' shapes.

    ``forward(*inputs, *options) -> output`` is the trainer's body (``ids_BS -> hidden_BSH``, inside
    its ``BodyPatch``) or the rollout engine's decode step over KV slots (``slots.SlotKV.forward``);
    the inputs are copied into the captured buffers before each replay; ``options`` (hashable
    host values, such as which sampling passes a step runs) are baked into the capture and keyed
    beside the shapes;
    capturing runs it twice first on a side stream (compilation, cuDNN plans, autotuning happen
    there, not in the graph). ``shapes`` bounds how many graphs are kept: a new shape past it
    drops the least recently used one.
    """

    def __init__(self, forward: Callable[..., Any], *, shapes: int = 8):
        self.forward = forward
        self.shapes = shapes
        self._graphs: OrderedDict[tuple, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...], Any]] = OrderedDict()
        self._pool: Any = None
        """The memory pool the first graph made, shared by the others (``torch.cuda.graph_pool_handle``)."""
        self.captures = 0
        """How many graphs were captured (a shape seen again replays its graph)."""

    def __call__(self, *inputs: torch.Tensor, options: tuple = ()) -> Any:
        key = (tuple(tuple(t.shape) for t in inputs), options)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(inputs, options)
            self._graphs[key] = entry
            while len(self._graphs) > self.shapes:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        graph, static, output = entry
        for mine, given in zip(static, inputs):
            mine.copy_(given)
        graph.replay()
        return output

    def _capture(self, inputs: tuple[torch.Tensor, ...], options: tuple):
        static = tuple(t.clone() for t in inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward(*static, *options)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: another thread of the process (a rollout engine's decode thread) may use
            # the GPU while this one captures; "global" would turn its calls into capture errors.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                output = self.forward(*static, *options)
        except RuntimeError as exc:  # something in the forward syncs with the host or allocates pinned memory
            raise GraphUnavailable(f"the forward could not be captured as a CUDA graph: {exc}") from exc
        self._pool = graph.pool()
        self.captures += 1
        return graph, static, output
