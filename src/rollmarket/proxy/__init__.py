"""The capture proxy: sits in front of any OpenAI-compatible server and records every generation call
with its token ids, logprobs and routed experts, streamed or not."""

from .app import Proxy, create_proxy_app
from .settings import ProxySettings
from .store import CaptureStore

__all__ = ["CaptureStore", "Proxy", "ProxySettings", "create_proxy_app"]
