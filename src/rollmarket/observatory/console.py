"""The mismatch matrix as rich tables on a console (`rollmarket observe`, and the demos' --observe)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from .bands import Band, ess_band, flip_band


STYLE = {Band.green: "green", Band.amber: "yellow", Band.red: "red", Band.none: "dim"}
"""The console's colour of each band (observatory.bands)."""


def ess_style(value: float | None) -> str:
    return STYLE[ess_band(value)]


def flip_style(value: float | None) -> str:
    return STYLE[flip_band(value)]


def print_matrix(matrix, out: Console) -> None:
    """The dense and router matrices as tables: token ESS [95% interval], mean |Δlogp| and k3 per
    tile; a `+replay` trainer engine (router replay) sits beside the same engine without it, and a
    cell with no numbers says why."""
    dense = Table(title=f"token ESS (mean |Δlogp|, k3) — rows: rollout engine, columns: trainer engine "
                        f"(+replay: router replay), {matrix.model}")
    dense.add_column("rollout \\ trainer")
    for t in matrix.trainer_engines:
        dense.add_column(t, justify="right")
    cells = {(c.rollout_engine, c.trainer_engine): c for c in matrix.cells}
    for r in matrix.rollout_engines:
        row = [r]
        for t in matrix.trainer_engines:
            c = cells[(r, t)]
            e = c.token_ess
            if e.mean is None:
                row.append(f"[dim]absent: {c.absent}[/]" if c.absent else "-")
                continue
            row.append(f"[{ess_style(e.mean)}]{e.mean:.4f}[/] [{e.lo:.4f}, {e.hi:.4f}]\n"
                       f"|Δ| {c.mean_abs_delta.mean:.2e}  k3 {c.kl_k3.mean:.2e}\n"
                       f"n={c.n}{' (n<30)' if c.low_n else ''}")
        dense.add_row(*row, end_section=True)
    out.print(dense)
    if any(c.router_flip_rate is not None for c in matrix.cells):
        router = Table(title="router flip rate (top-1 expert differs per token and MoE layer; +replay: measured "
                             "from the experts the replayed forward used, zero by construction)")
        router.add_column("rollout \\ trainer")
        for t in matrix.trainer_engines:
            router.add_column(t, justify="right")
        for r in matrix.rollout_engines:
            row = [r]
            for t in matrix.trainer_engines:
                f = cells[(r, t)].router_flip_rate
                c = cells[(r, t)]
                row.append(("[dim]absent[/]" if c.absent else "-") if f is None or f.mean is None else
                           f"[{flip_style(f.mean)}]{f.mean:.2%}[/] [{f.lo:.2%}, {f.hi:.2%}]\n"
                           f"{c.tokens} tok, worst layer {c.worst_layer}")
            router.add_row(*row, end_section=True)
        out.print(router)
