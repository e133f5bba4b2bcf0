"""A minimal rollout worker run as its own process by test_workers_multiprocess.py.

    python tests/worker_script.py URL WORKER_ID STOP_FILE

It registers, loads (acks) whatever policy the exchange names, then loops lease → submit until
STOP_FILE exists, and finally prints one JSON line to stdout: the worker id and, for every lease
it completed, the lease, job and group ids. Anything unexpected makes it exit non-zero.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from helpers import manifest, trajectories  # noqa: E402
from rollmarket import WorkerClient  # noqa: E402
from rollmarket.contracts import NoLeaseReason  # noqa: E402


def main(url: str, worker_id: str, stop_file: str) -> int:
    stop = Path(stop_file)
    completed: list[dict[str, str]] = []
    empty_answers = 0
    with WorkerClient(url) as client:
        registration = client.register(manifest(worker_id))
        if registration.policy is not None:
            client.ack_reload(registration.policy.policy_version, registration.policy.checkpoint_digest)
        while not stop.exists():
            grant = client.lease(wait_s=1.0)
            if grant.lease is None:
                empty_answers += 1
                if grant.reason is NoLeaseReason.reload_required and grant.policy is not None:
                    client.ack_reload(grant.policy.policy_version, grant.policy.checkpoint_digest)
                continue
            group = client.group_for(grant, trajectories(grant.job.group_size, seed=len(completed)))
            receipt = client.submit(group)
            if receipt.duplicate or receipt.lease_id != grant.lease.lease_id:
                print(f"unexpected receipt {receipt!r}", file=sys.stderr)
                return 2
            completed.append({"lease_id": grant.lease.lease_id, "job_id": grant.job.job_id,
                              "group_id": receipt.group_id})
    print(json.dumps({"worker_id": worker_id, "completed": completed, "empty_answers": empty_answers}))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
