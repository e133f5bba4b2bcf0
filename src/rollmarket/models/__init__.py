"""The tiny shipped models (Qwen3 dense and Qwen3-MoE) and the pipeline that builds them.

Importing this package pulls in torch and transformers; the exchange never does.
"""

from .configs import MODEL_NAMES
from .template import CHAT_TEMPLATE, parse_tool_calls, render_chat

__all__ = ["CHAT_TEMPLATE", "MODEL_NAMES", "parse_tool_calls", "render_chat"]
