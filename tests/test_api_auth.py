"""Who may call what: the exchange's bearer tokens (exchange/auth.py), end to end.

Workers get a token at registration (`rmw.<worker_id>.<secret>`, stored only as a sha256 of the
secret); trainers share one token given at start. Every worker and trainer route refuses a call
without the right token with 401 `unauthorized`; a valid token of the wrong kind gets 403
`forbidden`; a worker acting for another worker gets 403. The route list comes from the running
server's OpenAPI document, so a route added later is covered (or this file fails) without edits.

Raw requests use httpx so that headers can be malformed on purpose; the clients are used where
the typed errors of `rollmarket.client.errors` are the point.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import sqlite3
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from helpers import (
    TRAINER_TOKEN,
    ExchangeProcess,
    job,
    lease_one,
    manifest,
    policy,
    ready_worker,
    sha,
    trajectories,
)

from rollmarket import TrainerClient, WorkerClient
from rollmarket.client.errors import Forbidden, NotFound, Rejected, Unauthorized
from rollmarket.contracts import ErrorBody, RejectionReason
from rollmarket.exchange import auth

CALM = ("--heartbeat-ttl-s", "3600", "--lease-ttl-s", "3600", "--reaper-interval-s", "0.1")
"""Settings under which the reaper never changes anything while a test runs."""

REGISTER = ("POST", "/v1/workers/register")
KNOWN_WORKER_ROUTES = {
    ("POST", "/v1/workers/heartbeat"), ("POST", "/v1/leases"), ("POST", "/v1/leases/{lease_id}/fail"),
    ("POST", "/v1/groups"), ("POST", "/v1/reload-acks"),
}
KNOWN_TRAINER_ROUTES = {
    ("POST", "/v1/policies"), ("GET", "/v1/policies"), ("POST", "/v1/jobs"), ("GET", "/v1/jobs"),
    ("GET", "/v1/groups"), ("GET", "/v1/groups/{group_id}"), ("POST", "/v1/groups/{group_id}/report"),
    ("POST", "/v1/groups/reports"),
    ("GET", "/v1/pool"), ("GET", "/v1/workers"), ("GET", "/v1/audit"),
}


# -- helpers ------------------------------------------------------------------------------

def routes(url: str) -> dict[str, set[tuple[str, str]]]:
    """(method, path template) of every route, by OpenAPI tag ('workers', 'trainer', 'ops')."""
    spec = httpx.get(url + "/openapi.json", timeout=30).json()
    found: dict[str, set[tuple[str, str]]] = {}
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            for tag in operation.get("tags") or ["untagged"]:
                found.setdefault(tag, set()).add((method.upper(), path))
    return found


def call(url: str, method: str, path: str, authorization: str | None, body: bytes = b"") -> httpx.Response:
    """One raw request; path parameters become ids that exist nowhere."""
    headers = {"content-type": "application/json"}
    if authorization is not None:
        headers["authorization"] = authorization
    concrete = re.sub(r"\{[^}]+\}", "id_unknown", path)
    return httpx.request(method, url + concrete, content=body if method == "POST" else None,
                         headers=headers, timeout=30)


def assert_refused(response: httpx.Response, status: int, code: str, where: str) -> None:
    assert response.status_code == status, f"{where}: {response.status_code} {response.text}"
    detail = ErrorBody.model_validate(response.json()).error
    assert detail.code.value == code, f"{where}: {detail}"
    if status == 401:
        assert response.headers.get("www-authenticate") == "Bearer", where


def secret_of(token: str) -> str:
    return token.rsplit(".", 1)[1]


def worker_row(db: Path, worker_id: str) -> dict:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        row = conn.execute("SELECT * FROM workers WHERE worker_id=?", (worker_id,)).fetchone()
        return dict(row) if row is not None else {}
    finally:
        conn.close()


def table(db: Path, name: str) -> list[tuple]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return [tuple(r) for r in conn.execute(f"SELECT * FROM {name} ORDER BY rowid")]
    finally:
        conn.close()


# -- one exchange with two ready workers, shared by the tests that change nothing ------------

@dataclass
class Pool:
    server: ExchangeProcess
    trainer: TrainerClient
    w1: WorkerClient
    w2: WorkerClient

    def lease_for_w1(self, index: int):
        queued = job(index)
        self.trainer.enqueue(queued)
        grant = lease_one(self.w1)
        assert grant.job.job_id == queued.job_id
        return grant


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> Iterator[Pool]:
    root = tmp_path_factory.mktemp("auth")
    server = ExchangeProcess(db=root / "exchange.db", log=root / "exchange.log", args=list(CALM)).start()
    trainer = server.trainer()
    trainer.publish_policy(policy(0))
    w1 = ready_worker(server.url, "w1", max_concurrent_groups=64)
    w2 = ready_worker(server.url, "w2", max_concurrent_groups=64)
    try:
        yield Pool(server, trainer, w1, w2)
    finally:
        for client in (w1, w2, trainer):
            client.close()
        server.stop()


def test_every_route_is_classified(pool: Pool):
    """The OpenAPI tags split routes into worker, trainer and ops routes, and name at least the
    routes this file knows; registration and /healthz, /metrics are the only open ones."""
    found = routes(pool.server.url)
    assert set(found) == {"workers", "trainer", "ops"}, found.keys()
    assert found["workers"] - {REGISTER} >= KNOWN_WORKER_ROUTES
    assert REGISTER in found["workers"]
    assert found["trainer"] >= KNOWN_TRAINER_ROUTES
    assert found["ops"] == {("GET", "/healthz"), ("GET", "/metrics")}


@pytest.mark.parametrize("authorization", [None, "", "Bearer"], ids=["no-header", "empty", "scheme-only"])
def test_calls_without_credentials_get_401(pool: Pool, authorization: str | None):
    """Every worker and trainer route: 401 `unauthorized` with a Bearer challenge."""
    found = routes(pool.server.url)
    guarded = sorted((found["workers"] - {REGISTER}) | found["trainer"])
    for method, path in guarded:
        response = call(pool.server.url, method, path, authorization)
        assert_refused(response, 401, "unauthorized", f"{method} {path}")


def test_right_tokens_pass_every_route(pool: Pool):
    """The control for the refusals: with its own kind of token every route gets past auth
    (a 2xx, or a 4xx about the empty body or unknown id, never 401/403)."""
    found = routes(pool.server.url)
    for kind, token in (("workers", pool.w1.http.token), ("trainer", TRAINER_TOKEN)):
        for method, path in sorted(found[kind] - {REGISTER}):
            response = call(pool.server.url, method, path, f"Bearer {token}")
            assert response.status_code not in (401, 403), f"{method} {path}: {response.text}"


@pytest.mark.parametrize("token", ["wrong", TRAINER_TOKEN + "x", TRAINER_TOKEN[:-1], TRAINER_TOKEN.upper(),
                                   f"{TRAINER_TOKEN} {TRAINER_TOKEN}", "rmw.trainer." + TRAINER_TOKEN],
                         ids=["wrong", "suffix", "prefix", "upper-case", "doubled", "worker-shaped"])
def test_wrong_trainer_token_gets_401(pool: Pool, token: str):
    """Near misses of the trainer token are refused on every trainer route."""
    for method, path in sorted(routes(pool.server.url)["trainer"]):
        response = call(pool.server.url, method, path, f"Bearer {token}")
        assert_refused(response, 401, "unauthorized", f"{method} {path}")
    with TrainerClient(pool.server.url, token, retries=0) as trainer, pytest.raises(Unauthorized) as caught:
        trainer.pool()
    assert (caught.value.status, caught.value.code) == (401, "unauthorized")


def test_worker_token_on_trainer_routes_is_forbidden(pool: Pool):
    """A valid worker token is not a trainer token: 403 `forbidden` on every trainer route, and
    a publish or enqueue with a perfectly valid body stores nothing."""
    token = pool.w1.http.token
    for method, path in sorted(routes(pool.server.url)["trainer"]):
        response = call(pool.server.url, method, path, f"Bearer {token}")
        assert_refused(response, 403, "forbidden", f"{method} {path}")
    before = (pool.trainer.policies(), pool.trainer.jobs())
    with TrainerClient(pool.server.url, token, retries=0) as impostor:
        with pytest.raises(Forbidden):
            impostor.publish_policy(policy(5, parent_version=0))
        with pytest.raises(Forbidden):
            impostor.enqueue(job(500))
        with pytest.raises(Forbidden):
            impostor.audit()
    assert (pool.trainer.policies(), pool.trainer.jobs()) == before


def test_unauthenticated_writes_store_nothing(pool: Pool):
    """Valid bodies without a token: 401 before the body is even read; nothing is stored."""
    before = (pool.trainer.policies(), pool.trainer.jobs())
    response = call(pool.server.url, "POST", "/v1/policies", None,
                    policy(6, parent_version=0).model_dump_json().encode())
    assert_refused(response, 401, "unauthorized", "publish")
    response = call(pool.server.url, "POST", "/v1/jobs", None,
                    json.dumps({"jobs": [job(600).model_dump(mode="json")]}).encode())
    assert_refused(response, 401, "unauthorized", "enqueue")
    assert (pool.trainer.policies(), pool.trainer.jobs()) == before


def test_trainer_token_on_worker_routes_gets_401(pool: Pool):
    """The trainer token names no worker, so worker routes do not know who is calling."""
    for method, path in sorted(routes(pool.server.url)["workers"] - {REGISTER}):
        response = call(pool.server.url, method, path, f"Bearer {TRAINER_TOKEN}")
        assert_refused(response, 401, "unauthorized", f"{method} {path}")


def _forged(pool: Pool) -> dict[str, str]:
    """Authorization headers that must not authenticate as w1."""
    token = pool.w1.http.token
    secret, other = secret_of(token), secret_of(pool.w2.http.token)
    stored_hash = worker_row(pool.server.db, "w1")["token_hash"]
    return {
        "random-secret": f"Bearer rmw.w1.{secrets.token_urlsafe(32)}",
        "w2-secret-under-w1-id": f"Bearer rmw.w1.{other}",
        "w1-secret-under-w2-id": f"Bearer rmw.w2.{secret}",
        "w1-secret-under-unregistered-id": f"Bearer rmw.w3.{secret}",
        "stored-hash-as-secret": f"Bearer rmw.w1.{stored_hash}",
        "truncated-secret": f"Bearer {token[:-1]}",
        "extended-secret": f"Bearer {token}A",
        "empty-secret": "Bearer rmw.w1.",
        "no-secret": "Bearer rmw.w1",
        "prefix-only": "Bearer rmw.",
        "empty-worker-id": f"Bearer rmw..{secret}",
        "no-prefix": f"Bearer w1.{secret}",
        "upper-case-prefix": f"Bearer RMW.w1.{secret}",
        "secret-alone": f"Bearer {secret}",
        "token-twice": f"Bearer {token} {token}",
        "bearer-missing": token,
        "basic-scheme": f"Basic {token}",
        "token-scheme": f"Token {token}",
        "scheme-with-colon": f"Bearer: {token}",
        "no-space": f"Bearer{token}",
    }


def test_forged_worker_tokens_get_401(pool: Pool):
    """Right worker id with the wrong secret, malformed tokens, a missing "Bearer": all 401, on a
    heartbeat whose body is otherwise fine; w1's liveness record does not move."""
    body = json.dumps({"worker_id": "w1"}).encode()
    seen = worker_row(pool.server.db, "w1")["last_heartbeat_at"]
    for name, authorization in _forged(pool).items():
        for path in ("/v1/workers/heartbeat", "/v1/leases"):
            response = call(pool.server.url, "POST", path, authorization, body)
            assert_refused(response, 401, "unauthorized", f"{name} on {path}")
    assert worker_row(pool.server.db, "w1")["last_heartbeat_at"] == seen
    forged = f"rmw.w1.{secrets.token_urlsafe(32)}"
    with WorkerClient(pool.server.url, forged, manifest=manifest("w1"), retries=0) as impostor:
        with pytest.raises(Unauthorized) as caught:
            impostor.heartbeat()
    assert (caught.value.status, caught.value.code) == (401, "unauthorized")


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_real_worker_token_authenticates(pool: Pool, scheme: str):
    """The control for the forgeries: the real token works, whatever the scheme's case."""
    response = call(pool.server.url, "POST", "/v1/workers/heartbeat", f"{scheme} {pool.w1.http.token}",
                    json.dumps({"worker_id": "w1"}).encode())
    assert response.status_code == 200, response.text
    assert response.json()["worker_id"] == "w1"


# -- one worker acting for another ----------------------------------------------------------

def test_worker_cannot_heartbeat_as_another(pool: Pool):
    """w2's token with w1's name in the heartbeat: 403, and w1's record is untouched."""
    before = worker_row(pool.server.db, "w1")
    with WorkerClient(pool.server.url, pool.w2.http.token, manifest=manifest("w1"), retries=0) as w2_as_w1:
        with pytest.raises(Forbidden) as caught:
            w2_as_w1.heartbeat()
    assert (caught.value.status, caught.value.code) == (403, "forbidden")
    assert worker_row(pool.server.db, "w1") == before


def test_worker_cannot_ack_a_reload_as_another(pool: Pool):
    """w2's token on an ack naming w1: 403; no ack row and no worker row changes."""
    acks, workers = table(pool.server.db, "reload_acks"), table(pool.server.db, "workers")
    with WorkerClient(pool.server.url, pool.w2.http.token, manifest=manifest("w1"), retries=0) as w2_as_w1:
        with pytest.raises(Forbidden):
            w2_as_w1.ack_reload(0, sha("ckpt-0"), engine_fingerprint=sha("forged numerics"))
    assert table(pool.server.db, "reload_acks") == acks
    assert table(pool.server.db, "workers") == workers


def test_worker_cannot_submit_to_or_fail_another_workers_lease(pool: Pool):
    """w1 holds a lease. w2 cannot deliver for it, neither naming w1 (403: the group is not w2's
    to send) nor naming itself (the lease is answered as unknown), and cannot give it back (404,
    as for a lease never issued); the lease survives all of that and w1 then delivers under it."""
    grant = pool.lease_for_w1(1)
    as_w1 = pool.w1.seal(pool.w1.group_for(grant, trajectories(2)))
    as_w2 = as_w1.model_copy(update={"worker_id": "w2", "content_hash": None}).sealed()
    leases, groups = table(pool.server.db, "leases"), table(pool.server.db, "groups")
    with pytest.raises(Forbidden) as caught:
        pool.w2.submit(as_w1)
    assert (caught.value.status, caught.value.code) == (403, "forbidden")
    with pytest.raises(Rejected) as rejected:
        pool.w2.submit(as_w2)
    assert rejected.value.rejection_reasons == [RejectionReason.unknown_lease]
    with pytest.raises(NotFound):
        pool.w2.fail(grant.lease.lease_id, "engine_error", "not mine", retryable=False)
    assert table(pool.server.db, "leases") == leases
    assert table(pool.server.db, "groups") == groups
    receipt = pool.w1.submit(as_w1)
    assert receipt.lease_id == grant.lease.lease_id and not receipt.duplicate


def test_worker_can_fail_its_own_lease(pool: Pool):
    """The control for the 403 above: the holder may give its lease back."""
    grant = pool.lease_for_w1(2)
    assert pool.w1.fail(grant.lease.lease_id, "engine_error", "oom", retryable=False) == "failed"


# -- registration ---------------------------------------------------------------------------

def test_registration_token_is_required_when_set(start_exchange):
    """With --registration-token, registering needs exactly that token as a Bearer token;
    refused registrations leave no worker behind."""
    server = start_exchange("--registration-token", "let-me-in", *CALM)
    refused = {
        "none": None, "wrong": "Bearer let-me-out", "trainer-token": f"Bearer {TRAINER_TOKEN}",
        "bearer-missing": "let-me-in", "prefix": "Bearer let-me", "basic": "Basic let-me-in",
    }
    body = manifest("w-new").model_dump_json().encode()
    for name, authorization in refused.items():
        response = call(server.url, "POST", "/v1/workers/register", authorization, body)
        assert_refused(response, 401, "unauthorized", name)
    with WorkerClient(server.url, retries=0) as client, pytest.raises(Unauthorized):
        client.register(manifest("w-new"), registration_token="let-me-out")
    assert table(server.db, "workers") == []

    with WorkerClient(server.url, retries=0) as client:
        registration = client.register(manifest("w-new"), registration_token="let-me-in")
        assert registration.worker_id == "w-new"
        # The worker token it got back, not the registration token, is what works from now on.
        assert client.heartbeat().worker_id == "w-new"
    response = call(server.url, "POST", "/v1/workers/heartbeat", "Bearer let-me-in",
                    json.dumps({"worker_id": "w-new"}).encode())
    assert_refused(response, 401, "unauthorized", "registration token as worker token")
    assert [row[0] for row in table(server.db, "workers")] == ["w-new"]


def test_worker_token_is_stored_only_hashed(start_exchange):
    """The token is nowhere in the workers table, nor anywhere in the database files or the log;
    the table keeps sha256(secret). After a restart the same token still works, so the hash is
    what the exchange checks."""
    server = start_exchange(*CALM)
    with WorkerClient(server.url, retries=0) as client:
        token = client.register(manifest("w-hash")).token
    assert token.startswith("rmw.w-hash.")
    secret = secret_of(token)
    assert len(secret) >= 32

    row = worker_row(server.db, "w-hash")
    for column, value in row.items():
        assert secret not in str(value), f"the secret is in workers.{column}"
        assert token not in str(value), f"the token is in workers.{column}"
    assert row["token_hash"] == hashlib.sha256(secret.encode()).hexdigest()

    server.stop()
    for path in server.db.parent.iterdir():
        if path.name.startswith(server.db.name) or path == server.log:
            assert secret.encode() not in path.read_bytes(), f"the secret is in {path.name}"

    restarted = start_exchange(*CALM, db=server.db)
    with WorkerClient(restarted.url, token, manifest=manifest("w-hash"), retries=0) as client:
        assert client.heartbeat().worker_id == "w-hash"
    with WorkerClient(restarted.url, f"rmw.w-hash.{row['token_hash']}", manifest=manifest("w-hash"),
                      retries=0) as thief, pytest.raises(Unauthorized):
        thief.heartbeat()


def test_a_registered_worker_id_cannot_be_taken_over(pool: Pool):
    """Registering w1 again (which would mint a new token for it) is a 409; w1's old token still
    works and the stored hash did not change."""
    stored = worker_row(pool.server.db, "w1")["token_hash"]
    response = call(pool.server.url, "POST", "/v1/workers/register", None,
                    manifest("w1").model_dump_json().encode())
    assert_refused(response, 409, "worker_exists", "re-register")
    assert worker_row(pool.server.db, "w1")["token_hash"] == stored
    assert pool.w1.heartbeat().worker_id == "w1"


# -- the comparison itself ------------------------------------------------------------------

def _builtins_called(fn, *args):
    """Run fn(*args) and return its result and every built-in function it called."""
    called = []

    def profile(frame, event, arg):
        if event == "c_call":
            called.append(arg)

    sys.setprofile(profile)
    try:
        result = fn(*args)
    finally:
        sys.setprofile(None)
    return result, called


def _compared_in_constant_time(called) -> bool:
    return any(c is hmac.compare_digest for c in called)


def test_trainer_token_is_compared_with_compare_digest():
    """is_trainer matches exactly, through hmac.compare_digest, and never with an empty token."""
    token = "t0ken-ключ"  # non-ASCII must neither crash compare_digest nor match loosely
    cases = [
        (token, token, True), (token, token + "x", False), (token[:-1], token, False),
        (token + "x", token, False), (token.upper(), token, False), ("t0ken-ключи", token, False),
    ]
    for given, expected, matches in cases:
        result, called = _builtins_called(auth.is_trainer, given, expected)
        assert result is matches, (given, expected)
        assert _compared_in_constant_time(called), f"no hmac.compare_digest for {given!r}"
    assert auth.is_trainer(None, token) is False
    assert auth.is_trainer("", "") is False, "an exchange without a trainer token admits nobody"
    assert auth.is_trainer("anything", "") is False


def test_worker_token_is_compared_with_compare_digest():
    """worker_from_token compares hashes through hmac.compare_digest, also for unknown worker
    ids (against a dummy, so timing does not reveal which ids exist)."""
    hashes = {"w1": auth.hash_secret("s3cret"), "team.a.w7": auth.hash_secret("other")}
    cases = [
        ("rmw.w1.s3cret", "w1"),
        ("rmw.team.a.w7.other", "team.a.w7"),  # ids may hold dots; the secret is after the last
        ("rmw.w1.s3cre", None),
        ("rmw.w1.other", None),
        ("rmw.team.a.w7.s3cret", None),
        ("rmw.ghost.s3cret", None),
        (f"rmw.w1.{hashes['w1']}", None),  # the stored hash is not itself a credential
    ]
    for token, owner in cases:
        result, called = _builtins_called(auth.worker_from_token, token, hashes)
        assert result == owner, token
        assert _compared_in_constant_time(called), f"no hmac.compare_digest for {token!r}"
    for malformed in (None, "", "rmw.", "rmw.w1", "rmw.w1.", "rmw..s3cret", "w1.s3cret", "RMW.w1.s3cret"):
        assert auth.worker_from_token(malformed, hashes) is None, malformed
    assert auth.worker_from_token("rmw.w1.s3cret", {}) is None


def test_new_tokens_are_unguessable_and_hashed():
    """Each token carries a fresh secret of at least 256 bits; only its sha256 is kept."""
    tokens = [auth.new_worker_token("w1") for _ in range(3)]
    assert len({token for token, _ in tokens}) == 3
    for token, token_hash in tokens:
        secret = secret_of(token)
        assert token == f"rmw.w1.{secret}" and len(secret) >= 43
        assert token_hash == hashlib.sha256(secret.encode()).hexdigest()
        assert auth.worker_from_token(token, {"w1": token_hash}) == "w1"
