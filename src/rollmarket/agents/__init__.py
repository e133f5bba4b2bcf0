"""Agents: the loop over the OpenAI chat API, the tools it calls, and the training view of a run.

Nothing here imports torch: an agent talks to its model over HTTP.
"""

from .loop import Agent, AgentSettings, task_messages
from .model import ChatModel, ModelCallError, ModelTurn, Sampling
from .stitch import StitchError, TrainingView, stitch, to_trajectory
from .toolbox import LocalToolbox, RemoteToolbox, Toolbox, ToolSession

__all__ = ["Agent", "AgentSettings", "ChatModel", "LocalToolbox", "ModelCallError", "ModelTurn",
           "RemoteToolbox", "Sampling", "StitchError", "ToolSession", "Toolbox", "TrainingView", "stitch",
           "task_messages", "to_trajectory"]
