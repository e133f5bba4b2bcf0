"""Clients retry with backoff (tenacity), only what is safe to repeat; processes wait for an
exchange that is not up yet, saying so in one line, and give up with a one-line typed error.

The servers here are real sockets on loopback: a tiny HTTP server that answers 503 a set number
of times, a listener that accepts and hangs up, a port nobody listens on, and for the end to end
cases a real `rollmarket worker` started before its exchange and `rollmarket train` pointed at a
closed port.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from helpers import TRAINER_TOKEN, ExchangeProcess, job, manifest, policy

from rollmarket import TrainerClient, WorkerClient
from rollmarket.client import ExchangeUnavailable, ExchangeUnreachable, ServerError
from rollmarket.contracts import RolloutJob, SamplingConfig
from rollmarket.localhost import free_port

REPO = Path(__file__).resolve().parents[1]
MOE = REPO / "models" / "tiny-moe"


class FlakyServer:
    """A real HTTP server on loopback that answers 503 to the first `failures` requests of each
    path and then 200 `[]`; it records when each request arrived."""

    def __init__(self, failures: int, port: int | None = None):
        self.arrivals: dict[str, list[float]] = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                path = self.path.split("?")[0]
                seen = outer.arrivals.setdefault(f"{self.command} {path}", [])
                seen.append(time.monotonic())
                status, body = (503, b'{"error": {"code": "internal", "message": "busy"}}') \
                    if len(seen) <= failures else (200, b"[]")
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port or 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FlakyServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


class HangUp:
    """A listener that accepts each connection and closes it at once: the request may have
    arrived, and no answer comes. Counts connections."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.recv(65536)
            self.accepted += 1
            conn.close()

    def close(self):
        self.sock.close()


def test_idempotent_calls_retry_5xx_with_growing_waits():
    with FlakyServer(failures=3) as server, TrainerClient(server.url, "t", retries=5, wire="json") as trainer:
        assert trainer.policies() == []
    arrivals = server.arrivals["GET /v1/policies"]
    assert len(arrivals) == 4
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    # Waits are 0.1 * 2**n plus up to 0.1 of jitter: at least 0.1, 0.2, 0.4 s.
    assert all(gap >= 0.1 * 2**n for n, gap in enumerate(gaps)), gaps


def test_non_idempotent_calls_are_not_repeated_once_they_may_have_arrived():
    """A 503 to a lease request, or a connection dropped after the request went out: one attempt
    (a lease or a decision must not happen twice); an idempotent read tries again."""
    with FlakyServer(failures=10) as server, WorkerClient(server.url, "tok", retries=5, wire="json") as worker:
        with pytest.raises(ServerError):
            worker.lease()
    assert len(server.arrivals["POST /v1/leases"]) == 1
    hangup = HangUp()
    try:
        with TrainerClient(hangup.url, "t", retries=3, wire="json") as trainer:
            with pytest.raises(ExchangeUnavailable):
                trainer.report("grp_1", feedback=False)
            assert hangup.accepted == 1
            with pytest.raises(ExchangeUnavailable):
                trainer.pool()
            assert hangup.accepted == 1 + 4
    finally:
        hangup.close()


def test_a_refused_connection_is_retried_for_every_call(caplog):
    """Connection refused means nothing was sent, so even a lease request is tried again: it gets
    through once the server is up."""
    port = free_port()
    box: dict = {}

    def ask():
        with WorkerClient(f"http://127.0.0.1:{port}", "tok", retries=10, wire="json") as worker:
            try:
                box["answer"] = worker.http.call("POST", "/v1/leases")
            except Exception as exc:  # what the assertion below reports
                box["error"] = exc

    def refused_once() -> bool:
        return any("retrying POST /v1/leases" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.DEBUG, logger="rollmarket.client.http"):
        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        deadline = time.monotonic() + 60
        while not refused_once() and asker.is_alive():  # the first attempt met the closed port
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with FlakyServer(failures=0, port=port):
            asker.join(60)
    assert box.get("answer") == [], box
    assert refused_once()


def test_retries_stop_after_the_attempts_or_the_total_time():
    closed = f"http://127.0.0.1:{free_port()}"
    with TrainerClient(closed, "t", retries=3) as trainer:
        started = time.monotonic()
        with pytest.raises(ExchangeUnavailable) as caught:
            trainer.pool()
        elapsed = time.monotonic() - started
    assert "connection refused" in str(caught.value)
    assert 0.1 + 0.2 + 0.4 <= elapsed < 30
    trainer = TrainerClient(closed, "t", retries=1000)
    trainer.http.retry_total_s = 1.5
    started = time.monotonic()
    with pytest.raises(ExchangeUnavailable):
        trainer.pool()
    assert time.monotonic() - started < 1.5 + 2.2 + 5  # the last wait may still run; then it stops


def test_waiting_for_the_exchange_says_so_and_gives_up_typed(caplog):
    url = f"http://127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING, logger="rollmarket.client.http"), WorkerClient(url) as worker:
        started = time.monotonic()
        with pytest.raises(ExchangeUnreachable) as caught:
            worker.http.wait_for_exchange(3.0, say_every_s=1.0)
        elapsed = time.monotonic() - started
    message = str(caught.value)
    assert "\n" not in message and url in message and "connection refused" in message
    lines = [r for r in caplog.records if r.name == "rollmarket.client.http"]
    assert 1 <= len(lines) <= 5, [r.getMessage() for r in lines]
    for record in lines:
        assert record.levelno == logging.WARNING and record.exc_info is None
        assert record.getMessage().startswith(f"waiting for the exchange at {url} (connection refused); retrying in ")
    assert 3.0 <= elapsed < 3.0 + 5.5 + 5


def test_waiting_returns_as_soon_as_the_exchange_answers(tmp_path):
    port = free_port()
    server = ExchangeProcess(tmp_path / "ex.db", tmp_path / "ex.log", port=port)
    starter = threading.Timer(0.5, server.start)
    starter.start()
    try:
        with WorkerClient(f"http://127.0.0.1:{port}") as worker:
            worker.http.wait_for_exchange(180)
            assert worker.http.call("GET", "/healthz")["status"] == "ok"
    finally:
        starter.join()
        server.stop()


# -- real processes ------------------------------------------------------------------------------

def test_a_worker_started_before_its_exchange_waits_then_works(tmp_path):
    """`rollmarket worker` given two URLs (replicas) where nothing listens: it prints the waiting
    line naming both (no traceback), and once an exchange starts on the second it fails over to it,
    registers, loads the policy and delivers a group."""
    from rollmarket.engines.provenance import checkpoint_digest, model_config, model_config_hash, tokenizer_hash
    from rollmarket.contracts import PolicyManifest
    from rollmarket.tasks.suites import load_suite

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    closed = f"http://127.0.0.1:{free_port()}"  # a replica that never comes up
    log_path = tmp_path / "worker.log"
    events = tmp_path / "events.jsonl"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollmarket", "worker", "--model", str(MOE), "--threads", "1",
             "--exchange", f"{closed},{url}", "--worker-id", "early", "--heartbeat-s", "0.5", "--lease-wait-s", "1",
             "--max-groups", "1", "--events", str(events)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    server = ExchangeProcess(tmp_path / "ex.db", tmp_path / "ex.log", port=port)
    try:
        deadline = time.monotonic() + 300
        while f"waiting for the exchange at {closed}, {url} (connection refused)" not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        server.start()
        trainer = server.trainer()
        trainer.publish_policy(PolicyManifest(
            policy_version=0, checkpoint_digest=checkpoint_digest(MOE), checkpoint_uri=str(MOE),
            tokenizer_hash=tokenizer_hash(MOE), model_config_hash=model_config_hash(MOE),
            vocab_size=int(model_config(MOE)["vocab_size"]), precision_class="bf16"))
        task = load_suite("arithmetic", "heldout")[0]
        trainer.enqueue(RolloutJob(task=task, policy_version=0, group_size=1, max_context_tokens=2048,
                                   sampling_config=SamplingConfig(max_tokens=16, seed=0)))
        assert proc.wait(300) == 0, log_path.read_text()
        submitted = [e for e in map(json.loads, events.read_text().splitlines()) if e["event"] == "submitted"]
        assert len(submitted) == 1 and submitted[0]["task_id"] == task.task_id
        assert [j.state for j in trainer.jobs()] == ["done"]
        text = log_path.read_text()
        assert "Traceback" not in text
        waiting = [line for line in text.splitlines() if "waiting for the exchange" in line]
        assert waiting and all(line.startswith("waiting for the exchange at") for line in waiting), waiting
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        server.stop()


@pytest.mark.timeout(660)  # its own waits outlast the suite's 300 s on a loaded box
def test_the_trainer_against_a_closed_port_waits_then_fails_in_one_line(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    result = subprocess.run(
        [sys.executable, "-m", "rollmarket", "train", str(REPO / "configs" / "train-lookup.toml"),
         f"exchange.url={url}", "exchange.wait_s=4", f"runs_root={tmp_path / 'runs'}"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "ROLLMARKET_TRAINER_TOKEN": TRAINER_TOKEN})
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "Traceback" not in output
    assert f"waiting for the exchange at {url} (connection refused); retrying in" in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the exchange at " + url + " did not answer for"), last
    assert last.count(" — ") == 1 and "rollmarket exchange serve" in last  # what, then one way to fix it


# -- several exchange URLs (replicas): failover ------------------------------------------------

def test_failover_moves_past_a_dead_and_a_503_replica_and_sticks(exchange):
    """URLs: a closed port, a replica answering 503, then a real exchange. Registration (never
    sent to the closed port; idempotent-safe past the 503) lands on the real exchange at once,
    and later calls stay there: the 503 server sees one request in all."""
    closed = f"http://127.0.0.1:{free_port()}"
    with FlakyServer(failures=10_000) as busy:
        with exchange.trainer() as trainer:
            trainer.publish_policy(policy(0))
        worker = WorkerClient(f"{closed}, {busy.url},{exchange.url}/", retries=0, wire="json")
        assert worker.http.urls == (closed, busy.url, exchange.url)
        with pytest.raises(ServerError):  # connection refused → next URL; its 503 ends a non-idempotent call
            worker.register(manifest("w-fo"))
        assert worker.http.url == exchange.url
        worker.register(manifest("w-fo"))
        for _ in range(3):
            worker.heartbeat()
        assert sum(len(v) for v in busy.arrivals.values()) == 1
        with exchange.trainer() as trainer:
            events = trainer.audit(kind="worker.*", subject="w-fo").events
        assert [e.kind for e in events].count("worker.registered") == 1
        worker.close()


def test_failover_retries_an_idempotent_call_on_the_next_url_at_once(exchange):
    """A 503 from the first URL: an idempotent read goes to the next URL with no backoff."""
    with FlakyServer(failures=10_000) as busy:
        with TrainerClient([busy.url, exchange.url], TRAINER_TOKEN, retries=0, wire="json") as trainer:
            started = time.monotonic()
            assert trainer.policies() == []
            assert time.monotonic() - started < 5
            assert trainer.http.url == exchange.url
        assert len(busy.arrivals["GET /v1/policies"]) == 1


def test_non_idempotent_call_that_may_have_arrived_is_not_repeated_elsewhere(exchange):
    """A lease request whose connection drops after it went out is not sent to the next replica
    (it may have been granted); the next call goes there."""
    hangup = HangUp()
    try:
        with exchange.trainer() as trainer:
            trainer.publish_policy(policy(0))
            trainer.enqueue([job(0)])
        worker = WorkerClient(exchange.url, wire="json")
        worker.register(manifest("w-hang"))
        worker.ack_reload(0, policy(0).checkpoint_digest)
        both = WorkerClient([hangup.url, exchange.url], worker.http.token, manifest=worker.manifest,
                            retries=3, wire="json")
        with pytest.raises(ExchangeUnavailable):
            both.lease()
        assert hangup.accepted == 1
        with exchange.trainer() as trainer:
            assert trainer.audit(kind="lease.*").events == []
        grant = both.lease(wait_s=5)
        assert grant.lease is not None and both.http.url == exchange.url
        assert hangup.accepted == 1
        both.close()
        worker.close()
    finally:
        hangup.close()


def test_wait_for_exchange_finds_the_replica_that_answers(exchange):
    closed = f"http://127.0.0.1:{free_port()}"
    with WorkerClient([closed, exchange.url]) as worker:
        worker.http.wait_for_exchange(30)
        assert worker.http.url == exchange.url
    with WorkerClient([closed, f"http://127.0.0.1:{free_port()}"]) as worker:
        with pytest.raises(ExchangeUnreachable, match=closed):
            worker.http.wait_for_exchange(1.0)


def test_a_worker_client_that_never_registered_says_so():
    """Building a group, acking a reload or naming the worker before `register` (or `manifest=`) is one
    clear ExchangeError, not an AttributeError from deep inside the client."""
    from rollmarket.client import ExchangeError

    client = WorkerClient(f"http://127.0.0.1:{free_port()}", "token")
    for attempt in (lambda: client.worker_id, lambda: client.ack_reload(0, "0" * 64)):
        with pytest.raises(ExchangeError, match="register first"):
            attempt()
    client.close()
