"""The trainer's manifest file: load what is there, append fsynced lines, survive a torn line."""

from __future__ import annotations

import json

from rollstream.trainer.manifest import Manifest, ManifestState


def entry(step: int, keys: list[str], **extra) -> dict:
    return {"step": step, "status": "complete", "accepted_groups": len(keys), "group_keys": keys, **extra}


def test_a_missing_file_loads_as_empty(tmp_path):
    state = Manifest(tmp_path / "none.jsonl").load()
    assert state == ManifestState()
    assert (state.group_keys, state.last, state.committed_groups) == ([], None, 0)


def test_append_then_load_round_trip(tmp_path):
    manifest = Manifest(tmp_path / "sub" / "m.jsonl")  # parent folders are created
    manifest.append(entry(0, ["a", "b"], loss=0.5))
    manifest.append(entry(1, ["c"]))
    lines = manifest.path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1]
    assert lines[0] == json.dumps(entry(0, ["a", "b"], loss=0.5), sort_keys=True)
    state = Manifest(manifest.path).load()
    assert state.group_keys == ["a", "b", "c"]
    assert state.last == entry(1, ["c"])
    assert state.committed_groups == 3


def test_last_is_the_highest_step_not_the_last_line(tmp_path):
    manifest = Manifest(tmp_path / "m.jsonl")
    manifest.append(entry(4, ["x"]))
    manifest.append(entry(2, ["y", "z"]))
    state = manifest.load()
    assert state.last["step"] == 4
    assert state.group_keys == ["x", "y", "z"]
    assert state.committed_groups == 3


def test_a_torn_line_is_skipped_and_the_next_append_starts_on_a_fresh_line(tmp_path):
    path = tmp_path / "m.jsonl"
    manifest = Manifest(path)
    manifest.append(entry(0, ["a"]))
    with path.open("a") as fh:  # a crash mid-write: half a line, no newline
        fh.write('{"step": 1, "group_keys": ["b"')
    state = manifest.load()
    assert (state.group_keys, state.last["step"], state.committed_groups) == (["a"], 0, 1)

    manifest.append(entry(1, ["c"]))
    lines = path.read_text().split("\n")
    assert lines[1] == '{"step": 1, "group_keys": ["b"'  # the torn line stays on its own line
    assert json.loads(lines[2]) == entry(1, ["c"])
    assert lines[3] == ""  # every line ends with a newline
    state = manifest.load()
    assert state.group_keys == ["a", "c"]
    assert state.last == entry(1, ["c"])
    assert state.committed_groups == 2


def test_blank_lines_and_missing_optional_fields_are_tolerated(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('\n{"step": 0}\n\n{"step": 1, "group_keys": ["k"], "accepted_groups": 1}\n')
    state = Manifest(path).load()
    assert state.group_keys == ["k"]
    assert state.last == {"step": 1, "group_keys": ["k"], "accepted_groups": 1}
    assert state.committed_groups == 1
