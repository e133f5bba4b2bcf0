"""Trust across hosts (docs/security.md): signing keys made by `rollmarket keys generate`, a policy
that requires signed groups, and jobs that require or exclude engine fingerprints — against a real
exchange process, judged from its answers and from its database read from outside.

Signatures are checked here with `cryptography` directly (the raw public key the command printed,
the documented domain prefix), not with the gate's own helper.
"""

from __future__ import annotations

import base64
import os
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from helpers import ExchangeProcess, job, lease_one, manifest, policy, sha, trajectories
from rollmarket import WorkerClient
from rollmarket.client import Rejected
from rollmarket.contracts import NoLeaseReason, RejectionReason
from rollmarket.gate.integrity import load_signing_key

ROOT = Path(__file__).resolve().parents[1]
SIGNING_DOMAIN = b"rollmarket.sample_group.sig.v1:"
"""What a signature covers, before the content hash (docs/security.md)."""


def generate_key(path: Path) -> tuple[subprocess.CompletedProcess, str]:
    done = subprocess.run([sys.executable, "-m", "rollmarket", "keys", "generate", "--out", str(path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    return done, done.stdout.strip()


def verifies(public_b64: str, content_hash: str, signature_b64: str) -> bool:
    key = Ed25519PublicKey.from_public_bytes(base64.b64decode(public_b64))
    try:
        key.verify(base64.b64decode(signature_b64), SIGNING_DOMAIN + content_hash.encode())
    except InvalidSignature:
        return False
    return True


def stored_groups(db: Path) -> list[tuple[str, str, str]]:
    """(group_id, worker_id, engine_fingerprint) of every stored group, read from outside the server."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT group_id, worker_id, engine_fingerprint FROM groups ORDER BY rowid").fetchall()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def keypair(tmp_path_factory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("keys") / "worker.key"
    done, public = generate_key(path)
    assert done.returncode == 0, done.stderr
    return path, public


@pytest.fixture
def exchange(tmp_path):
    ex = ExchangeProcess(tmp_path / "ex.db", tmp_path / "ex.log").start()
    yield ex
    ex.stop()


def worker(url: str, worker_id: str, *, key_file: Path | None = None, public: str | None = None,
           fingerprint: str | None = None, version: int = 0) -> WorkerClient:
    """A registered worker that has acked `version`; it signs when given the key file. It may hold
    several leases: a rejected group leaves its lease standing."""
    client = WorkerClient(url, signing_key=load_signing_key(key_file) if key_file else None)
    fields = {"max_concurrent_groups": 4, **({"public_key": public} if public else {})}
    if fingerprint:
        fields["engine_fingerprint"] = fingerprint
    client.register(manifest(worker_id, **fields))
    client.ack_reload(version, sha(f"ckpt-{version}"))
    return client


# -- keys ----------------------------------------------------------------------------------------


def test_keys_generate_writes_a_private_file_and_prints_its_public_key(tmp_path, keypair):
    path, public = keypair
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert path.read_text().startswith("-----BEGIN PRIVATE KEY-----")
    assert len(base64.b64decode(public, validate=True)) == 32
    # The printed key is the file's: a signature made with the file verifies under it.
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    private = load_pem_private_key(path.read_bytes(), password=None)
    assert verifies(public, "abc", base64.b64encode(private.sign(SIGNING_DOMAIN + b"abc")).decode())
    # An existing key is never overwritten.
    before = path.read_bytes()
    done, _ = generate_key(path)
    assert done.returncode == 1 and "already exists" in done.stderr and "Traceback" not in done.stderr
    assert path.read_bytes() == before


def keys_public(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollmarket", "keys", "public", str(path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_a_key_open_to_others_or_not_a_key_is_refused(tmp_path, keypair):
    key_file, public = keypair
    assert keys_public(key_file).stdout.strip() == public
    loose = tmp_path / "loose.key"
    loose.write_bytes(key_file.read_bytes())
    loose.chmod(0o640)
    done = keys_public(loose)
    assert done.returncode == 1 and done.stderr.startswith("error: ") and f"chmod 600 {loose}" in done.stderr
    junk = tmp_path / "junk.key"
    junk.write_text("not a key\n")
    junk.chmod(0o600)
    done = keys_public(junk)
    assert done.returncode == 1 and "not an unencrypted PEM private key" in done.stderr
    assert "rollmarket keys generate" in done.stderr and "Traceback" not in done.stderr


# -- a policy that requires signatures -----------------------------------------------------------


def test_under_a_signing_policy_signed_groups_enter_and_unsigned_or_tampered_ones_do_not(exchange, keypair):
    key_file, public = keypair
    trainer = exchange.trainer()
    trainer.publish_policy(policy(0, require_signatures=True))
    trainer.enqueue([job(i) for i in range(3)])

    # A worker without a key is never leased a job under this policy.
    keyless = worker(exchange.url, "keyless")
    grant = keyless.lease(wait_s=0.5)
    assert grant.lease is None and grant.reason is NoLeaseReason.no_matching_jobs
    assert "public key" in grant.detail

    signer = worker(exchange.url, "signer", key_file=key_file, public=public)
    receipt = signer.submit(signer.group_for(lease_one(signer), trajectories(2)))

    # The same worker's client without the key sends an unsigned group: refused, nothing stored.
    unsigned_client = WorkerClient(exchange.url, signer.http.token, manifest=signer.manifest)
    grant = lease_one(unsigned_client)
    with pytest.raises(Rejected) as refused:
        unsigned_client.submit(unsigned_client.group_for(grant, trajectories(2, seed=1)))
    assert refused.value.rejection_reasons == [RejectionReason.signature_required]

    # A signature that does not cover the content (one byte flipped) is refused.
    sealed = signer.seal(signer.group_for(lease_one(signer), trajectories(2, seed=2)))
    raw = bytearray(base64.b64decode(sealed.signature))
    raw[0] ^= 1
    tampered = sealed.model_copy(update={"signature": base64.b64encode(bytes(raw)).decode()})
    with pytest.raises(Rejected) as refused:
        signer.submit(tampered)
    assert refused.value.rejection_reasons == [RejectionReason.bad_signature]

    assert [row[0] for row in stored_groups(exchange.db)] == [receipt.group_id]
    [served] = trainer.fetch(limit=10).groups
    assert served.group.group_id == receipt.group_id
    assert verifies(public, served.group.content_hash, served.group.signature)


@pytest.mark.slow
def test_rollmarket_worker_with_a_signing_key_signs_every_group(exchange, keypair, tmp_path):
    """The real worker (tiny MoE, embedded engine) registers the key's public half and signs what it
    submits, so a signing policy accepts its groups."""
    from test_worker import MOE, Worker, jobs, wait_done
    from test_worker import policy as model_policy

    key_file, public = keypair
    trainer = exchange.trainer()
    trainer.publish_policy(model_policy(0, MOE).model_copy(update={"require_signatures": True}))
    process = Worker(exchange.url, "signed-moe", tmp_path, args=("--signing-key", str(key_file)))
    try:
        assert process.wait_for("registered")["manifest"]["public_key"] == public
        trainer.enqueue(jobs(0, 2, max_tokens=16))
        wait_done(trainer, 2)
    finally:
        process.stop()
    groups = [served.group for served in trainer.fetch(limit=10).groups]
    assert len(groups) == 2 and {g.worker_id for g in groups} == {"signed-moe"}
    assert all(verifies(public, g.content_hash, g.signature) for g in groups)


@pytest.mark.slow
def test_rollmarket_train_publishes_a_policy_that_requires_signatures(exchange, tmp_path):
    """`exchange.require_signatures=true`: the policy the trainer publishes at start says so, read
    back from the exchange (the trainer is stopped once it has published)."""
    from helpers import TRAINER_TOKEN, wait_until

    log = open(tmp_path / "train.log", "wb")
    trainer_process = subprocess.Popen(
        [sys.executable, "-m", "rollmarket", "train", str(ROOT / "configs" / "train-lookup.toml"),
         f"exchange.url={exchange.url}", "exchange.require_signatures=true", "loop.steps=1",
         f"runs_root={tmp_path / 'runs'}"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "ROLLMARKET_TRAINER_TOKEN": TRAINER_TOKEN})
    trainer = exchange.trainer()

    def policies():
        assert trainer_process.poll() is None, (tmp_path / "train.log").read_text()[-2000:]
        return trainer.policies()

    try:
        [published] = wait_until("the trainer publishes its first policy", policies, timeout=180, every=0.5)
    finally:
        trainer_process.kill()
        trainer_process.wait(30)
        log.close()
    assert published.require_signatures is True


# -- fingerprints --------------------------------------------------------------------------------


def test_a_job_s_fingerprint_rules_hold_at_lease(exchange):
    """The rules judge the fingerprint a worker acked for the version it runs, not the one it
    registered with: numerics change with the checkpoint."""
    trusted, other = sha("build-a"), sha("build-b")
    trainer = exchange.trainer()
    trainer.publish_policy(policy(0))
    only_a = job(0, required_fingerprints=[trusted], priority=1)
    not_a = job(1, excluded_fingerprints=[trusted])
    trainer.enqueue([only_a, not_a])
    a = worker(exchange.url, "on-a", fingerprint=other)
    a.ack_reload(0, sha("ckpt-0"), engine_fingerprint=trusted)
    b = worker(exchange.url, "on-b", fingerprint=trusted)
    b.ack_reload(0, sha("ckpt-0"), engine_fingerprint=other)
    # b would take the higher-priority job first if it were allowed to.
    assert lease_one(b).job.job_id == not_a.job_id
    assert lease_one(a).job.job_id == only_a.job_id
    # Each job went to the only worker its rules allow, and no other lease was issued.
    conn = sqlite3.connect(f"file:{exchange.db}?mode=ro", uri=True)
    try:
        leases = dict(conn.execute("SELECT job_id, worker_id FROM leases").fetchall())
    finally:
        conn.close()
    assert leases == {only_a.job_id: "on-a", not_a.job_id: "on-b"}


def test_the_gate_refuses_a_group_whose_fingerprint_the_job_excludes(exchange):
    """A worker leased a job under one fingerprint whose numerics change before it submits (it acks
    the same version again with another fingerprint): the gate checks the group's fingerprint
    against the lease's rules."""
    before, after = sha("build-a"), sha("build-a, new kernels")
    trainer = exchange.trainer()
    trainer.publish_policy(policy(0))
    trainer.enqueue([job(0, excluded_fingerprints=[after])])
    client = worker(exchange.url, "drifted", fingerprint=before)
    grant = lease_one(client)
    client.ack_reload(0, sha("ckpt-0"), engine_fingerprint=after)
    client.loaded_fingerprint = after
    group = client.group_for(grant, trajectories(2))
    assert group.engine_fingerprint == after
    with pytest.raises(Rejected) as refused:
        client.submit(group)
    assert refused.value.rejection_reasons == [RejectionReason.fingerprint_not_allowed]
    assert stored_groups(exchange.db) == []
