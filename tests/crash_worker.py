"""A rollout worker process for tests/test_crash.py.

    python tests/crash_worker.py URL WORKER_ID OUT_DIR TOKENS

It registers, acks policy version 0, touches OUT_DIR/WORKER_ID.ready, then loops until
OUT_DIR/stop exists: lease -> build a group (TOKENS response tokens per trajectory) -> submit.
The exchange may be SIGKILLed and restarted at any moment, so:

* a lease call that fails to reach the exchange is simply tried again later (it is not idempotent;
  a lease granted whose answer was lost expires on the exchange's side);
* a submit is re-sent, the very same sealed group, until the exchange answers: a receipt (possibly
  ``duplicate=True`` when the first copy was committed but its answer was lost), or a refusal.
  The client's own retries do most of this; the transport errors they hide are counted and
  recorded with the outcome (``interrupted``);
* only after a 200 receipt arrives is one line appended to OUT_DIR/WORKER_ID.acked.jsonl, and the
  line is flushed and fsynced before the next lease. A refusal (for a lease that expired while the
  exchange was down) is written to OUT_DIR/WORKER_ID.refused.jsonl and the worker moves on.

Any other exception ends the process with a traceback and a non-zero exit status.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import httpx  # noqa: E402
from helpers import manifest, sha, trajectories  # noqa: E402

from rollmarket import WorkerClient  # noqa: E402
from rollmarket.client import Conflict, ExchangeUnavailable, Rejected, ServerError  # noqa: E402

SUBMIT_PATIENCE_S = 60.0  # longest one submission is retried while the exchange is down


def _append(path: Path, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(record, sort_keys=True) + "\n")
        out.flush()
        os.fsync(out.fileno())


class WatchingTransport(httpx.HTTPTransport):
    """The client's ordinary transport, counting the transport errors its retries hide.

    A connect error means the exchange was down when a request was sent; any other transport
    error (connection reset, closed mid-response) means the request was in flight when it died.
    """

    def __init__(self) -> None:
        super().__init__()
        self.errors: Counter[str] = Counter()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return super().handle_request(request)
        except httpx.TransportError as exc:
            self.errors["connect" if isinstance(exc, httpx.ConnectError) else "in_flight"] += 1
            raise

    def since(self, seen: dict[str, int]) -> dict[str, int]:
        """Errors counted since the snapshot `seen` (a dict(self.errors))."""
        return {k: v - seen.get(k, 0) for k, v in self.errors.items() if v > seen.get(k, 0)}


def _until(deadline: float, what: str, fn):
    """Call `fn` until it stops raising ExchangeUnavailable/ServerError, up to `deadline`."""
    while True:
        try:
            return fn()
        except (ExchangeUnavailable, ServerError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: the exchange stayed unreachable") from None
            time.sleep(0.1)


def main(url: str, worker_id: str, out_dir: Path, tokens: int) -> int:
    acked, refused = out_dir / f"{worker_id}.acked.jsonl", out_dir / f"{worker_id}.refused.jsonl"
    stop = out_dir / "stop"
    watch = WatchingTransport()
    client = WorkerClient(url, retries=8, timeout=30.0, transport=watch)
    deadline = time.monotonic() + 60
    # max_concurrent_groups > 1: a lease granted just before a kill, whose answer never arrived,
    # must not block this worker until it expires.
    _until(deadline, "register", lambda: client.register(manifest(worker_id, max_concurrent_groups=8)))
    _until(deadline, "ack", lambda: client.ack_reload(0, sha("ckpt-0")))
    (out_dir / f"{worker_id}.ready").touch()

    seed = int(sha(worker_id)[:6], 16) * 1000
    while not stop.exists():
        try:
            grant = client.lease(wait_s=0.5)
        except (ExchangeUnavailable, ServerError):
            time.sleep(0.1)  # down or restarting
            continue
        if grant.lease is None:
            continue
        seed += 1
        group = client.seal(client.group_for(
            grant, trajectories(grant.job.group_size, tokens=tokens, seed=seed)))
        seen = dict(watch.errors)
        give_up = time.monotonic() + SUBMIT_PATIENCE_S
        while True:
            try:
                receipt = client.submit(group)
            except (ExchangeUnavailable, ServerError) as exc:
                # The exchange died with the request in flight, or before it was sent. Re-send the
                # same group: if its first copy was committed, the answer is that copy's receipt.
                if time.monotonic() > give_up:
                    raise RuntimeError(f"submit of {group.group_id} never answered: {exc}") from exc
                time.sleep(0.1)
                continue
            except (Rejected, Conflict) as exc:
                _append(refused, {"group_id": group.group_id, "lease_id": group.lease_id,
                                  "code": exc.code, "reasons": exc.reasons, "message": exc.message,
                                  "interrupted": watch.since(seen)})
                break
            _append(acked, {"group_id": receipt.group_id, "lease_id": receipt.lease_id,
                            "content_hash": receipt.content_hash, "sent_hash": group.content_hash,
                            "sent_group_id": group.group_id, "duplicate": receipt.duplicate,
                            "interrupted": watch.since(seen)})
            break
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])))
