"""Avro single-object encoding: round trips, schema evolution, bad bytes."""

from __future__ import annotations

import copy
import json
import math

import pytest

from rollstream.exceptions import DecodeError, EncodeError, SchemaNotFoundError, UnknownFingerprintError
from rollstream.schemas import REGISTRY, SchemaRegistry, decode, encode, fingerprint_of
from rollstream.schemas.codec import SCHEMA_DIR

RESPONSE = {
    "prompt_id": "gsm8k-test-00017", "domain": "gsm8k", "mode": "train", "prompt": "2+2?", "ground_truth": "4",
    "round": 1, "sample_index": 5, "prompt_token_ids": [1, 2, 3], "response_token_ids": [7, 8],
    "infer_logprobs": [-0.5, -1.25], "response_text": "4", "finish_reason": "stop", "error": None,
    "policy_version": 3, "generation_ms": 12.5, "created_ms": 1700000000000,
}


def test_every_event_has_its_own_schema_file():
    names = {json.loads(p.read_text())["name"] for p in SCHEMA_DIR.glob("*.avsc")}
    assert names == set(REGISTRY.names) == {
        "Batch", "DeadLetter", "EpisodeRequest", "GenerationRequest", "Group", "GroupCommand", "GroupQueueOutcome",
        "Metric", "PolicyVersion", "Prompt", "PromptOutcome", "Response", "RewardedResponse", "Trajectory",
        "TrajectoryGroup",
    }


def test_fingerprint_matches_the_published_check_value():
    # Avro spec: CRC-64-AVRO of the canonical form of "int"
    assert int.from_bytes(fingerprint_of("int"), "little") == 0x7275D51A3F395C8F


def test_round_trip_with_header():
    data = encode(RESPONSE, "Response")
    assert data[:2] == b"\xc3\x01" and data[2:10] == REGISTRY.fingerprint("Response")
    assert decode(data) == ("Response", RESPONSE)


def test_nested_records_and_nan_survive():
    rewarded = {"response": RESPONSE, "response_level_reward": math.nan, "scores": {"acc": 0.0},
                "meta": {"invalid_format": "true"}, "reward_error": "boom", "reward_ms": 1.0}
    name, back = decode(encode(rewarded, "RewardedResponse"))
    assert name == "RewardedResponse" and math.isnan(back["response_level_reward"])
    assert back["response"] == RESPONSE and back["meta"] == {"invalid_format": "true"}


def test_defaults_fill_missing_optional_fields():
    minimal = {k: RESPONSE[k] for k in ("prompt_id", "domain", "prompt", "round", "sample_index",
                                        "prompt_token_ids", "response_token_ids", "infer_logprobs", "finish_reason")}
    _, back = decode(encode(minimal, "Response"))
    assert (back["mode"], back["policy_version"], back["error"], back["response_text"]) == ("train", 0, None, "")


def test_missing_required_field_is_an_encode_error():
    bad = dict(RESPONSE)
    del bad["prompt_id"]
    with pytest.raises(EncodeError, match="Response"):
        encode(bad, "Response")


def test_unknown_schema_name():
    with pytest.raises(SchemaNotFoundError, match="Nope"):
        encode({}, "Nope")


def _older_prompt_schema() -> dict:
    schema = json.loads((SCHEMA_DIR / "prompt.avsc").read_text())
    schema["fields"] = [f for f in schema["fields"] if f["name"] not in ("tag", "created_ms")]
    return schema


def test_writer_schema_without_a_newer_field_still_decodes():
    """An older producer (before `tag` and `created_ms` were added with defaults) is understood."""
    registry = SchemaRegistry.from_directory()
    old = _older_prompt_schema()
    writer = SchemaRegistry()
    writer.add(old)
    data = writer.encode({"prompt_id": "p", "domain": "d", "mode": "train", "prompt": "q", "ground_truth": "1"}, "Prompt")
    with pytest.raises(UnknownFingerprintError):
        registry.decode(data)  # the old version is not registered yet
    registry.add(old, current=False)
    assert registry.decode(data) == ("Prompt", {"prompt_id": "p", "domain": "d", "mode": "train", "prompt": "q",
                                                "ground_truth": "1", "tag": "", "created_ms": 0})
    # encoding still uses the current schema
    assert registry.decode(registry.encode({"prompt_id": "p", "domain": "d", "prompt": "q"}, "Prompt"))[1]["tag"] == ""


@pytest.mark.parametrize("data, error, match", [
    (b"", DecodeError, "missing C3 01"),
    (b"{\"json\": true}", DecodeError, "missing C3 01"),
    (b"\xc3\x01\x00\x00", DecodeError, "missing C3 01"),
    (b"\xc3\x01" + b"\xff" * 8 + b"\x00", UnknownFingerprintError, "0xffffffffffffffff"),
])
def test_bad_headers(data, error, match):
    with pytest.raises(error, match=match):
        decode(data)


def test_truncated_and_trailing_bodies_are_decode_errors():
    data = encode(RESPONSE, "Response")
    with pytest.raises(DecodeError, match="corrupt Response"):
        decode(data[:-5])
    with pytest.raises(DecodeError, match="trailing"):
        decode(data + b"\x00\x00")


def test_random_corruption_never_escapes_as_another_exception():
    import random

    rng = random.Random(0)
    data = bytearray(encode(RESPONSE, "Response"))
    for _ in range(300):
        corrupt = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            corrupt[rng.randrange(10, len(corrupt))] = rng.randrange(256)
        try:
            decode(bytes(corrupt))
        except DecodeError:
            pass


def test_registry_is_not_mutated_by_decoding():
    before = copy.deepcopy(REGISTRY.schema("Group"))
    decode(encode({"group_key": "g", "prompt_id": "p", "domain": "d", "accepted": True, "reason": "accepted",
                   "responses": []}, "Group"))
    assert REGISTRY.schema("Group") == before


def test_history_directory_versions_decode_but_never_encode(tmp_path):
    for path in SCHEMA_DIR.glob("*.avsc"):
        (tmp_path / path.name).write_text(path.read_text())
    (tmp_path / "history").mkdir()
    (tmp_path / "history" / "prompt.v0.avsc").write_text(json.dumps(_older_prompt_schema()))
    registry = SchemaRegistry.from_directory(tmp_path)
    writer = SchemaRegistry()
    writer.add(_older_prompt_schema())
    old_bytes = writer.encode({"prompt_id": "p", "domain": "d", "prompt": "q"}, "Prompt")
    assert registry.decode(old_bytes)[1]["created_ms"] == 0
    assert registry.encode({"prompt_id": "p", "domain": "d", "prompt": "q"}, "Prompt")[2:10] == REGISTRY.fingerprint("Prompt")


def test_a_trajectory_group_written_before_filter_config_existed_still_decodes():
    """history/trajectory_group.v1.avsc: groups recorded by an older group queue stay readable."""
    old = json.loads((SCHEMA_DIR / "history" / "trajectory_group.v1.avsc").read_text())
    assert "filter_config" not in {f["name"] for f in old["fields"]}
    writer = SchemaRegistry()
    writer.add(json.loads((SCHEMA_DIR / "trajectory.avsc").read_text()))
    writer.add(old)
    data = writer.encode({"group_key": "train/0/0", "group_id": 0, "episode_id": 0, "accepted": False,
                          "reason": "zero_std", "trajectories": []}, "TrajectoryGroup")
    name, record = REGISTRY.decode(data)
    assert (name, record["reason"], record["filter_config"], record["filter_config_hash"]) == (
        "TrajectoryGroup", "zero_std", "", "")
