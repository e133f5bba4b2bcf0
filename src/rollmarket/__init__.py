"""rollmarket: a rollout exchange, an off-policy gate and a mismatch observatory for RL of LLMs.

The top-level package stays light (no torch, no server): clients and contracts only.
"""

__version__ = "0.1.0"

from .client import ExchangeError, TrainerClient, WorkerClient  # noqa: E402

__all__ = ["ExchangeError", "TrainerClient", "WorkerClient", "__version__"]
