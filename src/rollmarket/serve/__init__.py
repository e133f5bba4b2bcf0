"""An OpenAI-compatible server over the embedded rollout engine, with vLLM's RL extensions.

`create_serve_app` is imported lazily, so that the settings (and `rollmarket serve-model --help`)
load without torch.
"""

from typing import Any

from .settings import ServeSettings


def __getattr__(name: str) -> Any:
    if name == "create_serve_app":
        from .app import create_serve_app

        return create_serve_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ServeSettings", "create_serve_app"]
