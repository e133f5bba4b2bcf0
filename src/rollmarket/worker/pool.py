"""Rollout workers as Ray actors on a Ray cluster someone already runs: `rollmarket pool`.

    driver (the CLI) ─► PoolSupervisor, a named detached actor "NAME" in namespace "rollmarket"
                            keeps `target` WorkerActors alive, one per slot:
                            an actor that dies (preempted node, kill -9, OOM) gets a successor in its slot
                            under a new worker id; scale(n) adds slots or drains the highest ones
                        ─► WorkerActor = one AgentWorker (rollmarket worker) in a Ray worker process

A dead actor's leases are the exchange's business, as for any worker that vanishes: its heartbeats
stop, the reaper marks it dead and abandons its leases (or they expire), and their jobs go back to
the queue. A successor never reuses a worker id (the exchange refuses a second registration of
one), so the books say which incarnation did what. Every worker's manifest names the pool, so the
exchange and the marketplace page show the pool's size.

The supervisor is detached: the pool outlives the command that started it, and any machine that
can reach the cluster can scale, inspect or stop it by name (`rollmarket pool scale|status|stop`).
Workers are owned by the supervisor, so stopping (or killing) it takes them down too. Ray is an
extra (`rollmarket[ray]`) imported only here, on use.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from enum import StrEnum

from pydantic import BaseModel, Field

from ..contracts.base import ID_PATTERN
from .host import HostSpec
from .runner import WorkerSettings

log = logging.getLogger(__name__)

NAMESPACE = "rollmarket"
"""The Ray namespace pools live in, so that `pool status NAME` finds them from any driver."""


class PoolError(RuntimeError):
    """A pool could not be started, found or changed."""


class RayMissing(PoolError):
    """Ray is not installed: it is the `rollmarket[ray]` extra."""


class PoolNotFound(PoolError):
    """No pool of that name runs on the cluster."""


class PoolExists(PoolError):
    """A pool of that name already runs on the cluster."""


def import_ray():
    """`ray`, or RayMissing naming the extra that brings it."""
    try:
        import ray
    except ImportError:
        raise RayMissing("Ray worker pools need Ray: pip install 'rollmarket[ray]'") from None
    return ray


class PoolSettings(BaseModel):
    """What a pool runs: how many workers, on which model, with which worker settings (saved with it)."""

    name: str = Field("rollmarket", min_length=1, max_length=64, pattern=ID_PATTERN,
                      description="The pool's name on the cluster and on the exchange.")
    workers: int = Field(1, ge=0, le=1024, description="Worker actors to keep alive.")
    host: HostSpec = Field(description="The model each worker samples from (a path or URL as the actors see it).")
    worker: WorkerSettings = Field(default_factory=WorkerSettings, description="Settings of every worker.")
    num_cpus: float = Field(1.0, gt=0, description="CPUs each worker actor reserves on the cluster (fractions allowed).")
    check_s: float = Field(0.5, gt=0, description="How often the supervisor looks for dead actors.")
    drain_s: float = Field(30.0, ge=0, description="How long a worker being scaled away may take to hand back "
                                                   "its lease before it is killed.")
    crash_window_s: float = Field(30.0, ge=0, description="A worker that dies younger than this is restarted after "
                                                          "a backoff (0.5 s, doubling per death in a row).")
    max_backoff_s: float = Field(30.0, ge=0, description="The longest wait before restarting a crashing worker.")


class SlotStatus(StrEnum):
    """Where a slot's worker is in its life."""

    starting = "starting"  # created, not yet answered the supervisor
    running = "running"
    backoff = "backoff"  # died young, waiting to restart
    draining = "draining"  # scaled away: handing back its lease, then stopping
    finished = "finished"  # stopped by itself (max_groups); not replaced


class PoolEventKind(StrEnum):
    started = "started"
    restarted = "restarted"
    died = "died"
    draining = "draining"
    drained = "drained"
    finished = "finished"


@dataclass(frozen=True)
class SlotState:
    """One slot of a pool as the supervisor sees it."""

    slot: int
    worker_id: str
    generation: int
    """0 for the slot's first actor, +1 per restart."""
    state: SlotStatus
    pid: int | None
    """The actor's process id, once it answered."""
    submitted: int | None
    """Groups this incarnation submitted, as it last answered."""


@dataclass(frozen=True)
class PoolEvent:
    """Something the supervisor did: started, restarted (with why), drained or finished a worker."""

    at: float
    kind: PoolEventKind
    slot: int
    worker_id: str
    detail: str = ""


@dataclass(frozen=True)
class PoolReport:
    """`pool status`: the target, each slot, and the restarts so far."""

    name: str
    target: int
    slots: tuple[SlotState, ...]
    restarts: int
    events: tuple[PoolEvent, ...]
    stopping: bool
    model: str
    exchange: str

    @property
    def running(self) -> int:
        return sum(1 for s in self.slots if s.state == SlotStatus.running)


class WorkerActor:
    """One rollout worker in a Ray worker process. `run()` blocks for the worker's life; the
    actor is threaded so that `stop()` and `progress()` answer meanwhile."""

    def __init__(self, host: HostSpec, settings: WorkerSettings):
        from .runner import AgentWorker

        self._stop = threading.Event()
        self._host = host.open()
        self._worker = AgentWorker(settings, self._host)

    def run(self) -> int:
        try:
            return self._worker.run(self._stop)
        finally:
            self._host.close()
            self._worker.events.close()

    def stop(self) -> None:
        self._stop.set()

    def progress(self) -> tuple[int, int]:
        """(process id, groups submitted)."""
        return os.getpid(), self._worker.submitted


@dataclass
class _Slot:
    slot: int
    generation: int
    worker_id: str
    actor: object | None  # None while the slot waits out a restart backoff
    done: object | None  # the ObjectRef of actor.run(): ready when the worker ends or the actor dies
    started: float  # monotonic
    state: SlotStatus = SlotStatus.starting
    pid: int | None = None
    submitted: int | None = None
    drain_deadline: float | None = None
    quick_deaths: int = 0  # deaths in a row, each within crash_window_s of its start
    restart_at: float = 0.0
    asked: object | None = None  # an unanswered actor.progress() ObjectRef


class PoolSupervisor:
    """Keeps `target` WorkerActors alive; runs as a named, detached, threaded Ray actor."""

    def __init__(self, settings: PoolSettings):
        self.ray = import_ray()
        self.settings = settings
        self.target = settings.workers
        self.slots: dict[int, _Slot] = {}
        self.restarts = 0
        self.events: deque[PoolEvent] = deque(maxlen=200)
        self.stopping = False
        self._lock = threading.Lock()
        self._actor_cls = self.ray.remote(WorkerActor).options(
            num_cpus=settings.num_cpus, max_concurrency=4, max_restarts=0)
        self._loop = threading.Thread(target=self._supervise, daemon=True, name="pool-supervisor")
        self._loop.start()

    # -- what drivers call ------------------------------------------------------------------------

    def scale(self, workers: int) -> int:
        """Set the number of workers to keep alive; returns the previous target."""
        if workers < 0:
            raise ValueError("a pool cannot have fewer than 0 workers")
        with self._lock:
            previous, self.target = self.target, workers
        return previous

    def report(self) -> PoolReport:
        with self._lock:
            slots = tuple(SlotState(s.slot, s.worker_id, s.generation, s.state, s.pid, s.submitted)
                          for s in sorted(self.slots.values(), key=lambda s: s.slot))
            return PoolReport(self.settings.name, self.target, slots, self.restarts, tuple(self.events),
                              self.stopping, self.settings.host.label, self.settings.worker.exchange)

    def shutdown(self, timeout_s: float) -> PoolReport:
        """Drain every worker (their leases go back to the exchange) and wait up to `timeout_s`."""
        with self._lock:
            self.stopping, self.target = True, 0
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if all(s.state == SlotStatus.finished for s in self.slots.values()):
                    break
            time.sleep(self.settings.check_s / 2)
        report = self.report()
        with self._lock:
            for slot in self.slots.values():  # finished ones, and any past the deadline
                if slot.actor is not None:
                    self.ray.kill(slot.actor)
        return report

    # -- the loop ---------------------------------------------------------------------------------

    def _supervise(self) -> None:
        while True:
            try:
                self._step()
            except Exception:  # the supervisor must outlive any one bad step
                log.exception("pool supervisor step failed")
            time.sleep(self.settings.check_s)

    def _step(self) -> None:
        with self._lock:
            refs = {s.done: s for s in self.slots.values() if s.done is not None and s.state != SlotStatus.finished}
        if refs:
            ready, _ = self.ray.wait(list(refs), num_returns=len(refs), timeout=0)
            for ref in ready:
                self._ended(refs[ref], ref)
        self._refresh_progress()
        now = time.monotonic()
        with self._lock:
            live = [s.slot for s in self.slots.values() if s.state not in (SlotStatus.draining, SlotStatus.finished)]
            finished = [s.slot for s in self.slots.values() if s.state == SlotStatus.finished]
            missing = self.target - len(live) - len(finished)
            if missing > 0:
                free = [i for i in range(self.target + len(self.slots)) if i not in self.slots][:missing]
                for index in free:
                    self._start(index, generation=0)
            for index in sorted(live, reverse=True)[:max(0, -missing)]:
                self._drain(self.slots[index], now)
            for slot in list(self.slots.values()):
                if slot.state == SlotStatus.backoff and now >= slot.restart_at:
                    self._start(slot.slot, slot.generation + 1, quick_deaths=slot.quick_deaths)
                elif slot.state == SlotStatus.draining and now > slot.drain_deadline:
                    self.ray.kill(slot.actor)

    def _drain(self, slot: _Slot, now: float) -> None:
        """Ask a worker to stop: it hands its lease back (retryable) and returns; killed at the deadline."""
        if slot.actor is None:  # waiting to restart: nothing runs
            del self.slots[slot.slot]
            return
        slot.state, slot.drain_deadline = SlotStatus.draining, now + self.settings.drain_s
        slot.actor.stop.remote()
        self.events.append(PoolEvent(time.time(), PoolEventKind.draining, slot.slot, slot.worker_id))

    def _ended(self, slot: _Slot, ref) -> None:
        """The slot's actor returned or died: drop it, or restart it (at once, or after a backoff
        when it keeps dying young: a bad model URL must not spin the cluster)."""
        try:
            self.ray.get(ref)
            why = None
        except Exception as exc:  # RayActorError (died), or the worker raised
            why = _death_reason(exc)
        with self._lock:
            if slot.state == SlotStatus.draining or self.stopping:
                self.ray.kill(slot.actor)
                del self.slots[slot.slot]
                self.events.append(PoolEvent(time.time(), PoolEventKind.drained, slot.slot, slot.worker_id))
            elif why is None:  # the worker chose to stop (max_groups): the slot is done
                slot.state = SlotStatus.finished
                self.events.append(PoolEvent(time.time(), PoolEventKind.finished, slot.slot, slot.worker_id))
            else:
                self.ray.kill(slot.actor)
                self.restarts += 1
                young = time.monotonic() - slot.started < self.settings.crash_window_s
                slot.quick_deaths = slot.quick_deaths + 1 if young else 0
                delay = min(self.settings.max_backoff_s, 0.5 * 2 ** (slot.quick_deaths - 1)) if young else 0.0
                slot.actor = slot.done = None
                slot.state, slot.restart_at, slot.pid = SlotStatus.backoff, time.monotonic() + delay, None
                self.events.append(PoolEvent(time.time(), PoolEventKind.died, slot.slot, slot.worker_id,
                                             why + (f" (restart in {delay:g}s)" if delay else "")))

    def _start(self, index: int, generation: int, *, quick_deaths: int = 0) -> None:
        # A fresh id per incarnation: the exchange refuses to register an id twice.
        worker_id = f"{self.settings.name}-{index}-{secrets.token_hex(3)}"
        settings = self.settings.worker.model_copy(update={"worker_id": worker_id, "pool": self.settings.name})
        actor = self._actor_cls.remote(self.settings.host, settings)
        self.slots[index] = _Slot(index, generation, worker_id, actor, actor.run.remote(), time.monotonic(),
                                  quick_deaths=quick_deaths)
        self.events.append(PoolEvent(time.time(), PoolEventKind.started if generation == 0 else PoolEventKind.restarted, index, worker_id))

    def _refresh_progress(self) -> None:
        """Collect the answers to last step's progress questions and ask again, never waiting: an
        actor still loading its model answers only once its constructor is done."""
        with self._lock:
            asked = {s.asked: s for s in self.slots.values() if s.asked is not None}
        ready, _ = self.ray.wait(list(asked), num_returns=len(asked), timeout=0) if asked else ([], [])
        with self._lock:
            for ref in ready:
                slot = asked[ref]
                slot.asked = None
                try:
                    slot.pid, slot.submitted = self.ray.get(ref)
                except Exception:  # died since: its run() says so and the next step restarts it
                    continue
                if slot.state is SlotStatus.starting:
                    slot.state = SlotStatus.running
            for slot in self.slots.values():
                if slot.actor is not None and slot.asked is None and slot.state is not SlotStatus.finished:
                    slot.asked = slot.actor.progress.remote()


def _death_reason(exc: Exception) -> str:
    """One line on why a worker actor ended in an error: its constructor's own exception when it
    could not start (Ray wraps it in a traceback), else the first line of Ray's account."""
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).splitlines() if line.strip()]
    if getattr(exc, "actor_init_failed", False) and lines:
        why = f"could not start: {lines[-1]}"
    else:
        why = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    return ("preempted: " if getattr(exc, "preempted", False) else "") + why[:300]


def _refuses(address: str) -> bool:
    """True when nothing listens at a HOST:PORT address (Ray itself would retry for minutes).
    Other forms (`auto`, `ray://...`) are left to Ray."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "/" in address:
        return False
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
    except OSError:
        return True
    return False


def connect(address: str):
    """Join the Ray cluster at `address` as a quiet driver in the pools' namespace."""
    ray = import_ray()
    if not ray.is_initialized():
        if _refuses(address):
            raise PoolError(f"no Ray cluster answers at {address}")
        try:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING,
                     configure_logging=False)
        except ConnectionError as exc:
            raise PoolError(f"no Ray cluster answers at {address}: {exc}") from None
    return ray


def start_pool(address: str, settings: PoolSettings):
    """Create the detached supervisor of a new pool; PoolExists when the name is taken."""
    ray = connect(address)
    taken = PoolExists(f"a pool named {settings.name!r} already runs on {address}")
    try:
        ray.get_actor(settings.name, namespace=NAMESPACE)
    except ValueError:
        pass
    else:
        raise taken
    supervisor = ray.remote(PoolSupervisor).options(
        name=settings.name, namespace=NAMESPACE, lifetime="detached", num_cpus=0, max_concurrency=8,
        max_restarts=-1)
    try:
        return supervisor.remote(settings)
    except ValueError:  # another driver took the name since we looked
        raise taken from None


def find_pool(address: str, name: str):
    """The supervisor of pool `name`; PoolNotFound when none runs."""
    ray = connect(address)
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        raise PoolNotFound(f"no pool named {name!r} runs on {address}") from None


def _answer(ray, ref, name: str, timeout_s: float):
    """The supervisor's answer, or a PoolError saying why there is none."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise PoolError(f"pool {name!r} did not answer in {timeout_s:g}s") from None
    except ray.exceptions.RayActorError as exc:
        raise PoolNotFound(f"pool {name!r} has ended: {str(exc).splitlines()[0]}") from None


def pool_report(address: str, name: str, timeout_s: float = 30.0) -> PoolReport:
    """What pool `name` runs now."""
    ray = connect(address)
    return _answer(ray, find_pool(address, name).report.remote(), name, timeout_s)


def scale_pool(address: str, name: str, workers: int, timeout_s: float = 30.0) -> int:
    """Set pool `name` to `workers` workers; returns the previous target."""
    ray = connect(address)
    return _answer(ray, find_pool(address, name).scale.remote(workers), name, timeout_s)


def stop_pool(address: str, name: str, drain_s: float = 30.0) -> PoolReport:
    """Drain pool `name`'s workers (up to `drain_s`), then end its supervisor."""
    ray = connect(address)
    supervisor = find_pool(address, name)
    report = _answer(ray, supervisor.shutdown.remote(drain_s), name, drain_s + 60)
    ray.kill(supervisor)
    return report
