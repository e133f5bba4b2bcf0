"""Concurrent requests share decode steps: one engine thread, batches formed from a queue.

Requests that arrive within ``window_s`` of each other (up to ``max_seqs`` sequences, counting
each of a request's ``n`` choices) run as one batch: one prefill and one decode step per token
for all of them. Events go back to each request's asyncio queue as they are produced, so
streaming clients see tokens as they are sampled. A request that arrives while a batch runs
waits for the next one (static batching; continuous batching is a later GPU issue).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..engines import RolloutEngine, SamplingParams, StepEvent

log = logging.getLogger(__name__)

DONE = object()


@dataclass
class Pending:
    prompt_ids: list[int]
    params: SamplingParams
    n: int
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancelled: bool = False
    enqueued_at: float = field(default_factory=time.perf_counter)

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class Batcher:
    def __init__(self, engine: RolloutEngine, *, max_seqs: int = 32, window_s: float = 0.005):
        self.engine = engine
        self.max_seqs = max_seqs
        self.window_s = window_s
        self._queue: queue.Queue[Pending | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="rollmarket-batcher", daemon=True)
        self._carry: Pending | None = None
        self.batches = 0
        self.sequences = 0
        self.largest_batch = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def submit(self, prompt_ids: list[int], params: SamplingParams, n: int) -> Pending:
        loop = asyncio.get_running_loop()
        pending = Pending(prompt_ids, params, n, loop, asyncio.Queue())
        self._queue.put(pending)
        return pending

    def _collect(self) -> list[Pending] | None:
        first = self._carry or self._queue.get()
        self._carry = None
        if first is None:
            return None
        batch, seqs = [first], first.n
        deadline = time.perf_counter() + self.window_s
        while seqs < self.max_seqs:
            remaining = deadline - time.perf_counter()
            try:
                item = self._queue.get(timeout=max(remaining, 0)) if remaining > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._queue.put(None)
                break
            if seqs + item.n > self.max_seqs:
                self._carry = item
                break
            batch.append(item)
            seqs += item.n
        return batch

    def _run(self) -> None:
        while True:
            batch = self._collect()
            if batch is None:
                return
            batch = [p for p in batch if not p.cancelled]
            if not batch:
                continue
            prompts, params, seeds_index, owners = [], [], [], []
            for pending in batch:
                for choice in range(pending.n):
                    prompts.append(pending.prompt_ids)
                    params.append(pending.params)
                    seeds_index.append(choice)
                    owners.append((pending, choice))
            self.batches += 1
            self.sequences += len(prompts)
            self.largest_batch = max(self.largest_batch, len(prompts))
            try:
                stream = self.engine.stream(prompts, params, seeds_index=seeds_index,
                                            should_abort=lambda: all(p.cancelled for p in batch))
                for events in stream:
                    by_owner: dict[int, list[tuple[int, StepEvent]]] = {}
                    for ev in events:
                        pending, choice = owners[ev.index]
                        by_owner.setdefault(id(pending), []).append((choice, ev))
                    for pending in batch:
                        items = by_owner.get(id(pending))
                        if items and not pending.cancelled:
                            pending.put(items)
            except Exception as exc:  # one bad batch must not take the server down
                log.exception("batch failed")
                for pending in batch:
                    pending.put(exc)
            for pending in batch:
                pending.put(DONE)
