"""Optional metric writers that mirror each training step to W&B or TensorBoard.

The trainer's own `runs/<id>/metrics.jsonl` is the record; these only copy it to a dashboard.
Both backends are optional extras (`pip install 'rollmarket[trackers]'`), imported only when a
tracker is made, and kept quiet: the library prints nothing, the CLI decides what to show.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

Metrics = dict[str, float | int | None]

INSTALL_HINT = "pip install 'rollmarket[trackers]'"


class TrackerUnavailable(RuntimeError):
    """A tracker's backend package is not installed."""


class Tracker(Protocol):
    """Something that mirrors one step's metrics somewhere; `close` flushes and releases it."""

    def log(self, metrics: Metrics, step: int) -> None: ...

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

    def close(self) -> None:
        """Finish the run.

        wandb-core writes the offline `.wandb` file a few ms after this returns; wandb's atexit
        hook (or `wandb.teardown()`) waits for it.
        """
        self._run.finish()


class TensorBoardTracker:
    """Writes one scalar per numeric metric to event files under `<run_dir>/tensorboard`."""

    def __init__(self, run_dir: Path) -> None:
        try:
            # torch ships the writer but needs the tensorboard package for the event format.
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise TrackerUnavailable(INSTALL_HINT) from e
        self._writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def log(self, metrics: Metrics, step: int) -> None:
        for key, value in metrics.items():
            # None marks a metric with no value this step (e.g. an eval that did not run).
            if isinstance(value, (int, float)):
                self._writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        self._writer.close()  # flushes pending events first


TRACKERS = ("wandb", "tensorboard")


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
