"""Avro single-object encoding: round trips, schema evolution, bad bytes."""

from __future__ import annotations

import base64
import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest

from rollstream.exceptions import DecodeError, EncodeError, SchemaNotFoundError, UnknownFingerprintError
from rollstream.schemas import REGISTRY, SchemaRegistry, decode, encode, fingerprint_of
from rollstream.schemas.codec import SCHEMA_DIR
from rollstream.schemas.packed import DTYPES, packed_array, to_bytes, unpack_array, view
from rollstream.schemas.records import is_payload_ref, payload_ref, response_summary

RESPONSE = {
    "prompt_id": "gsm8k-test-00017", "domain": "gsm8k", "mode": "train", "prompt": "2+2?", "ground_truth": "4",
    "round": 1, "sample_index": 5, "prompt_token_ids": [1, 2, 3], "response_token_ids": [7, 8],
    "infer_logprobs": [-0.5, -1.25], "response_text": "4", "finish_reason": "stop", "error": None,
    "policy_version": 3, "policy_versions": [3], "generation_ms": 12.5, "created_ms": 1700000000000, "extras": {},
    "messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "2+2?"}],
}
ARRAYS = ("prompt_token_ids", "response_token_ids", "infer_logprobs")


def plain(record: dict) -> dict:
    """``record`` with its packed arrays as lists, to compare with ==."""
    return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in record.items()}


def test_every_event_has_its_own_schema_file():
    names = {json.loads(p.read_text())["name"] for p in SCHEMA_DIR.glob("*.avsc")}
    assert names == set(REGISTRY.names) == {
        "Batch", "ChatMessage", "DeadLetter", "EpisodeRequest", "GenerationRequest", "Group", "GroupCommand",
        "GroupQueueOutcome", "Metric", "PackedArray", "PayloadRef", "PolicyVersion", "Prompt", "PromptHistory", "PromptOutcome",
        "PromptsEnd", "Response",
        "ResponseSummary", "RewardedResponse", "Trajectory", "TrajectoryGroup", "TrajectorySummary",
    }


def test_fingerprint_matches_the_published_check_value():
    # Avro spec: CRC-64-AVRO of the canonical form of "int"
    assert int.from_bytes(fingerprint_of("int"), "little") == 0x7275D51A3F395C8F


def test_round_trip_with_header():
    data = encode(RESPONSE, "Response")
    assert data[:2] == b"\xc3\x01" and data[2:10] == REGISTRY.fingerprint("Response")
    name, back = decode(data)
    assert name == "Response" and plain(back) == RESPONSE
    # packed: 4 bytes per token, read back as read-only numpy views of the right dtype
    assert back["response_token_ids"].dtype == np.int32 and back["infer_logprobs"].dtype == np.float32
    assert not back["response_token_ids"].flags.writeable
    assert bytes(np.array([7, 8], "<i4")) in data and bytes(np.array([-0.5, -1.25], "<f4")) in data


def test_nested_records_and_nan_survive():
    rewarded = {"response": response_summary(RESPONSE), "response_level_reward": math.nan, "scores": {"acc": 0.0},
                "meta": {"invalid_format": "true"}, "reward_error": "boom", "reward_ms": 1.0,
                "payload": payload_ref("rollstream.responses", 2, 41, 123)}
    name, back = decode(encode(rewarded, "RewardedResponse"))
    assert name == "RewardedResponse" and math.isnan(back["response_level_reward"])
    assert back["response"] == {**{k: RESPONSE[k] for k in back["response"] if k in RESPONSE},
                                "prompt_length": 3, "response_length": 2}
    assert back["meta"] == {"invalid_format": "true"}
    assert back["payload"] == {"topic": "rollstream.responses", "partition": 2, "offset": 41, "size_bytes": 123}
    assert is_payload_ref(back["payload"])


def test_defaults_fill_missing_optional_fields():
    minimal = {k: RESPONSE[k] for k in ("prompt_id", "domain", "prompt", "round", "sample_index",
                                        "prompt_token_ids", "response_token_ids", "infer_logprobs", "finish_reason")}
    _, back = decode(encode(minimal, "Response"))
    assert (back["mode"], back["policy_version"], back["error"], back["response_text"], back["extras"]) == (
        "train", 0, None, "", {})


def test_missing_required_field_is_an_encode_error():
    bad = dict(RESPONSE)
    del bad["prompt_id"]
    with pytest.raises(EncodeError, match="Response"):
        encode(bad, "Response")


def test_unknown_schema_name():
    with pytest.raises(SchemaNotFoundError, match="Nope"):
        encode({}, "Nope")


def _older_prompt_schema() -> dict:
    schema = json.loads((SCHEMA_DIR / "history" / "prompt.v1.avsc").read_text())
    schema["fields"] = [f for f in schema["fields"] if f["name"] not in ("tag", "created_ms")]
    return schema


def test_writer_schema_without_a_newer_field_still_decodes():
    """An older producer (before `tag` and `created_ms` were added with defaults) is understood."""
    registry = SchemaRegistry.from_directory()
    old = _older_prompt_schema()
    writer = SchemaRegistry()
    writer.add(old)
    data = writer.encode({"prompt_id": "p", "domain": "d", "mode": "train", "prompt": "q", "ground_truth": "1"}, "Prompt")
    with pytest.raises(UnknownFingerprintError, match="unknown writer schema fingerprint 0x"):
        registry.decode(data)  # the old version is not registered yet
    registry.add(old, current=False)
    assert registry.decode(data) == ("Prompt", {"prompt_id": "p", "domain": "d", "mode": "train", "prompt": "q",
                                                "ground_truth": "1", "messages": [], "tag": "",
                                                "created_ms": 0})
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
    writer.add(old)  # history files are self-contained: what the old writer had
    data = writer.encode({"group_key": "train/0/0", "group_id": 0, "episode_id": 0, "accepted": False,
                          "reason": "zero_std", "trajectories": []}, "TrajectoryGroup")
    name, record = REGISTRY.decode(data)
    assert (name, record["reason"], record["filter_config"], record["filter_config_hash"]) == (
        "TrajectoryGroup", "zero_std", "", "")


# ---- packed arrays --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_arrays_round_trip_for_every_dtype(dtype):
    rng = np.random.default_rng(0)
    info = np.finfo(dtype) if np.dtype(dtype).kind == "f" else np.iinfo(dtype)
    values = rng.uniform(max(info.min, -1e3), min(info.max, 1e3), size=(7, 3, 2)).astype(dtype)
    packed = packed_array(values)
    assert packed["dtype"] == dtype and packed["shape"] == [7, 3, 2]
    assert packed["data"] == values.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    record = {**RESPONSE, "extras": {"x": packed}}
    _, back = decode(encode(record, "Response"))
    restored = unpack_array(back["extras"]["x"])
    assert restored.dtype == np.dtype(dtype) and restored.shape == (7, 3, 2)
    assert restored.tobytes() == values.tobytes()  # bit-identical, NaN patterns included
    assert to_bytes(values.ravel(), dtype) == packed["data"]
    assert np.array_equal(view(packed["data"], dtype), values.ravel(), equal_nan=True)


@pytest.mark.parametrize("field, dtype", [("response_token_ids", np.int32), ("infer_logprobs", np.float32)])
def test_packed_fields_take_lists_arrays_or_bytes_alike(field, dtype):
    values = np.array([3, 1, 4, 1, 5], dtype=dtype)
    encoded = {encode({**RESPONSE, field: v, **({"infer_logprobs": values.astype(np.float32)}
                                                 if field == "response_token_ids" else {"response_token_ids": [1] * 5})},
                      "Response")
               for v in (values.tolist(), values, values.astype(np.int64 if dtype == np.int32 else np.float64),
                         values.astype("<" + np.dtype(dtype).str[1:]).tobytes())}
    assert len(encoded) == 1  # every form writes the same bytes


def test_packed_array_errors_are_clear():
    with pytest.raises(ValueError, match="dtype must be one of"):
        packed_array(np.array(["a"]))
    with pytest.raises(ValueError, match="shape"):
        unpack_array({"dtype": "uint8", "shape": [4, 2], "data": b"\x00" * 7})
    with pytest.raises(ValueError, match="unknown packed dtype"):
        to_bytes([1], "complex64")


@pytest.mark.parametrize("tokens", [[2**40], np.array([2**31], dtype=np.int64), np.array([1.5]), [-1, 2**31]])
def test_a_token_id_is_never_wrapped_or_truncated(tokens):
    with pytest.raises(EncodeError, match="Response"):
        encode({**RESPONSE, "response_token_ids": tokens, "infer_logprobs": [0.0] * len(tokens)}, "Response")


OLD_EVENTS = json.loads((Path(__file__).parent / "data" / "events_before_packed_arrays.json").read_text())


@pytest.mark.parametrize("name", ["Response", "Trajectory"])
def test_payload_events_in_the_format_before_packed_arrays_still_decode(name):
    fixture = OLD_EVENTS[name]
    decoded_name, record = decode(base64.b64decode(fixture["message_b64"]))
    old = fixture["record"]
    assert decoded_name == name and record["extras"] == {}
    if name == "Response":
        assert plain(record) == {**old, "extras": {}, "messages": [], "policy_versions": []}
    else:
        assert record["response_mask"].dtype == np.uint8 and record["response_mask"].tolist() == old["response_mask"]
        assert [plain(t) for t in record["turns"]] == old["turns"]
    # and they re-encode in the current format
    assert decode(encode(record, name))[0] == name


def test_decision_events_in_the_old_format_decode_with_their_payload_inline():
    _, rewarded = decode(base64.b64decode(OLD_EVENTS["RewardedResponse"]["message_b64"]))
    old = OLD_EVENTS["RewardedResponse"]["record"]
    assert not is_payload_ref(rewarded["payload"])
    assert plain(rewarded["payload"]) == {**old["response"], "extras": {}, "messages": [], "policy_versions": []}
    assert rewarded["response"]["response_length"] == 3 and rewarded["response_level_reward"] == 1.0

    _, group = decode(base64.b64decode(OLD_EVENTS["Group"]["message_b64"]))
    old = OLD_EVENTS["Group"]["record"]
    assert "prompt_token_ids" not in group
    assert [rr["response"]["sample_index"] for rr in group["responses"]] == [3, 4]
    # the second response was stored without its own prompt tokens: it gets the group's
    assert [rr["payload"]["prompt_token_ids"].tolist() for rr in group["responses"]] == [[11, 12, 13]] * 2
    assert [rr["response_level_reward"] for rr in group["responses"]] == [1.0, 0.0]
    again = decode(encode(group, "Group"))[1]  # an upgraded group re-encodes (payload inline)
    assert [plain(rr["payload"]) for rr in again["responses"]] == [plain(rr["payload"]) for rr in group["responses"]]

    _, tgroup = decode(base64.b64decode(OLD_EVENTS["TrajectoryGroup"]["message_b64"]))
    members = tgroup["trajectories"]
    assert [(m["traj_index"], m["num_turns"], m["response_length"], m["model_tokens"]) for m in members] == [
        (2, 2, 4, 3), (3, 2, 4, 3)]
    assert [m["payload"]["response_mask"].tolist() for m in members] == [[1, 1, 0, 1]] * 2
    assert [m["response_level_rewards"] for m in members] == [1.0, 0.0]
