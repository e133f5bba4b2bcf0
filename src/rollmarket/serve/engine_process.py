"""The decode loop in a process of its own (`serve-model --engine-process`).

In one process the decode thread and the HTTP event loop share one interpreter lock: while a
step's Python runs (an eager MoE step is nearly all host time) requests wait to be parsed and
answered, and while the event loop works the next step waits. vLLM's V1 splits its server the same
way (an API server process and an engine-core process). Here the HTTP process keeps the tokenizer,
the chat template and the detokenizer; the engine process loads the weights and runs the same
``Batcher``. They talk over one ``multiprocessing`` pipe (pickled tuples):

- HTTP → engine: ``("submit", id, prompt_ids, params, n, stream, experts)``, ``("cancel", id)``,
  ``("ask", token, what)`` (``counters`` or ``fingerprint``), ``("stop",)``.
- engine → HTTP: ``("ready", EngineFacts)`` or ``("failed", kind, message)`` once, at start;
  ``("out", [(id, items), ...])`` once per step for every request with news; ``("answer", token, value)``.

``items`` are what the in-process batcher hands its event loop — lists of (choice, StepEvent) —
with ``None`` for DONE and a string for a failed generation. A ``StepEvent`` crosses as a plain
tuple, its routed experts as int16 bytes and only for requests that asked for them
(``Pending.experts``): pickling 32 events as dataclasses with their expert arrays took ~6× as long
as the tuples (430 against 70 µs a step on a 2-core box), a cost paid on every decode step. When the engine process dies the
HTTP process fails what was in flight, answers 503 to new requests and to /health; when the HTTP
process dies the engine process reads the end of the pipe and exits.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import multiprocessing as mp
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np

from ..engines import ModelInfo, Precision, RolloutEngine, SamplingParams, StepEvent
from ..engines.loading import load_model, load_tokenizer
from ..engines.rollout import encode_chat
from .batcher import DONE, Batcher, Pending, to_loops
from .protocol import OpenAIError
from .settings import ServeSettings

START_TIMEOUT_S = 1800.0
"""Loading a large checkpoint (and capturing its first graphs) can take minutes."""


class EngineProcessError(RuntimeError):
    """The engine process could not start. ``settings``: the engine refused the settings (a KV cache
    or graphs the model or device cannot have), not a failed load."""

    def __init__(self, message: str, *, settings: bool = False):
        super().__init__(message)
        self.settings = settings


@dataclass(frozen=True)
class EngineFacts:
    """What the HTTP process needs to know of the engine (/v1/models, /v1/engine)."""

    info: ModelInfo
    name: str
    precision: Precision
    kv: str
    graphs: bool
    device: str
    step_buckets: bool


class EngineFace:
    """The HTTP process's stand-in for the engine: its facts and tokenizer, no weights."""

    def __init__(self, facts: EngineFacts, tokenizer: Any, batcher: "RemoteBatcher"):
        self.info, self.name, self.precision = facts.info, facts.name, facts.precision
        self.kv, self.graphs, self.device = facts.kv, facts.graphs, facts.device
        self.step_buckets = facts.step_buckets
        self.tokenizer = tokenizer
        self._batcher = batcher

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return encode_chat(self.tokenizer, messages, tools)

    def fingerprint(self) -> str:
        return str(self._batcher.ask("fingerprint"))


def _gone(why: str) -> OpenAIError:
    return OpenAIError(f"the engine process exited ({why})", status=503, type_="server_error",
                       code="engine_unavailable")


class RemoteBatcher:
    """The HTTP process's side of the pipe, with the ``Batcher`` surface the app uses."""

    def __init__(self, process: BaseProcess, conn: Connection, experts_LK: tuple[int, int] = (0, 0)):
        """``experts_LK``: an MoE model's (moe layers, top-k), the shape of a token's experts."""
        self._process, self._conn = process, conn
        self._experts_LK = experts_LK
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, Pending] = {}
        self._answers: dict[int, tuple[threading.Event, list]] = {}
        self._gone: str | None = None
        self._reader = threading.Thread(target=self._read, name="rollmarket-engine-pipe", daemon=True)

    @property
    def alive(self) -> bool:
        return self._gone is None

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def start(self) -> None:
        self._reader.start()

    def stop(self) -> None:
        if self._gone is None:
            try:
                self._send(("stop",))
            except OSError:
                pass
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout=10)

    def submit(self, prompt_ids: list[int], params: SamplingParams, n: int, *, stream: bool = True,
               experts: bool = True) -> Pending:
        if self._gone is not None:
            raise _gone(self._gone)
        rid = next(self._ids)
        pending = Pending(prompt_ids, params, n, asyncio.get_running_loop(), asyncio.Queue(), stream=stream,
                          request_id=rid, on_cancel=lambda: self._cancel(rid), experts=experts)
        self._pending[rid] = pending
        try:
            self._send(("submit", rid, prompt_ids, params, n, stream, experts))
        except OSError:  # the engine process died since the check above; the reader will say so
            self._pending.pop(rid, None)
            raise _gone("its pipe closed") from None
        return pending

    def _cancel(self, rid: int) -> None:
        if self._pending.pop(rid, None) is not None and self._gone is None:
            self._send(("cancel", rid))

    def ask(self, what: str, timeout: float = 600.0) -> Any:
        """The engine process's answer to ``what`` (``counters``, ``fingerprint``); blocks."""
        if self._gone is not None:
            raise _gone(self._gone)
        token = next(self._ids)
        answered, box = threading.Event(), list[Any]()
        self._answers[token] = (answered, box)
        self._send(("ask", token, what))
        if not answered.wait(timeout) or not box:
            self._answers.pop(token, None)
            raise _gone(self._gone or f"no answer to {what!r} in {timeout:.0f}s")
        return box[0]

    async def read_counters(self) -> dict[str, float]:
        return await asyncio.to_thread(self.ask, "counters")

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                if message[0] == "out":
                    self._hand_over(message[1])
                elif message[0] == "answer":
                    waiter = self._answers.pop(message[1], None)
                    if waiter is not None:
                        waiter[1].append(message[2])
                        waiter[0].set()
        except (EOFError, OSError):
            pass
        self._process.join(timeout=5)
        self._gone = f"exit code {self._process.exitcode}"
        # Everything in flight fails now, in the shape a failed decode step has.
        failed = RuntimeError(f"the engine process exited ({self._gone})")
        pendings, self._pending = self._pending, {}
        to_loops([(pending, [failed, DONE]) for pending in pendings.values()])
        for answered, _box in list(self._answers.values()):
            answered.set()

    def _hand_over(self, out: list[tuple[int, list]]) -> None:
        ready: list[tuple[Pending, list]] = []
        for rid, items in out:
            pending = self._pending.get(rid)
            if pending is None:
                continue  # cancelled here while its last step was on the way
            batch: list = []
            for item in items:
                if item is None:
                    batch.append(DONE)
                    self._pending.pop(rid, None)
                elif isinstance(item, str):
                    batch.append(RuntimeError(item))
                else:
                    batch.append([(choice, self._event(wire)) for choice, wire in item])
            ready.append((pending, batch))
        to_loops(ready)

    def _event(self, wire: tuple) -> StepEvent:
        index, token_id, logprob, top, experts, finish = wire
        experts_LK = None if experts is None else np.frombuffer(experts, np.int16).reshape(self._experts_LK)
        return StepEvent(index, token_id, logprob, top, experts_LK, finish)


class _PipeBatcher(Batcher):
    """The engine process's batcher: hands each step's news to the pipe, not to an event loop."""

    def __init__(self, engine: RolloutEngine, send, **kw):
        super().__init__(engine, **kw)
        self._send = send
        self.requests: dict[int, Pending] = {}

    def hand_over(self, items: list[tuple[Pending, list]]) -> None:
        out = []
        for pending, batch in items:
            wire: list = []
            for item in batch:
                if item is DONE:
                    wire.append(None)
                    self.requests.pop(pending.request_id, None)
                elif isinstance(item, BaseException):
                    wire.append(str(item))
                else:
                    experts = pending.experts
                    wire.append([(choice, (ev.index, ev.token_id, ev.logprob, ev.top,
                                           ev.experts_LK.tobytes() if experts and ev.experts_LK is not None else None,
                                           ev.finish_reason))
                                 for choice, ev in item])
            out.append((pending.request_id, wire))
        self._send(("out", out))


def engine_main(settings_json: str, conn: Connection) -> None:
    """The engine process: load the model, say ready, run the batcher until told to stop or the
    HTTP process is gone."""
    settings = ServeSettings.model_validate_json(settings_json)
    try:
        if settings.threads:
            import torch

            torch.set_num_threads(settings.threads)
        loaded = load_model(settings.model_path, settings.precision, settings.device)
        engine = RolloutEngine(loaded, kv=settings.kv_cache, graphs=settings.decode_graphs,
                               step_buckets=settings.step_buckets)
    except ValueError as exc:  # the engine refuses the settings (slots for a sliding window, graphs on CPU)
        conn.send(("failed", "settings", str(exc)))
        return
    except Exception as exc:
        conn.send(("failed", "load", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", EngineFacts(info=engine.info, name=engine.name, precision=engine.precision,
                                    kv=engine.kv, graphs=engine.graphs, device=engine.device,
                                    step_buckets=engine.step_buckets)))
    gc.collect()
    gc.freeze()  # as serve-model does: full collections would walk torch's long-lived objects
    lock = threading.Lock()

    def send(message: tuple) -> None:
        with lock:
            conn.send(message)

    batcher = _PipeBatcher(engine, send, max_seqs=settings.max_batch_seqs,
                           window_s=settings.batch_window_ms / 1000.0, profile_path=settings.profile_decode,
                           profile_after_steps=settings.profile_decode_after_steps)
    batcher.start()

    def answer(token: int, what: str) -> None:
        value: Any = batcher.counters() if what == "counters" else engine.fingerprint()
        send(("answer", token, value))

    try:
        while True:
            message = conn.recv()
            kind = message[0]
            if kind == "submit":
                _, rid, prompt_ids, params, n, stream, experts = message
                pending = Pending(prompt_ids, params, n, None, None, stream=stream, request_id=rid,
                                  experts=experts)
                batcher.requests[rid] = pending
                batcher.enqueue(pending)
            elif kind == "cancel":
                cancelled = batcher.requests.pop(message[1], None)
                if cancelled is not None:
                    cancelled.cancel()
            elif kind == "ask":
                # Its own thread: a fingerprint takes seconds, and submissions must not wait on it.
                threading.Thread(target=answer, args=message[1:], daemon=True).start()
            elif kind == "stop":
                break
    except (EOFError, OSError):
        pass  # the HTTP process is gone
    finally:
        batcher.stop()


def start_engine_process(settings: ServeSettings, *, timeout_s: float = START_TIMEOUT_S
                         ) -> tuple[EngineFace, RemoteBatcher]:
    """Spawn the engine process for ``settings`` and wait until its model is loaded. Its batcher
    is started with the app (``create_serve_app(face, settings, batcher)``)."""
    context = mp.get_context("spawn")  # CUDA does not survive a fork
    ours, theirs = context.Pipe()
    process = context.Process(target=engine_main, args=(settings.model_dump_json(), theirs),
                              name="rollmarket-engine")
    process.start()
    theirs.close()
    waited = 0.0
    while not ours.poll(0.5):
        waited += 0.5
        if not process.is_alive():
            raise EngineProcessError(f"the engine process exited while loading (exit code {process.exitcode})")
        if waited > timeout_s:
            process.terminate()
            raise EngineProcessError(f"the engine process did not load the model in {timeout_s:.0f}s")
    try:
        message = ours.recv()
    except EOFError:
        process.join(timeout=10)
        raise EngineProcessError(f"the engine process exited while loading (exit code {process.exitcode})") from None
    if message[0] == "failed":
        process.join(timeout=10)
        raise EngineProcessError(message[2], settings=message[1] == "settings")
    facts: EngineFacts = message[1]
    batcher = RemoteBatcher(process, ours, (facts.info.num_moe_layers or 0, facts.info.top_k or 0))
    return EngineFace(facts, load_tokenizer(settings.model_path), batcher), batcher
