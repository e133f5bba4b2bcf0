"""The optional metric writers (rollmarket.train.trackers), read back from what they wrote.

W&B runs offline (no network here) and its `.wandb` transaction log is parsed record by record;
TensorBoard's event files are read with tensorboard's own EventAccumulator. Both check that the
steps and values match what was logged, that None values are dropped, and that nothing is printed.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from rollmarket.train.trackers import (
    TensorBoardTracker,
    TrackerUnavailable,
    WandbTracker,
    installed_trackers,
    make_trackers,
)

STEPS = [
    (0, {"loss": 1.5, "optim/lr": 0.001, "reward/mean": 0.25, "eval/acc": None}),
    (1, {"loss": 1.25, "optim/lr": 0.001, "reward/mean": 0.5, "eval/acc": 0.75}),
    (2, {"loss": 0.875, "optim/lr": 0.0005, "reward/mean": None, "eval/acc": None}),
]
CONFIG = {"seed": 0, "lr": 0.001, "model": "tiny"}
GENERATIONS = [  # generations.jsonl rows, with a field the table leaves out (task_id)
    {"step": 1, "task_id": "t0", "reward": 1.0, "prompt": "What is 2+2?", "response": "4 | four\nsure",
     "decision": "train", "advantage": 0.5, "precision": "bf16", "worker_id": "w-bf16"},
    {"step": 1, "task_id": "t1", "reward": 0.0, "prompt": "Name a prime.", "response": "nine",
     "decision": "replay", "advantage": -0.5, "precision": "fp8", "worker_id": "w-fp8"},
]
TABLE_COLUMNS = ["step", "reward", "prompt", "response", "decision", "advantage", "precision", "worker"]
TABLE_ROWS = [[1, 1.0, "What is 2+2?", "4 | four\nsure", "train", 0.5, "bf16", "w-bf16"],
              [1, 0.0, "Name a prime.", "nine", "replay", -0.5, "fp8", "w-fp8"]]


def expected_rows() -> dict[int, dict[str, float]]:
    return {step: {k: v for k, v in m.items() if v is not None} for step, m in STEPS}


def read_wandb_records(path: Path):
    """Yield the protobuf records of a `.wandb` file.

    The file is a 7-byte header (":W&B", magic 0xBEE1, version) followed by the LevelDB log format:
    32 KiB blocks of chunks, each `crc32c:u32 length:u16 type:u8` + payload, where type 1 is a whole
    record and 2/3/4 are its first/middle/last pieces. wandb>=0.2x dropped its Python reader
    (`wandb.sdk.internal.datastore`), so the test reads the format itself.
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # block trailer / zero padding
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def item_key(item) -> str:
    return item.key or ".".join(item.nested_key)


def test_wandb_offline_run_holds_each_step(tmp_path, capfd):
    import wandb

    run_root = tmp_path / "runs" / "r1"  # not made yet, as for a trainer's fresh run
    (tracker,) = make_trackers(["wandb"], run_root, run_name="unit-run", config=CONFIG)
    assert isinstance(tracker, WandbTracker)
    for step, metrics in STEPS:
        tracker.log(metrics, step=step)
    tracker.close()
    # finish() returns once wandb-core has the exit record, but the core process writes the
    # `.wandb` file a few ms later (often the file is still its 7-byte header here). A trainer's
    # process exit waits for it through wandb's atexit hook; a test waits with teardown().
    wandb.teardown()

    (run_dir,) = (run_root / "wandb").glob("offline-run-*")
    (log_file,) = run_dir.glob("run-*.wandb")
    records = list(read_wandb_records(log_file))

    rows = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {item_key(i): json.loads(i.value_json) for i in record.history.item}
            rows[row["_step"]] = {k: v for k, v in row.items() if not k.startswith("_")}
    assert rows == expected_rows()

    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "unit-run"
    assert run.project == "rollmarket"
    config = {item_key(i): json.loads(i.value_json) for i in run.config.update}
    assert {k: v for k, v in config.items() if k != "_wandb"} == CONFIG
    assert any(r.WhichOneof("record_type") == "exit" for r in records), "run was not finished"

    out, err = capfd.readouterr()
    assert out == "" and err == "", "the library must not print"


def test_wandb_warnings_stay_off_the_terminal(tmp_path, monkeypatch, capfd):
    """wandb.termwarn ignores the run's `silent`; WANDB_SILENT, read at wandb's setup, stops it."""
    import wandb

    monkeypatch.delenv("WANDB_SILENT", raising=False)
    wandb.teardown()  # forget process-wide settings from earlier tests
    tracker = WandbTracker(tmp_path, run_name="noisy", config={})
    tracker.log({"loss": 1.0}, step=2)
    tracker.log({"loss": 2.0}, step=1)  # out of order: wandb drops it with a warning
    tracker.close()
    wandb.teardown()
    assert capfd.readouterr() == ("", "")


def test_wandb_tracker_leaves_a_callers_run_open(tmp_path):
    """wandb.init's default would return the caller's active run, and close() would finish it."""
    import wandb

    theirs = wandb.init(dir=str(tmp_path), mode="offline", settings=wandb.Settings(silent=True))
    try:
        tracker = WandbTracker(tmp_path, run_name="ours", config={})
        tracker.close()
        assert tracker._run.id != theirs.id
        theirs.log({"x": 1.0}, step=0)  # would raise on a finished run
    finally:
        theirs.finish()


def test_tensorboard_scalars_read_back(tmp_path, capfd):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tracker,) = make_trackers(["tensorboard"], tmp_path, run_name="unit-run", config=CONFIG)
    assert isinstance(tracker, TensorBoardTracker)
    for step, metrics in STEPS:
        tracker.log({**metrics, "note": "not a number"}, step=step)  # type: ignore[dict-item]
    tracker.close()

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    got = {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }
    want: dict[str, list[tuple[int, float]]] = {}
    for step, row in expected_rows().items():
        for key, value in row.items():
            want.setdefault(key, []).append((step, pytest.approx(value)))  # stored as float32
    assert got == want
    assert capfd.readouterr() == ("", "")


def test_unknown_tracker_name_lists_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="wandb, tensorboard"):
        make_trackers(["wandb", "mlflow"], tmp_path, run_name="r", config={})
    assert list(tmp_path.iterdir()) == [], "nothing may be started before the names are checked"


@pytest.mark.parametrize(
    ("name", "module"), [("wandb", "wandb"), ("tensorboard", "torch.utils.tensorboard")]
)
def test_missing_backend_says_how_to_install(tmp_path, monkeypatch, name, module):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(TrackerUnavailable, match=r"pip install 'rollmarket\[trackers\]'"):
        make_trackers([name], tmp_path, run_name="r", config={})


def test_wandb_rollouts_are_a_table_and_where_says_how_to_sync(tmp_path, capfd):
    import wandb

    (tracker,) = make_trackers(["wandb"], tmp_path, run_name="rollouts", config={})
    tracker.log_rollouts(GENERATIONS, step=1)
    tracker.log({"loss": 1.0}, step=1)
    tracker.log_rollouts([], step=2)  # a step without rollouts logs no table
    where = tracker.where()
    tracker.close()
    wandb.teardown()

    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    assert where == {"tracker": "wandb", "path": str(run_dir), "open": f"wandb sync {run_dir}"}
    (log_file,) = run_dir.glob("run-*.wandb")
    logged = [{item_key(i).split(".", 1)[1]: json.loads(i.value_json) for i in r.history.item
               if item_key(i).startswith("rollouts.")}
              for r in read_wandb_records(log_file) if r.WhichOneof("record_type") == "history"]
    logged = [row for row in logged if row]
    assert len(logged) == 1 and logged[0]["_type"] == "table-file" and logged[0]["nrows"] == 2
    # The table as wandb saved it with the run (what `wandb sync` uploads).
    table = json.loads((run_dir / "files" / logged[0]["path"]).read_text())
    assert table["columns"] == TABLE_COLUMNS and table["data"] == TABLE_ROWS
    assert capfd.readouterr() == ("", "")


def test_tensorboard_rollouts_are_text_and_where_says_how_to_open(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    (tracker,) = make_trackers(["tensorboard"], tmp_path, run_name="rollouts", config={})
    tracker.log_rollouts(GENERATIONS, step=1)
    assert tracker.where() == {"tracker": "tensorboard", "path": str(tmp_path / "tensorboard"),
                               "open": f"tensorboard --logdir {tmp_path / 'tensorboard'}"}
    tracker.close()

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    (tag,) = [t for t in events.Tags()["tensors"] if t.startswith("rollouts")]
    (event,) = events.Tensors(tag)
    text = tensor_util.make_ndarray(event.tensor_proto).item().decode()
    assert event.step == 1
    lines = text.splitlines()
    assert lines[0] == "| " + " | ".join(TABLE_COLUMNS) + " |" and len(lines) == 2 + len(TABLE_ROWS)
    assert lines[2] == "| 1 | 1.0 | What is 2+2? | 4 \\| four<br>sure | train | 0.5 | bf16 | w-bf16 |"
    assert lines[3] == "| 1 | 0.0 | Name a prime. | nine | replay | -0.5 | fp8 | w-fp8 |"


def test_every_installed_tracker_mirrors_by_default_unless_wandb_is_off(monkeypatch):
    import importlib.util

    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert installed_trackers() == ["wandb", "tensorboard"]  # both are test extras
    assert installed_trackers("disabled") == ["tensorboard"]
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert installed_trackers() == ["tensorboard"]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    assert installed_trackers() == []
