"""A simulated rollout worker process: `python -m rollmarket.sim.worker --url URL --profile NAME --model DIR`.

It registers as an fp16 engine of the model `rollmarket train` trains, heartbeats from a background
thread, reloads and acks policies (loading each checkpoint it acks: policy.py), leases jobs and
submits what its profile makes of them. Each thing that happens is one JSON line in --events.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np

from ..client import (
    Conflict,
    DigestMismatch,
    ExchangeError,
    ExchangeUnavailable,
    Rejected,
    WorkerClient,
)
from ..contracts import FailureKind, NoLeaseReason, WorkerManifest
from ..worker.heartbeat import Heartbeater, run_renewing
from . import synthetic
from .policy import ModelPolicy
from .profiles import SCORING, Profile, plan, reload_digest

PRECISION = "fp16"
"""The precision the simulated workers offer: the demo's trainer gives them their own share of each step's
jobs, apart from the real workers' precisions."""


class EventLog:
    def __init__(self, path: Path | None, worker_id: str, profile: Profile):
        self._file = open(path, "a", buffering=1) if path else None
        self._base = {"worker_id": worker_id, "profile": profile.value}

    def __call__(self, kind: str, **data) -> None:
        if self._file:
            self._file.write(json.dumps({"t": time.time(), "event": kind, **self._base, **data}) + "\n")


def manifest_for(profile: Profile, worker_id: str, price: float, policy: ModelPolicy) -> WorkerManifest:
    engine = "sim-fp8" if profile is Profile.toxic_precision else "sim-fp16"
    return WorkerManifest(
        worker_id=worker_id, engine_name=engine, engine_version="0.1",
        engine_fingerprint=synthetic.fingerprint(engine, -1), precision_classes=[PRECISION],
        supported_tokenizer_hashes=[policy.tokenizer_hash], max_context_tokens=policy.max_context_tokens,
        max_concurrent_groups=1, price_hint=price,
    )


def run(url: str, profile: Profile, worker_id: str, seed: int, events_path: Path | None,
        lease_ttl_s: float, heartbeat_s: float, price: float, model: Path) -> int:
    rng = np.random.default_rng(seed)
    log = EventLog(events_path, worker_id, profile)
    policy_model = ModelPolicy(model, scores=profile in SCORING)
    manifest = manifest_for(profile, worker_id, price, policy_model)
    client = WorkerClient(url, retries=8)
    registration = client.register(manifest)
    log("registered", heartbeat_ttl_s=registration.heartbeat_ttl_s)
    beat_client = WorkerClient(url, registration.token, manifest=manifest, retries=0)
    beats = Heartbeater(beat_client, heartbeat_s)
    beats.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    lied = False
    leases_seen = 0
    digests: dict[int, str] = {}
    """Digests of the policy versions this worker has seen published."""
    uris: dict[int, str] = {}
    if registration.policy is not None:
        digests[registration.policy.policy_version] = registration.policy.checkpoint_digest
        uris[registration.policy.policy_version] = registration.policy.checkpoint_uri
        policy_model.load(registration.policy.checkpoint_uri)

    def reload(policy) -> None:
        nonlocal lied
        version = policy.policy_version
        digests[version] = policy.checkpoint_digest
        uris[version] = policy.checkpoint_uri
        digest = reload_digest(profile, policy, digests, lied)
        lied = lied or digest != policy.checkpoint_digest
        # version-drift acks the new version but keeps running the previous checkpoint.
        drifts = profile is Profile.version_drift and version - 1 in uris
        policy_model.load(uris[version - 1] if drifts else policy.checkpoint_uri)
        fingerprint = synthetic.fingerprint(manifest.engine_name, policy.policy_version)
        try:
            status = client.ack_reload(policy.policy_version, digest, engine_fingerprint=fingerprint,
                                       load_seconds=0.02)
            log("reload_acked", version=policy.policy_version, aligned=status.aligned)
        except DigestMismatch as exc:
            log("reload_violation", version=policy.policy_version, error=str(exc))
        beats.reload_required.clear()

    while not stop.is_set():
        try:
            grant = client.lease(wait_s=1.0)
        except ExchangeUnavailable:
            time.sleep(0.5)
            continue
        if grant.reason is NoLeaseReason.reload_required and grant.policy is not None:
            reload(grant.policy)
            continue
        if grant.lease is None:
            continue
        leases_seen += 1
        lease_id = grant.lease.lease_id
        beats.active_leases.add(lease_id)
        log("leased", lease_id=lease_id, job_id=grant.lease.job_id, version=grant.lease.policy_version)
        digests[grant.policy.policy_version] = grant.policy.checkpoint_digest
        # Teacher forcing the group takes seconds on a busy machine: the lease is renewed meanwhile.
        decision = run_renewing(client, lease_id, lease_ttl_s, lambda: plan(
            profile, client, grant, rng, policy_model, leases_seen=leases_seen, lease_ttl_s=lease_ttl_s,
            digests=digests))
        if decision.crash:
            log("crashing", lease_id=lease_id)
            os._exit(3)  # dies holding the lease: no fail report, no more heartbeats
        if decision.hang_until_expiry:
            log("hanging", lease_id=lease_id)
            stop.wait(lease_ttl_s * 1.5)
            beats.active_leases.discard(lease_id)
            continue
        if decision.hold_s:
            until = time.monotonic() + decision.hold_s
            while not stop.is_set() and time.monotonic() < until:
                stop.wait(min(lease_ttl_s / 3, until - time.monotonic()))
                try:
                    client.renew(lease_id)
                except ExchangeError:
                    break
        try:
            receipt = client.submit(decision.group)
            log("accepted", lease_id=lease_id, group_id=receipt.group_id, tier=receipt.tier.value,
                lag=receipt.policy_lag_steps)
        except Rejected as exc:
            log("rejected", lease_id=lease_id, reasons=exc.reasons)
            try:  # give the job back so an honest worker can take it
                client.fail(lease_id, FailureKind.other, f"rejected: {', '.join(exc.reasons)}")
            except ExchangeError:
                pass
            # and leave it to one for a while: a worker refused at once would lease it straight back,
            # while the honest ones are still busy teacher forcing, until it runs out of attempts.
            stop.wait(lease_ttl_s / 3)
        except (Conflict, ExchangeError) as exc:
            log("submit_error", lease_id=lease_id, error=str(exc))
        beats.active_leases.discard(lease_id)
    beats.stopped.set()
    log("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--profile", required=True, choices=[p.value for p in Profile])
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--events", type=Path, default=None)
    parser.add_argument("--lease-ttl-s", type=float, default=10.0)
    parser.add_argument("--heartbeat-s", type=float, default=0.5)
    parser.add_argument("--price", type=float, default=1.0)
    parser.add_argument("--model", type=Path, required=True, help="The model the trainer trains (its base directory).")
    args = parser.parse_args(argv)
    return run(args.url, Profile(args.profile), args.worker_id, args.seed, args.events, args.lease_ttl_s,
               args.heartbeat_s, args.price, args.model)


if __name__ == "__main__":
    raise SystemExit(main())
