"""Continuous batching: one decode thread runs a ``DecodeSession`` that requests join and leave.

Between two decode steps the thread admits the waiting requests that fit (up to ``max_seqs``
sequences, counting each of a request's ``n`` choices; their prompts are prefilled together
and join the running batch), and a sequence leaves the batch the step it finishes. A busy batch
takes them in groups (``join_now``): a prefill is an eager forward whose host time, on a GPU,
is several decode steps' whatever its size, and under sustained load requests come one at a time. When the
engine is idle the first request waits for company until ``window_s`` passes with no new arrival
(at most ``WINDOW_SPAN`` windows in all), so a burst is prefilled as one even when its requests
come in over longer than one window (32 HTTP requests from one client take several ms to arrive:
a fixed window from the first one split such bursts into two prefills).

Results cross to the event loop in batches, to keep the decode loop and the event loop from
contending for the GIL on every token: one ``call_soon_threadsafe`` per step for all streaming
requests, and a non-streaming request gets its whole generation in one hand-over when it ends.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..engines import RolloutEngine, SamplingParams, StepEvent

log = logging.getLogger(__name__)

DONE = object()
WINDOW_SPAN = 8
"""An idle server's wait for a burst to finish arriving is at most this many ``window_s``."""
GROUP_STEPS = 8
"""A request waiting beside a busy batch waits at most this many decode steps for company."""


def join_now(waiting: int, room: int, running: int, max_seqs: int, waited_steps: int) -> bool:
    """Whether ``waiting`` sequences join a batch of ``running`` (``room`` more fit) before its next
    step. Each join costs a prefill: on the Qwen3-0.6B shape on an H200 an eager forward of ~30 ms
    of host time, four decode steps of the whole batch, for one row or for eight. So a batch at
    least half full takes joiners in groups of an eighth of its size (as many as fit), and a
    lone request joins after at most ``GROUP_STEPS`` steps; a batch under half full takes every
    request at once. (A full batch frees a slot or two a step: joining whatever fits the room
    would be a prefill a step again.)"""
    if waiting == 0 or room <= 0:
        return False
    return running < max_seqs // 2 or waiting >= max(1, max_seqs // 8) or waited_steps >= GROUP_STEPS


@dataclass
class Pending:
    prompt_ids: list[int]
    params: SamplingParams
    n: int
    loop: asyncio.AbstractEventLoop | None
    """The event loop that reads ``events``; None on the engine process's side (``engine_process``)."""
    events: asyncio.Queue | None
    stream: bool = True
    """Hand each step over as it comes; otherwise everything at once when the request ends."""
    cancelled: bool = False
    enqueued_at: float = field(default_factory=time.perf_counter)
    running: int = 0
    """Choices still decoding (set when the request joins the batch)."""
    seen_at_step: int = 0
    """Decode-thread side: the batcher's step count when it took the request off its queue."""
    held: list = field(default_factory=list)
    """Decode-thread side: items not yet handed to the event loop."""
    request_id: int = 0
    """Names the request between the HTTP process and the engine process (``engine_process``)."""
    experts: bool = True
    """Whether the request's routed experts are wanted (an MoE model's events always carry them
    in this process; an engine process sends them over its pipe only when wanted)."""
    on_cancel: Callable[[], None] | None = None

    def cancel(self) -> None:
        """The client went away or the request ended: its sequences leave the batch at the next step."""
        if not self.cancelled:
            self.cancelled = True
            if self.on_cancel is not None:
                self.on_cancel()


def deliver(items: list[tuple[asyncio.Queue, list]]) -> None:
    """Event-loop side: put each batch's items on its request's queue."""
    for events, batch in items:
        for item in batch:
            events.put_nowait(item)


def to_loops(items: list[tuple[Pending, list]]) -> None:
    """Hand each request's items to the event loop that reads them: one ``call_soon_threadsafe``
    per loop for all of them (this thread's batcher and an engine process's pipe reader both)."""
    by_loop: dict[int, tuple[asyncio.AbstractEventLoop, list]] = {}
    for pending, batch in items:
        assert pending.loop is not None and pending.events is not None
        by_loop.setdefault(id(pending.loop), (pending.loop, []))[1].append((pending.events, batch))
    for loop, grouped in by_loop.values():
        try:
            loop.call_soon_threadsafe(deliver, grouped)
        except RuntimeError:
            pass  # the server is shutting down: its loop is closed


class Batcher:
    def __init__(self, engine: RolloutEngine, *, max_seqs: int = 32, window_s: float = 0.005,
                 profile_path: str | None = None, profile_after_steps: int = 0):
        """``profile_path``: write cProfile statistics of the decode thread there when it stops,
        from its ``profile_after_steps``-th decode step on (past a warm-up's one-time costs:
        graph captures, kernel compiles, attention plans)."""
        self.engine = engine
        self.profile_path = profile_path
        self.profile_after_steps = profile_after_steps
        self._profile: Any = None
        self.max_seqs = max_seqs
        self.window_s = window_s
        self._queue: queue.Queue[Pending | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="rollmarket-batcher", daemon=True)
        self._waiting: list[Pending] = []
        """Decode-thread side: requests taken off the queue, not admitted yet (oldest first)."""
        self._stopping = False
        self.batches = 0
        """Prefills run: each admits every request that was waiting and fitted."""
        self.sequences = 0
        self.largest_batch = 0
        """Most sequences decoded in one step."""
        self.running = 0
        """Sequences in the batch now."""
        # Where the decode thread's wall time goes (cumulative; /v1/engine reports them, the
        # throughput benchmark takes differences per burst to split HTTP's cost from the engine's).
        self.steps = 0
        """Decode steps run."""
        self.step_seconds = 0.0
        """Wall time inside decode steps, the hand-over of their results included."""
        self.prefill_seconds = 0.0
        """Wall time of prefills (admissions)."""
        self.queue_seconds = 0.0
        """Summed over admitted requests: from ``submit`` to the start of their prefill."""

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        """Whether the decode loop can take requests (an engine process can die; this thread does not)."""
        return True

    @property
    def pid(self) -> int | None:
        """The process whose thread decodes: this one."""
        return os.getpid()

    def submit(self, prompt_ids: list[int], params: SamplingParams, n: int, *, stream: bool = True,
               experts: bool = True) -> Pending:
        loop = asyncio.get_running_loop()
        pending = Pending(prompt_ids, params, n, loop, asyncio.Queue(), stream=stream, experts=experts)
        self.enqueue(pending)
        return pending

    def enqueue(self, pending: Pending) -> None:
        self._queue.put(pending)

    def counters(self) -> dict[str, float]:
        """Where the decode loop's time went so far (cumulative), as /v1/engine reports it."""
        return {"batches": self.batches, "sequences": self.sequences, "largest_batch": self.largest_batch,
                "running": self.running,
                "decode_steps": self.steps, "decode_seconds": self.step_seconds,
                "prefill_seconds": self.prefill_seconds, "queue_seconds": self.queue_seconds}

    async def read_counters(self) -> dict[str, float]:
        return self.counters()

    def hand_over(self, items: list[tuple[Pending, list]]) -> None:
        """Pass each request's new items (lists of (choice, StepEvent), an exception, DONE) to the
        event loops that read them."""
        to_loops(items)

    def _admissible(self, running: int) -> list[Pending]:
        """The waiting requests that join the batch of ``running`` sequences now (``join_now``);
        blocks only when idle."""
        self._pull(block=running == 0 and not self._waiting)
        self._waiting = [p for p in self._waiting if not p.cancelled]
        if not self._waiting:
            return []
        waiting = sum(p.n for p in self._waiting)
        waited = self.steps - self._waiting[0].seen_at_step
        if running and not self._stopping and not join_now(waiting, self.max_seqs - running, running,
                                                           self.max_seqs, waited):
            return []
        batch: list[Pending] = []
        seqs = running
        while self._waiting:
            item = self._waiting[0]
            # A request larger than max_seqs still runs, alone.
            if seqs + item.n > self.max_seqs and seqs > 0:
                break
            batch.append(self._waiting.pop(0))
            seqs += item.n
            if seqs >= self.max_seqs:
                break
        return batch

    def _pull(self, *, block: bool) -> None:
        """Move what is queued to ``_waiting``. ``block`` (an idle batcher): first wait for a
        request, then for the rest of its burst: each arrival keeps the window open for another
        quiet ``window_s``, up to ``WINDOW_SPAN`` windows from the first."""
        def take(item: Pending | None) -> bool:
            if item is None:
                self._stopping = True
                return False
            item.seen_at_step = self.steps
            self._waiting.append(item)
            return True

        if block and not self._stopping:
            if not take(self._queue.get()):
                return
            first = time.perf_counter()
            deadline = first + self.window_s
            while sum(p.n for p in self._waiting) < self.max_seqs:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                try:
                    item = self._queue.get(timeout=remaining)
                except queue.Empty:
                    break
                if not take(item):
                    return
                deadline = min(time.perf_counter() + self.window_s, first + WINDOW_SPAN * self.window_s)
        while not self._stopping:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if not take(item):
                return

    def _run(self) -> None:
        if self.profile_path is None:
            return self._serve()
        import cProfile

        self._profile = cProfile.Profile()  # enabled in this thread: it sees the decode loop only
        self._profile_when_due()
        try:
            self._serve()
        finally:
            self._profile.disable()
            self._profile.dump_stats(self.profile_path)

    def _profile_when_due(self) -> None:
        if self._profile is not None and self.steps == self.profile_after_steps:
            self._profile.enable()

    def _serve(self) -> None:
        session = self.engine.session()
        owners: dict[int, tuple[Pending, int]] = {}
        while True:
            self.running = len(session)
            joining = self._admissible(len(session))
            if self._stopping and not joining and not session:
                return
            try:
                if joining:
                    self._admit(session, joining, owners)
                if not session:
                    continue
                self._step(session, owners)
            except Exception as exc:  # one bad batch must not take the server down
                log.exception("decode step failed")
                failed = list({id(p): p for p, _ in owners.values()}.values())
                failed += [pending for pending in joining if pending.running == 0]
                self.hand_over([(pending, [exc, DONE]) for pending in failed])
                owners.clear()
                session = self.engine.session()

    def _admit(self, session, joining: list[Pending], owners: dict[int, tuple[Pending, int]]) -> None:
        prompts, params, seeds_index, who = [], [], [], []
        for pending in joining:
            for choice in range(pending.n):
                prompts.append(pending.prompt_ids)
                params.append(pending.params)
                seeds_index.append(choice)
                who.append((pending, choice))
        started = time.perf_counter()
        self.queue_seconds += sum(started - pending.enqueued_at for pending in joining)
        rows = session.add(prompts, params, seeds_index)
        for row, owner in zip(rows, who):
            owners[row.index] = owner
        for pending in joining:
            pending.running = pending.n
        self.batches += 1
        self.sequences += len(prompts)
        self.prefill_seconds += time.perf_counter() - started

    def _step(self, session, owners: dict[int, tuple[Pending, int]]) -> None:
        started = time.perf_counter()
        self._decode(session, owners)
        self.steps += 1
        self.step_seconds += time.perf_counter() - started
        self._profile_when_due()

    def _decode(self, session, owners: dict[int, tuple[Pending, int]]) -> None:
        cancelled = [r for r in session.rows if owners[r.index][0].cancelled]
        if cancelled:
            session.remove(cancelled)
            for r in cancelled:
                owners.pop(r.index)
            if not session:
                return
        self.largest_batch = max(self.largest_batch, len(session))
        touched: dict[int, Pending] = {}
        ev: StepEvent
        for ev in session.step():
            pending, choice = owners[ev.index]
            if pending.cancelled:
                continue
            if not pending.held:
                pending.held.append([])
            pending.held[0].append((choice, ev))
            touched[id(pending)] = pending
            if ev.finish_reason is not None:
                owners.pop(ev.index)
                pending.running -= 1
        ready: list[tuple[Pending, list]] = []
        for pending in touched.values():
            finished = pending.running == 0
            if not (pending.stream or finished):
                continue  # keep accumulating until the request ends
            batch = pending.held
            pending.held = []
            if finished:
                batch.append(DONE)
            ready.append((pending, batch))
        if ready:
            self.hand_over(ready)
