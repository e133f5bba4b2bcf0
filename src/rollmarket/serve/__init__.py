"""An OpenAI-compatible server over the embedded rollout engine, with vLLM's RL extensions."""

from .app import create_serve_app
from .settings import ServeSettings

__all__ = ["ServeSettings", "create_serve_app"]
