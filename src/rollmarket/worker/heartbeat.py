"""Staying alive on an exchange: a heartbeat thread, and slow work that keeps its lease renewed."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from ..client import ExchangeError, WorkerClient

T = TypeVar("T")


class Heartbeater(threading.Thread):
    """Beats every `interval` seconds on its own connection until stopped (or the process dies).

    `reload_required` is set when the exchange says a newer policy is published;
    `cancelled` collects the lease ids the exchange no longer honours.
    """

    def __init__(self, client: WorkerClient, interval: float):
        super().__init__(daemon=True, name="heartbeat")
        self.client = client
        self.interval = interval
        self.stopped = threading.Event()
        self.reload_required = threading.Event()
        self.active_leases: set[str] = set()
        self.cancelled: set[str] = set()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                reply = self.client.heartbeat(active_lease_ids=sorted(self.active_leases))
            except ExchangeError:
                continue
            if reply.reload_required:
                self.reload_required.set()
            self.cancelled.update(reply.cancelled_lease_ids)


def run_renewing(client: WorkerClient, lease_id: str, lease_ttl_s: float, work: Callable[[], T]) -> T:
    """Run slow work (real sampling) in a thread and renew the lease every third of its TTL."""
    result: dict = {}

    def target() -> None:
        try:
            result["value"] = work()
        except BaseException as exc:  # re-raised in the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True, name="lease-work")
    thread.start()
    while thread.is_alive():
        thread.join(lease_ttl_s / 3)
        if thread.is_alive():
            try:
                client.renew(lease_id)
            except ExchangeError:
                pass
    if "error" in result:
        raise result["error"]
    return result["value"]
