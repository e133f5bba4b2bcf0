"""Simulated workers for `rollmarket demo paths`.

Honest and faulty worker profiles as real processes beside real workers, all fed by `rollmarket
train` itself: the simulated ones draw their tokens instead of generating them, but take their
logprobs from the checkpoints they load (policy.py), so the trainer's gate judges them as it judges
any group. The point is to drive every path of the exchange and the gate with real processes, real
HTTP and a real database.
"""
