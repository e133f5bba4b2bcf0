"""Rollout examples: a training run's `generations.jsonl` as a paged, searchable, filterable table,
its CSV export, and one generation's trajectory read from the run's exchange.db.

    /train/<id>/rollouts[.json]?page=&per_page=&q=&step_min=&step_max=&decision=&precision=&worker=
                                &reward_min=&reward_max=&sort=
    /train/<id>/rollouts.csv?<same filters>        every matching row (no paging)
    /train/<id>/rollouts/<row>[.json]              one generation's turns, tool calls and tokens

Speed: each process keeps a `GenerationsIndex` per file, keyed by its size and mtime and extended
by reading only the bytes appended since: every line's byte offset (a newline scan, so a cold open
pages in file order at once) and, from the first request that filters, searches or sorts, the
scalar columns as numpy arrays and the text for search. A page then filters and sorts arrays and
parses just its own lines. Files stay the source of truth: nothing is written, not even a cache.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import sqlite3
import threading
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from pydantic import Field

from ..contracts import Record
from .data import DashboardError, Missing
from .runs import RunKind, discover, find_run

GENERATIONS = "generations.jsonl"
EXCHANGE_DB = "exchange.db"
TRAINING = (RunKind.train, RunKind.demo)
PER_PAGE_DEFAULT, PER_PAGE_MAX = 25, 500
EXPORT_PAGES = 10
"""Table pages a static export writes per training run (with their rows' generation pages and the CSV)."""
EAGER_COLUMNS_BYTES = 32 << 20
"""Below this size a table's first request reads every row's columns (filters, facets) at once."""
CACHED_RUNS = 8
"""Runs whose indexes are kept in memory at once (each run: generations.jsonl and token_logprobs.jsonl;
the least recently used goes first)."""

NUMERIC = ("step", "sample_index", "policy_version", "policy_lag", "reward", "trained_reward", "advantage",
           "tokens", "clipped_tokens")
CATEGORICAL = ("group_id", "task_id", "worker_id", "precision", "decision", "used")
TEXT = ("prompt", "response")
COLUMNS = ("row",) + NUMERIC[:1] + ("group_id", "task_id") + NUMERIC[1:4] + ("worker_id", "precision", "decision",
                                                                             "used") + NUMERIC[4:] + TEXT
"""Every column of the table, in the order generations.jsonl rows carry them (row first)."""
DEFAULT_COLUMNS = ("step", "reward", "prompt", "response", "decision", "advantage", "precision", "worker_id")
SORTABLE = ("row",) + NUMERIC + CATEGORICAL
FILTERS = ("q", "step_min", "step_max", "decision", "precision", "worker", "reward_min", "reward_max")


# ----------------------------------------------------------------------------- records


class GenerationRow(Record):
    """One line of generations.jsonl (fields an older run does not write are None)."""

    row: int = Field(description="0-based line number among the file's rows: the row's id in URLs.")
    step: int | None = None
    group_id: str | None = None
    task_id: str | None = None
    sample_index: int | None = None
    policy_version: int | None = None
    policy_lag: int | None = Field(default=None, description="Versions behind the trainer when the group was judged.")
    worker_id: str | None = None
    precision: str | None = None
    decision: str | None = Field(default=None, description="The gate's decision for the group.")
    used: bool | None = Field(default=None, description="Whether the run carried policy-gradient signal.")
    reward: float | None = None
    trained_reward: float | None = Field(default=None, description="The reward trained on (differs under shuffle).")
    advantage: float | None = None
    tokens: int | None = Field(default=None, description="Response tokens.")
    clipped_tokens: int | None = Field(default=None, description="Valid tokens with |Δlogp| past the gate's clamp.")
    prompt: str | None = None
    response: str | None = None
    error: str | None = Field(default=None, description="Why the line could not be read.")


class RolloutQuery(Record):
    """The table's query parameters, validated (bad values are a typed 400)."""

    page: int = 1
    per_page: int = PER_PAGE_DEFAULT
    q: str | None = Field(default=None, description="Case-insensitive substring of prompt, response or task id.")
    step_min: int | None = None
    step_max: int | None = None
    decision: str | None = None
    precision: str | None = None
    worker: str | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    sort: str = Field(default="row", description="A sortable column; a leading '-' sorts descending.")

    def params(self, **changes: Any) -> dict[str, str]:
        """The non-default parameters (with changes), as a link to another page of the table puts them."""
        data = {**self.model_dump(), **changes}
        defaults = RolloutQuery().model_dump()
        return {k: str(v) for k, v in data.items() if v is not None and v != defaults[k]}


class Facets(Record):
    """What the filters can choose from, over the whole file."""

    decisions: list[str]
    precisions: list[str]
    workers: list[str]
    step_min: int | None
    step_max: int | None


class RolloutsPage(Record):
    run_id: str
    query: RolloutQuery
    total: int = Field(description="Rows in generations.jsonl.")
    matched: int = Field(description="Rows that pass the filters and search.")
    pages: int = Field(description="Pages of `per_page` rows among the matched (at least 1).")
    rows: list[GenerationRow] = Field(description="This page's rows, in the requested order.")
    columns: list[str] = Field(description="Every column, in file order.")
    default_columns: list[str] = Field(description="The columns shown until the reader chooses others.")
    sortable: list[str]
    facets: Facets | None = Field(description="None until a filtered, searched or sorted request has read every "
                                              "row's columns (a cold open of a big file does not wait for them).")


class TokenCell(Record):
    """One response token with its behaviour logprob and, where the run saved it, the trainer's."""

    position: int = Field(description="Index among the trajectory's response tokens.")
    token_id: int
    text: str
    logprob: float | None = Field(description="The behaviour (rollout) logprob; None for tool output tokens.")
    trainer_logprob: float | None = Field(
        None, description="The trainer's teacher-forced logprob (token_logprobs.jsonl); None where not saved.")
    delta: float | None = Field(None, description="trainer_logprob − logprob (Δlogp).")


class ToolCallView(Record):
    """A tool call the model wrote in a segment, parsed as the agent parses it."""

    name: str
    arguments: str = Field(description="The arguments as JSON.")


class Segment(Record):
    """A run of response tokens from one source: the model (an action) or a tool's output."""

    kind: str = Field(description="'model' or 'tool'.")
    turn: int = Field(description="The turn (0-based, from turn_boundaries) the segment starts in.")
    text: str
    tokens: list[TokenCell]
    tool_calls: list[ToolCallView] = Field(default_factory=list, description="Calls in a model segment's text.")


class GroupReport(Record):
    """The gate's figures for the generation's group, from the exchange's decisions table."""

    status: str
    token_ess: float | None = None
    mean_abs_delta: float | None = None
    max_abs_delta: float | None = None
    clipped_fraction: float | None = None
    router_flip_rate: float | None = None
    reasons: list[str] = Field(default_factory=list)


class GenerationPage(Record):
    run_id: str
    generation: GenerationRow
    source: str | None = Field(description="Where the tokens came from ('exchange.db'), or None when unavailable.")
    note: str | None = Field(description="Why tokens are missing or uncoloured, in words.")
    worker_id: str | None = None
    engine: str | None = Field(default=None, description="The worker's engine name and version.")
    finish_reason: str | None = None
    n_tokens: int = 0
    mean_logprob: float | None = Field(default=None, description="Mean behaviour logprob over the model's tokens.")
    segments: list[Segment] = Field(default_factory=list)
    report: GroupReport | None = None


# ----------------------------------------------------------------------------- errors


def bad_parameter(name: str, message: str) -> DashboardError:
    return DashboardError(Missing.bad_query, message, parameter=name)


# ----------------------------------------------------------------------------- discovery


def training_runs(runs_dir: Path) -> list[Path]:
    """Every training (or demo) run directory with a generations.jsonl under `runs_dir`, by name."""
    found = discover(Path(runs_dir)).values()
    return sorted((f.path for f in found if f.kind in TRAINING and (f.path / GENERATIONS).is_file()),
                  key=lambda p: p.name)


def find_training_run(runs_dir: Path, run_id: str) -> Path:
    """The training run named `run_id` holding a generations.jsonl (runs.py's discovery); a typed 404
    otherwise."""
    path = find_run(runs_dir, run_id, TRAINING, GENERATIONS)
    if path is None:
        raise DashboardError(Missing.run, f"no training run {run_id!r} under {runs_dir}", run_id=run_id)
    return path


# ----------------------------------------------------------------------------- the index


def _num(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


class GenerationsIndex:
    """Every complete line of one generations.jsonl: its byte offset, and the columns filters,
    search and sort use.

    Offsets come from a newline scan, cheap enough for a cold open of a big file to page through it
    in file order at once; the columns cost a JSON parse of every line, done at once for a small
    file, else in a background thread after the first page (a filter that arrives first parses
    them itself). Both are extended with the bytes appended since (a running run appends whole
    lines after each step); a file that shrank or changed under the indexed part is indexed afresh.
    Callers hold `lock` around everything but `warm_in_background`."""

    def __init__(self, path: Path):
        self.path = path
        self.lock = threading.Lock()
        self.warming = threading.Event()
        """Set while a background thread parses columns (tests and the benchmark wait on it)."""
        self._reset()

    def _reset(self) -> None:
        self.generation = getattr(self, "generation", 0) + 1
        """Bumped by every reset, so a background parse of a replaced file is dropped."""
        self.end = 0
        """Byte offset just past the last indexed newline."""
        self.size = self.mtime_ns = -1
        self.tail = b""
        """The indexed part's last bytes, to tell an append from a rewrite."""
        self.offsets: list[int] = []
        self.numeric: dict[str, list[float]] = {c: [] for c in NUMERIC}
        self.codes: dict[str, list[int]] = {c: [] for c in CATEGORICAL}
        self.values: dict[str, dict[str, int]] = {c: {} for c in CATEGORICAL}
        self.prompt_codes: list[int] = []
        self.prompts: dict[str, int] = {}
        """Distinct prompts -> code: a group's runs share theirs, so search scans each once."""
        self.responses: list[str] = []
        """Response plus task id, per row, for search."""
        self.arrays: dict[str, np.ndarray] | None = None
        self.lowered: tuple[list[str], list[str]] | None = None
        """Prompts and responses lower-cased, made by the first search after the columns grow."""

    def refresh(self) -> None:
        """Index the lines appended since the last refresh (offsets only)."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            raise DashboardError(Missing.run, f"{self.path} is gone") from None
        if (st.st_size, st.st_mtime_ns) == (self.size, self.mtime_ns):
            return
        with open(self.path, "rb") as f:
            if st.st_size < self.end or (self.end and not self._same_tail(f)):
                self._reset()  # rewritten (a resumed run drops torn rows): start over
            f.seek(self.end)
            data = f.read(st.st_size - self.end)
        last = data.rfind(b"\n")
        pos = 0
        while pos <= last:
            nl = data.index(b"\n", pos)
            if data[pos:nl].strip():
                self.offsets.append(self.end + pos)
            pos = nl + 1
        if last >= 0:
            self.end += last + 1
            self.tail = (self.tail + data[:last + 1])[-64:]
        # A line still being written (no newline yet) shows on a later refresh.
        self.size, self.mtime_ns = st.st_size, st.st_mtime_ns

    def _same_tail(self, f) -> bool:
        f.seek(self.end - len(self.tail))
        return f.read(len(self.tail)) == self.tail

    def _code(self, column: str, value: Any) -> int:
        if value is None:
            return -1
        key = str(value).lower() if isinstance(value, bool) else str(value)
        return self.values[column].setdefault(key, len(self.values[column]))

    @property
    def has_columns(self) -> bool:
        return len(self.prompt_codes) == len(self.offsets)

    def _parse(self, offsets: list[int], first: int, last: int) -> list[dict]:
        """Rows [first, last) as dicts ({} for a line that is not a JSON object); reads only the file."""
        if first >= last:
            return []
        start = offsets[first]
        with open(self.path, "rb") as f:
            f.seek(start)
            data = f.read(offsets[last - 1] - start)
            data += f.readline()
        parsed = []
        for offset in offsets[first:last]:
            at = offset - start
            try:
                row = json.loads(data[at:data.index(b"\n", at)])
            except ValueError:
                row = None  # shown as the row's error when its page is read
            parsed.append(row if isinstance(row, dict) else {})
        return parsed

    def _append(self, parsed: list[dict]) -> None:
        for row in parsed:
            for c in NUMERIC:
                self.numeric[c].append(_num(row.get(c)))
            for c in CATEGORICAL:
                self.codes[c].append(self._code(c, row.get(c)))
            self.prompt_codes.append(self.prompts.setdefault(str(row.get("prompt") or ""), len(self.prompts)))
            self.responses.append(f"{row.get('response') or ''}\n{row.get('task_id') or ''}")
        if parsed:
            self.lowered = None

    def columns(self) -> dict[str, np.ndarray]:
        """The columns of every indexed row, parsing only the rows not parsed before (and converting
        only their values: the arrays of the rows before are kept and extended)."""
        self._append(self._parse(self.offsets, len(self.prompt_codes), len(self.offsets)))
        done = 0 if self.arrays is None else len(self.arrays["prompt"])
        if self.arrays is None or done < len(self.prompt_codes):
            lists = {**self.numeric, **self.codes, "prompt": self.prompt_codes}
            new = {c: np.asarray(v[done:], dtype=np.float64 if c in NUMERIC else np.int64) for c, v in lists.items()}
            self.arrays = new if self.arrays is None else {c: np.concatenate([self.arrays[c], new[c]]) for c in new}
        return self.arrays

    def warm_in_background(self) -> None:
        """Parse the missing columns in a thread, outside the lock (pages keep answering meanwhile),
        and add them under it unless a request or a rewrite got there first."""
        with self.lock:
            if self.warming.is_set() or self.has_columns:
                return
            self.warming.set()
            generation, offsets, first, last = self.generation, self.offsets, len(self.prompt_codes), len(self.offsets)

        def work() -> None:
            try:
                parsed = self._parse(offsets, first, last)
                with self.lock:
                    if self.generation == generation and len(self.prompt_codes) == first:
                        self._append(parsed)
            finally:
                self.warming.clear()

        threading.Thread(target=work, name="rollouts-columns", daemon=True).start()

    def search_text(self) -> tuple[list[str], list[str]]:
        """Distinct prompts and per-row responses, lower-cased (after `columns()`)."""
        if self.lowered is None:
            self.lowered = ([p.lower() for p in self.prompts], [r.lower() for r in self.responses])
        return self.lowered

    def __len__(self) -> int:
        return len(self.offsets)


_indexes: OrderedDict[str, GenerationsIndex] = OrderedDict()
_indexes_lock = threading.Lock()


def generations_index(run_dir: Path) -> GenerationsIndex:
    """The run's index, fresh as of now (cached per process, refreshed by size and mtime)."""
    return _line_index(Path(run_dir) / GENERATIONS)


def _line_index(path: Path) -> GenerationsIndex:
    """The index of any of a run's JSONL files (its offsets; columns only where a query asks for them)."""
    key = str(path.resolve())
    with _indexes_lock:
        index = _indexes.pop(key, None) or GenerationsIndex(path)  # (moved to the end: most recently used)
        _indexes[key] = index
        while len(_indexes) > 2 * CACHED_RUNS:
            _indexes.popitem(last=False)
    with index.lock:
        index.refresh()
    return index


# ----------------------------------------------------------------------------- queries


def parse_query(params: dict[str, str]) -> RolloutQuery:
    """The table's parameters from a request's query string; anything malformed is a typed 400."""
    known = set(RolloutQuery.model_fields)
    for name in params:
        if name not in known:
            raise bad_parameter(name, f"unknown parameter {name!r}; known: {', '.join(sorted(known))}")
    values: dict[str, Any] = {}
    for name, raw in params.items():
        if raw == "":
            continue  # an empty form field means "no filter"
        kind = RolloutQuery.model_fields[name].annotation
        try:
            if kind in (int, int | None):
                values[name] = int(raw)
            elif kind in (float, float | None):
                values[name] = float(raw)
                if not math.isfinite(values[name]):
                    raise ValueError
            else:
                values[name] = raw
        except ValueError:
            raise bad_parameter(name, f"{name}={raw[:100]!r} is not a{'n integer' if kind in (int, int | None) else ' number'}") from None
    query = RolloutQuery(**values)
    if query.page < 1:
        raise bad_parameter("page", f"page={query.page}: pages start at 1")
    if not 1 <= query.per_page <= PER_PAGE_MAX:
        raise bad_parameter("per_page", f"per_page={query.per_page}: between 1 and {PER_PAGE_MAX}")
    if query.sort.lstrip("-") not in SORTABLE:
        raise bad_parameter("sort", f"sort={query.sort[:100]!r}: one of {', '.join(SORTABLE)} (with '-' to sort descending)")
    return query


def _matching(index: GenerationsIndex, query: RolloutQuery) -> np.ndarray:
    """Row numbers passing the filters, in the requested order."""
    n = len(index)
    if query.sort in ("row", "-row") and not any(getattr(query, name) is not None for name in FILTERS):
        rows = np.arange(n)  # file order needs no columns: a cold open pages at once
        return rows[::-1] if query.sort == "-row" else rows
    cols = index.columns()
    mask = np.ones(n, dtype=bool)
    for name, column, op in (("step_min", "step", np.greater_equal), ("step_max", "step", np.less_equal),
                             ("reward_min", "reward", np.greater_equal), ("reward_max", "reward", np.less_equal)):
        bound = getattr(query, name)
        if bound is not None:
            mask &= op(cols[column], bound)  # NaN (missing) never passes a bound
    for name, column in (("decision", "decision"), ("precision", "precision"), ("worker", "worker_id")):
        wanted = getattr(query, name)
        if wanted is not None:
            mask &= cols[column] == index.values[column].get(wanted, -2)
    if query.q:
        needle = query.q.lower()
        prompts, responses = index.search_text()
        in_prompt = np.fromiter((needle in p for p in prompts), dtype=bool, count=len(prompts))
        found = in_prompt[cols["prompt"]] & mask
        for i in np.flatnonzero(mask & ~found):  # responses only where the prompt did not already match
            found[i] = needle in responses[i]
        mask = found
    rows = np.flatnonzero(mask)
    column = query.sort.lstrip("-")
    if column == "row":
        return rows[::-1] if query.sort.startswith("-") else rows
    if column in CATEGORICAL:
        # Codes in order of first appearance; rank them by their text.
        names = sorted(index.values[column], key=lambda v: v)
        rank = np.full(len(index.values[column]) + 1, len(names), dtype=np.float64)
        for r, name in enumerate(names):
            rank[index.values[column][name]] = r
        keys = rank[cols[column][rows]]  # code -1 (missing) indexes the last slot: sorts last
    else:
        keys = cols[column][rows]
    missing = np.isnan(keys)
    keys = np.where(missing, 0.0, keys)
    if query.sort.startswith("-"):
        keys = -keys
    # Missing values last either way, ties in file order.
    order = np.lexsort((rows, keys, missing))
    return rows[order]


def _read_rows(path: Path, offsets: list[int], rows: Iterator[int] | np.ndarray) -> Iterator[GenerationRow]:
    """The rows, parsed from their lines (`offsets` is the index's list as the rows were chosen from it:
    a rebuild replaces the list, so a CSV still streaming reads the lines it chose)."""
    with open(path, "rb") as f:
        for row in rows:
            row = int(row)
            f.seek(offsets[row])
            line = f.readline()
            try:
                data = json.loads(line)
                if not isinstance(data, dict):
                    raise ValueError(f"a JSON {type(data).__name__}, not an object")
                yield GenerationRow(row=row, **{k: v for k, v in data.items() if k in GenerationRow.model_fields
                                                and k != "row"})
            except ValueError as exc:  # pydantic's ValidationError is one too: a field of the wrong type
                yield GenerationRow(row=row, error=f"line {row + 1}: {str(exc)[:200]}")


def facets(index: GenerationsIndex) -> Facets:
    steps = index.columns()["step"]
    finite = steps[~np.isnan(steps)]
    return Facets(decisions=sorted(index.values["decision"]), precisions=sorted(index.values["precision"]),
                  workers=sorted(index.values["worker_id"]),
                  step_min=int(finite.min()) if finite.size else None,
                  step_max=int(finite.max()) if finite.size else None)


def rollouts_page(runs_dir: Path, run_id: str, query: RolloutQuery) -> RolloutsPage:
    """One page of the run's generations table."""
    index = generations_index(find_training_run(runs_dir, run_id))
    with index.lock:
        _warm_columns(index)
        rows = _matching(index, query)
        pages = max(1, math.ceil(len(rows) / query.per_page))
        if query.page > pages:
            raise bad_parameter("page", f"page={query.page}: the table has {pages} page(s) of {query.per_page}")
        start = (query.page - 1) * query.per_page
        shown = list(_read_rows(index.path, index.offsets, rows[start:start + query.per_page]))
        page = RolloutsPage(run_id=run_id, query=query, total=len(index), matched=len(rows), pages=pages,
                            rows=shown, columns=list(COLUMNS), default_columns=list(DEFAULT_COLUMNS),
                            sortable=list(SORTABLE), facets=facets(index) if index.has_columns else None)
    if page.facets is None:
        index.warm_in_background()
    return page


def _warm_columns(index: GenerationsIndex) -> None:
    """Read the columns now unless that would make a cold open of a big file wait: a small file, or
    one whose columns were read before (then only the appended rows are parsed). A big file's are
    read in the background after its first page."""
    if index.prompt_codes or index.end <= EAGER_COLUMNS_BYTES:
        index.columns()


def rollouts_csv(runs_dir: Path, run_id: str, query: RolloutQuery) -> Iterator[str]:
    """Every row passing the query's filters and search, in its order, as CSV (RFC 4180 quoting:
    prompts hold newlines, commas and quotes); paging is ignored."""
    index = generations_index(find_training_run(runs_dir, run_id))
    with index.lock:
        rows, offsets = _matching(index, query), index.offsets
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(COLUMNS)
    for row in _read_rows(index.path, offsets, rows):
        data = row.model_dump()
        writer.writerow(["" if data[c] is None else data[c] for c in COLUMNS])
        if buffer.tell() > 1 << 16:
            yield buffer.getvalue()
            buffer.seek(0)
            buffer.truncate()
    yield buffer.getvalue()


# ----------------------------------------------------------------------------- one generation


def _open_readonly(path: Path) -> sqlite3.Connection:
    """The exchange's database for reading, creating nothing beside it.

    mode=ro alone still creates `-wal` and `-shm` files next to a WAL database that has none (a
    finished run's exchange removed them on close) and leaves them there; such a database is
    complete in its main file, so it is opened immutable (no locks, no side files). While those
    files exist (a live exchange, or one that crashed), the writer owns them and mode=ro reads
    through them, seeing its latest commits."""
    live = any(path.with_name(path.name + suffix).exists() for suffix in ("-wal", "-shm"))
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro{'' if live else '&immutable=1'}", uri=True, timeout=5)
    conn.row_factory = sqlite3.Row
    return conn


def _tokenizer(run_dir: Path):
    """The run's tokenizer from its newest checkpoint (tokenizers only: the dashboard never loads torch).
    None without a checkpoint, or in a core install (`tokenizers` comes with the ml extra): the page
    then shows token ids."""
    candidates = sorted((run_dir / "checkpoints").glob("v*/tokenizer.json"), reverse=True)
    return _load_tokenizer(str(candidates[0])) if candidates else None


@lru_cache(maxsize=8)
def _load_tokenizer(path: str):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return Tokenizer.from_file(path)


_TOOL_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)


def _tool_calls(text: str) -> list[dict]:
    """The well-formed tool calls in a model's text, as `models.template.parse_tool_calls` finds them
    (not imported from there: the `models` package loads torch, which the dashboard never does)."""
    calls = []
    for match in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(match.group(1))
            args = obj.get("arguments", {}) if isinstance(obj, dict) else None
            args = json.loads(args) if isinstance(args, str) else args
        except (json.JSONDecodeError, AttributeError):
            continue
        if isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(args, dict):
            calls.append({"name": obj["name"], "arguments": args})
    return calls


TOKEN_LOGPROBS = "token_logprobs.jsonl"


def _trainer_logprobs(run_dir: Path, row: int, generation: GenerationRow, n_tokens: int) -> list | None:
    """The trainer's logprob of each response token of generations row `row`: line `row` of
    token_logprobs.jsonl, which the trainer writes beside each generations row in the same order.
    None when the run did not save it or the line is not this generation's."""
    path = run_dir / TOKEN_LOGPROBS
    if not path.is_file():
        return None
    try:
        index = _line_index(path)  # the same line index as generations.jsonl's, so row N means the same
        with index.lock:
            if row >= len(index.offsets):
                return None
            offset = index.offsets[row]
        with open(path, "rb") as f:
            f.seek(offset)
            saved = json.loads(f.readline())
    except (DashboardError, OSError, ValueError):
        return None
    same = (saved.get("step"), saved.get("group_id"), saved.get("sample_index")) == (
        generation.step, generation.group_id, generation.sample_index)
    values = saved.get("trainer_logprobs")
    return values if same and isinstance(values, list) and len(values) == n_tokens else None


def generation_page(runs_dir: Path, run_id: str, row: int) -> GenerationPage:
    """One generation: its row, and its tokens from the run's exchange.db (group by group_id,
    trajectory by sample_index), segmented into model turns and tool output."""
    run_dir = find_training_run(runs_dir, run_id)
    index = generations_index(run_dir)
    if not 0 <= row < len(index):
        raise DashboardError(Missing.row, f"run {run_id} has no row {row} ({len(index)} rows)", run_id=run_id, row=row)
    generation = next(_read_rows(index.path, index.offsets, [row]))
    page = dict(run_id=run_id, generation=generation, source=None)
    db = run_dir / EXCHANGE_DB
    if not db.is_file() or generation.group_id is None:
        return GenerationPage(**page, note="This run has no exchange.db: only the decoded text is shown.")
    from ..contracts.sample import SampleGroup
    from ..contracts.wire import unpackb

    try:
        conn = _open_readonly(db)
        try:
            stored = conn.execute("SELECT payload FROM groups WHERE group_id=?", (generation.group_id,)).fetchone()
            decided = conn.execute("SELECT status, body FROM decisions WHERE group_id=? ORDER BY seq DESC LIMIT 1",
                                   (generation.group_id,)).fetchone()
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise DashboardError(Missing.unreadable_run, f"{db}: {exc}") from None
    if stored is None:
        return GenerationPage(**page, note=f"Group {generation.group_id} is not in the run's exchange.db.")
    group = SampleGroup.model_validate(unpackb(stored["payload"]))
    trajectory = next((t for t in group.trajectories if t.sample_index == generation.sample_index), None)
    if trajectory is None or trajectory.response_token_ids is None:
        return GenerationPage(**page, note=f"Sample {generation.sample_index} of group {generation.group_id} "
                                           "has no tokens in the exchange.")
    report = None
    if decided is not None:
        body = json.loads(decided["body"])
        budget = body.get("report") or {}
        report = GroupReport(status=decided["status"], token_ess=budget.get("token_ess"),
                             mean_abs_delta=budget.get("mean_abs_delta"), max_abs_delta=budget.get("max_abs_delta"),
                             clipped_fraction=budget.get("clipped_fraction"),
                             router_flip_rate=budget.get("router_flip_rate"),
                             reasons=[str(r) for r in body.get("reasons") or []])
    ids_T = trajectory.response_token_ids.tolist()
    logprobs_T = trajectory.logprobs.tolist() if trajectory.logprobs is not None else [None] * len(ids_T)
    tool_T = trajectory.tool_output_mask.tolist() if trajectory.tool_output_mask is not None else [0] * len(ids_T)
    boundaries = sorted(b for b in trajectory.turn_boundaries if 0 <= b < len(ids_T))
    tokenizer = _tokenizer(run_dir)
    trainer_T = _trainer_logprobs(run_dir, row, generation, len(ids_T))
    runs: list[tuple[str, int, list[TokenCell]]] = []  # (kind, turn, tokens) of each segment
    for pos, (token_id, logprob, tool) in enumerate(zip(ids_T, logprobs_T, tool_T)):
        kind = "tool" if tool else "model"
        text = tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer else f"⟨{token_id}⟩"
        behaviour = None if tool else logprob
        trainer = None if tool or trainer_T is None else trainer_T[pos]
        cell = TokenCell(position=pos, token_id=token_id, text=text, logprob=behaviour, trainer_logprob=trainer,
                         delta=trainer - behaviour if trainer is not None and behaviour is not None else None)
        if not runs or runs[-1][0] != kind or pos in boundaries:
            runs.append((kind, sum(1 for b in boundaries if 0 < b <= pos), []))
        runs[-1][2].append(cell)
    segments = []
    for kind, turn, cells in runs:
        text = (tokenizer.decode([c.token_id for c in cells], skip_special_tokens=False) if tokenizer
                else "".join(c.text for c in cells))
        calls = [ToolCallView(name=c["name"], arguments=json.dumps(c["arguments"], ensure_ascii=False))
                 for c in (_tool_calls(text) if kind == "model" else [])]
        segments.append(Segment(kind=kind, turn=turn, tokens=cells, text=text, tool_calls=calls))
    model_lp = [lp for lp, tool in zip(logprobs_T, tool_T) if not tool and lp is not None]
    note = None if trainer_T is not None else (
        "This run saved no teacher-forced logprobs for this row (token_logprobs.jsonl; logging.token_logprobs), so "
        "tokens are coloured by how unlikely the behaviour policy found them; the gate's group figures are above.")
    return GenerationPage(**{**page, "source": EXCHANGE_DB}, note=note, worker_id=group.worker_id,
                          engine=f"{group.engine_name} {group.engine_version}",
                          finish_reason=trajectory.finish_reason.value, n_tokens=len(ids_T),
                          mean_logprob=sum(model_lp) / len(model_lp) if model_lp else None,
                          segments=segments, report=report)

