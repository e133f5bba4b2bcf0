"""Rendering: where each page lives (on the server and in a static export), relative links between
them, and the jinja2 templates that turn a page record from `data` into HTML."""

from __future__ import annotations

import math
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape

from ..contracts import Interval, Record
from .data import TrajectoryRef, trajectory_path

HERE = Path(__file__).parent
TEMPLATES = HERE / "templates"
STATIC = HERE / "static"
DELTA_SATURATION = 0.5
"""|Δlogp| at which a token's colour is fully saturated in the viewer."""


@dataclass(frozen=True)
class Page:
    """One page of the dashboard, independent of whether a server or a folder of files serves it."""

    kind: str
    """index, run, trajectory, metrics, train, train-metrics, train-columns, rollouts, rollouts_csv, generation, campaign,
    questions, market, probe, static, or raw (a server path as requested, for error pages)."""
    run_id: str | None = None
    """The run's id; for a campaign page, the campaign's."""
    ref: TrajectoryRef | None = None
    asset: str | None = None
    query: str | None = None
    """The query string a served page was asked with (its twin keeps it; a campaign page's chosen
    metrics, `metric=…&metric=…`); a static export has none."""
    params: tuple[tuple[str, str], ...] = ()
    """A rollouts table's non-default query parameters, sorted."""
    row: int | None = None

    @classmethod
    def index(cls) -> Page:
        return cls("index")

    @classmethod
    def metrics(cls) -> Page:
        return cls("metrics")

    @classmethod
    def run(cls, run_id: str) -> Page:
        return cls("run", run_id=run_id)

    @classmethod
    def trajectory(cls, ref: TrajectoryRef) -> Page:
        return cls("trajectory", run_id=ref.run_id, ref=ref)

    @classmethod
    def train(cls, run_id: str, query: str | None = None) -> Page:
        return cls("train", run_id=run_id, query=query or None)

    @classmethod
    def train_metrics(cls, run_id: str) -> Page:
        """The incremental twin a running run's page polls: `?after=<step>` gives the newer steps."""
        return cls("train-metrics", run_id=run_id)

    @classmethod
    def train_columns(cls, run_id: str, key: str | None = None) -> Page:
        """Columns the training page fetches when its chooser picks them: on a server one route
        (`?keys=K…`); in a static export one script per metric (`key`; None: their folder)."""
        return cls("train-columns", run_id=run_id, asset=key)

    @classmethod
    def rollouts(cls, run_id: str, params: dict[str, str] | None = None, *, csv: bool = False) -> Page:
        return cls("rollouts_csv" if csv else "rollouts", run_id=run_id, params=tuple(sorted((params or {}).items())))

    @classmethod
    def generation(cls, run_id: str, row: int) -> Page:
        return cls("generation", run_id=run_id, row=row)

    @classmethod
    def campaign(cls, campaign_id: str, metrics: list[str] | None = None) -> Page:
        return cls("campaign", run_id=campaign_id, query=urlencode([("metric", m) for m in metrics or []]) or None)

    @classmethod
    def questions(cls) -> Page:
        return cls("questions")

    @classmethod
    def market(cls, run_id: str | None = None) -> Page:
        """The marketplace: the dashboard's exchange, or with `run_id` that training run's exchange.db."""
        return cls("market", run_id=run_id)

    @classmethod
    def probe(cls, name: str) -> Page:
        """A saved endpoint probe report (`rollmarket probe --out RUNS/probes/NAME.json`)."""
        return cls("probe", run_id=name)

    @classmethod
    def static(cls, asset: str) -> Page:
        return cls("static", asset=asset)


def server_path(page: Page, *, json_twin: bool = False) -> str:
    """The absolute path (with query) the dashboard server answers this page on."""
    ext = ".json" if json_twin else ""
    query = f"?{page.query}" if page.query else ""
    if page.kind == "index":
        return ("/index.json" if json_twin else "/") + query
    if page.kind == "train":
        return f"/train/{quote(page.run_id, safe='')}{ext}{query}"
    if page.kind == "train-metrics":
        return f"/train/{quote(page.run_id, safe='')}/metrics.json"
    if page.kind == "train-columns":
        return f"/train/{quote(page.run_id, safe='')}/columns.json"
    if page.kind == "campaign":
        return f"/campaigns/{quote(page.run_id, safe='')}{ext}{query}"
    if page.kind in ("metrics", "questions"):
        return f"/{page.kind}{ext}"
    if page.kind == "run":
        return f"/runs/{quote(page.run_id, safe='')}{ext}"
    if page.kind == "trajectory":
        return trajectory_path(page.ref, json_twin=json_twin)
    if page.kind in ("rollouts", "rollouts_csv"):
        ext = ".csv" if page.kind == "rollouts_csv" else ext
        return f"/train/{quote(page.run_id, safe='')}/rollouts{ext}" + ("?" + urlencode(page.params) if page.params else "")
    if page.kind == "generation":
        return f"/train/{quote(page.run_id, safe='')}/rollouts/{page.row}{ext}"
    if page.kind == "market":
        return f"/market{ext}" + (f"?{urlencode({'run': page.run_id})}" if page.run_id else "")
    if page.kind == "probe":
        return f"/probe/{quote(page.run_id, safe='')}{ext}"
    if page.kind == "raw":
        return page.asset + ("" if not json_twin or page.asset.endswith(".json") else ".json")
    return f"/static/{page.asset}"


def slug(name: str) -> str:
    """A file-name-safe, URL-safe, reversible spelling: other characters become ~XX (hex)."""
    return re.sub(r"[^A-Za-z0-9_.-]", lambda m: "".join(f"~{b:02x}" for b in m.group().encode()), name)


def file_path(page: Page, *, json_twin: bool = False) -> str:
    """The page's file in a static export, relative to its root."""
    ext = ".json" if json_twin else ".html"
    if page.kind in ("index", "metrics", "questions"):
        return page.kind + ext
    if page.kind == "market":
        return f"market{ext}" if page.run_id is None else f"market/{slug(page.run_id)}{ext}"
    if page.kind == "run":
        return f"runs/{slug(page.run_id)}{ext}"
    if page.kind == "train":
        return f"train/{slug(page.run_id)}{ext}"
    if page.kind == "train-metrics":
        return f"train/{slug(page.run_id)}/metrics.json"
    if page.kind == "train-columns":
        # A script, not JSON: a page opened from file:// may add a <script> but not fetch a file.
        return f"train/{slug(page.run_id)}/columns/" + (f"{slug(page.asset)}.js" if page.asset is not None else "")
    if page.kind == "campaign":
        return f"campaigns/{slug(page.run_id)}{ext}"
    if page.kind == "trajectory":
        ref = page.ref
        name = f"{slug(ref.trajectory_id)}__{slug(ref.trainer_engine or '')}"
        if ref.compare:
            name += f"__vs__{slug(ref.compare)}"
        return f"runs/{slug(ref.run_id)}/trajectory/{slug(ref.rollout_engine)}/{name}{ext}"
    if page.kind == "rollouts":
        # Only plain pages are exported (page=N, nothing else): a filtered page is not among the files.
        params = dict(page.params)
        number = params.pop("page", "1")
        suffix = "" if number == "1" else f"-page{slug(number)}"
        extra = "".join(f"~{slug(k)}={slug(v)}" for k, v in sorted(params.items()))
        return f"train/{slug(page.run_id)}/rollouts{suffix}{extra}{ext}"
    if page.kind == "rollouts_csv":
        extra = "".join(f"~{slug(k)}={slug(v)}" for k, v in page.params)
        return f"train/{slug(page.run_id)}/rollouts{extra}.csv"
    if page.kind == "generation":
        return f"train/{slug(page.run_id)}/rollouts/{page.row}{ext}"
    if page.kind == "probe":
        return f"probe/{slug(page.run_id)}{ext}"
    return f"static/{page.asset}"


class Linker:
    """Relative links from the page being rendered, so that a served dashboard works under any
    prefix and a static export works from file:// with no server."""

    def __init__(self, here: Page, *, static: bool, exported: set[str] | None = None):
        self.here = here
        self.static = static
        self.exported = exported

    def _target(self, page: Page, json_twin: bool) -> str:
        return file_path(page, json_twin=json_twin) if self.static else server_path(page, json_twin=json_twin)

    def href(self, page: Page, *, json_twin: bool = False, fragment: str | None = None) -> str:
        target = self._target(page, json_twin)
        path, _, query = target.partition("?")
        here = self._target(self.here, False).partition("?")[0]
        # Relative to the target's folder, then its name: '../R', never '..' (a browser makes that '/runs/R/').
        folder, name = posixpath.split("/" + path.lstrip("/"))
        up = posixpath.relpath(folder, posixpath.dirname("/" + here.lstrip("/")))
        rel = f"{up}/{name}" if up != "." or not name else name
        return rel + (f"?{query}" if query else "") + (f"#{fragment}" if fragment else "")

    def has(self, page: Page) -> bool:
        """Whether the page exists where these links go (a static export writes a chosen set)."""
        return not self.static or self.exported is None or file_path(page) in self.exported

    # Shorthands for the templates.
    def index(self) -> str:
        return self.href(Page.index())

    def metrics(self, fragment: str | None = None) -> str:
        return self.href(Page.metrics(), fragment=fragment)

    def run(self, run_id: str) -> str:
        return self.href(Page.run(run_id))

    def train(self, run_id: str) -> str | None:
        """A training run's page; None where a static export did not write it."""
        page = Page.train(run_id)
        return self.href(page) if self.has(page) else None

    def train_metrics(self, run_id: str) -> str:
        return self.href(Page.train_metrics(run_id))

    def train_columns(self, run_id: str) -> str:
        """Where the page fetches a metric it did not carry: the server's route, or the export's folder."""
        return self.href(Page.train_columns(run_id))

    def campaign(self, campaign_id: str) -> str | None:
        """A campaign's page; None where a static export did not write it."""
        page = Page.campaign(campaign_id)
        return self.href(page) if self.has(page) else None

    def observatory(self, run_id: str) -> str | None:
        page = Page.run(run_id)
        return self.href(page) if self.has(page) else None

    def questions(self) -> str:
        return self.href(Page.questions())

    def trajectory(self, ref: TrajectoryRef, *, trainer: str | None = None, compare: str | None | bool = False,
                   fragment: str | None = None) -> str | None:
        """A link to `ref`, optionally with another trainer or compare engine; None if not exported."""
        changes: dict[str, Any] = {}
        if trainer is not None:
            changes["trainer_engine"] = trainer
        if compare is not False:
            changes["compare"] = compare
        page = Page.trajectory(ref.model_copy(update=changes) if changes else ref)
        return self.href(page, fragment=fragment) if self.has(page) else None

    def rollouts(self, run_id: str, params: dict[str, str] | None = None, *, csv: bool = False) -> str | None:
        """A page (or the CSV) of a run's rollouts table with these query parameters; None if not exported."""
        page = Page.rollouts(run_id, params, csv=csv)
        return self.href(page) if self.has(page) else None

    def generation(self, run_id: str, row: int) -> str | None:
        page = Page.generation(run_id, row)
        return self.href(page) if self.has(page) else None

    def market(self, run_id: str | None = None) -> str | None:
        """A link to the marketplace; None in a static export that has none."""
        page = Page.market(run_id)
        return self.href(page) if self.has(page) else None

    def probe(self, name: str) -> str | None:
        """A saved probe report's page; None where a static export did not write it (not a report)."""
        page = Page.probe(name)
        return self.href(page) if self.has(page) else None

    def asset(self, name: str) -> str:
        return self.href(Page.static(name))

    def twin(self) -> str:
        return self.href(self.here, json_twin=True)


# ----------------------------------------------------------------------------- formatting


def num(value: float | None, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return f"{value:.{digits}f}"


def signed(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "—"
    return f"{value:+.{digits}f}"


def pct(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{100 * value:.{digits}f}%"


def interval(value: Interval | None, kind: str = "num") -> str:
    if value is None or value.lo is None or value.hi is None:
        return "[—]"
    f = pct if kind == "pct" else num
    return f"[{f(value.lo)}, {f(value.hi)}]"


def delta_style(delta: float | None) -> str:
    """A diverging colour for Δ: blue when the trainer likes the token more, red when less."""
    if delta is None:
        return ""
    alpha = min(1.0, abs(delta) / DELTA_SATURATION)
    rgb = "33,102,172" if delta > 0 else "178,24,43"
    ink = ";color:#fff" if alpha > 0.55 else ""
    return f"background:rgba({rgb},{alpha:.3f}){ink}"


SURPRISE_SATURATION = 4.0
"""−logprob at which a token's shade is full on the generation page."""


def surprise_style(logprob: float | None) -> str:
    """A shade for an unlikely token (no trainer logprobs to take a Δ against): amber, fuller as the
    behaviour policy's logprob of it falls; none for a token it was sure of or tool output."""
    if logprob is None or not math.isfinite(logprob):
        return ""
    alpha = min(1.0, max(0.0, -logprob) / SURPRISE_SATURATION)
    return f"background:rgba(214,137,16,{alpha:.3f})" if alpha >= 0.01 else ""


def token_text(text: str) -> str:
    """Whitespace made visible enough to hover: a newline shows as ↵ and still breaks the line."""
    return text.replace("\n", "↵\n")


def tip(token, trainer: str) -> str:
    return (f"rollout logprob {num(token.rollout_logprob)} · trainer ({trainer}) logprob "
            f"{num(token.trainer_logprob)} · Δ {signed(token.delta)}")


class _Lazy:
    """A page record's JSON, made only when a template uses it: `data.x` (its model_dump) or
    `page_json` (its JSON text, safe inside a <script> element). A training page's record can hold
    10,000 steps of a hundred metrics; pages that do not use a form do not pay for it."""

    def __init__(self, record: Record):
        self._record = record
        self._dump: dict | None = None

    def _data(self) -> dict:
        if self._dump is None:
            self._dump = self._record.model_dump(mode="json")
        return self._dump

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return self._data()[name]
        except KeyError:
            raise AttributeError(name) from None

    def __getitem__(self, name: str) -> Any:
        return self._data()[name]

    def __html__(self) -> str:
        # '<', '>' and '&' only occur inside JSON strings, where their \u escapes mean the same.
        text = self._record.model_dump_json()
        return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


class Renderer:
    """The jinja2 environment with the dashboard's filters."""

    def __init__(self) -> None:
        self.env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(["html"]),
                               undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
        self.env.filters.update(num=num, signed=signed, pct=pct, interval=interval, delta_style=delta_style, surprise_style=surprise_style,
                                token_text=token_text)
        self.env.globals.update(tip=tip, delta_saturation=DELTA_SATURATION)

    def render(self, template: str, page: Record, link: Linker, **extra: Any) -> str:
        lazy = _Lazy(page)
        return self.env.get_template(template).render(page=page, data=lazy, page_json=lazy, link=link, **extra)
