"""Chat messages on the prompt's path: Prompt -> GenerationRequest -> Response ->
ResponseSummary -> Group carry ``messages``; events written before the field existed (the landed
main's schemas, kept under history/) still decode, with no messages."""

from __future__ import annotations

import io

import fastavro
import numpy as np
import pytest
from fastavro import parse_schema

from rollstream.schemas import REGISTRY, decode, encode
from rollstream.schemas.codec import MAGIC, fingerprint_of
from rollstream.schemas.records import payload_ref, response_summary
from rollstream.streams.event_builders import generation_request, group_record

CHAT = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "2+2?"}]
PROMPT = {"prompt_id": "p1", "domain": "math", "mode": "train", "prompt": "2+2?", "ground_truth": "4",
          "messages": CHAT, "tag": "", "created_ms": 5}
RESPONSE = {
    "prompt_id": "p1", "domain": "math", "mode": "train", "prompt": "2+2?", "ground_truth": "4", "messages": CHAT,
    "round": 0, "sample_index": 1, "prompt_token_ids": [1, 2, 3], "response_token_ids": [7], "infer_logprobs": [-0.5],
    "response_text": "4", "finish_reason": "stop", "error": None, "policy_version": 0, "generation_ms": 1.0,
    "created_ms": 5, "extras": {},
}


def without_messages(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "messages"}


def written_by(file: str, record: dict) -> bytes:
    """``record`` as a producer with the history schema ``file`` wrote it."""
    contained = REGISTRY.self_contained_file(file)
    buf = io.BytesIO(MAGIC + fingerprint_of(contained))
    buf.seek(0, 2)
    fastavro.schemaless_writer(buf, parse_schema(contained, _force=True), record)
    return buf.getvalue()


def rewarded(summary: dict) -> dict:
    return {"response": summary, "response_level_reward": 1.0, "scores": {"acc": 1.0}, "meta": {},
            "reward_error": None, "reward_ms": 0.0, "payload": payload_ref("rollstream.responses", 0, 3, 100)}


def test_messages_travel_from_the_prompt_to_the_group():
    assert decode(encode(PROMPT, "Prompt")) == ("Prompt", PROMPT)
    request = generation_request(PROMPT, round_=0, num_return_sequences=2, sample_offset=0, seed=9)
    assert request["messages"] == CHAT and decode(encode(request, "GenerationRequest"))[1]["messages"] == CHAT
    _, response = decode(encode(RESPONSE, "Response"))
    summary = response_summary(response)
    assert summary["messages"] == CHAT
    # a replacement request built from a summary keeps the chat
    assert generation_request(summary, round_=1, num_return_sequences=1, sample_offset=2, seed=1)["messages"] == CHAT
    group = group_record(prompt=summary, decided_accepted=True, reason="accepted", values={}, responses=[],
                         filter_config="{}", filter_config_hash="", policy_version=0, rounds=1, responses_generated=2)
    assert decode(encode(group, "Group"))[1]["messages"] == CHAT


@pytest.mark.parametrize("file, name, record", [
    ("history/prompt.v1.avsc", "Prompt", without_messages(PROMPT)),
    ("history/generation_request.v1.avsc", "GenerationRequest",
     {"prompt_id": "p1", "domain": "math", "mode": "val", "prompt": "2+2?", "ground_truth": "4", "round": 1,
      "num_return_sequences": 2, "sample_offset": 4, "seed": 7, "created_ms": 3}),
    ("history/response.v2.avsc", "Response", without_messages(RESPONSE)),
])
def test_events_written_before_messages_decode_with_none(file, name, record):
    decoded_name, back = decode(written_by(file, record))
    plain = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in back.items()}
    added = {"policy_versions": []} if name == "Response" else {}  # newer still: the versions, default none
    assert (decoded_name, plain) == (name, {**record, "messages": [], **added})


def test_decision_events_written_before_messages_decode_with_none():
    summary = without_messages(response_summary(RESPONSE))
    old_rewarded = rewarded(summary)
    assert decode(written_by("history/rewarded_response.v2.avsc", old_rewarded)) == (
        "RewardedResponse", rewarded({**summary, "messages": []}))
    # an inline Response payload of the old schema resolves too
    inline = {**old_rewarded, "payload": without_messages(RESPONSE)}
    back = decode(written_by("history/rewarded_response.v2.avsc", inline))[1]
    assert back["payload"]["messages"] == [] and back["payload"]["prompt"] == "2+2?"
    group = {"group_key": "p1", "kind": "rlvr", "prompt_id": "p1", "domain": "math", "mode": "train", "accepted": True,
             "reason": "accepted", "decision_values": {"mean": 0.5}, "filter_config": "{}", "filter_config_hash": "h",
             "policy_version": 0, "rounds": 1, "responses_generated": 2, "prompt": "2+2?", "ground_truth": "4",
             "created_ms": 1, "responses": [old_rewarded]}
    assert decode(written_by("history/group.v2.avsc", group)) == (
        "Group", {**group, "messages": [], "responses": [rewarded({**summary, "messages": []})]})
