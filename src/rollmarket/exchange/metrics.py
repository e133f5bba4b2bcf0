"""Prometheus metrics of one exchange process (documented in docs/metrics.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ExchangeMetrics:
    """Counters are updated as requests finish; gauges are read from the store at scrape time."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("rollmarket_http_requests", "HTTP requests by route and status.",
                                ["route", "method", "status"], registry=r)
        self.latency = Histogram("rollmarket_http_request_seconds", "HTTP request latency by route.",
                                 ["route", "method"], buckets=LATENCY_BUCKETS, registry=r)
        self.submissions = Counter("rollmarket_submissions", "Group submissions by outcome.",
                                   ["outcome"], registry=r)
        self.rejections = Counter("rollmarket_rejections", "Rejected submissions by reason.",
                                  ["reason"], registry=r)
        self.tokens = Counter("rollmarket_response_tokens_ingested", "Response tokens in accepted groups.",
                              registry=r)
        self.groups_stored = Counter("rollmarket_groups_stored", "Accepted groups by arrival tier.",
                                     ["tier"], registry=r)
        self.leases = Counter("rollmarket_lease_requests", "Lease requests by result.",
                              ["result"], registry=r)
        self.lease_endings = Counter("rollmarket_lease_endings", "Leases that ended without a group.",
                                     ["state"], registry=r)
        self.decisions = Counter("rollmarket_decisions", "Trainer decisions by status.",
                                 ["status"], registry=r)
        self.reload_violations = Counter("rollmarket_reload_violations",
                                         "Reload acks whose digest contradicts the manifest.", registry=r)
        self.write_batch = Histogram("rollmarket_store_write_batch_ops",
                                     "Operations per committed write batch (store group commit).",
                                     buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.jobs = Gauge("rollmarket_jobs", "Jobs by state.", ["state"], registry=r)
        self.workers = Gauge("rollmarket_workers", "Registered workers by status.", ["status"], registry=r)
        self.groups_available = Gauge("rollmarket_groups_available", "Available groups by tier.",
                                      ["tier"], registry=r)
        self.leases_state = Gauge("rollmarket_leases", "Leases by state.", ["state"], registry=r)
        self.active_version = Gauge("rollmarket_policy_active_version",
                                    "Policy version the pool is aligned to (-1: none).", registry=r)
        self.published_version = Gauge("rollmarket_policy_published_version",
                                       "Latest published policy version (-1: none).", registry=r)
        self.leader = Gauge("rollmarket_exchange_leader",
                            "1 when this replica runs the singleton sweeps (the reaper), else 0.", registry=r)

    def render(self, counts: dict[str, dict[str, int]], active: int | None, published: int | None,
               *, leader: bool = True) -> bytes:
        for gauge, key in ((self.jobs, "jobs"), (self.workers, "workers"),
                           (self.groups_available, "groups"), (self.leases_state, "leases")):
            gauge.clear()
            for label, value in counts.get(key, {}).items():
                gauge.labels(label).set(value)
        self.active_version.set(-1 if active is None else active)
        self.published_version.set(-1 if published is None else published)
        self.leader.set(1 if leader else 0)
        return generate_latest(self.registry)

    def names(self) -> list[str]:
        """Every metric family name as Prometheus exposes it."""
        return sorted({metric.name for metric in self.registry.collect()})
