"""BatchBuilder against a real broker: exact batches, resume, duplicates, dead letters, manifest.

Groups are produced the real way: each member's payload (Response / Trajectory) is
written to its payload topic first, and the small Group / TrajectoryGroup on groups.accepted names
it by PayloadRef; the builder fetches the payloads of the groups it batches."""

from __future__ import annotations

import json
import time
import uuid

import pytest
from kafka import KafkaConsumer, TopicPartition

from rollstream.kafka.clients import make_producer
from rollstream.kafka.topics import Topics
from rollstream.runtime import now_ms
from rollstream.schemas import decode, encode
from rollstream.schemas.records import is_payload_ref
from rollstream.trainer.batch_builder import BatchBuilder

from ..trainer import records
from ..trainer.records import group_schema_of, write_payloads
from .harness import committed

pytestmark = pytest.mark.integration

TOPICS = ["groups.accepted", "groups.rejected", "batches", "dead-letter", "responses", "trajectories"]
RESPONSES = 4
WAIT_S = 30.0


def group_record(key: str, *, n: int = RESPONSES, accepted: bool = True, bad_lengths: bool = False,
                 version: int = 0) -> dict:
    """An RLVR Group of ``n`` responses (payloads inline until ``produce`` writes them): response
    i is [100 + i, 200 + i] after the prompt [1, 2, 3], reward i % 2; ``bad_lengths``: one
    infer_logprob short (a fault only the payload shows)."""
    members = []
    for i in range(n):
        tokens = [100 + i, 200 + i]
        resp = records.response_payload(key, i, [1, 2, 3], tokens, [-0.5] * (len(tokens) - (1 if bad_lengths else 0)),
                                        version=version)
        members.append(records.rewarded(resp, float(i % 2)))
    return records.rlvr_group(key, members, accepted=accepted, version=version)


def trajectory_group_record(key: str, *, n: int = 2, accepted: bool = True) -> dict:
    """An agentic group of ``n`` two-turn trajectories; trajectory i has reward i."""
    trajectories = []
    for i in range(n):
        turns = [records.turn([1, 2], [100 + i, 101 + i], [-0.1, -0.2]),
                 records.turn([7, 8, 9], [200 + i], [-0.3])]
        traj = records.trajectory_payload(i, turns, [1, 1, 0, 0, 0, 1], float(i), version=3)
        traj.update(seed=1, step_rewards=[0.0, float(i)])
        trajectories.append(records.member(traj))
    return records.traj_group(key, trajectories, accepted=accepted, version=3)


def produce(bootstrap, topics: Topics, items, topic: str | None = None):
    """Produce ``items`` on ``topic`` (default groups.accepted): group keys (encoded as accepted
    groups), dicts (``Group`` records, or ``TrajectoryGroup`` records when they have
    ``trajectories``; inline payloads are written to ``responses`` / ``trajectories`` first and
    named by reference) or raw bytes. Returns the records as produced."""
    producer = make_producer(bootstrap)
    out = []
    try:
        for item in items:
            if isinstance(item, bytes):
                key, value = b"junk", item
            else:
                record = group_record(item) if isinstance(item, str) else item
                record = write_payloads(producer, topics.responses, topics.trajectories, record)
                key, value = record["group_key"].encode(), encode(record, group_schema_of(record))
                out.append(record)
            producer.send(topic or topics.groups_accepted, key=key, value=value)
        producer.flush()
    finally:
        producer.close()
    return out


def read_all(bootstrap, topic, count, partitions=1):
    """Decode ``count`` events of ``topic`` from the beginning, in offset order per partition."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None,
                             enable_auto_commit=False, consumer_timeout_ms=1000)
    consumer.assign([TopicPartition(topic, p) for p in range(partitions)])
    consumer.seek_to_beginning()
    out, deadline = [], time.monotonic() + WAIT_S
    try:
        while len(out) < count and time.monotonic() < deadline:
            for msg in consumer:
                out.append(decode(msg.value)[1])
    finally:
        consumer.close()
    return out


def wait_buffered(builder, n):
    deadline = time.monotonic() + WAIT_S
    while builder.buffered < n and time.monotonic() < deadline:
        assert builder.next_batch(timeout_s=0.3) is None
    assert builder.buffered == n


@pytest.fixture
def env(kafka_broker, topic_factory, tmp_path):
    topics = topic_factory(TOPICS)
    return kafka_broker, topics, f"trainer-{uuid.uuid4().hex[:8]}", tmp_path / "manifest.jsonl"


def test_batches_hold_exactly_batch_size_groups_and_restart_resumes_after_last_commit(env):
    bootstrap, topics, gid, manifest = env
    # g3 is an event without its decision time (created_ms 0): its lag is None
    stamped = [{**group_record(f"g{i}"), "created_ms": now_ms()} for i in range(3)]
    created = {g["group_key"]: g["created_ms"] for g in produce(bootstrap, topics, stamped + ["g3", "g4"])}
    produced_at = now_ms()

    with BatchBuilder(bootstrap, topics, 2, group_id=gid, manifest_path=manifest) as builder:
        first = builder.next_batch(timeout_s=WAIT_S)
        assert first.group_keys == ["g0", "g1"] and first.step == 0
        assert first.batch_size == 2 * RESPONSES and first.response_ids.shape == (8, 2)
        builder.commit(first)
        second = builder.next_batch(timeout_s=WAIT_S)
        assert second.group_keys == ["g2", "g3"] and second.step == 1
        builder.commit(second)

    assert committed(bootstrap, gid, topics.groups_accepted) == 4
    lines = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert [(e["step"], e["status"], e["group_keys"], e["offsets"]) for e in lines] == [
        (0, "complete", ["g0", "g1"], {"0": 2}),
        (1, "complete", ["g2", "g3"], {"0": 4}),
    ]
    assert all(e["responses_per_group"] == [RESPONSES, RESPONSES] for e in lines)
    assert all(e["fill_seconds"] >= 0 and e["target_groups"] == 2 for e in lines)
    for e in lines:  # when each group arrived, and how long after its decision (the event's created_ms)
        assert len(e["arrived_ms"]) == 2 and all(a >= produced_at for a in e["arrived_ms"])
        assert e["arrival_lag_ms"] == [a - created[k] if created[k] else None
                                       for a, k in zip(e["arrived_ms"], e["group_keys"])]
    assert lines[1]["arrival_lag_ms"][1] is None

    # a new builder with the same group id: g4 was consumed but never committed, so it comes back
    produce(bootstrap, topics, ["g5"])
    with BatchBuilder(bootstrap, topics, 2, group_id=gid, manifest_path=manifest) as builder:
        third = builder.next_batch(timeout_s=WAIT_S)
        assert third.group_keys == ["g4", "g5"] and third.step == 2
        assert (builder.consumed, builder.duplicates) == (2, 0)  # resumed at offset 4
        builder.commit(third)

    assert json.loads(manifest.read_text().splitlines()[-1])["offsets"] == {"0": 6}
    events = read_all(bootstrap, topics.batches, 4)
    # the restart re-sends the last step's event (a crash may have come before it): at least once
    assert [(e["step"], e["status"], e["group_keys"]) for e in events] == [
        (0, "complete", ["g0", "g1"]), (1, "complete", ["g2", "g3"]), (1, "complete", ["g2", "g3"]),
        (2, "complete", ["g4", "g5"]),
    ]


def test_batch_handed_out_but_not_committed_is_redelivered(env):
    bootstrap, topics, gid, _ = env
    produce(bootstrap, topics, ["g0", "g1", "g2", "g3"])
    with BatchBuilder(bootstrap, topics, 2, group_id=gid) as builder:
        builder.commit(builder.next_batch(timeout_s=WAIT_S))
        assert builder.next_batch(timeout_s=WAIT_S).group_keys == ["g2", "g3"]  # never committed
    with BatchBuilder(bootstrap, topics, 2, group_id=gid) as builder:
        assert builder.next_batch(timeout_s=WAIT_S).group_keys == ["g2", "g3"]


def test_redelivered_group_is_ignored_and_counted(env):
    bootstrap, topics, gid, manifest = env
    produce(bootstrap, topics, ["g0", "g1", "g0", "g2", "g1", "g3"])
    with BatchBuilder(bootstrap, topics, 2, group_id=gid, manifest_path=manifest) as builder:
        first = builder.next_batch(timeout_s=WAIT_S)
        builder.commit(first)
        second = builder.next_batch(timeout_s=WAIT_S)
        entry = builder.commit(second)
        assert builder.duplicates == 2
        assert builder.metrics()["trainer/batch/duplicates"] == 2
    assert (first.group_keys, second.group_keys) == (["g0", "g1"], ["g2", "g3"])
    assert entry["offsets"] == {"0": 6}  # the skipped duplicates are committed past


def test_restart_recognises_groups_of_manifest_as_duplicates(env):
    # trained and written to the manifest, but the offset commit never happened (crash)
    bootstrap, topics, gid, manifest = env
    manifest.write_text(json.dumps({"step": 4, "group_keys": ["g0", "g1"]}) + "\n")
    produce(bootstrap, topics, ["g0", "g1", "g2", "g3"])
    with BatchBuilder(bootstrap, topics, 2, group_id=gid, manifest_path=manifest) as builder:
        batch = builder.next_batch(timeout_s=WAIT_S)
        assert (batch.group_keys, batch.step, builder.duplicates) == (["g2", "g3"], 5, 2)
        assert builder.commit(batch)["offsets"] == {"0": 4}


def test_corrupt_events_go_to_dead_letter_and_the_rest_flow(env):
    bootstrap, topics, gid, _ = env
    produce(bootstrap, topics, [
        "g0",
        b"not avro at all",                                   # offset 1: undecodable
        b"\xc3\x01" + b"\x00" * 8 + b"body",                  # offset 2: unknown fingerprint
        group_record("rej", accepted=False),                  # offset 3: not accepted
        group_record("bad", bad_lengths=True),                # offset 4: logprob/token mismatch
        "g1",
    ])
    with BatchBuilder(bootstrap, topics, 2, group_id=gid) as builder:
        batch = builder.next_batch(timeout_s=WAIT_S)
        assert batch.group_keys == ["g0", "g1"]
        assert builder.commit(batch)["offsets"] == {"0": 6}
        assert builder.dead_lettered == 4
    letters = read_all(bootstrap, topics.dead_letter, 4)
    assert [(d["offset"], d["reason"]) for d in letters] == [
        (1, "undecodable"), (2, "unknown_schema"), (3, "invalid_event"), (4, "invalid_event"),
    ]
    assert letters[0]["payload"] == b"not avro at all"
    assert letters[0]["source_topic"] == topics.groups_accepted
    assert "infer_logprobs" in letters[3]["error"]


def test_take_partial_ships_buffered_groups_with_status_partial(env):
    bootstrap, topics, gid, manifest = env
    produce(bootstrap, topics, ["g0"])
    with BatchBuilder(bootstrap, topics, 3, group_id=gid, manifest_path=manifest) as builder:
        wait_buffered(builder, 1)
        batch = builder.take_partial()
        assert batch.group_keys == ["g0"] and batch.batch_size == RESPONSES
        entry = builder.commit(batch)
        assert builder.take_partial() is None
    assert (entry["status"], entry["accepted_groups"], entry["target_groups"]) == ("partial", 1, 3)
    (event,) = read_all(bootstrap, topics.batches, 1)
    assert (event["status"], event["group_keys"], event["offsets"]) == ("partial", ["g0"], {"0": 1})


def test_commit_rejects_a_batch_committed_twice(env):
    bootstrap, topics, gid, _ = env
    produce(bootstrap, topics, ["g0"])
    with BatchBuilder(bootstrap, topics, 1, group_id=gid) as builder:
        batch = builder.next_batch(timeout_s=WAIT_S)
        builder.commit(batch)
        with pytest.raises(ValueError, match="not an outstanding batch"):
            builder.commit(batch)


def test_groups_spread_over_partitions_are_each_trained_once(kafka_broker, topic_factory, tmp_path):
    topics = topic_factory(TOPICS, partitions=3)
    gid, manifest = f"trainer-{uuid.uuid4().hex[:8]}", tmp_path / "m.jsonl"
    keys = [f"g{i}" for i in range(9)]
    produce(kafka_broker, topics, keys)
    seen = []
    with BatchBuilder(kafka_broker, topics, 2, group_id=gid, manifest_path=manifest) as builder:
        for _ in range(2):
            batch = builder.next_batch(timeout_s=WAIT_S)
            builder.commit(batch)
            seen += batch.group_keys
    with BatchBuilder(kafka_broker, topics, 5, group_id=gid, manifest_path=manifest) as builder:
        batch = builder.next_batch(timeout_s=WAIT_S)
        assert builder.duplicates == 0
        entry = builder.commit(batch)
        seen += batch.group_keys
    assert sorted(seen) == sorted(keys)
    assert sum(entry["offsets"].values()) == len(keys)


def test_accepted_trajectory_groups_are_batched_and_unaccepted_ones_dead_lettered(env):
    bootstrap, topics, gid, manifest = env
    produce(bootstrap, topics, [
        trajectory_group_record("train/0/0"),
        trajectory_group_record("train/1/0", accepted=False),  # offset 1: not accepted
        "g0",                                                   # an RLVR group in between
        trajectory_group_record("train/2/0", n=3),
    ])
    with BatchBuilder(bootstrap, topics, 3, group_id=gid, manifest_path=manifest) as builder:
        batch = builder.next_batch(timeout_s=WAIT_S)
        assert batch.group_keys == ["train/0/0", "g0", "train/2/0"]
        assert batch.responses_per_group == [2, RESPONSES, 3]
        assert batch.group_index.tolist() == [0, 0] + [1] * RESPONSES + [2, 2, 2]
        assert batch.prompt_ids_str[:2] == ["train/0/0", "train/0/0"]
        assert batch.sample_index[-3:] == [0, 1, 2]
        assert batch.response_ids.shape == (2 + RESPONSES + 3, 6)
        assert batch.response_ids[1].tolist() == [101, 102, 7, 8, 9, 201]
        assert batch.response_mask[1].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
        assert batch.infer_logprobs[1].tolist() == pytest.approx([-0.1, -0.2, 0, 0, 0, -0.3])
        assert batch.prompt_ids[0].tolist() == [0, 1, 2]  # left-padded to the RLVR prompt of 3
        adv = batch.advantages[:2]  # rewards [0, 1]: -A and +A on the model tokens only
        assert (adv[0, [0, 1, 5]] < 0).all() and (adv[1, [0, 1, 5]] > 0).all()
        assert adv[:, 2:5].abs().sum().item() == 0
        entry = builder.commit(batch)
        assert (builder.dead_lettered, entry["offsets"]) == (1, {"0": 4})
    assert entry["responses_per_group"] == [2, RESPONSES, 3]
    (letter,) = read_all(bootstrap, topics.dead_letter, 1)
    assert (letter["offset"], letter["reason"]) == (1, "invalid_event")
    assert "'train/1/0'" in letter["error"] and "not accepted" in letter["error"]


def versioned(key: str, version: int) -> dict:
    return group_record(key, n=2, version=version)


def test_groups_beyond_max_staleness_are_rejected_stale_never_trained(env):
    """max_staleness 0: step s trains only groups generated by version s. Leftovers of step 0
    (version 0) are rejected as stale before step 1, with their values, and their offsets pass."""
    bootstrap, topics, gid, manifest = env
    produce(bootstrap, topics, [versioned("g0", 0), versioned("g1", 0), versioned("g2", 0)])
    with BatchBuilder(bootstrap, topics, 1, group_id=gid, manifest_path=manifest, max_staleness=0) as builder:
        first = builder.next_batch(timeout_s=WAIT_S)
        assert first.group_keys == ["g0"]
        builder.commit(first)
        produce(bootstrap, topics, [versioned("g3", 1)])
        second = builder.next_batch(timeout_s=WAIT_S)
        assert (second.step, second.group_keys) == (1, ["g3"])
        assert builder.stale_groups == 2 and builder.metrics()["trainer/batch/stale_groups"] == 2
        assert builder.commit(second)["offsets"] == {"0": 4}
    rejected = read_all(bootstrap, topics.groups_rejected, 2)
    assert [(g["group_key"], g["accepted"], g["reason"]) for g in rejected] == [
        ("g1", False, "stale"), ("g2", False, "stale")]
    assert rejected[0]["decision_values"] == {"policy_version": 0.0, "current_version": 1.0, "max_staleness": 0.0,
                                              "lag": 1.0}
    assert len(rejected[0]["responses"]) == 2  # the whole group, replayable
    assert all(is_payload_ref(rr["payload"]) for rr in rejected[0]["responses"])  # still small: references
    assert builder.metrics()["trainer/batch/payload_records_fetched"] == 4  # g0's and g3's only, never stale ones


def test_a_group_of_the_old_format_trains_from_its_inline_payloads(env):
    """A Group written before payload references (v1: responses with their tokens inline) decodes
    with its payloads inline: it is batched without any fetch."""
    bootstrap, topics, gid, _ = env
    old = group_record("old")
    v1 = {k: v for k, v in old.items()}
    v1["prompt_token_ids"] = [1, 2, 3]
    v1["responses"] = [{**{k: v for k, v in rr.items() if k != "payload"},
                        "response": {k: v for k, v in rr["payload"].items() if k != "extras"}}
                       for rr in old["responses"]]
    produce(bootstrap, topics, [records.encode_history(v1, "history/group.v1.avsc"), "g1"])
    with BatchBuilder(bootstrap, topics, 2, group_id=gid) as builder:
        batch = builder.next_batch(timeout_s=WAIT_S)
        assert batch.group_keys == ["old", "g1"]
        assert batch.response_ids[:RESPONSES].tolist() == [[100 + i, 200 + i] for i in range(RESPONSES)]
        assert batch.prompt_ids[0].tolist() == [1, 2, 3]
        assert builder.metrics()["trainer/batch/payload_records_fetched"] == RESPONSES  # g1's only
        assert builder.commit(batch)["offsets"] == {"0": 2}


def test_a_reference_to_another_members_payload_dead_letters_the_group_and_the_rest_flow(env):
    bootstrap, topics, gid, _ = env
    (a,) = produce(bootstrap, topics, ["a"])
    wrong = group_record("w")
    wrong["responses"] = [{**rr, "payload": a["responses"][(i + 1) % RESPONSES]["payload"]}
                          for i, rr in enumerate(wrong["responses"])]
    produce(bootstrap, topics, [wrong, "b"])
    with BatchBuilder(bootstrap, topics, 2, group_id=gid) as builder:
        first = builder.next_batch(timeout_s=WAIT_S)
        assert first.group_keys == ["a", "b"]
        assert builder.dead_lettered == 1 and builder.invalid_payload_groups == 1
        assert builder.commit(first)["offsets"] == {"0": 3}
    (letter,) = read_all(bootstrap, topics.dead_letter, 1)
    assert (letter["offset"], letter["reason"]) == (1, "invalid_event")
    assert "group 'w' member ('w', 0): payload" in letter["error"] and "is the Response of ('a', 1)" in letter["error"]
