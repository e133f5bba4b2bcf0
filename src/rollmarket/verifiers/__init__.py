"""Verifiers: score an answer (and the tool calls behind it) for a task, in-process or over HTTP.

    from rollmarket.verifiers import verify, verify_trajectory
    verify(task, "The answer is 391.")          # VerifyResult(reward=1.0, passed=True, ...)

Built-in verifiers: exact, numeric, math, json_schema, tool_use, compound, code, llm_judge,
multiple_choice, instructions, math_verify (see docs/verifiers.md).
`rollmarket verifier serve` runs them as a resources server (`create_resources_app`, imported
lazily so that this package pulls in neither fastapi nor torch); `ResourcesClient` talks to it;
`profile_rollouts` computes pass@k and majority@k over agent runs.
"""

from __future__ import annotations

from typing import Any

from . import builtin  # noqa: F401  (registers the built-in verifiers)
from .profile import (
    ProfileReport,
    majority_at_k,
    pass_at_k,
    profile_rollouts,
    read_rollouts,
)
from .settings import ResourcesSettings
from .verifier import (
    VERIFIERS,
    Verifier,
    VerifierArgs,
    VerifierConfigError,
    get_verifier,
    register_verifier,
    verify,
    verify_trajectory,
)

_LAZY = {"create_resources_app": ".server", "serve": ".server", "ResourcesClient": ".client",
         "ResourcesError": ".client"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["VERIFIERS", "ProfileReport", "ResourcesClient", "ResourcesError", "ResourcesSettings", "Verifier",
           "VerifierArgs", "VerifierConfigError", "create_resources_app", "get_verifier", "majority_at_k",
           "pass_at_k", "profile_rollouts", "read_rollouts", "register_verifier", "serve", "verify",
           "verify_trajectory"]
