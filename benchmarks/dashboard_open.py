"""Dashboard: how long a big run's pages take to open, server side (issue 15, "Speed").

Each case writes a run into a temporary directory and times requests through the real app
(FastAPI's TestClient, in process: the time is the server's, no network, no browser):

    training run, 10,000 metrics rows of ~100 keys each, evals every 10 steps over 20 tasks x 8 samples
        first open      /train/<id>.json (and the HTML page) with nothing cached: every file parsed
        open again      the same requests: nothing changed, the parsed columns are reused
        live poll       one row appended, then /train/<id>/metrics.json?after=<last step>
        index           / with that run among 200 others

    naive       the same request with every cache emptied first: re-parsing every file on every
                request, what a dashboard without the (size, mtime) caches and the incremental
                reader would do (a first open is exactly that, so its ratio is 1)

    in Chromium the same run's page, served by `rollmarket dashboard` and opened from a static export
                (file://), in Debian's chromium: page bytes and the time from navigation to the
                default charts drawn (`performance.now()` once the first chart exists: train.js draws
                them all in one task), best of --browser-repeats in a fresh context each. "before" is
                the same with the source of --before (git archive of its src/, run with PYTHONPATH):
                the page that carried every metric inline.

Time is the app's own (its Server-Timing header: the page built and serialized, not the transfer),
the best of --repeats. Other pages add their cases with `@case(...)` (the rollouts table's 100,000
generations is one); each returns rows of {part, case, request, ms, naive_ms, bytes}, and
docs/render.py's dashboard blocks show every row.

    .venv/bin/python benchmarks/dashboard_open.py
    .venv/bin/python benchmarks/dashboard_open.py --steps 2000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from fastapi.testclient import TestClient
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the run writer the dashboard's tests use

from training_fixture import write_training_run  # noqa: E402

from rollmarket.dashboard import create_dashboard_app  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from _result import write_result  # noqa: E402

console = Console(width=max(Console().width, 120))
RUN = "20261126T000000Z-b16b16"
CASES: list[tuple[str, Callable[[Path, argparse.Namespace], list[dict]]]] = []
"""(name, function(work dir, args) -> rows), in the order they run."""


def case(name: str):
    """Register a benchmark case (a later part adds its own beside the training run's)."""
    def register(fn):
        CASES.append((name, fn))
        return fn
    return register


def empty_caches() -> None:
    """Forget everything the dashboard parsed: the naive baseline's every request starts here."""
    from rollmarket.dashboard import data, runs, training

    runs.TAIL._files.clear()
    runs.COLUMNS._cache.clear()
    for fn in (runs._read_json, runs._count_lines, training._eval_points, data._read_matrix, data._read_jsonl):
        fn.cache_clear()


def timed(client: TestClient, url: str, repeats: int, *, before: Callable[[], None] | None = None) -> tuple[float, int]:
    """The best server-side time of `repeats` GETs in ms (the app's Server-Timing header: the page
    built and serialized, not the transfer into the test client) and the response's size; `before`
    runs untimed before each."""
    best, size = float("inf"), 0
    for _ in range(repeats):
        if before:
            before()
        response = client.get(url)
        assert response.status_code == 200, (url, response.status_code, response.text[:300])
        best = min(best, float(response.headers["server-timing"].split("dur=")[1]))
        size = len(response.content)
    return best, size


@case("training run")
def training_run(work: Path, args) -> list[dict]:
    root = work / "train"
    run = write_training_run(root / RUN, args.steps, eval_every=10, tasks=20, samples=8, extra_keys=args.extra_keys,
                             generations=False)
    for i in range(args.others):  # an index with many runs
        write_training_run(root / f"20261125T00{i // 60:02d}{i % 60:02d}Z-0{i:05x}", 3, seed=i, generations=False)
    keys = len(json.loads((run / "metrics.jsonl").read_text().splitlines()[-1]))
    label = f"{args.steps:,} steps × {keys} keys"
    rows = []
    # The process's one-time costs (imports, scipy's t quantiles, templates) are paid on a small run
    # first: "first open" is the big run's parsing, not the interpreter's start.
    warm = write_training_run(work / "warm" / RUN, 5, generations=False)
    TestClient(create_dashboard_app(warm.parent)).get(f"/train/{RUN}")
    for request, url in (("twin", f"/train/{RUN}.json"), ("page", f"/train/{RUN}")):
        client = TestClient(create_dashboard_app(root))
        # A first open parses every file once: the same work as a naive request, so it is timed as
        # one (best of repeats, each after emptying the caches) and compared with nothing.
        first, size = timed(client, url, args.repeats, before=empty_caches)
        again, _ = timed(client, url, args.repeats)
        rows.append({"part": "training", "case": label, "request": f"first open: {request}", "ms": first,
                     "naive_ms": first, "bytes": size})
        rows.append({"part": "training", "case": label, "request": f"open again: {request}", "ms": again,
                     "naive_ms": first, "bytes": size})
    client = TestClient(create_dashboard_app(root))
    client.get(f"/train/{RUN}.json")
    step = args.steps
    best, naive = float("inf"), float("inf")
    for _ in range(args.repeats):
        step += 1
        with open(run / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "critic/rewards/mean": 0.5}) + "\n")
        ms, size = timed(client, f"/train/{RUN}/metrics.json?after={step - 1}", 1)
        best = min(best, ms)
        naive = min(naive, timed(client, f"/train/{RUN}/metrics.json?after={step - 1}", 1, before=empty_caches)[0])
    rows.append({"part": "training", "case": label, "request": "live poll: one new row", "ms": best, "naive_ms": naive,
                 "bytes": size})
    ms, size = timed(client, "/", args.repeats)
    naive, _ = timed(client, "/", args.repeats, before=empty_caches)
    rows.append({"part": "index", "case": f"index of {args.others + 1} runs", "request": "index page", "ms": ms,
                 "naive_ms": naive, "bytes": size})
    return rows


BEFORE = "c76f3ae"
"""The last commit whose training page carried every metric inline (the baseline of the browser case)."""
FIRST_CHART = """() => { const c = document.querySelector('#charts canvas');
                          return c && window.Chart && Chart.getChart(c) ? performance.now() : false; }"""


def source_at(ref: str, work: Path) -> Path:
    """The package source of `ref` (git archive of its src/), to run the dashboard of that commit."""
    out = work / f"src-{ref}"
    out.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "src"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out / "src"


def dashboard_cli(src: Path, *args: str, **popen) -> subprocess.Popen:
    """`rollmarket dashboard ARGS` with the package from `src` (PYTHONPATH comes before the install)."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.Popen([sys.executable, "-m", "rollmarket", "dashboard", *args], env=env, **popen)


def chart_ms(browser, url: str, repeats: int) -> float:
    """Best time in ms from navigation to the training page's first chart, each in a fresh context."""
    best = float("inf")
    for _ in range(repeats):
        context = browser.new_context(viewport={"width": 1400, "height": 900})
        try:
            page = context.new_page()
            page.goto(url, wait_until="commit", timeout=120_000)
            best = min(best, page.wait_for_function(FIRST_CHART, timeout=120_000, polling="raf").json_value())
        finally:
            context.close()
    return best


@case("training page in chromium")
def training_browser(work: Path, args) -> list[dict]:
    import httpx

    from rollmarket.localhost import free_port, wait_healthy

    sys.path.insert(0, str(REPO / "tests"))
    from dashboard_browser import chromium

    root = work / "browser"
    run = write_training_run(root / RUN, args.steps, eval_every=10, tasks=20, samples=8, extra_keys=args.extra_keys,
                             generations=False)
    keys = len(json.loads((run / "metrics.jsonl").read_text().splitlines()[-1]))
    label = f"{args.steps:,} steps × {keys} keys"
    measured: dict[str, dict[str, tuple[float, int]]] = {}
    with chromium() as browser:
        for version, src in (("before", source_at(args.before, work)), ("now", REPO / "src")):
            found = subprocess.run([sys.executable, "-c", "import rollmarket; print(rollmarket.__file__)"],
                                   env={**os.environ, "PYTHONPATH": str(src)}, capture_output=True, text=True)
            assert found.stdout.strip().startswith(str(src)), (version, found.stdout, found.stderr)
            port, log = free_port(), work / f"dashboard-{version}.log"
            with open(log, "w") as out:
                proc = dashboard_cli(src, "--runs", str(root), "--port", str(port), stdout=out,
                                     stderr=subprocess.STDOUT)
            try:
                url = f"http://127.0.0.1:{port}"
                wait_healthy(url, proc, log=log, timeout=120)
                size = len(httpx.get(f"{url}/train/{RUN}", timeout=120).content)
                measured.setdefault("served page", {})[version] = (
                    chart_ms(browser, f"{url}/train/{RUN}", args.browser_repeats), size)
            finally:
                proc.terminate()
                proc.wait(timeout=30)
            site = work / f"site-{version}"
            started = time.perf_counter()
            assert dashboard_cli(src, "--runs", str(root), "--static", str(site), stdout=subprocess.DEVNULL).wait() == 0
            console.print(f"{version}: static export in {time.perf_counter() - started:.1f} s")
            page_file = site / "train" / f"{RUN}.html"
            measured.setdefault("static page (file://)", {})[version] = (
                chart_ms(browser, page_file.as_uri(), args.browser_repeats), page_file.stat().st_size)
    return [{"part": "browser", "case": label, "request": f"chromium: {where} to charts drawn",
             "ms": got["now"][0], "naive_ms": got["before"][0], "bytes": got["now"][1],
             "before_bytes": got["before"][1]} for where, got in measured.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--extra-keys", type=int, default=60, help="Keys added to each row beyond the trainer's.")
    parser.add_argument("--others", type=int, default=199, help="Other runs beside the big one (the index).")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--browser-repeats", type=int, default=3, help="Page loads per version in Chromium.")
    parser.add_argument("--before", default=BEFORE, help="The commit the browser case compares with.")
    parser.add_argument("--cases", nargs="*", choices=[name for name, _ in CASES], help="Run only these cases "
                        "(and write --out with their rows only).")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "dashboard_open.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dashboard-open-"))
    try:
        rows = [row for name, fn in CASES if not args.cases or name in args.cases for row in fn(work, args)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = Table(title="dashboard: time to open (best of repeats; chromium rows: naive = before)")
    for column in ("case", "request", "ms", "naive ms", "× faster", "response"):
        table.add_column(column, justify="left" if column in ("case", "request") else "right")
    for r in rows:
        r["ratio"] = r["naive_ms"] / r["ms"]
        table.add_row(r["case"], r["request"], f"{r['ms']:.1f}", f"{r['naive_ms']:.1f}", f"{r['ratio']:.1f}×",
                      f"{r['bytes'] / 1e6:.2f} MB")
    console.print(table)
    write_result(args.out, "dashboard_open", args, rows)
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
