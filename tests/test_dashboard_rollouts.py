"""The rollout examples table (/train/<id>/rollouts), its CSV, and one generation's page.

A training run is written in code: generations.jsonl with prompts that hold newlines, commas,
quotes and non-ASCII text, an exchange.db made with the exchange's own schema holding each group's
msgpack payload (token ids, behaviour logprobs, a tool's output) and the gate's decision, and a
word-level tokenizer.json. The run sits four levels deep, as a campaign's runs do. Expected values
are computed here from the rows as written, never by the code under test. The browser half drives
the real `rollmarket dashboard` process in Debian's chromium. Screenshots: test-artifacts/dashboard/.
"""

from __future__ import annotations

import csv
import io
import json
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from rollmarket.contracts.sample import SampleGroup, Trajectory
from rollmarket.contracts.wire import packb
from rollmarket.dashboard import create_dashboard_app, export_static
from rollmarket.exchange.stores.sqlite import SCHEMA

from dashboard_browser import dashboard_process, open_page, shot

ROOT = Path(__file__).resolve().parents[1]
RUN_ID = "20260301T120000Z-r0ll0t"
WHERE = ("exp", "runs", "grpo__s0")  # a campaign run's place under --runs
CALL = '{"name": "calc", "arguments": {"expression": "2+3"}}'
VOCAB = ["[UNK]", "<tool_call>", "\n", CALL, "</tool_call>", "5", "The ", "answer ", "is ", "<|im_end|>"]
MODEL_A = [1, 2, 3, 2, 4]       # a tool call
TOOL = [5]                      # the tool's output, spliced into the response
MODEL_B = [6, 7, 8, 5, 9]       # the answer
NEEDLE = "zebracorn"
CSV_COLUMNS = ["row", "step", "group_id", "task_id", "sample_index", "policy_version", "policy_lag", "worker_id",
               "precision", "decision", "used", "reward", "trained_reward", "advantage", "tokens", "clipped_tokens",
               "prompt", "response"]


def generations() -> list[dict]:
    """5 steps x 3 groups x 4 samples; prompts with newlines, commas, quotes and non-ASCII."""
    rows = []
    for step in range(1, 6):
        for g in range(3):
            group = (step - 1) * 3 + g
            for s in range(4):
                i = len(rows)
                rows.append({
                    "step": step, "group_id": f"grp_{group:04d}", "task_id": f"arith-{group:03d}", "sample_index": s,
                    "policy_version": step - 1, "policy_lag": g % 2, "worker_id": ["w-a", "w-b"][group % 2],
                    "precision": ["bf16", "fp8"][g % 2], "decision": ["train", "correct", "quarantine"][g],
                    "used": s % 2 == 0, "reward": [1.0, 0.0, 0.5, -0.25][(i * 7) % 4], "trained_reward": 0.0,
                    "advantage": round(0.1 * ((i * 5) % 9) - 0.4, 3), "tokens": 10 + (i * 3) % 17,
                    "clipped_tokens": i % 3,
                    "prompt": f'<|im_start|>user\nWhat is {group}, "plus" {s}?\nÜber — 日本\n<|im_end|>',
                    "response": ("I think " + (NEEDLE + ", " if i in (7, 33) else "") + f'it is "{group + s}"\n'
                                 "<|im_end|>")})
    return rows


ROWS = generations()


def write_run(run: Path, rows: list[dict]) -> Path:
    run.mkdir(parents=True)
    (run / "generations.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    tokenizer = Tokenizer(WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.decoder = decoders.Fuse()  # tokens joined as they are, as a byte-level BPE decodes
    (run / "checkpoints" / "v0002").mkdir(parents=True)
    tokenizer.save(str(run / "checkpoints" / "v0002" / "tokenizer.json"))
    conn = sqlite3.connect(run / "exchange.db")
    conn.executescript(SCHEMA)
    for group_id in sorted({r["group_id"] for r in rows}):
        n = int(group_id.split("_")[1])
        trajectories = [Trajectory(
            sample_index=s, prompt_token_ids=np.array([6, 7], dtype=np.int32),
            response_token_ids=np.array(MODEL_A + TOOL + MODEL_B, dtype=np.int32),
            logprobs=np.array(logprobs(n, s), dtype=np.float32),
            tool_output_mask=np.array([0] * len(MODEL_A) + [1] * len(TOOL) + [0] * len(MODEL_B), dtype=np.uint8),
            turn_boundaries=[0, len(MODEL_A) + len(TOOL)], reward=1.0) for s in range(4)]
        group = SampleGroup(group_id=group_id, job_id=f"job_{n}", lease_id=f"lease_{n}", worker_id="w-a",
                            task_id=f"arith-{n:03d}", policy_version=0, checkpoint_digest="a" * 64,
                            tokenizer_hash="b" * 64, sampling_config_hash="c" * 64, engine_name="rollmarket-hf",
                            engine_version="0.1.0", engine_fingerprint="fp", device_type="cpu",
                            precision_class="bf16", quantization_class="none", trajectories=trajectories)
        conn.execute("INSERT INTO groups (group_id, lease_id, job_id, worker_id, task_id, policy_version, "
                     "precision_class, engine_fingerprint, content_hash, n_tokens, tier, status, lag_at_arrival, "
                     "receipt, received_at, payload) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                     (group_id, group.lease_id, group.job_id, "w-a", group.task_id, 0, "bf16", "fp", "d" * 64, 40,
                      "fresh", "train", 0, "{}", 0.0, packb(group)))
        report = {"token_ess": 0.9 + n / 1000, "mean_abs_delta": 0.01 * n, "max_abs_delta": 0.5,
                  "clipped_fraction": 0.125}
        status = next(r["decision"] for r in rows if r["group_id"] == group_id)
        conn.execute("INSERT INTO decisions (group_id, trainer_id, status, body, decided_at) VALUES (?,?,?,?,?)",
                     (group_id, "default", status,
                      json.dumps({"status": status, "reasons": ["within_budget"], "report": report}), 0.0))
    conn.commit()
    conn.close()
    return run


def logprobs(group: int, sample: int) -> list[float]:
    """Behaviour logprobs of the response tokens (tool output slots 0, as the contract says)."""
    return [-0.01 * (group + 1), -0.5, -2.0 - sample, -0.02, -0.3, 0.0, -0.03, -1.5, -0.04, -6.0, -0.001]


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    write_run(root.joinpath(*WHERE, RUN_ID), ROWS)
    return root


@pytest.fixture(scope="module")
def client(runs_dir) -> TestClient:
    return TestClient(create_dashboard_app(runs_dir))


def table(client, **params) -> dict:
    response = client.get(f"/train/{RUN_ID}/rollouts.json", params=params)
    assert response.status_code == 200, response.text
    return response.json()


def expected_row(i: int) -> dict:
    return {"row": i, **ROWS[i], "error": None}


# ----------------------------------------------------------------------------- JSON twins


def test_first_page_is_the_file_in_order(client):
    data = table(client)
    assert (data["total"], data["matched"], data["pages"]) == (60, 60, 3)
    assert data["rows"] == [expected_row(i) for i in range(25)]
    assert data["facets"] == {"decisions": ["correct", "quarantine", "train"], "precisions": ["bf16", "fp8"],
                              "workers": ["w-a", "w-b"], "step_min": 1, "step_max": 5}
    html = client.get(f"/train/{RUN_ID}/rollouts").text
    assert html.count('<tr data-row="') == 25 and "1 – 25 of 60" in html


def test_paging_reaches_every_row_once(client):
    seen = [r["row"] for p in (1, 2, 3) for r in table(client, page=p)["rows"]]
    assert seen == list(range(60))
    assert [r["row"] for r in table(client, page=4, per_page=7)["rows"]] == list(range(21, 28))


def test_filters_search_and_sort(client):
    want = [i for i, r in enumerate(ROWS) if r["decision"] == "correct" and 2 <= r["step"] <= 4 and r["reward"] >= 0.5]
    data = table(client, decision="correct", step_min=2, step_max=4, reward_min=0.5, per_page=500)
    assert [r["row"] for r in data["rows"]] == want and data["matched"] == len(want) and want
    fp8_wb = [i for i, r in enumerate(ROWS) if r["precision"] == "fp8" and r["worker_id"] == "w-b"]
    assert [r["row"] for r in table(client, precision="fp8", worker="w-b", per_page=500)["rows"]] == fp8_wb
    # Search: case-insensitive, over response, prompt and task id.
    assert [r["row"] for r in table(client, q=NEEDLE.upper())["rows"]] == [7, 33]
    assert table(client, q="ÜBER")["matched"] == 60
    assert [r["row"] for r in table(client, q="arith-007")["rows"]] == [i for i, r in enumerate(ROWS)
                                                                          if r["task_id"] == "arith-007"]
    by_reward = sorted(range(60), key=lambda i: (-ROWS[i]["reward"], i))
    assert [r["row"] for r in table(client, sort="-reward", per_page=500)["rows"]] == by_reward
    by_worker = sorted(range(60), key=lambda i: (ROWS[i]["worker_id"], i))
    assert [r["row"] for r in table(client, sort="worker_id", per_page=500)["rows"]] == by_worker
    assert [r["row"] for r in table(client, sort="-row", per_page=3)["rows"]] == [59, 58, 57]
    assert table(client, decision="nope")["matched"] == 0


def test_csv_is_the_filtered_table_with_real_quoting(client):
    response = client.get(f"/train/{RUN_ID}/rollouts.csv", params={"decision": "train", "sort": "-advantage",
                                                                   "page": 2, "per_page": 5})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/csv")
    assert "attachment" in response.headers["content-disposition"]
    parsed = list(csv.reader(io.StringIO(response.text)))
    assert parsed[0] == CSV_COLUMNS
    want = sorted((i for i, r in enumerate(ROWS) if r["decision"] == "train"), key=lambda i: (-ROWS[i]["advantage"], i))
    assert [int(r[0]) for r in parsed[1:]] == want  # every matching row: paging does not apply

    def text(value) -> str:
        return "" if value is None else str(value)

    for line in parsed[1:]:
        source = ROWS[int(line[0])]
        assert line[1:] == [text(source[c]) for c in CSV_COLUMNS[1:]]
    assert any("\n" in r[-2] and '"plus"' in r[-2] and "," in r[-2] for r in parsed[1:])


@pytest.mark.parametrize("query, parameter", [
    ("page=0", "page"), ("page=4", "page"), ("page=x", "page"), ("per_page=501", "per_page"),
    ("per_page=0", "per_page"), ("sort=prompt", "sort"), ("step_min=1.5", "step_min"), ("reward_min=nan", "reward_min"),
    ("colour=red", "colour")])
def test_bad_parameters_are_typed_400s(client, query, parameter):
    for suffix in (".json", ".csv", ""):
        if suffix == ".csv" and query == "page=4":
            continue  # the CSV is every matching row: paging does not apply to it
        response = client.get(f"/train/{RUN_ID}/rollouts{suffix}?{query}")
        assert response.status_code == 400, (suffix, query, response.text[:300])
        if suffix != "":
            body = response.json()["error"]
            assert body["code"] == "invalid_request" and body["reasons"] == ["bad_query"]
            assert body["details"]["parameter"] == parameter


@pytest.mark.parametrize("path, status, reason", [
    ("/train/nope/rollouts.json", 404, "unknown_run"), ("/train/nope/rollouts.csv", 404, "unknown_run"),
    ("/train/..%2F..%2Fetc/rollouts.json", 404, None),
    (f"/train/{RUN_ID}/rollouts/60.json", 404, "unknown_row"),
    (f"/train/{RUN_ID}/rollouts/-1.json", 400, "bad_query"), (f"/train/{RUN_ID}/rollouts/x.json", 400, "bad_query")])
def test_unknown_runs_and_rows_are_typed(client, path, status, reason):
    response = client.get(path)
    assert response.status_code == status
    if reason:  # (a path with an encoded '/' matches no route at all: a plain 404)
        assert response.json()["error"]["reasons"] == [reason]


def test_generation_twin_has_every_token_from_the_exchange(client, runs_dir):
    run = runs_dir.joinpath(*WHERE, RUN_ID)
    before = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in run.iterdir()}
    row = 22  # group 5, sample 2
    data = client.get(f"/train/{RUN_ID}/rollouts/{row}.json").json()
    assert data["generation"] == expected_row(row)
    assert (data["source"], data["engine"], data["finish_reason"], data["n_tokens"]) == (
        "exchange.db", "rollmarket-hf 0.1.0", "stop", 11)
    kinds = [(s["kind"], s["turn"], [t["token_id"] for t in s["tokens"]]) for s in data["segments"]]
    assert kinds == [("model", 0, MODEL_A), ("tool", 0, TOOL), ("model", 1, MODEL_B)]
    tokens = [t for s in data["segments"] for t in s["tokens"]]
    assert [t["text"] for t in tokens] == [VOCAB[i] for i in MODEL_A + TOOL + MODEL_B]
    assert [s["text"] for s in data["segments"]] == ["".join(VOCAB[i] for i in ids) for ids in (MODEL_A, TOOL, MODEL_B)]
    assert [s["tool_calls"] for s in data["segments"]] == [
        [{"name": "calc", "arguments": json.dumps({"expression": "2+3"})}], [], []]
    want = logprobs(5, 2)
    for t in tokens:
        tool = t["position"] == len(MODEL_A)
        assert t["logprob"] is None if tool else t["logprob"] == pytest.approx(want[t["position"]], abs=1e-6)
    model = [lp for k, lp in enumerate(want) if k != len(MODEL_A)]
    assert data["mean_logprob"] == pytest.approx(sum(model) / len(model), abs=1e-6)
    assert data["report"] == {"status": ROWS[row]["decision"], "token_ess": 0.905, "mean_abs_delta": 0.05, "max_abs_delta": 0.5,
                              "clipped_fraction": 0.125, "router_flip_rate": None, "reasons": ["within_budget"]}
    html = client.get(f"/train/{RUN_ID}/rollouts/{row}").text
    assert html.count('data-testid="tok"') == 10 and 'data-testid="tool-output"' in html
    assert 'data-testid="tool-call"' in html and "calc({&#34;expression&#34;: &#34;2+3&#34;})" in html
    after = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in run.iterdir()}
    assert after == before  # read-only: no journal, no cache, nothing touched


def test_reading_a_wal_exchange_creates_no_files(tmp_path):
    """The exchange runs SQLite in WAL mode; once it closes, its -wal and -shm files are gone, and a
    plain read-only open would create them again in the run directory."""
    run = write_run(tmp_path / RUN_ID, ROWS[:8])
    conn = sqlite3.connect(run / "exchange.db")
    assert conn.execute("PRAGMA journal_mode=wal").fetchone()[0] == "wal"
    conn.close()
    before = sorted(p.name for p in run.iterdir())
    assert "exchange.db-wal" not in before
    data = TestClient(create_dashboard_app(tmp_path)).get(f"/train/{RUN_ID}/rollouts/5.json").json()
    assert data["source"] == "exchange.db" and data["n_tokens"] == 11
    assert sorted(p.name for p in run.iterdir()) == before


def test_a_growing_file_shows_new_rows_and_a_rewrite_is_reindexed(tmp_path):
    run = write_run(tmp_path / RUN_ID, ROWS[:8])
    client = TestClient(create_dashboard_app(tmp_path))
    assert table(client)["total"] == 8
    with open(run / "generations.jsonl", "a") as f:
        f.write(json.dumps(ROWS[8]) + "\n" + json.dumps(ROWS[9])[:30])  # the writer is mid-line
    data = table(client, per_page=500)
    assert data["total"] == 9 and data["rows"][-1] == expected_row(8)
    assert table(client, q=NEEDLE)["matched"] == 1  # row 7
    with open(run / "generations.jsonl", "a") as f:
        f.write(json.dumps(ROWS[9])[30:] + "\n")
    assert table(client, per_page=500)["rows"][-1] == expected_row(9)
    # The filters' columns grew with the file (rows 8 and 9 are group 2's, the first quarantined).
    assert [r["row"] for r in table(client, decision="quarantine")["rows"]] == [8, 9]
    # A resumed run rewrites the file (torn rows dropped): the index starts over.
    (run / "generations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[40:43]))
    data = table(client)
    assert data["total"] == 3 and [r["step"] for r in data["rows"]] == [r["step"] for r in ROWS[40:43]]
    assert data["rows"][0]["prompt"] == ROWS[40]["prompt"]


def test_a_big_file_pages_at_once_and_reads_its_columns_in_the_background(tmp_path, monkeypatch):
    """Above EAGER_COLUMNS_BYTES the first page comes from the line offsets alone (no facets yet);
    a background thread then parses the columns, and the facets and filters appear."""
    from rollmarket.dashboard import rollouts

    monkeypatch.setattr(rollouts, "EAGER_COLUMNS_BYTES", 0)
    write_run(tmp_path / RUN_ID, ROWS)
    client = TestClient(create_dashboard_app(tmp_path))
    first = table(client, page=2)
    assert first["facets"] is None and first["rows"] == [expected_row(i) for i in range(25, 50)]
    deadline = time.monotonic() + 60
    while (data := table(client))["facets"] is None:
        assert time.monotonic() < deadline, "the columns were never read"
        time.sleep(0.02)
    assert data["facets"]["decisions"] == ["correct", "quarantine", "train"]
    assert table(client, decision="quarantine")["matched"] == sum(r["decision"] == "quarantine" for r in ROWS)


def test_a_run_without_an_exchange_shows_its_text(tmp_path):
    run = tmp_path / RUN_ID
    run.mkdir()
    (run / "generations.jsonl").write_text(json.dumps({"step": 1, "prompt": "p", "response": "r"})
                                           + "\nnot json\n[1, 2]\n" + json.dumps({"step": "two"}) + "\n")
    client = TestClient(create_dashboard_app(tmp_path))
    data = table(client)
    assert data["rows"][0]["step"] == 1 and data["rows"][0]["worker_id"] is None
    assert [r["error"].split(":")[0] for r in data["rows"][1:]] == ["line 2", "line 3", "line 4"]
    assert table(client, step_min=0)["matched"] == 1  # unreadable rows have no step to pass a bound
    page = client.get(f"/train/{RUN_ID}/rollouts/0.json").json()
    assert page["segments"] == [] and "exchange.db" in page["note"]


def test_the_pages_never_import_torch(runs_dir):
    """Services never load torch: the table, the CSV and a generation's page (tokenizer, exchange payload
    and tool-call parsing included) are served by a process that never imports it."""
    code = f"""
import sys
from fastapi.testclient import TestClient
from rollmarket.dashboard import create_dashboard_app
client = TestClient(create_dashboard_app({str(runs_dir)!r}))
for url in ["/train/{RUN_ID}/rollouts?q=x", "/train/{RUN_ID}/rollouts.csv", "/train/{RUN_ID}/rollouts/3"]:
    assert client.get(url).status_code == 200, url
assert "torch" not in sys.modules and "transformers" not in sys.modules
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_without_tokenizers_a_generation_shows_its_token_ids(runs_dir):
    """A core install (`pip install rollmarket`) has no `tokenizers`: the page still opens, each token
    shown as its id. Run in a process where importing tokenizers fails."""
    code = f"""
import sys
sys.modules["tokenizers"] = None  # import tokenizers now raises ImportError
from fastapi.testclient import TestClient
from rollmarket.dashboard import create_dashboard_app
client = TestClient(create_dashboard_app({str(runs_dir)!r}))
response = client.get("/train/{RUN_ID}/rollouts/22.json")
assert response.status_code == 200, response.text
print(" ".join(t["text"] for s in response.json()["segments"] for t in s["tokens"]))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [f"⟨{i}⟩" for i in MODEL_A + TOOL + MODEL_B]


def test_pages_load_nothing_from_the_network(client):
    for url in (f"/train/{RUN_ID}/rollouts", f"/train/{RUN_ID}/rollouts/3"):
        html = client.get(url).text
        sources = re.findall(r"<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)=\"([^\"]*)\"", html)
        assert sources and not [s for s in sources if re.match(r"(https?:)?//", s)], (url, sources)


# ----------------------------------------------------------------------------- in the browser


@pytest.fixture(scope="module")
def server(runs_dir, tmp_path_factory):
    """`rollmarket dashboard` as a real process on a free loopback port."""
    with dashboard_process(runs_dir, tmp_path_factory.mktemp("dashboard") / "dashboard.log") as url:
        yield url


def shown_columns(page) -> list[str]:
    return page.eval_on_selector_all('table.rollouts thead th:not(.hidden-col)', "ths => ths.map(t => t.dataset.col)")


def test_table_pages_chooses_columns_exports_csv_and_opens_a_row(browser, server, tmp_path):
    context, page = open_page(browser, accept_downloads=True)
    requests, errors = page.requests, page.errors
    try:
        page.goto(f"{server}/train/{RUN_ID}/rollouts")
        assert page.locator("table.rollouts tbody tr").count() == 25
        assert shown_columns(page) == ["row", "step", "worker_id", "precision", "decision", "reward", "advantage",
                                       "prompt", "response"]
        shot(page, "rollouts-table")
        # Paging: next twice, then back.
        page.click('[data-testid="next"]')
        page.wait_for_selector('tr[data-row="25"]')
        page.click('[data-testid="next"]')
        page.wait_for_selector('tr[data-row="50"]')
        assert page.locator("table.rollouts tbody tr").count() == 10
        assert page.locator('[data-testid="next"]').count() == 0
        page.click('[data-testid="prev"]')
        page.wait_for_selector('tr[data-row="25"]')
        # Column chooser: hide prompt, show task_id; remembered across a reload; reset restores.
        page.click('[data-testid="chooser"] summary')
        page.uncheck('[data-testid="col-prompt"]')
        page.check('[data-testid="col-task_id"]')
        page.reload()
        cols = shown_columns(page)
        assert "prompt" not in cols and "task_id" in cols
        assert page.locator('td[data-col="task_id"]').first.is_visible()
        page.click('[data-testid="reset-columns"]')
        assert "prompt" in shown_columns(page) and "task_id" not in shown_columns(page)
        # Long cells expand; a short one offers no "more".
        assert page.locator('td[data-col="response"] [data-testid="expand"]').first.is_hidden()
        clip = page.locator('td[data-col="prompt"] .clip').first
        closed = clip.bounding_box()["height"]
        page.locator('td[data-col="prompt"] [data-testid="expand"]').first.click()
        assert clip.bounding_box()["height"] > closed
        # Filter through the form, then download the CSV of exactly the filtered rows.
        page.select_option('[data-testid="filter-decision"]', "quarantine")
        page.fill('[data-testid="q"]', "arith-01")
        page.click('[data-testid="apply"]')
        want = [i for i, r in enumerate(ROWS) if r["decision"] == "quarantine" and "arith-01" in r["task_id"]]
        page.wait_for_selector(f'tr[data-row="{want[0]}"]')
        assert [int(x) for x in page.eval_on_selector_all("tbody tr", "rs => rs.map(r => r.dataset.row)")] == want
        with page.expect_download() as download:
            page.click('[data-testid="csv"]')
        target = tmp_path / "rows.csv"
        download.value.save_as(target)
        parsed = list(csv.reader(io.StringIO(target.read_text(encoding="utf-8"))))
        assert [int(r[0]) for r in parsed[1:]] == want and parsed[1][-2] == ROWS[want[0]]["prompt"]
        shot(page, "rollouts-filtered")
        # A row opens its trajectory: tool output between two turns, tokens shaded by logprob.
        page.click(f'tr[data-row="{want[0]}"] [data-testid="open-row"]')
        page.wait_for_selector('[data-testid="tokens"]')
        assert page.locator('[data-testid="tool-output"]').count() == 1
        assert page.locator('[data-testid="tool-call"] code').inner_text() == 'calc({"expression": "2+3"})'
        toks = page.locator('[data-testid="tok"]')
        assert toks.count() == 10
        unlikely = toks.nth(8)  # "5" at position 9 (the tool token is not a model token): logprob −6.0
        assert "214, 137, 16" in unlikely.evaluate("e => getComputedStyle(e).backgroundColor")
        assert "-6.0000" in unlikely.get_attribute("title")
        assert toks.nth(5).evaluate("e => getComputedStyle(e).backgroundColor") != unlikely.evaluate(
            "e => getComputedStyle(e).backgroundColor")
        shot(page, "rollouts-generation")
    finally:
        context.close()
    assert not errors, errors
    assert all(u.startswith(server) for u in requests), [u for u in requests if not u.startswith(server)]


def test_static_export_pages_from_files(browser, runs_dir, tmp_path):
    summary = export_static(runs_dir, tmp_path / "site")
    # 3 table pages (60 rows) and the 60 rows' pages.
    assert summary.rollout_pages == 3 + 60
    base = tmp_path / "site" / "train" / RUN_ID
    parsed = list(csv.reader(io.StringIO((base / "rollouts.csv").read_text(encoding="utf-8"))))
    assert [int(r[0]) for r in parsed[1:]] == list(range(60))
    context, page = open_page(browser)
    requests, errors = page.requests, page.errors
    try:
        page.goto((base / "rollouts.html").as_uri())
        assert page.locator('[data-testid="static-note"]').is_visible()
        page.click('[data-testid="next"]')
        page.wait_for_selector('tr[data-row="25"]')
        page.click('tr[data-row="30"] [data-testid="open-row"]')
        page.wait_for_selector('[data-testid="tokens"]')
        assert page.locator('[data-testid="tok"]').count() == 10
        page.click('[data-testid="back"]')
        page.wait_for_selector('tr[data-row="0"]')
    finally:
        context.close()
    assert not errors, errors
    assert [u for u in requests if not u.startswith("file://")] == []


def test_tokens_are_coloured_by_delta_where_the_trainer_saved_its_logprobs(tmp_path):
    """token_logprobs.jsonl (written by the trainer beside each generations row, in the same order)
    gives each model token its trainer logprob and Δ = trainer − behaviour; a line that is not the
    row's generation is not used."""
    rows = ROWS[:8]
    run = write_run(tmp_path / RUN_ID, rows)
    n_tokens = len(MODEL_A) + len(TOOL) + len(MODEL_B)
    tool = set(range(len(MODEL_A), len(MODEL_A) + len(TOOL)))
    saved = []
    for k, r in enumerate(rows):
        trainer = [None if p in tool else round(-0.1 * (p + 1) - 0.01 * k, 5) for p in range(n_tokens)]
        saved.append({"step": r["step"], "group_id": r["group_id"], "sample_index": r["sample_index"],
                      "trainer_logprobs": trainer})
    saved[3]["group_id"] = "grp_elsewhere"  # line 3 belongs to another generation
    (run / "token_logprobs.jsonl").write_text("".join(json.dumps(s) + "\n" for s in saved))
    client = TestClient(create_dashboard_app(tmp_path))

    row = 5
    data = client.get(f"/train/{RUN_ID}/rollouts/{row}.json").json()
    n, s = int(rows[row]["group_id"].split("_")[1]), rows[row]["sample_index"]
    behaviour = logprobs(n, s)
    tokens = {t["position"]: t for seg in data["segments"] for t in seg["tokens"]}
    assert data["note"] is None and len(tokens) == n_tokens
    for p, t in tokens.items():
        if p in tool:
            assert t["trainer_logprob"] is None and t["delta"] is None
        else:
            trainer = -0.1 * (p + 1) - 0.01 * row
            assert t["trainer_logprob"] == pytest.approx(trainer, abs=1e-5)
            assert t["delta"] == pytest.approx(trainer - behaviour[p], abs=1e-5)
    html = client.get(f"/train/{RUN_ID}/rollouts/{row}").text
    assert 'data-testid="delta-legend"' in html and html.count("data-delta=") == n_tokens - len(tool)

    other = client.get(f"/train/{RUN_ID}/rollouts/3.json").json()
    assert all(t["delta"] is None for seg in other["segments"] for t in seg["tokens"])
    assert "token_logprobs.jsonl" in other["note"]
