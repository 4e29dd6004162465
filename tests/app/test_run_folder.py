"""Starting a run never loses a run: the folder rules of rollstream.app.run_folder."""

from __future__ import annotations

import json
from pathlib import Path


from rollstream.app.run_folder import STARTED, is_run, make_room, mark_started


def previous_run(folder: Path, stamp: str = "20261201-101500") -> Path:
    (folder / "logs").mkdir(parents=True)
    (folder / STARTED).write_text(stamp + "\n")
    (folder / "summary.json").write_text(json.dumps({"outcome": "complete"}))
    return folder


def test_a_run_is_renamed_by_its_start_and_a_start_that_never_got_going_is_removed(tmp_path):
    run_dir = previous_run(tmp_path / "demo")
    kept = make_room(run_dir)
    assert kept == tmp_path / "demo.20261201-101500" and not run_dir.exists()
    assert json.loads((kept / "summary.json").read_text()) == {"outcome": "complete"}
    (run_dir / "logs").mkdir(parents=True)  # a start whose broker never answered: no STARTED
    assert make_room(run_dir) is None and not run_dir.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.20261201-101500"]
    previous_run(run_dir)  # another run started within the same second
    assert make_room(run_dir) == tmp_path / "demo.20261201-101500-2"


def test_a_trainers_own_folder_is_a_run_too(tmp_path):
    """`rollstream worker trainer` writes a manifest and checkpoints under runs/<name>, no marker."""
    run_dir = tmp_path / "t"
    (run_dir / "checkpoints" / "v000001").mkdir(parents=True)
    (run_dir / "batches.jsonl").write_text('{"step": 0}\n')
    kept = make_room(run_dir)
    assert kept is not None and (kept / "batches.jsonl").read_text() == '{"step": 0}\n'
    for leftover in ("logs", "kafka", "config.yaml", "stages.json"):  # all a failed start writes
        (run_dir / leftover).mkdir(parents=True)
    assert not is_run(run_dir) and make_room(run_dir) is None and not run_dir.exists()


def test_a_summary_from_before_the_marker_makes_a_run_and_replace_deletes_only_once_started(tmp_path):
    run_dir = tmp_path / "old"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text("{}")
    assert is_run(run_dir)
    kept = make_room(run_dir)
    assert kept is not None and kept.name.startswith("old.") and (kept / "summary.json").is_file()
    run_dir.mkdir()
    mark_started(run_dir, kept, replace=True)
    assert not kept.exists() and is_run(run_dir)
    assert len((run_dir / STARTED).read_text().strip()) == len("20261201-101500")
