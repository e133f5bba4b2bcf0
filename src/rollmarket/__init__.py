"""rollmarket: a rollout exchange, an off-policy gate and a mismatch observatory for RL of LLMs.

The top-level package stays light (no torch, no server): clients and contracts only, and those are
imported on first use, so that `rollmarket --help` starts in a fraction of a second.
"""

from typing import Any

__version__ = "0.1.0"

_CLIENT_NAMES = ("ExchangeError", "TrainerClient", "WorkerClient")


def __getattr__(name: str) -> Any:
    if name in _CLIENT_NAMES:
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ExchangeError", "TrainerClient", "WorkerClient", "__version__"]
