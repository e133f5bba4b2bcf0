"""Optional metric writers that mirror each training step to W&B or TensorBoard.

The trainer's own `runs/<id>/metrics.jsonl` and `generations.jsonl` are the record; these only copy
them to a dashboard: each step's metrics, and its rollouts (a `wandb.Table`; TensorBoard text).
Both backends are optional extras (`pip install 'rollmarket[trackers]'`), imported only when a
tracker is made, and kept quiet: the library prints nothing; `where()` says where a run went, and
the CLI decides what to show.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Any, Protocol

Metrics = dict[str, float | int | None]

ROLLOUT_COLUMNS = ("step", "reward", "prompt", "response", "decision", "advantage", "precision", "worker")
"""The rollout table's columns, from generations.jsonl rows (`worker` is their `worker_id`)."""


def rollout_rows(generations: list[dict[str, Any]]) -> list[list[Any]]:
    """generations.jsonl rows as rollout-table rows, in ROLLOUT_COLUMNS order."""
    return [[g.get("worker_id") if c == "worker" else g.get(c) for c in ROLLOUT_COLUMNS] for g in generations]

INSTALL_HINT = "pip install 'rollmarket[trackers]'"


class TrackerUnavailable(RuntimeError):
    """A tracker's backend package is not installed."""


class Tracker(Protocol):
    """Something that mirrors one step's metrics somewhere; `close` flushes and releases it."""

    def log(self, metrics: Metrics, step: int) -> None: ...

    def log_rollouts(self, generations: list[dict[str, Any]], step: int) -> None: ...

    def where(self) -> dict[str, str]:
        """{"tracker", "path", "open"}: where the run went and the command that opens it."""
        ...

    def close(self) -> None: ...


class WandbTracker:
    """Mirrors metrics to a W&B run; offline by default, so it needs no network or account.

    An offline run lands in `<run_dir>/wandb/offline-run-*/`; `wandb sync` uploads it later.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        run_name: str,
        config: dict[str, Any],
        project: str = "rollmarket",
        mode: str = "offline",
    ) -> None:
        try:
            import wandb
        except ImportError as e:
            raise TrackerUnavailable(INSTALL_HINT) from e
        # wandb's warnings (wandb.termwarn) obey process-wide settings, read from the environment
        # when wandb first sets up, not the per-run `silent`; a user's own WANDB_SILENT wins.
        os.environ.setdefault("WANDB_SILENT", "true")
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)  # else wandb warns and probes a missing dir
        settings = wandb.Settings(
            silent=True,  # no "wandb: ..." banners for this run; the CLI does the talking
            console="off",  # leave sys.stdout/stderr alone instead of capturing them
            x_disable_stats=True,  # no system-metrics sampler beside the trainer
            x_save_requirements=False,  # skip a pip freeze of the environment per run
            # Own a fresh run: the default would hand back (and `close` would finish) a run
            # the caller already had open.
            reinit="create_new",
        )
        self._wandb, self._mode = wandb, mode
        self._run = wandb.init(
            project=project,
            name=run_name,
            dir=str(run_dir),
            config=config,
            mode=mode,
            settings=settings,
        )

    def log(self, metrics: Metrics, step: int) -> None:
        self._run.log({k: v for k, v in metrics.items() if v is not None}, step=step)

    def log_rollouts(self, generations: list[dict[str, Any]], step: int) -> None:
        """The step's rollouts as a `rollouts` wandb.Table (ROLLOUT_COLUMNS)."""
        if generations:
            table = self._wandb.Table(columns=list(ROLLOUT_COLUMNS), data=rollout_rows(generations))
            self._run.log({"rollouts": table}, step=step)

    def where(self) -> dict[str, str]:
        folder = str(Path(self._run.dir).parent)  # <run_dir>/wandb/offline-run-*/ (its files/ is run.dir)
        if self._mode == "offline":
            return {"tracker": "wandb", "path": folder, "open": f"wandb sync {folder}"}
        return {"tracker": "wandb", "path": folder, "open": self._run.url or folder}

    def close(self) -> None:
        """Finish the run.

        wandb-core writes the offline `.wandb` file a few ms after this returns; wandb's atexit
        hook (or `wandb.teardown()`) waits for it.
        """
        self._run.finish()


def _markdown_cell(value: Any) -> str:
    """A value as one markdown table cell: pipes escaped, line breaks as <br>."""
    return re.sub(r"\r\n|\r|\n", "<br>", str(value).replace("|", "\\|"))


class TensorBoardTracker:
    """Writes one scalar per numeric metric to event files under `<run_dir>/tensorboard`."""

    def __init__(self, run_dir: Path) -> None:
        try:
            # torch ships the writer but needs the tensorboard package for the event format.
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise TrackerUnavailable(INSTALL_HINT) from e
        self._log_dir = Path(run_dir) / "tensorboard"
        self._writer = SummaryWriter(log_dir=str(self._log_dir))

    def log(self, metrics: Metrics, step: int) -> None:
        for key, value in metrics.items():
            # None marks a metric with no value this step (e.g. an eval that did not run).
            if isinstance(value, (int, float)):
                self._writer.add_scalar(key, value, global_step=step)

    def log_rollouts(self, generations: list[dict[str, Any]], step: int) -> None:
        """The step's rollouts as one markdown table under the `rollouts` text tag."""
        if not generations:
            return
        lines = ["| " + " | ".join(ROLLOUT_COLUMNS) + " |", "|" + "---|" * len(ROLLOUT_COLUMNS)]
        lines += ["| " + " | ".join(_markdown_cell(v) for v in row) + " |" for row in rollout_rows(generations)]
        self._writer.add_text("rollouts", "\n".join(lines), global_step=step)

    def where(self) -> dict[str, str]:
        return {"tracker": "tensorboard", "path": str(self._log_dir), "open": f"tensorboard --logdir {self._log_dir}"}

    def close(self) -> None:
        self._writer.close()  # flushes pending events first


TRACKERS = ("wandb", "tensorboard")


def installed_trackers(wandb_mode: str = "offline") -> list[str]:
    """The trackers a run mirrors to by default: each whose package is installed. W&B is left out
    when it is turned off (`wandb_mode` or W&B's own WANDB_MODE set to "disabled")."""
    names = []
    if importlib.util.find_spec("wandb") and "disabled" not in (wandb_mode, os.environ.get("WANDB_MODE")):
        names.append("wandb")
    if importlib.util.find_spec("tensorboard"):  # torch's SummaryWriter writes through it
        names.append("tensorboard")
    return names


def make_trackers(
    names: list[str],
    run_dir: Path,
    *,
    run_name: str,
    config: dict[str, Any],
    wandb_project: str = "rollmarket",
    wandb_mode: str = "offline",
) -> list[Tracker]:
    """Build the named trackers (from `TRACKERS`) for one run directory."""
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(f"unknown tracker(s) {unknown}; valid: {', '.join(TRACKERS)}")
    trackers: list[Tracker] = []
    try:
        for name in names:
            if name == "wandb":
                tracker: Tracker = WandbTracker(
                    run_dir,
                    run_name=run_name,
                    config=config,
                    project=wandb_project,
                    mode=wandb_mode,
                )
            else:
                tracker = TensorBoardTracker(run_dir)
            trackers.append(tracker)
    except BaseException:
        # Don't leave a half-built set open (e.g. a live W&B run) when a later one fails.
        for tracker in trackers:
            tracker.close()
        raise
    return trackers
