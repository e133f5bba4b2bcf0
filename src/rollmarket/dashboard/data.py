"""Every page's data, read from observatory run directories (files are the source of truth).

Each page is one record below; the HTML page renders it and its `.json` twin is its JSON dump, so
a test of the JSON is a test of what the page shows. Reads are cached by file size and mtime, so a
run being written shows its new files on the next request.
"""

from __future__ import annotations

import json
from enum import Enum
from functools import lru_cache
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from pydantic import Field, computed_field

from ..contracts import (
    AgentDivergenceReport,
    DenseMismatchReport,
    LengthPoint,
    PositionProfile,
    MatrixCell,
    ObservatoryMatrix,
    Record,
    RouterMismatchReport,
    WorstToken,
)
from ..contracts.errors import ErrorCode
from ..observatory import layout
from ..observatory.bands import Band, ess_band, flip_band
from ..observatory.layout import TrajectoryView, ViewToolCall

LOW_N = 30


# ----------------------------------------------------------------------------- errors


class Missing(str, Enum):
    """What a 404 could not find."""

    run = "unknown_run"
    rollout_engine = "unknown_rollout_engine"
    trainer_engine = "unknown_trainer_engine"
    trajectory = "unknown_trajectory"
    compare = "unknown_compare_engine"
    row = "unknown_row"
    """A table row (a generation) the run does not have."""
    campaign = "unknown_campaign"
    metric = "unknown_metric"
    """A ?metric= the campaign's runs do not log."""
    unreadable_run = "unreadable_run"
    """A file of the run (matrix.json, a report, a viewer file) does not parse (served as 500)."""
    bad_query = "bad_query"
    """A query parameter that is unknown, malformed or one the page cannot use (served as 400)."""
    no_market = "no_market"
    """/market without --exchange or --exchange-db, and no ?run=."""
    exchange_unreachable = "exchange_unreachable"
    """The exchange behind /market does not answer, or refuses the token (served as 502)."""
    unreadable_exchange_db = "unreadable_exchange_db"
    """The exchange database behind /market does not read (served as 502)."""
    probe = "unknown_probe"
    """/probe/<name> with no saved report <runs>/probes/<name>.json."""
    unreadable_probe = "unreadable_probe"
    """A saved probe report that does not parse as one (served as 500)."""


STATUS = {Missing.bad_query: 400, Missing.unreadable_run: 500, Missing.unreadable_probe: 500,
          Missing.exchange_unreachable: 502, Missing.unreadable_exchange_db: 502}
"""The HTTP status of each reason; every other one is a 404."""


class DashboardError(Exception):
    """A page that cannot be shown; the app answers it as a typed error with the reason's status
    (STATUS: 404 unless listed)."""

    def __init__(self, missing: Missing, message: str, **details: Any):
        super().__init__(message)
        self.missing = missing
        self.message = message
        self.details = details

    @property
    def status_code(self) -> int:
        return STATUS.get(self.missing, 404)

    @property
    def code(self) -> ErrorCode:
        """The error body's code: invalid_request for a 400, internal for a 5xx, else not_found."""
        status = self.status_code
        return ErrorCode.invalid_request if status == 400 else ErrorCode.internal if status >= 500 else ErrorCode.not_found


# ----------------------------------------------------------------------------- records of the pages


class TrajectoryRef(Record):
    """Where a trajectory page is: enough to link to it from a server or a static export."""

    run_id: str
    rollout_engine: str
    trajectory_id: str
    trainer_engine: str | None = Field(description="The trainer whose logprobs colour the tokens.")
    compare: str | None = Field(default=None, description="Another rollout engine shown side by side.")

    @computed_field(description="The page's path on the dashboard server.")
    @property
    def path(self) -> str:
        return trajectory_path(self)


def trajectory_path(ref: TrajectoryRef, *, json_twin: bool = False) -> str:
    """`/runs/<run>/trajectory/<rollout>/<id>[.json]?trainer=…&compare=…` with the id URL-encoded
    (ids hold `#` and `@`, which a browser would otherwise take for a fragment and userinfo)."""
    path = (f"/runs/{quote(ref.run_id, safe='')}/trajectory/{quote(ref.rollout_engine, safe='')}/"
            f"{quote(ref.trajectory_id, safe='')}{'.json' if json_twin else ''}")
    query = {k: v for k, v in (("trainer", ref.trainer_engine), ("compare", ref.compare)) if v}
    return path + ("?" + urlencode(query) if query else "")


class RunSummary(Record):
    """One observatory run as the index lists it."""

    run_id: str
    created_at: str | None
    model: str | None
    suite: str | None = None
    rollout_engines: list[str] = Field(default_factory=list)
    trainer_engines: list[str] = Field(default_factory=list)
    cells: int = 0
    divergences: int = 0
    moe: bool = Field(default=False, description="True when the run has router (MoE) fields.")
    error: str | None = Field(default=None, description="Why the run's matrix.json could not be read.")


class IndexPage(Record):
    runs_dir: str
    runs: list[RunSummary] = Field(description="Newest first.")


class Tile(Record):
    """One matrix tile: the cell as matrix.json has it, its bands and where a click goes."""

    cell: MatrixCell
    ess_band: Band
    flip_band: Band | None = Field(description="None for dense models (no router fields).")
    trajectory: TrajectoryRef | None = Field(description="The cell's worst trajectory, with its trainer selected.")


class TileRow(Record):
    rollout_engine: str
    tiles: list[Tile | None] = Field(description="One per trainer engine, in the matrix's order; None if not run.")


class WorstTokenCard(Record):
    """The largest-|Δ| token of a cell with its surroundings and a link to its trajectory."""

    rollout_engine: str
    trainer_engine: str
    worst_token: WorstToken
    trajectory: TrajectoryRef | None


class LengthSeries(Record):
    """ESS and mean |Δ| of one cell against the sampled max_tokens (the length-scaling charts)."""

    rollout_engine: str
    trainer_engine: str
    points: list[LengthPoint]


class DivergenceRow(Record):
    """Two rollout engines' runs of one task compared, with a link to them side by side."""

    trajectory_id: str
    report: AgentDivergenceReport
    view: TrajectoryRef | None = Field(description="engine_a's run with engine_b's beside it; None if not viewable.")


class RunPage(Record):
    run: RunSummary
    config: dict[str, Any] = Field(default_factory=dict, description="config.json as written by the run.")
    rollout_engines: list[str]
    trainer_engines: list[str]
    tiles: list[TileRow] = Field(description="Rows by rollout engine; the router matrix is drawn from the same "
                                             "tiles when run.moe.")
    worst_token: WorstTokenCard | None = Field(description="The largest-|Δ| token over all cells.")
    cell_worst_tokens: list[WorstTokenCard]
    length_scaling: list[LengthSeries]
    position_scaling: list[PositionProfile] = Field(
        default_factory=list, description="Per-token |Δ| and k3 by response position, per cell (probes).")
    divergence: list[DivergenceRow]


class TokenView(Record):
    """One response token with both engines' logprobs of it."""

    position: int = Field(description="Index among the trajectory's response tokens (tool output not counted).")
    text: str
    token_id: int
    rollout_logprob: float
    trainer_logprob: float | None = Field(description="None when the trainer did not score this trajectory.")
    delta: float | None = Field(description="trainer_logprob − rollout_logprob.")


class TurnView(Record):
    index: int
    new_messages: list[dict[str, Any]]
    tokens: list[TokenView]
    content: str
    tool_calls: list[ViewToolCall]
    finish_reason: str
    mean_abs_delta: float | None
    max_abs_delta: float | None
    divergent: bool = Field(default=False, description="The turn where this run and the compared one split.")
    split_at: int | None = Field(default=None, description="In the divergent turn: the index of the first token "
                                                           "that differs from the compared run's.")


class SideView(Record):
    """One rollout engine's run of the trajectory, with the selected trainer's Δ on each token."""

    rollout_engine: str
    trajectory_id: str
    task_id: str
    prompt: str
    final_answer: str | None
    terminal_reason: str
    reward: float | None
    expected: str | None
    has_trainer: bool = Field(description="Whether the selected trainer scored this run.")
    n_tokens: int
    mean_abs_delta: float | None
    worst_position: int | None = Field(description="Position of the largest-|Δ| token.")
    turns: list[TurnView]
    report: DenseMismatchReport | None = Field(description="The run's dense report for this trainer, if written.")
    router: RouterMismatchReport | None = None


class TrajectoryPage(Record):
    run_id: str
    trajectory_id: str
    rollout_engine: str
    trainer_engine: str
    trainer_engines: list[str]
    compare: str | None
    compare_options: list[str] = Field(description="Other rollout engines that ran this trajectory.")
    main: SideView
    other: SideView | None = Field(description="The compared engine's run, when ?compare= is given.")
    divergence: AgentDivergenceReport | None = Field(
        description="The divergence report of this task between the two engines shown (or any, without compare).")
    self_ref: TrajectoryRef


# ----------------------------------------------------------------------------- reading files


def _stat_key(path: Path) -> tuple[str, int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return str(path), st.st_mtime_ns, st.st_size


@lru_cache(maxsize=64)
def _read_matrix(key: tuple[str, int, int]) -> ObservatoryMatrix:
    return ObservatoryMatrix.model_validate_json(Path(key[0]).read_bytes())


@lru_cache(maxsize=64)
def _read_jsonl(key: tuple[str, int, int], kind: str) -> tuple:
    model = {"view": TrajectoryView, "dense": DenseMismatchReport, "router": RouterMismatchReport,
             "divergence": AgentDivergenceReport}[kind]
    records = []
    with open(key[0], encoding="utf-8") as f:
        lines = f.readlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(model.model_validate_json(line))
        except ValueError as exc:
            if number == len(lines) and not line.endswith("\n"):
                break  # the writer is mid-line: the record shows on the next read
            raise DashboardError(Missing.unreadable_run, f"{key[0]}: line {number}: {exc}") from None
    return tuple(records)


def read_jsonl(path: Path, kind: str) -> tuple:
    key = _stat_key(path)
    return () if key is None else _read_jsonl(key, kind)


class Runs:
    """The observatory runs under one directory: each child holding a matrix.json."""

    def __init__(self, runs_dir: Path):
        self.runs_dir = Path(runs_dir)

    def run_dir(self, run_id: str) -> Path:
        # Only names that are children of runs_dir are runs: '..' or a path never escapes it.
        path = self.runs_dir / run_id
        if "/" in run_id or run_id in (".", "..") or not (path / layout.MATRIX).is_file():
            raise DashboardError(Missing.run, f"no observatory run {run_id!r} under {self.runs_dir}", run_id=run_id)
        return path

    def matrix(self, run_id: str) -> ObservatoryMatrix:
        path = self.run_dir(run_id) / layout.MATRIX
        try:
            return _read_matrix(_stat_key(path))
        except (ValueError, OSError) as exc:
            raise DashboardError(Missing.unreadable_run, f"{path}: {exc}", run_id=run_id) from None

    def run_ids(self) -> list[str]:
        if not self.runs_dir.is_dir():
            return []
        return [p.name for p in self.runs_dir.iterdir() if (p / layout.MATRIX).is_file()]

    def views(self, run_id: str, rollout: str) -> dict[str, TrajectoryView]:
        return {v.trajectory_id: v for v in read_jsonl(layout.viewer_path(self.run_dir(run_id), rollout), "view")}

    def dense_reports(self, run_id: str, rollout: str, trainer: str) -> dict[str, DenseMismatchReport]:
        path = layout.dense_path(self.run_dir(run_id), rollout, trainer)
        return {r.trajectory_id: r for r in read_jsonl(path, "dense")}

    def router_reports(self, run_id: str, rollout: str, trainer: str) -> dict[str, RouterMismatchReport]:
        path = layout.router_path(self.run_dir(run_id), rollout, trainer)
        return {r.trajectory_id: r for r in read_jsonl(path, "router")}

    def divergence(self, run_id: str, matrix: ObservatoryMatrix) -> list[AgentDivergenceReport]:
        reports = read_jsonl(self.run_dir(run_id) / layout.DIVERGENCE, "divergence")
        return list(reports) or list(matrix.divergence)

    def config(self, run_id: str) -> dict[str, Any]:
        """The observatory's settings: observe.json where it ran inside a demo's run, else config.json."""
        run = self.run_dir(run_id)
        path = run / layout.EMBEDDED_CONFIG if (run / layout.EMBEDDED_CONFIG).exists() else run / layout.CONFIG
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    # ------------------------------------------------------------------------- pages

    def summary(self, run_id: str) -> RunSummary:
        try:
            m = self.matrix(run_id)
        except DashboardError as exc:
            return RunSummary(run_id=run_id, created_at=None, model=None, error=exc.message)
        return RunSummary(run_id=run_id, created_at=m.created_at, model=m.model, suite=m.suite,
                          rollout_engines=m.rollout_engines, trainer_engines=m.trainer_engines, cells=len(m.cells),
                          divergences=len(self.divergence(run_id, m)),
                          moe=any(c.router_flip_rate is not None for c in m.cells))

    def index_page(self) -> IndexPage:
        runs = [self.summary(r) for r in self.run_ids()]
        runs.sort(key=lambda s: (s.created_at or "", s.run_id), reverse=True)
        return IndexPage(runs_dir=str(self.runs_dir), runs=runs)

    def run_page(self, run_id: str) -> RunPage:
        m = self.matrix(run_id)
        summary = self.summary(run_id)
        viewable = {r: set(self.views(run_id, r)) for r in m.rollout_engines}

        def ref(rollout: str, trainer: str | None, tid: str | None, compare: str | None = None) -> TrajectoryRef | None:
            if tid is None or tid not in viewable.get(rollout, ()):
                return None
            if compare is not None and tid not in viewable.get(compare, ()):
                return None
            return TrajectoryRef(run_id=run_id, rollout_engine=rollout, trajectory_id=tid, trainer_engine=trainer,
                                 compare=compare)

        by_pair = {(c.rollout_engine, c.trainer_engine): c for c in m.cells}

        def tile(cell: MatrixCell | None) -> Tile | None:
            if cell is None:
                return None
            flip = cell.router_flip_rate
            return Tile(cell=cell, ess_band=ess_band(cell.token_ess.mean),
                        flip_band=None if flip is None else flip_band(flip.mean),
                        trajectory=ref(cell.rollout_engine, cell.trainer_engine, cell.worst_trajectory_id))

        rows = [TileRow(rollout_engine=r, tiles=[tile(by_pair.get((r, t))) for t in m.trainer_engines])
                for r in m.rollout_engines]
        cards = [WorstTokenCard(rollout_engine=c.rollout_engine, trainer_engine=c.trainer_engine,
                                worst_token=c.worst_token,
                                trajectory=ref(c.rollout_engine, c.trainer_engine, c.worst_trajectory_id))
                 for c in m.cells if c.worst_token is not None]
        worst = max(cards, key=lambda card: abs(card.worst_token.delta), default=None)
        series: dict[tuple[str, str], list[LengthPoint]] = {}
        for point in m.length_scaling:
            series.setdefault((point.rollout_engine, point.trainer_engine), []).append(point)
        lengths = [LengthSeries(rollout_engine=r, trainer_engine=t, points=sorted(p, key=lambda x: x.max_tokens))
                   for (r, t), p in series.items()]
        default_trainer = m.trainer_engines[0] if m.trainer_engines else None
        divergence = []
        for d in self.divergence(run_id, m):
            tid = layout.trajectory_id(d.task_id, d.sample_index)
            divergence.append(DivergenceRow(trajectory_id=tid, report=d,
                                            view=ref(d.engine_a, default_trainer, tid, compare=d.engine_b)))
        return RunPage(run=summary, config=self.config(run_id), rollout_engines=m.rollout_engines,
                       trainer_engines=m.trainer_engines, tiles=rows, worst_token=worst,
                       cell_worst_tokens=cards, length_scaling=lengths, position_scaling=m.position_scaling,
                       divergence=divergence)

    def trajectory_page(self, run_id: str, rollout: str, trajectory_id: str, *, trainer: str | None = None,
                        compare: str | None = None) -> TrajectoryPage:
        m = self.matrix(run_id)
        if rollout not in m.rollout_engines:
            raise DashboardError(Missing.rollout_engine, f"run {run_id} has no rollout engine {rollout!r}",
                                 rollout_engine=rollout, known=m.rollout_engines)
        views = self.views(run_id, rollout)
        if trajectory_id not in views:
            raise DashboardError(Missing.trajectory, f"no trajectory {trajectory_id!r} on {rollout} in run {run_id}",
                                 trajectory_id=trajectory_id, rollout_engine=rollout)
        view = views[trajectory_id]
        if trainer is None:
            scored = [t for t in m.trainer_engines if view.turns and t in view.turns[0].trainer_logprobs]
            trainer = (scored or m.trainer_engines or [""])[0]
        elif trainer not in m.trainer_engines:
            raise DashboardError(Missing.trainer_engine, f"run {run_id} has no trainer engine {trainer!r}",
                                 trainer_engine=trainer, known=m.trainer_engines)
        options = [r for r in m.rollout_engines if r != rollout and trajectory_id in self.views(run_id, r)]
        if compare is not None and compare not in options:
            raise DashboardError(Missing.compare, f"no run of {trajectory_id!r} on rollout engine {compare!r}",
                                 compare=compare, known=options)
        task_reports = [d for d in self.divergence(run_id, m)
                        if layout.trajectory_id(d.task_id, d.sample_index) == trajectory_id.split("@")[0]
                        and rollout in (d.engine_a, d.engine_b)]
        divergence = next((d for d in task_reports if compare in (d.engine_a, d.engine_b)), None) if compare \
            else next(iter(task_reports), None)
        split = divergence.first_divergent_step if divergence and compare else None
        other_view = self.views(run_id, compare)[trajectory_id] if compare else None
        split_at = _first_difference(view, other_view, split) if other_view is not None else None
        main = self._side(run_id, view, trainer, split, split_at)
        other = self._side(run_id, other_view, trainer, split, split_at) if other_view is not None else None
        ref = TrajectoryRef(run_id=run_id, rollout_engine=rollout, trajectory_id=trajectory_id, trainer_engine=trainer,
                            compare=compare)
        return TrajectoryPage(run_id=run_id, trajectory_id=trajectory_id, rollout_engine=rollout,
                              trainer_engine=trainer, trainer_engines=m.trainer_engines, compare=compare,
                              compare_options=options, main=main, other=other, divergence=divergence, self_ref=ref)

    def _side(self, run_id: str, view: TrajectoryView, trainer: str, split: int | None,
              split_at: int | None = None) -> SideView:
        turns, position, deltas = [], 0, []
        worst: tuple[float, int] | None = None
        for turn in view.turns:
            trainer_lp = turn.trainer_logprobs.get(trainer)
            tokens = []
            for i, text in enumerate(turn.tokens):
                t_lp = trainer_lp[i] if trainer_lp is not None and i < len(trainer_lp) else None
                delta = None if t_lp is None else t_lp - turn.rollout_logprobs[i]
                tokens.append(TokenView(position=position, text=text, token_id=turn.token_ids[i],
                                        rollout_logprob=turn.rollout_logprobs[i], trainer_logprob=t_lp, delta=delta))
                if delta is not None:
                    deltas.append(abs(delta))
                    if worst is None or abs(delta) > worst[0]:
                        worst = (abs(delta), position)
                position += 1
            turn_abs = [abs(t.delta) for t in tokens if t.delta is not None]
            turns.append(TurnView(index=turn.index, new_messages=turn.new_messages, tokens=tokens, content=turn.content,
                                  tool_calls=turn.tool_calls, finish_reason=turn.finish_reason,
                                  mean_abs_delta=sum(turn_abs) / len(turn_abs) if turn_abs else None,
                                  max_abs_delta=max(turn_abs, default=None), divergent=turn.index == split,
                                  split_at=split_at if turn.index == split else None))
        return SideView(rollout_engine=view.rollout_engine, trajectory_id=view.trajectory_id, task_id=view.task_id,
                        prompt=view.prompt, final_answer=view.final_answer, terminal_reason=view.terminal_reason,
                        reward=view.reward, expected=view.expected, has_trainer=bool(deltas), n_tokens=position,
                        mean_abs_delta=sum(deltas) / len(deltas) if deltas else None,
                        worst_position=None if worst is None else worst[1], turns=turns,
                        report=self.dense_reports(run_id, view.rollout_engine, trainer).get(view.trajectory_id),
                        router=self.router_reports(run_id, view.rollout_engine, trainer).get(view.trajectory_id))

    def trajectory_refs(self, run_id: str) -> list[TrajectoryRef]:
        """Every trajectory page of a run, once per trainer (what a static export writes)."""
        m = self.matrix(run_id)
        return [TrajectoryRef(run_id=run_id, rollout_engine=r, trajectory_id=tid, trainer_engine=t)
                for r in m.rollout_engines for tid in self.views(run_id, r) for t in m.trainer_engines]


def _first_difference(a: TrajectoryView, b: TrajectoryView, turn: int | None) -> int | None:
    """Index of the first token of turn `turn` whose text differs between two runs."""
    turns_a = {t.index: t for t in a.turns}
    turns_b = {t.index: t for t in b.turns}
    if turn is None or turn not in turns_a or turn not in turns_b:
        return None
    x, y = turns_a[turn].tokens, turns_b[turn].tokens
    return next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None if len(x) == len(y) else min(len(x), len(y)))

