"""The pure selection behind `rollstream replay`: predicates, ranges, JSON rendering."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from rollstream.schemas import decode, encode
from rollstream.schemas.packed import packed_array
from rollstream.schemas.records import payload_ref, payload_refs, response_summary, trajectory_summary
from rollstream.tools.replay import (
    Payload,
    Predicate,
    Record,
    Replayed,
    Selection,
    jsonable,
    parse_time_ms,
    payload_digest,
    summary,
    with_payloads,
)

GROUP = {"group_key": "p1", "domain": "gsm8k", "accepted": False, "reason": "zero_std",
         "decision_values": {"std": 0.0, "mean": 1.0, "rejected_responses/truncated": 2.0}, "rounds": 2,
         "responses": [{"response": {"domain": "gsm8k"}}]}


@pytest.mark.parametrize("text, expected", [
    ("reason=zero_std", True), ("reason!=zero_std", False), ("domain=math", False),
    ("decision_values.std=0", True), ("decision_values.mean>=1", True), ("decision_values.mean>1", False),
    ("rounds<3", True), ("rounds=2.0", True), ("accepted=false", True), ("accepted=true", False),
    ("missing=x", False), ("decision_values.missing!=x", False), ("responses.0=x", False),
    ("accepted=False", True), ("decision_values.rejected_responses/truncated>=1", True),
])
def test_predicates(text, expected):
    assert Predicate.parse(text).matches(GROUP) is expected


@pytest.mark.parametrize("bad", ["reason", "=x", "rounds>abc", "a b=c"])
def test_bad_predicates_say_the_accepted_form(bad):
    with pytest.raises(ValueError, match="bad predicate"):
        Predicate.parse(bad)


def test_selection_ranges_keys_partitions_and_undecodable_records():
    sel = Selection(from_offset=2, to_offset=5, since_ms=1000, until_ms=2000, key="p1", partitions=(0,),
                    predicates=(Predicate.parse("reason=zero_std"),))
    assert sel.matches(0, 2, 1000, b"p1", GROUP)
    assert not sel.matches(0, 5, 1000, b"p1", GROUP)  # to_offset is exclusive
    assert not sel.matches(0, 1, 1000, b"p1", GROUP)
    assert not sel.matches(0, 3, 2000, b"p1", GROUP)  # until is exclusive
    assert not sel.matches(0, 3, 999, b"p1", GROUP)
    assert not sel.matches(1, 3, 1500, b"p1", GROUP)
    assert not sel.matches(0, 3, 1500, b"p2", GROUP) and not sel.matches(0, 3, 1500, None, GROUP)
    assert not sel.matches(0, 3, 1500, b"p1", None)  # undecodable: only without predicates
    assert Selection().matches(7, 0, 0, None, None)


def test_json_rendering_and_times():
    assert jsonable({"payload": b"\x00\x01", "x": [math.nan, math.inf, 1.5]}) == {
        "payload": "AAE=", "x": ["NaN", "Infinity", 1.5]}
    assert parse_time_ms("1700000000000") == 1700000000000
    assert parse_time_ms("2026-11-29T23:00:00") == parse_time_ms("2026-11-29T23:00:00+00:00") == 1795993200000
    with pytest.raises(ValueError, match="ISO 8601"):
        parse_time_ms("yesterday")
    assert summary(GROUP) == ("reason=zero_std accepted=false domain=gsm8k values{std=0.0, mean=1.0, rejected_responses/truncated=2.0} "
                              "group_key=p1 rounds=2")
    assert summary(None) == "(undecodable)"


# -- the new format: packed arrays and payload references ----------------------------------------

def response(index: int, text: str, tokens: list[int]) -> dict:
    return {"prompt_id": "p1", "domain": "gsm8k", "mode": "train", "prompt": "q", "ground_truth": "2", "round": 0,
            "sample_index": index, "prompt_token_ids": [1, 2, 3], "response_token_ids": tokens,
            "infer_logprobs": [-0.5] * len(tokens), "response_text": text, "finish_reason": "stop", "error": None,
            "policy_version": 0, "generation_ms": 0.0, "created_ms": 0,
            "extras": {"routed_experts": packed_array(np.arange(2 * len(tokens), dtype=np.uint8).reshape(len(tokens), 2))}}


def rewarded(index: int, ref: dict) -> dict:
    body = response(index, "x", [5])
    return {"response": response_summary(body), "response_level_reward": float(index), "scores": {"acc": 1.0},
            "meta": {}, "reward_error": None, "reward_ms": 0.0, "payload": ref}


def group(refs: list[dict]) -> dict:
    return {**{k: v for k, v in GROUP.items() if k != "responses"}, "prompt_id": "p1",
            "responses": [rewarded(i, ref) for i, ref in enumerate(refs)]}


def test_decoded_packed_arrays_render_as_json_lists():
    _, value = decode(encode(response(0, "two", [7, 8]), "Response"))
    assert isinstance(value["response_token_ids"], np.ndarray)  # what decode hands back
    out = jsonable(value)
    assert out["prompt_token_ids"] == [1, 2, 3] and out["response_token_ids"] == [7, 8]
    assert out["infer_logprobs"] == [-0.5, -0.5]
    assert out["extras"]["routed_experts"] == {"dtype": "uint8", "shape": [2, 2], "data": "AAECAw=="}  # bytes: base64
    assert jsonable({"x": np.array([np.nan, 1.0], dtype=np.float32), "n": np.int32(3)}) == {"x": ["NaN", 1.0], "n": 3}
    json.dumps(out)  # nothing numpy left


def test_payload_refs_of_every_decision_event():
    refs = [payload_ref("t.responses", 0, 4, 100), payload_ref("t.responses", 1, 9, 120)]
    _, decoded = decode(encode(group(refs), "Group"))
    assert payload_refs(decoded) == refs
    assert payload_refs(decoded["responses"][1]) == [refs[1]]  # a RewardedResponse on responses.rewarded
    traj = {"mode": "train", "group_id": 0, "episode_id": 0, "traj_index": 1, "env_type": "x", "seed": 1,
            "turns": [], "response_mask": [], "response_level_rewards": 0.0, "stop_reason": "done"}
    tref = payload_ref("t.trajectories", 0, 3, 50)
    assert payload_refs({"group_key": "train/0/0", "trajectories": [trajectory_summary(traj, tref)]}) == [tref]
    assert payload_refs(response(0, "x", [1])) == [] and payload_refs(None) == []  # payloads name nothing


def test_with_payloads_adds_token_counts_and_texts_per_member():
    refs = [payload_ref("t.responses", 0, 4, 100), payload_ref("t.responses", 0, 5, 100)]
    _, decoded = decode(encode(group(refs), "Group"))
    _, first = decode(encode(response(0, "four", [7, 8, 9, 10]), "Response"))
    found = {("t.responses", 0, 4): Payload("Response", first),
             ("t.responses", 0, 5): Payload(None, None, "t.responses[0]@5 is below the log start offset 6")}
    shown = with_payloads(decoded, found)
    one, two = shown["responses"]
    assert one["payload_tokens"] == {"prompt": 3, "response": 4} and one["response_text"] == "four"
    assert one["payload_ref"] == refs[0] and one["payload"] is first and one["response_level_reward"] == 0.0
    assert two["payload_error"] == "t.responses[0]@5 is below the log start offset 6" and two["payload"] == refs[1]
    assert "response_text" not in two
    assert decoded["responses"][0]["payload"] == refs[0]  # the decoded event itself is left as it was
    brief = with_payloads(decoded, found, full=False)["responses"][0]
    assert brief["payload"] == refs[0] and "payload_ref" not in brief and brief["response_text"] == "four"
    assert payload_digest(shown).splitlines() == [
        "#0 prompt=3 response=4 'four'", "#1 payload unavailable: t.responses[0]@5 is below the log start offset 6"]
    row = Replayed(Record("t.groups.rejected", 0, 0, b"p1", "Group", decoded, b""), 0, found).to_json()
    assert row["value"]["responses"][0]["payload"]["response_token_ids"] == [7, 8, 9, 10]
    assert row["value"]["responses"][0]["payload_ref"] == refs[0]
    assert Replayed(Record("t", 0, 0, b"p1", "Group", decoded, b""), 0).to_json()["value"]["responses"][0][
        "payload"] == refs[0]  # without payloads: the references only
    legacy = rewarded(0, first)  # an old-format event, upgraded at decode: its Response inline, nothing to fetch
    assert payload_refs(legacy) == []
    inline = with_payloads(legacy, {})
    assert inline["payload_tokens"] == {"prompt": 3, "response": 4} and inline["response_text"] == "four"


def test_trajectory_payloads_show_model_tokens_and_turn_texts():
    turns = [{"prompt_token_ids": [1, 2], "response_token_ids": [3, 4], "infer_logprobs": [-0.1, -0.2],
              "response_text": "[up]"},
             {"prompt_token_ids": [5], "response_token_ids": [6], "infer_logprobs": [-0.3], "response_text": "[left]"}]
    traj = {"mode": "train", "group_id": 0, "episode_id": 0, "traj_index": 1, "env_type": "x", "seed": 1,
            "turns": turns, "response_mask": [1, 1, 0, 1], "response_level_rewards": 1.0, "stop_reason": "done"}
    _, payload = decode(encode(traj, "Trajectory"))
    ref = payload_ref("t.trajectories", 0, 3, 50)
    shown = with_payloads({"group_key": "train/0/0", "trajectories": [trajectory_summary(payload, ref)]},
                          {("t.trajectories", 0, 3): Payload("Trajectory", payload)})
    (member,) = shown["trajectories"]
    assert member["payload_tokens"] == {"prompt": 2, "response": 4, "model": 3, "turns": 2}
    assert member["response_texts"] == ["[up]", "[left]"]
    assert payload_digest(shown) == "#1 prompt=2 response=4 model=3 turns=2 '[up] | [left]'"
    assert jsonable(shown)["trajectories"][0]["payload"]["response_mask"] == [1, 1, 0, 1]
