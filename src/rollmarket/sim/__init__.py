"""Simulated workers and trainer for `rollmarket demo --simulate`.

Logprobs here come from a deterministic synthetic model, not a network: the point is to drive
every path of the exchange and the gate (honest, noisy, stale and broken workers) with real
processes, real HTTP and a real database. Later issues put real engines behind the same loop.
"""
