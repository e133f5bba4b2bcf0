"""The CLI's one error boundary: an expected error becomes one line on stderr, `error: what — how to
fix`, and an exit code (2 for a usage error, 1 otherwise); anything else is a bug and keeps its
traceback. `rollmarket --debug` (or ROLLMARKET_DEBUG=1) shows the traceback of expected errors too.

Expected errors are the library's typed errors listed in EXPECTED, click's own usage errors,
file-system errors that name a file, and a package of an extra missing from a core install (EXTRAS:
`pip install rollmarket` has no torch, so `rollmarket train` names `pip install 'rollmarket[ml]'`).
The table names classes by module so that nothing is imported to check them: an exception can only
be of a class whose module is already loaded.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import click

USAGE, FAILURE = 2, 1


@dataclass(frozen=True)
class Expected:
    """A typed error of the library that the CLI reports in one line."""

    module: str
    name: str
    exit_code: int
    fix: str | None = None
    """How to fix it, when the error's own `fix` attribute does not say."""


EXPECTED: tuple[Expected, ...] = (
    Expected("rollmarket.train.config", "TrainConfigError", USAGE),
    Expected("rollmarket.tasks.suites", "UnknownSuite", USAGE, "`rollmarket suites ls` lists the suites and their splits"),
    Expected("rollmarket.tasks.suites", "TaskFileError", USAGE,
             "each line must be one TaskSpec JSON object (docs/suites.md)"),
    Expected("rollmarket.exchange.store", "StoreError", FAILURE,
             "--db takes a SQLite file or postgresql://USER@HOST:PORT/DATABASE of a running server "
             "(the postgres extra: pip install 'rollmarket[postgres]')"),
    Expected("rollmarket.localhost", "PortInUse", FAILURE,
             "pick another port with --port, or stop the process listening there (ss -ltnp shows it)"),
    Expected("rollmarket.localhost", "PortUnavailable", FAILURE,
             "listen on 127.0.0.1 or an address of this machine (--host), on a port above 1023"),
    Expected("rollmarket.engines.provenance", "ModelLoadError", FAILURE,
             "pass a Hugging Face model directory with config.json and weights, such as models/tiny-moe"),
    Expected("rollmarket.train.loop", "TrainingError", FAILURE),
    Expected("rollmarket.observatory.engines", "EngineNameError", USAGE),
    Expected("rollmarket.observatory.engines", "ReplayUnavailable", USAGE,
             "observe an MoE model (such as models/tiny-moe), or drop the +replay trainer engines"),
    Expected("rollmarket.research.campaign", "CampaignError", USAGE),
    Expected("rollmarket.research.campaign", "CampaignFailed", FAILURE,
             "read the failed runs' train.log; running the campaign again with the same --out resumes them"),
    Expected("rollmarket.research.rundiff", "RunDirError", USAGE,
             "pass run directories that `rollmarket train` made (with config.json)"),
    Expected("rollmarket.train.failpoints", "FailpointError", FAILURE,
             "ROLLMARKET_FAILPOINTS takes point[@step],... with the points docs/training.md lists"),
    Expected("rollmarket.train.trackers", "TrackerUnavailable", FAILURE,
             "install the tracker (pip install 'rollmarket[trackers]') or drop it from logging.trackers"),
    Expected("rollmarket.client.errors", "Unauthorized", FAILURE,
             "check the token (--token, or ROLLMARKET_TRAINER_TOKEN) against the exchange's"),
    Expected("rollmarket.client.errors", "ExchangeUnavailable", FAILURE,
             "start it (`rollmarket exchange serve`) or point --url / ROLLMARKET_URL at it"),
    Expected("rollmarket.client.errors", "ExchangeError", FAILURE),
    Expected("rollmarket.worker.host", "HostError", FAILURE),
    Expected("rollmarket.worker.pool", "RayMissing", FAILURE),
    Expected("rollmarket.worker.pool", "PoolNotFound", FAILURE,
             "check the name and --ray; `rollmarket pool --ray ADDRESS --workers N ...` starts one"),
    Expected("rollmarket.worker.pool", "PoolExists", FAILURE,
             "pick another --name, or `rollmarket pool stop NAME` first"),
    Expected("rollmarket.worker.pool", "PoolError", FAILURE,
             "is the Ray cluster up (`ray status --address HOST:PORT`)?"),
    Expected("rollmarket.gate.integrity", "SigningKeyError", FAILURE),
    Expected("rollmarket.agents.model", "ModelCallError", FAILURE,
             "start the model server first (`rollmarket serve-model`) or fix --model-url"),
    Expected("rollmarket.agents.probe", "ProbeError", FAILURE),
    Expected("rollmarket.verifiers.client", "ResourcesError", FAILURE,
             "start it (`rollmarket verifier serve`) or fix --resources-url"),
    Expected("rollmarket.research.squeeze", "BadRetention", USAGE),
    Expected("rollmarket.research.squeeze", "SqueezeError", FAILURE),
    Expected("rollmarket.research.stats", "BadMetricSpec", USAGE),
    Expected("rollmarket.research.stats", "UnknownCondition", USAGE),
    Expected("rollmarket.research.stats", "BadSettings", USAGE),
    Expected("rollmarket.research.stats", "StatsError", FAILURE, "see docs/statistics.md"),
    Expected("rollmarket.tasks.curriculum", "CurriculumError", USAGE),
    Expected("httpx", "TransportError", FAILURE, "is the server running at that address?"),
)

_FILE_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)

# Packages that come only with an extra (pyproject's [project.optional-dependencies]): a command that
# imports one in a core install (`pip install rollmarket`) says which extra to install.
EXTRAS: dict[str, str] = {
    "torch": "ml", "transformers": "ml", "tokenizers": "ml", "safetensors": "ml", "peft": "ml",
    "psycopg": "postgres", "psycopg_pool": "postgres",
    "ray": "ray",
    "wandb": "trackers", "tensorboard": "trackers",
}


def missing_extra(exc: BaseException) -> str | None:
    """The extra whose package `exc` failed to import, or None when it is no such failure."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    return EXTRAS.get(exc.name.partition(".")[0])


def _expected_class(exc: BaseException) -> Expected | None:
    for entry in EXPECTED:
        module = sys.modules.get(entry.module)
        cls = getattr(module, entry.name, None) if module else None
        if isinstance(cls, type) and isinstance(exc, cls):
            return entry
    return None


def one_line(text: str) -> str:
    """Messages with several lines (pydantic's, tracebacks of servers) joined into one."""
    return "; ".join(part.strip() for part in str(text).strip().splitlines() if part.strip())


def explain(exc: BaseException) -> tuple[str, int] | None:
    """(the line to print, exit code) for an expected error; None for a bug."""
    if isinstance(exc, click.ClickException):
        if isinstance(exc, click.UsageError):
            where = exc.ctx.command_path if exc.ctx else "rollmarket"
            fix = getattr(exc, "fix", None) or f"see `{where} --help`"
            return f"error: {one_line(exc.format_message())} — {fix}", exc.exit_code
        return f"error: {one_line(exc.format_message())}", exc.exit_code
    entry = _expected_class(exc)
    if entry is not None:
        fix = getattr(exc, "fix", None) or entry.fix
        return f"error: {one_line(str(exc))}" + (f" — {fix}" if fix else ""), entry.exit_code
    extra = missing_extra(exc)
    if extra is not None:
        return (f"error: this command needs {exc.name}, which comes with the {extra} extra and is not installed"
                f" — pip install 'rollmarket[{extra}]'"), FAILURE
    if isinstance(exc, _FILE_ERRORS) and exc.filename:
        return f"error: {exc.filename}: {exc.strerror} — check the path", FAILURE
    return None


def debug_requested() -> bool:
    """ROLLMARKET_DEBUG=1 (set by `rollmarket --debug` too): show tracebacks of expected errors."""
    return os.environ.get("ROLLMARKET_DEBUG", "") not in ("", "0")
