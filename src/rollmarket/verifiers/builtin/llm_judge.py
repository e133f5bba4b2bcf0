"""`llm_judge`: another model, behind any OpenAI-compatible endpoint, judges the answer.

args: {"base_url": "http://127.0.0.1:8000/v1", "model": "judge", "prompt": "...{question}...{answer}...",
       "pattern": "(?i)verdict\\W*(correct|incorrect)\\b", "verdicts": {"CORRECT": 1.0, "INCORRECT": 0.0},
       "retries": 3, "backoff_s": 0.5, "timeout_s": 60, "failures_file": "judge-failures.jsonl"}

The prompt template is filled with {question} (the task's prompt, or its last user message),
{answer} and {reference} (task.answer as text, "" when there is none), sent as one user message
(temperature 0 by default), and the judge's reply is read with `pattern`: the last match's first
group, looked up in `verdicts` (case-insensitive) or, when `verdicts` is empty, read as a number
(the reward, clipped to [0, 1]). passed = reward >= pass_threshold.

Every result keeps the judge's filled prompt (info.judge_prompt), its raw reply (info.judge_raw,
None when there was none) and the attempts made. A connection error, a timeout, HTTP 429 or 5xx
is retried `retries` times, waiting backoff_s * 2**attempt between tries; other HTTP errors are
not. The API key is read from the environment variable `api_key_env` (any non-empty text when
unset: local servers ignore it).

Typed failures (info.failure): `no_answer`, `judge_unreachable` (every try failed to get a
reply), `judge_error` (the endpoint refused the request: 4xx), `unparseable` (the reply does not
match `pattern`, or the verdict is unknown), `judged_wrong`. The judge's own failures (the first
three but `no_answer`) are also appended, one JSON line each, to `failures_file` when set, so they
can be judged again later (`rollmarket eval reverify`) instead of being mistaken for wrong answers.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import Field

from ...contracts import TaskSpec, ToolCallRecord, VerifyResult
from ..verifier import (
    Verifier,
    VerifierArgs,
    VerifierConfigError,
    register_verifier,
    result,
)

log = logging.getLogger(__name__)

DEFAULT_PROMPT = (
    "You are grading an answer to a question against a reference answer.\n\n"
    "Question:\n{question}\n\nReference answer:\n{reference}\n\nAnswer to grade:\n{answer}\n\n"
    "Reply with one line: VERDICT: CORRECT or VERDICT: INCORRECT.")


class JudgeFailure(StrEnum):
    """Why a judged answer scored 0 (or was not judged)."""

    no_answer = "no_answer"
    judge_unreachable = "judge_unreachable"
    judge_error = "judge_error"
    unparseable = "unparseable"
    judged_wrong = "judged_wrong"


class JudgeArgs(VerifierArgs):
    base_url: str = Field(min_length=1, description="The endpoint's base URL, ending in /v1.")
    model: str = Field(min_length=1, description="The judge model's name at that endpoint.")
    prompt: str = Field(DEFAULT_PROMPT, min_length=1,
                        description="Template with {question}, {answer} and {reference}.")
    pattern: str = Field(r"(?i)verdict\W*(correct|incorrect)\b",
                         description="Regex; the first group of its last match is the verdict.")
    verdicts: dict[str, float] = Field(default_factory=lambda: {"CORRECT": 1.0, "INCORRECT": 0.0},
                                       description="Verdict -> reward; empty: the verdict is the reward.")
    pass_threshold: float = Field(1.0, ge=0, le=1, description="passed = reward >= this.")
    api_key_env: str = Field("OPENAI_API_KEY", description="Environment variable holding the API key.")
    temperature: float = Field(0.0, ge=0, le=2)
    max_tokens: int = Field(256, ge=1, le=32_768)
    retries: int = Field(3, ge=0, le=10, description="Tries after the first, for connection errors, 429 and 5xx.")
    backoff_s: float = Field(0.5, ge=0, le=60, description="Wait before retry n: backoff_s * 2**n.")
    timeout_s: float = Field(60.0, gt=0, le=600, description="Limit of one request.")
    failures_file: str | None = Field(None, description="JSON lines file the judge's own failures are appended to.")


_failures_lock = threading.Lock()


def _question(task: TaskSpec) -> str:
    if task.prompt is not None:
        return task.prompt
    users = [m for m in task.messages or [] if m.get("role") == "user"]
    content = users[-1].get("content") if users else None
    return content if isinstance(content, str) else json.dumps(content)


def _reference(task: TaskSpec) -> str:
    if task.answer is None:
        return ""
    return task.answer if isinstance(task.answer, str) else json.dumps(task.answer)


def judge_args_of(verifier: Any, args: Any) -> list[dict[str, Any]]:
    """Every llm_judge args dict in a verifier configuration: its own, and its compound parts' at any depth."""
    if verifier == "llm_judge":
        return [args if isinstance(args, dict) else {}]
    if verifier != "compound" or not isinstance(args, dict) or not isinstance(args.get("components"), list):
        return []
    return [found for part in args["components"] if isinstance(part, dict)
            for found in judge_args_of(part.get("verifier"), part.get("args") or {})]


def check_judge_policy(task: TaskSpec, allowed_urls: Sequence[str]) -> None:
    """VerifierConfigError unless every judge `task` would call is at one of `allowed_urls` and none
    names a failures file: what a server that scores other people's tasks allows (the task picks
    the URL the server sends the answer to and the file it appends to)."""
    allowed = {url.rstrip("/") for url in allowed_urls}
    for args in judge_args_of(task.verifier, task.verifier_args):
        url = str(args.get("base_url", "")).rstrip("/")
        if url not in allowed:
            raise VerifierConfigError(f"verifier 'llm_judge' on {task.task_id}: judge {url!r} is not allowed "
                                      "here; the server's operator allows judges with --judge-urls")
        if args.get("failures_file") is not None:
            raise VerifierConfigError(f"verifier 'llm_judge' on {task.task_id}: failures_file is for in-process "
                                      "runs; over HTTP the result's info carries the same record")


def _retryable(exc: Exception) -> bool:
    import openai

    if isinstance(exc, (openai.APIConnectionError, openai.APITimeoutError)):
        return True
    return isinstance(exc, openai.APIStatusError) and (exc.status_code == 429 or exc.status_code >= 500)


def _record_failure(path: str, entry: dict[str, Any]) -> None:
    line = json.dumps(entry, ensure_ascii=False) + "\n"
    with _failures_lock, Path(path).open("a", encoding="utf-8") as out:
        out.write(line)


@register_verifier
class LlmJudgeVerifier(Verifier):
    name = "llm_judge"
    Args = JudgeArgs

    def expected(self, task: TaskSpec, args: JudgeArgs) -> re.Pattern[str]:
        try:
            pattern = re.compile(args.pattern)
        except re.error as exc:
            raise VerifierConfigError(f"verifier 'llm_judge' on {task.task_id}: pattern is not a regex: {exc}") \
                from None
        if pattern.groups < 1:
            raise VerifierConfigError(f"verifier 'llm_judge' on {task.task_id}: pattern needs a group (the verdict)")
        try:
            args.prompt.format(question="", answer="", reference="")
        except (KeyError, IndexError, ValueError) as exc:
            raise VerifierConfigError(f"verifier 'llm_judge' on {task.task_id}: prompt template: {exc!r}; use "
                                      "{question}, {answer} and {reference} ({{ }} for braces)") from None
        return pattern

    def score(self, task: TaskSpec, answer: str | None, tool_calls: Sequence[ToolCallRecord],
              args: JudgeArgs, expected: re.Pattern[str]) -> VerifyResult:
        reference = _reference(task)
        if answer is None or not answer.strip():
            return result(0.0, canonical=None, expected=reference, why="no answer", failure=JudgeFailure.no_answer)
        prompt = args.prompt.format(question=_question(task), answer=answer, reference=reference)
        raw, attempts, error = self._ask(args, prompt)
        kept = {"judge_prompt": prompt, "judge_raw": raw, "judge_model": args.model, "attempts": attempts}
        if raw is None:
            failure = JudgeFailure.judge_error if error.startswith("HTTP 4") else JudgeFailure.judge_unreachable
            return self._judge_failed(task, args, failure, f"the judge gave no reply: {error}", reference, kept)
        matches = list(expected.finditer(raw))
        verdict = matches[-1].group(1).strip() if matches else None
        reward = self._reward(verdict, args) if verdict is not None else None
        if reward is None:
            why = ("the judge's reply does not match the pattern" if verdict is None
                   else f"unknown verdict {verdict[:40]!r}")
            return self._judge_failed(task, args, JudgeFailure.unparseable, why, reference, kept)
        passed = reward >= args.pass_threshold
        if reward > 0:
            return result(reward, passed=passed, canonical=None, expected=reference, verdict=verdict, **kept)
        return result(0.0, passed=False, canonical=None, expected=reference, verdict=verdict,
                      why=f"the judge said {verdict[:40]!r}", failure=JudgeFailure.judged_wrong, **kept)

    @staticmethod
    def _reward(verdict: str, args: JudgeArgs) -> float | None:
        if args.verdicts:
            folded = {k.casefold(): v for k, v in args.verdicts.items()}
            return folded.get(verdict.casefold())
        try:
            value = float(verdict)
        except ValueError:
            return None
        return min(1.0, max(0.0, value)) if math.isfinite(value) else None

    @staticmethod
    def _ask(args: JudgeArgs, prompt: str) -> tuple[str | None, int, str]:
        """(the reply text or None, tries made, the last error when there is no reply)."""
        import openai  # imported here: the verifiers package stays light for processes that never judge

        client = openai.OpenAI(base_url=args.base_url, api_key=os.environ.get(args.api_key_env) or "unused",
                               max_retries=0, timeout=args.timeout_s)
        error = ""
        try:
            for attempt in range(args.retries + 1):
                if attempt:
                    time.sleep(args.backoff_s * 2 ** (attempt - 1))
                try:
                    reply = client.chat.completions.create(
                        model=args.model, messages=[{"role": "user", "content": prompt}],
                        temperature=args.temperature, max_tokens=args.max_tokens)
                except openai.APIStatusError as exc:
                    error = f"HTTP {exc.status_code}: {str(exc.message)[:200]}"
                    if not _retryable(exc):
                        return None, attempt + 1, error
                    continue
                except openai.APIError as exc:
                    error = f"{type(exc).__name__}: {str(exc)[:200]}"
                    if not _retryable(exc):
                        return None, attempt + 1, error
                    continue
                content = reply.choices[0].message.content if reply.choices else None
                return content or "", attempt + 1, ""
            return None, args.retries + 1, error
        finally:
            client.close()

    @staticmethod
    def _judge_failed(task: TaskSpec, args: JudgeArgs, failure: JudgeFailure, why: str, reference: str,
                      kept: dict[str, Any]) -> VerifyResult:
        if args.failures_file:
            _record_failure(args.failures_file, {"time": time.time(), "task_id": task.task_id,
                                                 "failure": failure.value, "why": why, **kept})
        return result(0.0, passed=False, canonical=None, expected=reference, why=why, failure=failure, **kept)
