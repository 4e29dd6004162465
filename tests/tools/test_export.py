"""`rollstream export`: rows per response, read back by the Hugging Face ``datasets`` Parquet
loader with the tokens bit-identical to the payloads; a failed export leaves no file; bad output
paths are one-line errors. ``check_export`` is the end-to-end check the real-model runs
(tests/e2e) apply to their own recorded runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from rollstream.app.cli import app
from rollstream.exceptions import RollstreamError
from rollstream.kafka.payloads import PayloadFetcher, ref_key
from rollstream.kafka.topics import Topics
from rollstream.schemas import decode, encode
from rollstream.schemas.records import is_payload_ref
from rollstream.streams.event_builders import group_record
from rollstream.tools import export as export_module
from rollstream.tools.export import export_run
from rollstream.tools.readback import read_values
from rollstream.tools.replay import Record, Replayed
from tests.integration.harness import response

ROOT = Path(__file__).resolve().parents[2]
TOPICS = Topics("ex.")


def load_rows(path: Path, cache: Path) -> list[dict]:
    """``path`` through the datasets Parquet loader, as a user would read it."""
    import datasets

    return list(datasets.load_dataset("parquet", data_files=str(path), split="train", cache_dir=str(cache)))


def _same(values, payload_array, dtype) -> bool:
    """Bit-identical: the row's list as ``dtype`` bytes equals the payload's array bytes."""
    return np.asarray(values, dtype=dtype).tobytes() == np.asarray(payload_array, dtype=dtype).tobytes()


def check_export(bootstrap: str, prefix: str, agentic: bool, config_path: Path, folder: Path) -> list[dict]:
    """Run `rollstream export --rejected` over a recorded run and check it against the topics:
    one row per member of every accepted and rejected group, each row's decision and reward its
    group's, its tokens (and logprobs, and masks) bit-identical to the payload it references.
    Returns the rows."""
    out = folder / "groups.parquet"
    done = subprocess.run([sys.executable, "-m", "rollstream", "export", "-c", str(config_path), "-b", bootstrap,
                           "--prefix", prefix, "-o", str(out), "--rejected"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    topics = Topics(prefix)
    groups = {"accepted": read_values(bootstrap, topics.groups_accepted),
              "rejected": read_values(bootstrap, topics.groups_rejected)}
    members_of = "trajectories" if agentic else "responses"
    expected = [(decision, group, member) for decision, gs in groups.items() for group in gs
                for member in group[members_of]]
    rows = load_rows(out, folder / "hf-cache")
    assert len(rows) == len(expected) > 0
    counts = {d: sum(decision == d for decision, _, _ in expected) for d in groups}
    assert f"wrote {out}: {counts['accepted']} accepted, {counts['rejected']} rejected rows" in done.stdout
    index = "traj_index" if agentic else "sample_index"
    by_key = {(r["decision"], r["group_key"], r[index]): r for r in rows}
    refs = [m["payload"] for _, _, m in expected if is_payload_ref(m["payload"])]
    with PayloadFetcher(bootstrap) as fetcher:
        fetched = fetcher.fetch(refs)
    for decision, group, member in expected:
        idx = member["traj_index"] if agentic else member["response"]["sample_index"]
        row = by_key[(decision, group["group_key"], idx)]
        assert (row["reason"], row["policy_version"], row["payload_error"]) == (group["reason"], group["policy_version"], None)
        _, payload = decode(fetched.values[ref_key(member["payload"])])
        if agentic:
            assert row["reward"] == member["response_level_rewards"]
            for t, turn in enumerate(payload["turns"]):
                assert _same(row["turn_prompt_token_ids"][t], turn["prompt_token_ids"], np.int32)
                assert _same(row["turn_response_token_ids"][t], turn["response_token_ids"], np.int32)
                assert _same(row["turn_infer_logprobs"][t], turn["infer_logprobs"], np.float32)
            assert _same(row["response_mask"], payload["response_mask"], np.uint8)
        else:
            assert (row["reward"], row["prompt"]) == (member["response_level_reward"], group["prompt"])
            assert row["response_text"] == payload["response_text"]
            for name, dtype in (("prompt_token_ids", np.int32), ("response_token_ids", np.int32),
                                ("infer_logprobs", np.float32)):
                assert _same(row[name], payload[name], dtype), name
    return rows


def _group(pid: str, accepted: bool, rewards: list[float]) -> dict:
    members = [response(pid, i, reward=r, tokens=3 + i) for i, r in enumerate(rewards)]
    record = group_record(prompt=members[0]["response"], decided_accepted=accepted,
                          reason="accepted" if accepted else "zero_std", values={}, responses=members,
                          filter_config="{}", filter_config_hash="h", policy_version=2, rounds=1,
                          responses_generated=len(members))
    return decode(encode(record, "Group"))[1]  # as read back: packed arrays decoded


def _replaying(groups_by_topic: dict[str, list[dict]], fail_after: int | None = None):
    def replay(bootstrap, topic, selection, **kwargs):
        for offset, group in enumerate(groups_by_topic.get(topic, [])):
            if fail_after is not None and offset >= fail_after:
                raise RollstreamError("broker went away")
            yield Replayed(Record(topic, 0, offset, group["group_key"].encode(), "Group", group, b""), 0)
    return replay


def test_rows_are_one_per_response_with_inline_payloads_read_back_bit_identical(tmp_path, monkeypatch):
    accepted, rejected = [_group("p1", True, [1.0, 0.0])], [_group("p2", False, [0.0, 0.0, 0.0])]
    monkeypatch.setattr(export_module, "replay", _replaying({TOPICS.groups_accepted: accepted,
                                                            TOPICS.groups_rejected: rejected}))
    out = tmp_path / "g.parquet"
    done = export_run("unused:1", TOPICS, out, agentic=False, rejected=True, row_group_rows=2)
    assert (done.rows, done.groups, done.payload_errors) == ({"accepted": 2, "rejected": 3},
                                                             {"accepted": 1, "rejected": 1}, 0)
    rows = load_rows(out, tmp_path / "cache")
    assert [(r["decision"], r["prompt_id"], r["sample_index"], r["reward"]) for r in rows] == [
        ("accepted", "p1", 0, 1.0), ("accepted", "p1", 1, 0.0),
        ("rejected", "p2", 0, 0.0), ("rejected", "p2", 1, 0.0), ("rejected", "p2", 2, 0.0)]
    members = [m for g in accepted + rejected for m in g["responses"]]
    for row, member in zip(rows, members):
        payload = member["payload"]
        assert _same(row["response_token_ids"], payload["response_token_ids"], np.int32)
        assert _same(row["infer_logprobs"], payload["infer_logprobs"], np.float32)
        assert (row["response_text"], row["reason"], row["messages"]) == (
            payload["response_text"], "accepted" if row["decision"] == "accepted" else "zero_std",
            accepted[0]["messages"] if row["decision"] == "accepted" else rejected[0]["messages"])
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".partial" or p.name.startswith(".")] == []


def test_without_rejected_only_the_accepted_groups_are_read(tmp_path, monkeypatch):
    monkeypatch.setattr(export_module, "replay", _replaying({TOPICS.groups_accepted: [_group("p1", True, [1.0, 0.0])],
                                                            TOPICS.groups_rejected: [_group("p2", False, [0.0])]}))
    done = export_run("unused:1", TOPICS, tmp_path / "g.parquet", agentic=False)
    assert (done.rows, done.groups) == ({"accepted": 2, "rejected": 0}, {"accepted": 1, "rejected": 0})


def test_a_failed_export_leaves_nothing_behind(tmp_path, monkeypatch):
    groups = [_group(f"p{i}", True, [1.0, 0.0]) for i in range(5)]
    monkeypatch.setattr(export_module, "replay", _replaying({TOPICS.groups_accepted: groups}, fail_after=3))
    out = tmp_path / "g.parquet"
    out.write_bytes(b"an earlier export")
    with pytest.raises(RollstreamError, match="broker went away"):
        export_run("unused:1", TOPICS, out, agentic=False, row_group_rows=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.parquet"] and out.read_bytes() == b"an earlier export"
    with pytest.raises(RollstreamError, match=r"^export: cannot write .*missing/g.parquet"):
        export_run("unused:1", TOPICS, tmp_path / "missing" / "g.parquet", agentic=False)


@pytest.mark.parametrize(("out", "message"), [("missing/g.parquet", "its folder"), (".", "a directory")])
def test_an_output_that_cannot_be_written_is_one_line_with_exit_code_2(tmp_path, out, message):
    result = CliRunner().invoke(app, ["export", "-c", str(ROOT / "examples" / "rlvr_math.yaml"), "-b", "127.0.0.1:1",
                                      "-o", str(tmp_path / out)])
    assert result.exit_code == 2 and message in result.output and str(tmp_path) in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []
