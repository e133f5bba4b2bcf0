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
    """index, run, trajectory, metrics, market, static, or raw (a server path as requested, for error pages)."""
    run_id: str | None = None
    ref: TrajectoryRef | None = None
    asset: str | None = None

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
    def market(cls, run_id: str | None = None) -> Page:
        """The marketplace: the dashboard's exchange, or with `run_id` that training run's exchange.db."""
        return cls("market", run_id=run_id)

    @classmethod
    def static(cls, asset: str) -> Page:
        return cls("static", asset=asset)


def server_path(page: Page, *, json_twin: bool = False) -> str:
    """The absolute path (with query) the dashboard server answers this page on."""
    ext = ".json" if json_twin else ""
    if page.kind == "index":
        return "/index.json" if json_twin else "/"
    if page.kind == "metrics":
        return f"/metrics{ext}"
    if page.kind == "run":
        return f"/runs/{quote(page.run_id, safe='')}{ext}"
    if page.kind == "trajectory":
        return trajectory_path(page.ref, json_twin=json_twin)
    if page.kind == "market":
        return f"/market{ext}" + (f"?{urlencode({'run': page.run_id})}" if page.run_id else "")
    if page.kind == "raw":
        return page.asset + ("" if not json_twin or page.asset.endswith(".json") else ".json")
    return f"/static/{page.asset}"


def slug(name: str) -> str:
    """A file-name-safe, URL-safe, reversible spelling: other characters become ~XX (hex)."""
    return re.sub(r"[^A-Za-z0-9_.-]", lambda m: "".join(f"~{b:02x}" for b in m.group().encode()), name)


def file_path(page: Page, *, json_twin: bool = False) -> str:
    """The page's file in a static export, relative to its root."""
    ext = ".json" if json_twin else ".html"
    if page.kind in ("index", "metrics"):
        return page.kind + ext
    if page.kind == "market":
        return f"market{ext}" if page.run_id is None else f"market/{slug(page.run_id)}{ext}"
    if page.kind == "run":
        return f"runs/{slug(page.run_id)}{ext}"
    if page.kind == "trajectory":
        ref = page.ref
        name = f"{slug(ref.trajectory_id)}__{slug(ref.trainer_engine or '')}"
        if ref.compare:
            name += f"__vs__{slug(ref.compare)}"
        return f"runs/{slug(ref.run_id)}/trajectory/{slug(ref.rollout_engine)}/{name}{ext}"
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

    def market(self, run_id: str | None = None) -> str | None:
        """A link to the marketplace; None in a static export that has none."""
        page = Page.market(run_id)
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


def token_text(text: str) -> str:
    """Whitespace made visible enough to hover: a newline shows as ↵ and still breaks the line."""
    return text.replace("\n", "↵\n")


def tip(token, trainer: str) -> str:
    return (f"rollout logprob {num(token.rollout_logprob)} · trainer ({trainer}) logprob "
            f"{num(token.trainer_logprob)} · Δ {signed(token.delta)}")


class Renderer:
    """The jinja2 environment with the dashboard's filters."""

    def __init__(self) -> None:
        self.env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(["html"]),
                               undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
        self.env.filters.update(num=num, signed=signed, pct=pct, interval=interval, delta_style=delta_style,
                                token_text=token_text)
        self.env.globals.update(tip=tip, delta_saturation=DELTA_SATURATION)

    def render(self, template: str, page: Record, link: Linker, **extra: Any) -> str:
        data = page.model_dump(mode="json")
        return self.env.get_template(template).render(page=page, data=data, link=link, **extra)
